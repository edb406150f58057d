"""The allocator setting: large buffers freed and allocated again are reused, not remapped."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from dlrmflow.memory import ENV, Available, available_memory, tune_allocator

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
from dlrmflow.memory import tune_allocator
print(tune_allocator())
from dlrmflow.features.batch import KeyedJaggedTensor
from dlrmflow.features.spec import SparseFeature
from dlrmflow.kernels.interaction import dot_interaction
from dlrmflow.kernels.tbe import SGD, TableBatchedEmbeddingBag
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
from dlrmflow.memory import tune_allocator
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


def _fake_machine(tmp_path, meminfo_kb: int, cgroup_line: str, files: dict[str, str]):
    """A /proc/meminfo, /proc/self/cgroup and cgroup tree under ``tmp_path``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kb} kB\n")
    (tmp_path / "cgroup").write_text(cgroup_line + "\n")
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {
        "meminfo": tmp_path / "meminfo",
        "proc_cgroup": tmp_path / "cgroup",
        "cgroup_root": tmp_path / "fs",
    }


def test_available_memory_is_the_least_of_the_machine_and_its_cgroup_limits(tmp_path):
    """A container's limit (v2 memory.max, here on the job's parent cgroup) is what the
    process may take when it is below MemAvailable; its file cache counts as free."""
    v2 = {
        "cgroup.controllers": "cpu memory\n",
        "job/memory.max": "2000000000\n",
        "job/memory.current": "1500000000\n",
        "job/memory.stat": "anon 1000000000\nactive_file 300000000\ninactive_file 200000000\n",
        "job/step/memory.max": "max\n",
        "job/step/memory.current": "1500000000\n",
    }
    paths = _fake_machine(tmp_path / "a", 8_000_000, "0::/job/step", v2)
    found = available_memory(**paths)
    assert found is not None and found.bytes == 1_000_000_000
    assert found.source == f"the cgroup limit {tmp_path}/a/fs/job/memory.max"
    # Without a limit: MemAvailable.
    unlimited = {**v2, "job/memory.max": "max\n"}
    found = available_memory(**_fake_machine(tmp_path / "b", 8_000_000, "0::/job/step", unlimited))
    assert found == Available(8_000_000 * 1024, f"MemAvailable in {tmp_path}/b/meminfo")


def test_a_cgroup_v1_limit_counts_too(tmp_path):
    v1 = {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",  # the root: no limit
        "memory/memory.usage_in_bytes": "5000000000\n",
        "memory/batch/memory.limit_in_bytes": "3000000000\n",
        "memory/batch/memory.usage_in_bytes": "2000000000\n",
        "memory/batch/memory.stat": "total_active_file 100\ntotal_inactive_file 400\n",
    }
    lines = "4:memory:/batch\n3:cpu,cpuacct:/batch\n0::/"
    found = available_memory(**_fake_machine(tmp_path, 8_000_000, lines, v1))
    assert found is not None and found.bytes == 1_000_000_500
    assert found.source.endswith("memory/batch/memory.limit_in_bytes")


def test_available_memory_on_this_machine_is_positive():
    found = available_memory()
    if platform.system() == "Linux":
        assert found is not None and found.bytes > 0
