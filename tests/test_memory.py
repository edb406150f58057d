"""What a process may still take (``MemAvailable`` or, less, its cgroup's room, v1 and v2),
and the peak an evaluation reports."""

from __future__ import annotations

import mmap
import platform

import pytest

from dlrmflow.memory import Available, available_memory, peak_rss_bytes, reset_peak_rss
from dlrmflow.train.run.evaluate import evaluate
from dlrmflow.train.run.trainer import train
from tests.conftest import tiny_run_config


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


def test_an_evaluation_reports_its_own_peak_not_the_process_s(tiny_dataset, tmp_path):
    """In a process that trained first (the flows, the demo), eval.json's peak resident
    set is the evaluation's: 256 MiB touched and released before it does not count."""
    if not reset_peak_rss():
        pytest.skip("the peak resident set cannot be reset here (/proc/self/clear_refs)")
    config = tiny_run_config(tiny_dataset, tmp_path / "run", max_steps=2)
    train(config)
    size = 256 << 20
    with mmap.mmap(-1, size) as block:
        block.write(b"\x01" * size)  # resident until unmapped; the peak keeps it
    before = peak_rss_bytes()
    (peak,) = evaluate(config.run_dir)["peak_rss_bytes"]
    assert 0 < peak < before - size // 2, (peak, before)
