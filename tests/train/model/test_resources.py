"""Resources are checked before they run out: a disk too small for the embeddings on disk,
tables too large for the host's memory and a memory budget too small for one batch each
end ``dlrmflow train`` in one line and exit 1, naming the file or the configuration key,
with nothing left behind (no SIGBUS, no allocator traceback, no half-made file)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrmflow.config import build_config
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.memory import Available
from dlrmflow.train.model.dlrm import embedding_optimizer
from dlrmflow.train.model.memory_budget import MemoryShortage, check_memory, tiered_embeddings
from dlrmflow.train.model.sharded.tiers import TierBudgetError
from dlrmflow.train.planner import cpu_topology, plan_for_config
from tests.conftest import small_tmpfs

SMALL_MODEL = [
    "model.embedding_dim=8",
    "model.bottom_mlp=[16,8]",
    "model.top_mlp=[32]",
    "train.batch_size=512",
    "train.num_workers=0",
    "train.max_steps=2",
]
# 26 hashed tables of up to 30,000 rows (far more buckets than IDs): 9.2 MB of rows and
# row-wise Adagrad state at dim 8, more than the 8 MB disk and the 1 MB budget. Two ranks
# get 4.6 MB each: one rank's file fits, the other's does not, and neither is left.
LARGE_TABLES = ["features.hash_size_factor=1000", "features.max_rows_per_table=30000"]
# 26 tables of 10^6 rows at dim 16384: 1.7 TB of rows and state, more than any host has,
# while their row map on disk (4 bytes a row: 104 MB) fits any: a budget is the remedy.
HUGE_TABLES = [
    "features.hash_size_factor=1e9",
    "features.max_rows_per_table=1000000",
    "model.embedding_dim=16384",
    "model.bottom_mlp=[16,16384]",
]


def _train(data: str, run_dir: Path, *sets: str, nproc: int = 1) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("DLRMFLOW_HELD_RUN_DIRS", "DLRMFLOW_DEBUG")
    }
    args = ["train", "--data", data, "--run-dir", str(run_dir), "--nproc", str(nproc)]
    for s in [*SMALL_MODEL, *sets]:
        args += ["--set", s]
    command = [sys.executable, "-m", "dlrmflow", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def _one_line(done: subprocess.CompletedProcess) -> str:
    """The error line of a run that failed as expected: exit 1, one line, no traceback."""
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_disk_too_small_for_the_embeddings_fails_before_training(
    tiny_dataset: str, tmp_path: Path, nproc: int
):
    """The run directory on an 8 MB disk, its embeddings on disk needing more: one line
    naming the file and the bytes (needed and free) rather than a SIGBUS (exit 135) with
    the file and the lock left behind. No file remains, and the run directory is free
    for the next run, which fails the same way."""
    with small_tmpfs(tmp_path / "run") as run_dir:
        budget = "train.embedding_memory_bytes=1000000"
        for _ in range(2 if nproc == 1 else 1):
            line = _one_line(_train(tiny_dataset, run_dir, *LARGE_TABLES, budget, nproc=nproc))
            rank_dir = "" if nproc == 1 else "rank[01]/"
            assert "in use" not in line  # the lock of the run before was released
            pattern = (
                rf"{run_dir}/embeddings/{rank_dir}embeddings\.tiered: the embedding rows and "
                r"optimizer state kept on disk need \S+ MB \(\d+ bytes\), but its file system "
                r"has \S+ MB \(\d+ bytes\) free"
            )
            assert re.search(pattern, line), line
            assert not list(run_dir.rglob("*.tiered"))
            assert not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("nproc", [1, 2])
def test_tables_too_large_for_memory_fail_before_allocating(
    tiny_dataset: str, tmp_path: Path, nproc: int
):
    """1.7 TB of tables: one line naming train.embedding_memory_bytes, with the bytes
    needed and available, at once (not an allocator traceback after trying)."""
    started = time.monotonic()
    line = _one_line(_train(tiny_dataset, tmp_path / "run", *HUGE_TABLES, nproc=nproc))
    assert time.monotonic() - started < 60
    who = "this process" if nproc == 1 else "ranks 0-1 on this host"
    needed = 4 * 26 * 1_000_000 * (16384 + 1)
    assert f"the embedding tables need 1.7 TB ({needed} bytes) of memory in {who}" in line
    assert re.search(r"this host has \S+ [kMGT]?B \(\d+ bytes\) available \(", line), line
    assert "set train.embedding_memory_bytes below " in line
    assert "allocate" not in line
    assert not (tmp_path / "run" / "embeddings").exists()


def test_a_budget_too_small_for_one_batch_names_configuration_keys(
    tiny_dataset: str, tmp_path: Path
):
    """1000 bytes of cache for a batch of 512 samples of 26 tables: one line naming
    train.embedding_memory_bytes (with how much more it needs) and train.batch_size, never
    a constructor argument (cache_rows) the user cannot set."""
    budget = "train.embedding_memory_bytes=1000"
    line = _one_line(_train(tiny_dataset, tmp_path / "run", budget))
    assert line.startswith("error: train.embedding_memory_bytes: ")
    assert "distinct rows in memory at once but the cache holds 15" in line
    assert "raise it by at least " in line and line.endswith("or lower train.batch_size")
    assert "cache_rows" not in line


def test_a_budget_without_room_for_one_row_of_cache_names_the_key(tmp_path: Path):
    config = _config(embedding_memory_bytes=10)
    with pytest.raises(TierBudgetError) as e:
        tiered_embeddings(config, SPEC, embedding_optimizer(config.train), tmp_path)
    assert str(e.value) == (
        "train.embedding_memory_bytes: 10 bytes hold no row of the cache of the tables on "
        "disk (97 bytes a row, its tracking included); raise it"
    )
    assert list(tmp_path.iterdir()) == []


# Two ranks on one host, 4 tables of 50,000 rows at dim 16: 3.4 MB each with row-wise
# Adagrad, 6.8 MB for the job.
SPEC = FeatureSpec(
    dense=("I1",), sparse=tuple(SparseFeature(f"C{k}", 50_000, 16) for k in range(4))
)
TABLE_BYTES = 4 * 50_000 * 17


def _config(**train: object):
    return build_config(
        {
            "model": {"embedding_dim": 16, "bottom_mlp": [16], "top_mlp": [8]},
            "distributed": {"sharding": "table_wise"},  # whole tables: no state split
            "train": train,
        }
    )


def test_the_ranks_of_a_host_are_checked_together():
    """Each rank's shards fit in the memory available, both ranks' do not: the host's
    ranks share it, so the job is refused, naming the budget that would fit."""
    config = _config()
    plan = plan_for_config(config, SPEC, 2, 2, topology=cpu_topology(2, 2))
    job = 4 * TABLE_BYTES
    check_memory(config, SPEC, plan, available=Available(job, "test"))
    with pytest.raises(MemoryShortage) as e:
        check_memory(config, SPEC, plan, available=Available(job - 1, "test"))
    most = (job - 1) // 2 - 4 * 2 * 50_000
    assert str(e.value) == (
        f"the embedding tables need 13.6 MB ({job} bytes) of memory in ranks 0-1 on this "
        f"host, but this host has 13.6 MB ({job - 1} bytes) available (test); set "
        f"train.embedding_memory_bytes below {most} to keep the rows beyond it on disk"
    )
    # Ranks on hosts of their own: each host holds one rank's shards.
    alone = dataclasses.replace(plan, ranks_per_host=1)
    check_memory(config, SPEC, alone, available=Available(job // 2, "test"))


def test_with_a_budget_the_cache_and_the_row_map_are_what_memory_holds():
    """One process under train.embedding_memory_bytes needs the cache (within the budget)
    and 4 bytes per row on disk, not the tables: a budget that keeps the tables in memory
    on a host too small for them is refused, naming the budget below which they fit."""
    rows = 4 * 50_000
    budget = 1_000_000
    # Every table on disk: at most the budget for the cache, plus the row map.
    check_memory(
        _config(embedding_memory_bytes=budget), SPEC, available=Available(budget + 4 * rows, "t")
    )
    with pytest.raises(
        MemoryShortage, match=r"lower train.embedding_memory_bytes \(now 99000000\) below 200000$"
    ):
        check_memory(
            _config(embedding_memory_bytes=99_000_000), SPEC, available=Available(1_000_000, "t")
        )
    with pytest.raises(
        MemoryShortage,
        match=r"even on disk, the tables' 200000 rows need 800.0 kB \(800000 bytes\) of "
        r"memory, 4 bytes a row: lower features.max_rows_per_table$",
    ):
        check_memory(
            _config(embedding_memory_bytes=budget), SPEC, available=Available(4 * rows, "t")
        )
