"""The allocator setting (``runtime.glibc_malloc``): large buffers freed and allocated again
are reused, not remapped; without glibc, or where ``mallopt`` refuses, nothing changes."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from dlrmflow.runtime import glibc_malloc
from dlrmflow.runtime.glibc_malloc import ENV, tune_allocator

GLIBC = platform.libc_ver()[0] == "glibc"


def _huge_pages_always() -> bool:
    """Whether the kernel backs every large mapping with 2 MiB pages (few faults to save)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


# Ten training steps of a TBE (dim 128, batch 4096: a 54 MB pooled output, as in the
# kernel benchmark) and the dot interaction; prints the page faults of the last seven.
FAULTS = """
import resource, torch
from dlrmflow.runtime.glibc_malloc import tune_allocator
print(tune_allocator())
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.features.spec import SparseFeature
from dlrmflow.kernels.interaction import dot_interaction
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.kernels.optimizers import SGD
keys = [f"C{i}" for i in range(26)]
tbe = TableBatchedEmbeddingBag([SparseFeature(k, 1000, 128) for k in keys], SGD(0.01))
ids = torch.randint(0, 1000, (4096, 26), generator=torch.Generator().manual_seed(0))
kjt = KeyedJaggedTensor.from_one_hot(keys, ids)
dense = torch.randn(4096, 128, requires_grad=True)
for step in range(10):
    if step == 3:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    dot_interaction(dense, tbe(kjt).view(4096, 26, 128)).sum().backward()
    dense.grad = None
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(threshold: str) -> tuple[str, int]:
    env = {**os.environ, ENV: threshold}
    out = subprocess.run(
        [sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's; elsewhere it is left alone")
@pytest.mark.skipif(_huge_pages_always(), reason="huge pages: a fresh mapping costs few faults")
def test_a_tuned_process_reuses_large_buffers_without_page_faults():
    untouched, default_faults = _faults("0")
    tuned, tuned_faults = _faults(str(1 << 30))
    assert untouched == "None" and tuned == str(1 << 30)
    # By default glibc maps each step's large buffers afresh: a fault per 4 KiB page,
    # ~40k a step. Tuned, the heap hands the freed blocks back (measured: ~0-14k a step).
    assert default_faults > 7 * 20_000
    assert tuned_faults < default_faults / 4


# A reader thread's shuffle windows: twelve 40 MB blocks from malloc, written whole, by a
# thread other than the main one, the last three alive at once (one handed out, two being
# prepared); prints the page faults of the last eight.
THREAD_FAULTS = """
import ctypes, resource, threading
from dlrmflow.runtime.glibc_malloc import tune_allocator
tune_allocator()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
faults = []
def build_windows():
    held = []
    for window in range(12):
        if window == 4:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        block = libc.malloc(40_000_000)
        libc.memset(block, 1, 40_000_000)
        held.append(block)
        if len(held) > 3:
            libc.free(held.pop(0))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
thread = threading.Thread(target=build_windows)
thread.start()
thread.join()
print(faults[1] - faults[0])
"""


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's; elsewhere it is left alone")
@pytest.mark.skipif(_huge_pages_always(), reason="huge pages: a fresh mapping costs few faults")
def test_a_tuned_process_reuses_a_threads_large_buffers_too():
    def faults(threshold: str) -> int:
        env = {**os.environ, ENV: threshold}
        run = subprocess.run(
            [sys.executable, "-c", THREAD_FAULTS], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        return int(run.stdout)

    default_faults, tuned_faults = faults("0"), faults(str(1 << 30))
    # Untuned, each buffer is a fresh mapping: ~9,800 faults apiece. With the thresholds
    # alone the thread's own arena still unmaps a heap as each buffer is freed (measured
    # ~19,500 faults); in the main heap the freed buffers are reused.
    assert default_faults > 8 * 5_000
    assert tuned_faults < default_faults / 4


def test_a_bad_threshold_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(ValueError, match=f"{ENV}='lots'.*byte count"):
        tune_allocator()
    monkeypatch.setenv(ENV, str(2**31))
    with pytest.raises(ValueError, match=ENV):
        tune_allocator()
    monkeypatch.setenv(ENV, "0")
    assert tune_allocator() is None


@pytest.mark.skipif(not GLIBC, reason="only glibc has mallopt")
def test_glibc_here_has_mallopt():
    # Fails when glibc's mallopt cannot be found where glibc is: the setting would be
    # silently gone (the fault tests above would then fail too, where they run).
    assert glibc_malloc._glibc_mallopt() is not None


def test_without_mallopt_or_when_it_refuses_nothing_is_set(monkeypatch):
    monkeypatch.setenv(ENV, str(1 << 30))
    monkeypatch.setattr(glibc_malloc, "_applied", None)
    monkeypatch.setattr(glibc_malloc, "_glibc_mallopt", lambda: None)
    assert tune_allocator() is None and glibc_malloc.applied_threshold() is None
    calls = []

    def refusing(param: int, value: int) -> int:
        calls.append(param)
        return 0 if param == glibc_malloc._M_ARENA_MAX else 1

    monkeypatch.setattr(glibc_malloc, "_glibc_mallopt", lambda: refusing)
    assert tune_allocator() is None and glibc_malloc.applied_threshold() is None
    assert glibc_malloc._M_ARENA_MAX in calls
