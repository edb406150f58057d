import json
import shutil

import pytest
import torch

from dlrmflow.train.run.checkpoint import list_checkpoints, load_checkpoint
from dlrmflow.train.run.evaluate import evaluate
from dlrmflow.train.run.trainer import train
from tests.conftest import tiny_run_config


def _weights(run_dir):
    return load_checkpoint(run_dir).model.state_dict()


def test_train_writes_metrics_and_checkpoint_then_evaluates(tiny_dataset, tmp_path):
    cfg = tiny_run_config(tiny_dataset, tmp_path / "run", epochs=2)
    result = train(cfg)
    assert result.rows == 2 * 2 * 6000  # two training days, two epochs
    assert result.steps == 2 * 24  # 12000 rows / 512 -> 24 batches per epoch (last partial)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(5, 48, 5)) + [48]
    assert records[-1]["rows"] == result.rows
    assert records[-1]["loss"] < records[0]["loss"]

    metrics = evaluate(tmp_path / "run")
    assert metrics["rows"] == 6000
    assert 0.6 < metrics["auc"] <= 1.0
    written = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert written["auc"] == metrics["auc"]
    # The reliability table: 15 bins of 400 rows, their rates in order, and its plot.
    table = written["reliability"]
    assert [b["rows"] for b in table] == [400] * 15
    assert [b["predicted"] for b in table] == sorted(b["predicted"] for b in table)
    mean = sum(b["predicted"] * b["rows"] for b in table) / 6000
    assert mean / metrics["positive_rate"] == pytest.approx(metrics["calibration"])
    assert written["calibration_error"] >= abs(mean - metrics["positive_rate"]) - 1e-12
    assert (tmp_path / "run" / "reliability.png").read_bytes()[:4] == b"\x89PNG"
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.step == result.steps and ckpt.rows == result.rows


def test_same_seed_gives_bitwise_identical_weights(tiny_dataset, tmp_path):
    for name in ("a", "b", "c"):
        seed = 1 if name == "c" else 0
        train(tiny_run_config(tiny_dataset, tmp_path / name, max_steps=8, seed=seed))
    a, b, c = (_weights(tmp_path / n) for n in ("a", "b", "c"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_vocabulary_ids_and_dcnv2_train(tiny_dataset, tmp_path):
    cfg = tiny_run_config(tiny_dataset, tmp_path / "run", max_steps=6)
    cfg.features.ids = "vocab"
    cfg.model.arch = "dcnv2"
    train(cfg)
    assert (tmp_path / "run" / "vocab.npz").is_file()
    metrics = evaluate(tmp_path / "run", max_rows=1000)
    assert metrics["rows"] == 1000


def test_evaluate_without_checkpoint_fails_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        evaluate(tmp_path)


def test_multi_hot_data_trains_with_mean_pooling(tmp_path):
    from dlrmflow.config import DataConfig
    from dlrmflow.ingest.synthetic import generate_dataset
    from tests.conftest import TINY_DATA

    data = str(tmp_path / "mh")
    generate_dataset(DataConfig(url=data, **{**TINY_DATA, "multi_hot": True}))
    cfg = tiny_run_config(data, tmp_path / "run", epochs=2)
    cfg.features.pooling = "mean"
    cfg.data.multi_hot = True
    result = train(cfg)
    assert result.rows == 2 * 2 * 6000
    assert evaluate(tmp_path / "run")["auc"] > 0.6


def test_periodic_evaluation_logs_auc_and_keeps_the_best_checkpoint(tiny_dataset, tmp_path):
    cfg = tiny_run_config(
        tiny_dataset,
        tmp_path / "run",
        epochs=2,
        eval_every=8,
        checkpoint_every=8,
        keep_checkpoints=1,
    )
    train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    evals = [r for r in records if "auc" in r]
    assert [r["step"] for r in evals] == [8, 16, 24, 32, 40, 48]
    assert all(0.5 < r["auc"] <= 1.0 for r in evals)
    kept = list_checkpoints(tmp_path / "run")
    best = max(evals[:-1], key=lambda r: r["auc"])  # the final checkpoint is kept anyway
    steps = {c.step for c in kept}
    assert 48 in steps and best["step"] in steps and len(steps) <= 2
    for c in kept:
        assert c.manifest["metrics"]["auc"] == next(r["auc"] for r in evals if r["step"] == c.step)


def test_embeddings_beyond_the_memory_budget_train_from_disk_to_the_same_weights(
    tiny_dataset, tmp_path, monkeypatch
):
    """Tables bigger than train.embedding_memory_bytes live on disk behind a cache smaller
    than a step's rows... and train, resume, checkpoint and evaluate exactly as in memory."""
    in_memory = tiny_run_config(tiny_dataset, tmp_path / "memory", max_steps=8)
    train(in_memory)
    budget = 90_000  # bytes: 1384 cached rows (dim 8, state, bookkeeping) of the ~13k rows
    on_disk = tiny_run_config(
        tiny_dataset,
        tmp_path / "disk",
        max_steps=4,
        checkpoint_every=4,
        embedding_memory_bytes=budget,
    )
    train(on_disk)  # stops at step 4, checkpoint written
    assert (tmp_path / "disk" / "embeddings" / "embeddings.tiered").is_file()
    resumed = on_disk.model_copy(deep=True)
    resumed.train.max_steps = 8
    result = train(resumed)  # a new process would do the same: rows come from the checkpoint
    assert result.resumed_from_step == 4 and result.steps == 8
    cache = result.embedding_cache
    assert cache["evictions"] > 0 and 0 < cache["hit_rate"] < 1  # the cache really was small
    got, want = _weights(tmp_path / "disk"), _weights(tmp_path / "memory")
    assert all(torch.equal(got[k], want[k]) for k in want)
    # Evaluated under the same budget: its tables in a scratch file, removed afterwards,
    # and the metrics of the in-memory run.
    from dlrmflow.train.model import memory_budget as tiers
    from dlrmflow.train.run.evaluate import evaluate

    bags = []
    real = tiers.TieredEmbeddings
    monkeypatch.setattr(
        tiers, "TieredEmbeddings", lambda *a, **k: bags.append(real(*a, **k)) or bags[-1]
    )
    scored, want_metrics = evaluate(tmp_path / "disk"), evaluate(tmp_path / "memory")
    assert [bag.path.parent.name for bag in bags] == ["eval-rank0"]
    assert not (tmp_path / "disk" / "embeddings" / "eval-rank0").exists()
    assert (scored["auc"], scored["logloss"]) == (want_metrics["auc"], want_metrics["logloss"])


def test_a_manifest_test_day_without_a_file_fails_before_training(tiny_dataset, tmp_path):
    from dlrmflow.ingest.errors import DataError
    from tests.ingest.test_manifest import edit_manifest

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)

    def drop_test_file(m: dict) -> None:
        m["files"] = [f for f in m["files"] if f["day"] != m["test_day"]]
        m["rows"] = sum(f["rows"] for f in m["files"])

    edit_manifest(data, drop_test_file)
    with pytest.raises(DataError, match="test day 2: no file"):
        train(tiny_run_config(str(data), tmp_path / "run", max_steps=2))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_zero_row_training_day_is_a_warning_the_run_record_keeps(tiny_dataset, tmp_path):
    from tests.ingest.test_manifest import set_rows, write_empty

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    write_empty(data, 0)
    set_rows(data, {0: 0})
    with pytest.warns(UserWarning, match="day 0 has no rows"):
        result = train(tiny_run_config(str(data), tmp_path / "run", epochs=1))
    assert result.rows == 6000  # day 1 alone
    assert any("day 0 has no rows" in w for w in result.warnings)
    record = json.loads((tmp_path / "run" / "train_result.json").read_text())
    assert record["warnings"] == result.warnings
