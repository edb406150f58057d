"""The logs shape (``generate --shape logs``: string IDs, a weighted list, float features, a
table shared by ``item_id`` and ``recent_items``, a key) end to end, so that nothing keeps
assuming Criteo: trained at one rank, and at two with row-wise shards partly on disk,
evaluated and scored, against the Bayes AUC the generator records. (Shards on disk train
bitwise as in memory: ``test_sharded_tiers``.)

Measured on this data (12,000 rows a day, 3 training days, 2 epochs): one rank and two
come within 0.014 and 0.011 of the Bayes AUC (0.731) and differ by 0.003. With the tags
declared without their weights they reached 0.673 and 0.675, below the true model with
every weight at its mean (0.690). At one rank, ``recent_items`` in a table of its own
reached 0.717 as shared, and the schema without it 0.714.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dlrmflow.config import DataConfig, RunConfig
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.synthetic_logs import generate_logs_dataset
from dlrmflow.score.score import score_dataset
from dlrmflow.train.launch.job import launch_training
from dlrmflow.train.model.plan import ShardingPlan
from dlrmflow.train.run.checkpoint import load_checkpoint
from dlrmflow.train.run.evaluate import evaluate

ROWS = 12_000
DATA = {"days": 4, "rows_per_day": ROWS, "row_group_size": 3000, "cardinality_scale": 0.0001}
# Below the Bayes AUC, at most: 36,000 training rows leave a model 0.011 to 0.014 short of
# it (measured above), and the rest of the margin leaves room for another CPU's rounding
# and the ~0.005 standard error of an AUC over 12,000 rows.
AUC_GAP = 0.025


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("logs") / "data")
    generate_logs_dataset(DataConfig(url=url, **DATA))
    return url


def _config(data: str, run_dir: Path, nproc: int, **train: object) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run_dir": str(run_dir),
            "data": {"url": data},
            "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [32]},
            "train": {
                "batch_size": 512 // nproc,  # the same global batch at either rank count
                "epochs": 2,
                "lr": 0.01,
                "embedding_lr": 0.2,
                "num_workers": 0,
                "log_every": 10**6,
                **train,
            },
            "distributed": {"nproc": nproc, "sharding": "row_wise" if nproc > 1 else None},
        }
    )


@pytest.fixture(scope="module")
def one_rank(logs: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("one") / "run"
    launch_training(_config(logs, run, 1))
    return run


@pytest.fixture(scope="module")
def two_ranks(logs: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Two ranks, every table row-wise, under train.embedding_memory_bytes: per rank,
    halves of 2000, 1024 and 1024 rows of 8 floats and a sum of squares (72 KB); 30 KB
    keep one table's shard (18 KB) in memory and, for the shards on disk, a cache of
    fewer rows than the ~600 IDs the steps touch, so rows are evicted and read again."""
    run = tmp_path_factory.mktemp("two") / "run"
    result = launch_training(_config(logs, run, 2, embedding_memory_bytes=30_000))
    return run, result.embedding_cache


def test_one_rank_trains_near_the_optimum_evaluates_and_scores(logs, one_rank, tmp_path):
    manifest = read_manifest(logs)
    bayes = manifest.bayes_auc
    metrics = evaluate(one_rank)
    assert bayes - AUC_GAP < metrics["auc"] <= bayes + 0.01, (metrics["auc"], bayes)
    # The tags' weights reach the model: it beats the true model with the weights at
    # their mean, the best a model blind to them could approach (measured without
    # weights: 0.017 below that).
    assert metrics["auc"] > manifest.generator["auc_list_weights_ignored"] + 0.01
    assert 0.9 < metrics["calibration"] < 1.1
    spec = load_checkpoint(one_rank).spec
    assert (spec.label, spec.sparse_names) == (
        "click",
        ["user_id", "item_id", "recent_items", "tags"],
    )
    # item_id and recent_items look up one table, items.
    assert [t.name for t in spec.tables] == ["user_id", "items", "tags"]
    assert spec.table_features("items") == ["item_id", "recent_items"]
    scored = score_dataset(str(one_rank), logs, str(tmp_path / "scores"), days="3")
    assert scored["rows"] == ROWS
    table = pq.read_table(tmp_path / "scores")
    test_day = pq.read_table(manifest.day_paths(logs, [3])[0], columns=["request_id"])
    # The declared key beside each prediction: every request of the day, once.
    assert sorted(table.column("request_id").to_pylist()) == sorted(
        test_day.column("request_id").to_pylist()
    )


def test_two_ranks_shard_every_table_on_disk_and_agree_with_one(logs, one_rank, two_ranks):
    run, cache = two_ranks
    plan = ShardingPlan.from_dict(json.loads((run / "plan.json").read_text()))
    assert {t.sharding for t in plan.tables} == {"row_wise"}
    assert all(len(t.shards) == 2 for t in plan.tables)
    for rank in range(2):
        assert {s.tier for _, s in plan.shards_on(rank)} == {"device", "ssd"}, rank
    assert cache["evictions"] > 0 and 0 < cache["hit_rate"] < 1
    bayes = read_manifest(logs).bayes_auc
    two, one = evaluate(run), evaluate(one_rank)
    assert bayes - AUC_GAP < two["auc"] <= bayes + 0.01, (two["auc"], bayes)
    # The same global batch, other readers' row order and float sums: close, not equal.
    assert abs(two["auc"] - one["auc"]) < 0.01, (two["auc"], one["auc"])
