"""What a test may compare bitwise, and what only within a stated tolerance.

Bitwise: two values this machine computed, in this test session (a resumed run against an
uninterrupted one, two ranks' layouts against each other, a reference recomputed here).
The same seed and data give the same bits on one machine, so anything less would let a
determinism bug through.

Within ``ACROSS_CPUS``: a value computed on another machine and committed with the tests
(``tests/data``). Matrix multiplies round differently on another CPU (MKL and oneDNN pick
their kernels by the instruction set, and sum in another order), so float32 training on
the same data moves by a few units in the last place per step. Such a test is marked
``recorded`` (``pytest -m recorded`` lists them), and ``tests/test_across_cpus.py`` runs
them under ``OTHER_CPU``, which makes the libraries take another CPU's code paths on this
one: a test that pins this machine's bits then fails here, not on the next machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

# A few steps of float32 training on another CPU: the observed drift is ~1e-7 relative
# (a loss, a log loss), the tolerance is a hundred times that. A wrong resume point, an
# optimizer state lost or a batch read twice moves these values by 1e-3 or more.
ACROSS_CPUS_REL = 1e-5
ACROSS_CPUS_ABS = 1e-7

# Another CPU's code paths on this one: MKL's compatible path (its products round as on a
# machine of another family), oneDNN's AVX2 kernels (no AVX-512, no AMX: bfloat16 and
# float32 products as on an older x86-64), numpy's dispatch without AVX-512.
OTHER_CPU = {
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
}


def close_across_cpus(got: float, want: float) -> bool:
    """Whether ``got`` (computed here) matches ``want`` (recorded on another machine)."""
    return math.isclose(got, want, rel_tol=ACROSS_CPUS_REL, abs_tol=ACROSS_CPUS_ABS)


def assert_weights_close_across_cpus(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]
) -> None:
    """Every tensor of ``got`` within the tolerance of ``want``'s, elementwise."""
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=ACROSS_CPUS_REL, atol=ACROSS_CPUS_ABS), (
            f"{name}: max difference {(got[name] - want[name]).abs().max().item():.3g}"
        )
