"""The compiled kernels' two dependencies on private pieces, and what runs without them.

- ``cpu_tbe`` runs a step's parts on torch's OpenMP team through libgomp's private
  ``GOMP_parallel``; whatever goes wrong with it, the parts run on a pool of Python
  threads instead.
- ``dlrmflow.prefetch`` uses an LLVM intrinsic whose name depends on numba's LLVM; where
  no name works, the prefetch compiles to nothing.

Either way the results must be bitwise those of the normal path: the optimizer updates
are deterministic (see ``dlrmflow.kernels.tbe``), and a prefetch changes no value.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np
import pytest
import torch

import dlrmflow
from dlrmflow import prefetch
from dlrmflow.features import jit
from dlrmflow.kernels import cpu_tbe
from dlrmflow.kernels.tbe import SGD, RowWiseAdagrad, TableBatchedEmbeddingBag
from tests.kernels.batches import random_jagged, random_one_hot
from tests.kernels.test_tbe import MANY_TABLES

REPO = Path(dlrmflow.__file__).resolve().parent.parent  # where ``tests`` imports from

# Enough keys per weight group that a step splits into parts (dims 4 and 2).
TABLES = MANY_TABLES
OPTIMIZERS = [SGD(0.2, weight_decay=0.1), RowWiseAdagrad(0.2, 1e-6, 0.05)]


def trained_states() -> dict[str, np.ndarray]:
    """Weights and row-wise state after jagged and one-hot steps, each split over 2 threads."""
    states = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_tbe, "_threads", lambda elements: 2)
        for optimizer in OPTIMIZERS:
            tbe = TableBatchedEmbeddingBag(TABLES, optimizer, seed=5)
            for step in range(3):
                for kjt in (random_jagged(step, TABLES, 12), random_one_hot(step, TABLES, 12)):
                    gen = torch.Generator().manual_seed(100 + step)
                    tbe(kjt).backward(torch.randn(kjt.stride, tbe.output_dim, generator=gen))
            for name, buffer in tbe.state_dict().items():
                states[f"{type(optimizer).__name__}.{name}"] = buffer.numpy().copy()
    return states


def transformed_window() -> dict[str, np.ndarray]:
    """The feature transform's writers into a shuffled window: hashed IDs (with nulls) and
    dense values, over more blocks than the kernels prefetch ahead."""
    rng = np.random.default_rng(7)
    n, keys, window = 3 * 512 + 100, 5, 4096
    ids = tuple(jit.frozen(rng.integers(0, 2**40, n).view(np.uint64)) for _ in range(keys))
    valid = [None if k % 2 else rng.random(n) > 0.2 for k in range(keys)]
    salts = rng.integers(0, 2**63, keys, dtype=np.uint64)
    rows = rng.integers(1, 2**20, keys, dtype=np.uint64)
    dest = rng.permutation(window)[:n].astype(np.int64)
    sparse = np.zeros((window, keys), np.int32)
    jit.one_hot_rows(ids, jit.masks(valid), salts, rows, sparse, dest)
    dense = np.zeros((window, 3), np.float32)
    jit.scatter_rows(rng.random((3, n), dtype=np.float32), dense, dest)
    return {"sparse": sparse, "dense": dense}


def finished(run: Callable[[], dict[str, np.ndarray]], seconds: float = 120):
    """``run()``'s result; fails rather than hangs if a step waits for work never done."""
    result: list[dict[str, np.ndarray]] = []
    thread = threading.Thread(target=lambda: result.append(run()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, "the steps did not finish (or raised: see the thread's traceback)"
    return result[0]


def assert_bitwise_equal(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name].dtype == expected[name].dtype, name
        assert got[name].tobytes() == expected[name].tobytes(), name


# --- torch's OpenMP runtime --------------------------------------------------------------


def _torch_has_libgomp() -> bool:
    return any("libgomp" in f for f in os.listdir(Path(torch.__file__).parent / "lib"))


@pytest.fixture
def fresh_runner(monkeypatch):
    """Make ``_omp_runner`` load the runtime again on its next call (restored after)."""
    monkeypatch.setattr(cpu_tbe, "_omp", None)


@pytest.fixture(scope="module")
def normal_states() -> dict[str, np.ndarray]:
    """The states with the steps' parts on torch's team where it has one."""
    assert cpu_tbe._omp_runner() is not None or not _torch_has_libgomp()
    return trained_states()


@pytest.fixture
def pool_spy(monkeypatch) -> list[int]:
    """The worker counts asked of the Python-thread pool, one entry per split step."""
    asked: list[int] = []
    helpers = cpu_tbe._helpers

    def spy(workers: int):
        asked.append(workers)
        return helpers(workers)

    monkeypatch.setattr(cpu_tbe, "_helpers", spy)
    return asked


@pytest.mark.skipif(not _torch_has_libgomp(), reason="torch here ships no GNU OpenMP runtime")
def test_the_steps_run_on_torchs_openmp_team_here(monkeypatch, fresh_runner, pool_spy):
    # Else the comparisons below would hold the fallback up against itself.
    runner = cpu_tbe._omp_runner()
    assert runner is not None
    regions: list[int] = []

    def counting(body: Callable[[], None], threads: int) -> None:
        regions.append(threads)
        runner(body, threads)

    monkeypatch.setattr(cpu_tbe, "_omp", (os.getpid(), counting))
    trained_states()
    assert regions and set(regions) == {2} and not pool_spy


class _Symbol:
    """A stand-in for libgomp's ``GOMP_parallel`` (ctypes sets its argtypes and restype)
    that hands the C callback and the thread count to ``call``."""

    def __init__(self, call: Callable[..., None]) -> None:
        self.call = call

    def __call__(self, body, data, threads, flags) -> None:
        self.call(body, threads)


def _unloadable(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise OSError("cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", refuse)


def _without_symbol(monkeypatch) -> None:
    monkeypatch.setattr(cpu_tbe, "_load_torch_libgomp", lambda: types.SimpleNamespace())


def _library(parallel: Callable[..., None]) -> Callable[[pytest.MonkeyPatch], None]:
    def install(monkeypatch) -> None:
        monkeypatch.setattr(
            cpu_tbe,
            "_load_torch_libgomp",
            lambda: types.SimpleNamespace(GOMP_parallel=_Symbol(parallel)),
        )

    return install


def _fails(body, threads) -> None:
    raise OSError("GOMP_parallel failed")


def _skips_the_body(body, threads) -> None:
    pass


def _elsewhere(body, threads) -> None:
    thread = threading.Thread(target=body, args=(None,))
    thread.start()
    thread.join()


@pytest.mark.parametrize(
    "break_runtime",
    [
        _unloadable,
        _without_symbol,
        _library(_fails),
        _library(_skips_the_body),
        _library(_elsewhere),
    ],
    ids=["not_loadable", "no_symbol", "call_fails", "body_not_run", "not_on_this_thread"],
)
def test_a_broken_openmp_runtime_sends_the_steps_to_python_threads(
    break_runtime, monkeypatch, fresh_runner, pool_spy, normal_states
):
    with monkeypatch.context() as broken:
        break_runtime(broken)
        assert cpu_tbe._omp_runner() is None
    assert_bitwise_equal(finished(trained_states), normal_states)
    assert pool_spy and set(pool_spy) == {1}  # every split step went to the pool


@pytest.mark.parametrize("runner", [_fails, _skips_the_body], ids=["raises", "does_nothing"])
def test_a_runtime_that_breaks_during_a_step_still_completes_it(
    runner, monkeypatch, pool_spy, normal_states
):
    # It passed the trial region, then misbehaves: the step's parts left over run on
    # this thread or the pool, and a runtime that raised is not tried again.
    monkeypatch.setattr(cpu_tbe, "_omp", (os.getpid(), runner))
    assert_bitwise_equal(finished(trained_states), normal_states)
    if runner is _fails:
        assert cpu_tbe._omp_runner() is None and pool_spy
    else:
        assert cpu_tbe._omp_runner() is runner and not pool_spy


# --- the prefetch intrinsic --------------------------------------------------------------

_BOGUS = "llvm.dlrmflow.no_such_prefetch"


def test_the_probe_tells_a_prefetch_from_other_names():
    assert not prefetch.lowers_to_prefetch(_BOGUS)  # an unknown intrinsic: a call is left
    assert not prefetch.lowers_to_prefetch("memset")  # not an intrinsic name at all
    assert not prefetch.lowers_to_prefetch('llvm.prefetch.p0"')  # not a plain name


def test_a_known_name_is_a_prefetch_on_this_llvm():
    # The fallback keeps the kernels right without one, but ~20-35% slower (see
    # dlrmflow.prefetch): a failure here asks for this LLVM's name in INTRINSICS.
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

from dlrmflow import prefetch

prefetch.INTRINSICS = ({_BOGUS!r},)
from dlrmflow.features import jit
from dlrmflow.kernels import cpu_tbe
from tests.kernels import test_fallbacks

assert prefetch.intrinsic_name() is None
results = {{**test_fallbacks.trained_states(), **test_fallbacks.transformed_window()}}
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
