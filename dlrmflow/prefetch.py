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


def _prefetch_intrinsic(write: int, locality: int):  # noqa: ANN202 - a numba intrinsic
    """An intrinsic that starts loading the cache line at an address (a ``uintp``)."""

    def typer(typingctx, address):  # noqa: ARG001 - numba's intrinsic signature
        def codegen(context, builder, signature, args):  # noqa: ARG001
            byte_pointer = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            function = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]),
                "llvm.prefetch.p0",
            )
            pointer = builder.inttoptr(args[0], byte_pointer)
            flags = [ir.Constant(i32, write), ir.Constant(i32, locality), ir.Constant(i32, 1)]
            builder.call(function, [pointer, *flags])  # the last flag: a data line
            return context.get_dummy_value()

        return types.void(types.uintp), codegen

    typer.__name__ = typer.__qualname__ = f"prefetch_w{write}_l{locality}"
    return intrinsic(typer)


# A line about to be written, kept in every cache level.
prefetch = _prefetch_intrinsic(write=1, locality=3)
# A line about to be read once, streamed through: kept out of the nearest cache level.
prefetch_read = _prefetch_intrinsic(write=0, locality=2)
