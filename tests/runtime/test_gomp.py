"""Steps on torch's OpenMP team (``runtime.gomp``), and on a pool of Python threads
whatever goes wrong with that runtime: bitwise the same weights either way."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from dlrmflow.kernels import cpu_tbe
from dlrmflow.runtime import gomp
from tests.runtime.results import assert_bitwise_equal, finished, trained_states


def _torch_has_libgomp() -> bool:
    return any("libgomp" in f for f in os.listdir(Path(torch.__file__).parent / "lib"))


@pytest.fixture
def fresh_runner(monkeypatch):
    """Make ``omp_runner`` load the runtime again on its next call (restored after)."""
    monkeypatch.setattr(gomp, "_omp", None)


@pytest.fixture(scope="module")
def normal_states() -> dict[str, np.ndarray]:
    """The states with the steps' parts on torch's team where it has one."""
    assert gomp.omp_runner() is not None or not _torch_has_libgomp()
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


@pytest.mark.skipif(sys.platform != "linux", reason="torch's Linux builds ship GNU OpenMP")
def test_the_steps_run_on_torchs_openmp_team_here(monkeypatch, fresh_runner, pool_spy):
    # Fails when torch stops shipping libgomp, or ships one the runner cannot use: the
    # measured gain would be gone unnoticed. Else the comparisons below would hold the
    # fallback up against itself.
    assert _torch_has_libgomp(), "torch's lib/ holds no libgomp: re-measure runtime.gomp"
    runner = gomp.omp_runner()
    assert runner is not None
    regions: list[int] = []

    def counting(body: Callable[[], None], threads: int) -> None:
        regions.append(threads)
        runner(body, threads)

    monkeypatch.setattr(gomp, "_omp", (os.getpid(), counting))
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
    monkeypatch.setattr(gomp, "_load_torch_libgomp", lambda: types.SimpleNamespace())


def _library(parallel: Callable[..., None]) -> Callable[[pytest.MonkeyPatch], None]:
    def install(monkeypatch) -> None:
        monkeypatch.setattr(
            gomp,
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
        assert gomp.omp_runner() is None
    assert_bitwise_equal(finished(trained_states), normal_states)
    assert pool_spy and set(pool_spy) == {1}  # every split step went to the pool


@pytest.mark.parametrize("runner", [_fails, _skips_the_body], ids=["raises", "does_nothing"])
def test_a_runtime_that_breaks_during_a_step_still_completes_it(
    runner, monkeypatch, pool_spy, normal_states
):
    # It passed the trial region, then misbehaves: the step's parts left over run on
    # this thread or the pool, and a runtime that raised is not tried again.
    monkeypatch.setattr(gomp, "_omp", (os.getpid(), runner))
    assert_bitwise_equal(finished(trained_states), normal_states)
    if runner is _fails:
        assert gomp.omp_runner() is None and pool_spy
    else:
        assert gomp.omp_runner() is runner and not pool_spy
