"""``prefetch(address)`` for numba kernels: LLVM's prefetch, which numba does not expose.

The compiled kernels (the TBE backward, the feature transform) know addresses they will
write to well before they get there: rows of a table scattered far beyond the caches, or
rows of a shuffled window spread over many batches. Asking for such a cache line early
keeps several trips to memory in flight instead of stalling on each in turn; the
hardware's own prefetcher only follows a few sequential streams.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def prefetch(typingctx, address):  # noqa: ARG001 - numba's intrinsic signature
    """Start loading the cache line at ``address`` (a ``uintp``) for writing."""

    def codegen(context, builder, signature, args):  # noqa: ARG001
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        function = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]),
            "llvm.prefetch.p0",
        )
        # For writing (1), kept in all cache levels (3), a data line (1).
        pointer = builder.inttoptr(args[0], byte_pointer)
        builder.call(
            function, [pointer, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)]
        )
        return context.get_dummy_value()

    return types.void(types.uintp), codegen
