"""LLVM's prefetch in the compiled kernels (``runtime.llvm_prefetch``): a name of the
intrinsic that lowers to a prefetch on this LLVM, and kernels compiled without one that
give bitwise the same results."""

from __future__ import annotations

import os
import subprocess
import sys

import numba
import numpy as np

from dlrmflow.runtime import llvm_prefetch as prefetch
from tests.runtime.results import (
    REPO,
    assert_bitwise_equal,
    trained_states,
    transformed_window,
)

_BOGUS = "llvm.dlrmflow.no_such_prefetch"


def test_the_probe_tells_a_prefetch_from_other_names():
    assert not prefetch.lowers_to_prefetch(_BOGUS)  # an unknown intrinsic: a call is left
    assert not prefetch.lowers_to_prefetch("memset")  # not an intrinsic name at all
    assert not prefetch.lowers_to_prefetch('llvm.prefetch.p0"')  # not a plain name


def test_a_known_name_is_a_prefetch_on_this_llvm():
    # The fallback keeps the kernels right without one, but ~20-35% slower (see
    # dlrmflow.runtime.llvm_prefetch): a failure here asks for this LLVM's name in INTRINSICS.
    name = prefetch.intrinsic_name()
    assert name is not None, f"none of {prefetch.INTRINSICS} lowers to a prefetch here"

    @numba.njit
    def touch(a):
        prefetch.prefetch(a.ctypes.data)
        return a.sum()

    assert touch(np.ones(4)) == 4.0
    assert name in next(iter(touch.inspect_llvm().values()))


_WITHOUT_PREFETCH = f"""
import sys

import numpy as np

from dlrmflow.runtime import llvm_prefetch as prefetch

prefetch.INTRINSICS = ({_BOGUS!r},)
from dlrmflow.features import jit
from dlrmflow.kernels import cpu_tbe
from tests.runtime import results

assert prefetch.intrinsic_name() is None
results = {{**results.trained_states(), **results.transformed_window()}}
kernels = [cpu_tbe._assign_slots, cpu_tbe._reduce_and_update, jit.one_hot_rows, jit.scatter_rows]
code = "".join(ir for kernel in kernels for ir in kernel.inspect_llvm().values())
assert "llvm.prefetch" not in code and {_BOGUS!r} not in code, "a prefetch call was compiled"
np.savez(sys.argv[1], **results)
"""


def test_kernels_compiled_without_the_prefetch_give_the_same_results(tmp_path):
    # A fresh process, with numba's cache in tmp_path, compiles the kernels with no name
    # of the intrinsic usable; a call of the bogus name would not even run (a crash).
    out = tmp_path / "results.npz"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_PREFETCH, str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    with np.load(out) as saved:
        without = {name: saved[name] for name in saved.files}
    assert_bitwise_equal(without, {**trained_states(), **transformed_window()})
