"""``prefetch(address)`` for numba kernels: LLVM's prefetch, which numba does not expose.

The compiled kernels (the TBE backward, the feature transform) know addresses they will
write to well before they get there: rows of a table scattered far beyond the caches, or
rows of a shuffled window spread over many batches. Asking for such a cache line early
keeps several trips to memory in flight instead of stalling on each in turn; the
hardware's own prefetcher only follows a few sequential streams. Gain, measured against
the same kernels with the prefetch compiled to nothing, both faster with it:

- the TBE backward of a batch of 4096 over Criteo's 26 tables capped at 200k rows, dim
  128, with row-wise Adagrad (one-hot and 20 IDs a bag) and, by less, with SGD;
- the feature transform writing 26 hashed columns into a shuffled 4M-row window.

The figures, with the machine they came from, are in this module's commit history.

What it reaches into, written against numba 0.68.1 and llvmlite 0.50.0 (LLVM 22): the
intrinsic ``llvm.prefetch``, called from a numba ``intrinsic`` by a name that follows
LLVM's pointer types, so it depends on the LLVM that numba ships. Before the first kernel
that uses it is compiled, a probe compiles one call of each name in ``INTRINSICS`` for
this machine and the first that becomes a prefetch is used.

Fallback, where none does (it fails to compile, or leaves a call to an unknown function,
which would crash when run): the prefetch compiles to nothing; the kernels' results are
the same, they only lose the overlap. ``tests/runtime/test_llvm_prefetch.py`` compiles
the kernels both ways and fails when no name lowers to a prefetch here.
"""

from __future__ import annotations

import functools
import re

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["INTRINSICS", "intrinsic_name", "lowers_to_prefetch", "prefetch", "prefetch_read"]

# The names the prefetch has had: with opaque pointers (LLVM 15 and later), then with the
# typed ``i8*``. Read when a kernel using the prefetch is compiled, not when numba loads
# one from its cache.
INTRINSICS: tuple[str, ...] = ("llvm.prefetch.p0", "llvm.prefetch.p0i8")

_BYTE_POINTER = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)
_SIGNATURE = ir.FunctionType(ir.VoidType(), [_BYTE_POINTER, _I32, _I32, _I32])


@functools.cache
def lowers_to_prefetch(name: str) -> bool:
    """Whether LLVM compiles a call of the intrinsic ``name`` for this machine without a
    call left to a function of that name (a recognised intrinsic leaves an instruction,
    or nothing on a machine without one). Only plain ``llvm.`` names are tried: they are
    written as they are in the assembly, where an unresolved call would show them."""
    if not re.fullmatch(r"llvm(\.\w+)+", name, flags=re.ASCII):
        return False
    module = ir.Module("prefetch_probe")
    try:
        probe = ir.Function(module, ir.FunctionType(ir.VoidType(), [_BYTE_POINTER]), "probe")
        builder = ir.IRBuilder(probe.append_basic_block())
        builder.call(ir.Function(module, _SIGNATURE, name), [probe.args[0], *_flags(1, 3)])
        builder.ret_void()
        parsed = llvm.parse_assembly(str(module))
        parsed.verify()
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        machine = llvm.Target.from_default_triple().create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten()
        )
        assembly = machine.emit_assembly(parsed)
    except Exception:  # noqa: BLE001 - any failure means: compile the prefetch to nothing
        return False
    return name not in assembly


def intrinsic_name() -> str | None:
    """The first of ``INTRINSICS`` that this LLVM compiles to a prefetch; None: none does,
    and the prefetch compiles to nothing."""
    return next((name for name in INTRINSICS if lowers_to_prefetch(name)), None)


def _flags(write: int, locality: int) -> list[ir.Constant]:
    """The intrinsic's last three arguments; the last one says: a data line."""
    return [ir.Constant(_I32, write), ir.Constant(_I32, locality), ir.Constant(_I32, 1)]


def _prefetch_intrinsic(write: int, locality: int):  # noqa: ANN202 - a numba intrinsic
    """An intrinsic that starts loading the cache line at an address (a ``uintp``)."""

    def typer(typingctx, address):  # noqa: ARG001 - numba's intrinsic signature
        def codegen(context, builder, signature, args):  # noqa: ARG001
            name = intrinsic_name()
            if name is not None:
                function = cgutils.get_or_insert_function(builder.module, _SIGNATURE, name)
                pointer = builder.inttoptr(args[0], _BYTE_POINTER)
                builder.call(function, [pointer, *_flags(write, locality)])
            return context.get_dummy_value()

        return types.void(types.uintp), codegen

    typer.__name__ = typer.__qualname__ = f"prefetch_w{write}_l{locality}"
    return intrinsic(typer)


# A line about to be written, kept in every cache level.
prefetch = _prefetch_intrinsic(write=1, locality=3)
# A line about to be read once, streamed through: kept out of the nearest cache level.
prefetch_read = _prefetch_intrinsic(write=0, locality=2)
