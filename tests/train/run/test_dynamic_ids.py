"""Dynamic ID tables from a schema, end to end: ``ids: dynamic`` trains
with raw IDs mapped by the trainer, evaluates without admitting, resumes bitwise with its
map, exports its weights with the map and a program that maps raw IDs itself, records
each day's counts in a model line, and trains in a job of two ranks (resumed, evaluated
at either rank count, continued at another)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from dlrmflow.cli import app
from dlrmflow.ingest.register import register_dataset
from dlrmflow.schema import SchemaError, parse_schema
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.line.line import history, versions
from dlrmflow.train.model.dynamic_ids import DynamicIdEmbeddings
from dlrmflow.train.run.checkpoint import load_checkpoint
from tests.conftest import run_cli, tiny_run_config
from tests.ingest.own_data import SCHEMA, write_own_dataset
from tests.train.run.test_own_data import _with_features
from tests.train.run.test_own_data_ops import MODEL, register_days
from tests.train.run.test_own_data_ops import TRAIN as OWN_TRAIN

runner = CliRunner()

SCHEMA_YAML = """\
label: click
dense:
  - column: price
sparse:
  - column: user_id
  - column: item_id
    ids: dynamic
    rows: 232
    admit_after: 2
    ttl: 3
    evict_every: 2
  - column: tags
"""
# Three passes of 4 steps; the table's 232 rows hold 200 samples' IDs and the default row.
TRAIN = (*OWN_TRAIN, "--set", "train.epochs=3")


@pytest.fixture(scope="module")
def registered(tmp_path_factory) -> Path:
    return register_days(tmp_path_factory.mktemp("dynamic"), SCHEMA_YAML)


def train(run_dir: Path, data: Path, steps: int, *extra: str):
    return runner.invoke(
        app,
        ["train", "--run-dir", str(run_dir), "--data", str(data), *TRAIN, *MODEL,
         "--set", f"train.max_steps={steps}", *extra],
    )  # fmt: skip


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_dynamic_table_trains_admits_evicts_and_evaluates(registered, tmp_path, where):
    run_dir = tmp_path / "run"
    # On disk: the map's 27,952 bytes stay in memory, the rows' cache gets the 20,000 left.
    disk = ("--set", "train.embedding_memory_bytes=47952") if where == "disk" else ()
    result = train(run_dir, registered, 6, *disk)
    assert result.exit_code == 0, result.output
    assert bool(json.loads(result.output)["embedding_cache"]) == (where == "disk")
    embeddings = load_checkpoint(run_dir).model.embeddings
    assert isinstance(embeddings, DynamicIdEmbeddings)
    item_map = embeddings.maps["item_id"]
    # item_id holds 100 distinct IDs, each seen about twice a batch: admitted on the second.
    assert 0 < item_map.rows_in_use <= 100 and int(embeddings.step) == 6
    raw = np.arange(100, dtype=np.int64)
    assert (item_map.rows_of(raw) > 0).sum() == item_map.rows_in_use
    evaluated = runner.invoke(app, ["evaluate", "--run-dir", str(run_dir)])
    assert evaluated.exit_code == 0, evaluated.output
    assert 0.0 < json.loads(evaluated.output)["auc"] < 1.0
    # Evaluation looked up without admitting: the checkpoint's map is as it was.
    again = load_checkpoint(run_dir).model.embeddings.maps["item_id"]
    assert np.array_equal(again.rows_of(raw), item_map.rows_of(raw))


def test_a_resumed_run_ends_where_the_uninterrupted_one_does(registered, tmp_path):
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    assert train(whole, registered, 8).exit_code == 0
    assert train(halves, registered, 4).exit_code == 0
    result = train(halves, registered, 8)
    assert result.exit_code == 0, result.output
    a, b = (load_checkpoint(d).model.embeddings for d in (whole, halves))
    assert a.bag.table("item_id").equal(b.bag.table("item_id"))
    for key, array in a.maps["item_id"].arrays().items():
        assert np.array_equal(array, b.maps["item_id"].arrays()[key]), key


def _final(run_dir: Path):
    embeddings = load_checkpoint(run_dir).model.embeddings
    return embeddings.bag.table("item_id"), embeddings.maps["item_id"].arrays(), embeddings


def test_a_job_of_two_ranks_trains_resumes_and_evaluates_with_a_sharded_map(registered, tmp_path):
    """At 2 ranks (2 steps an epoch of 200 rows each), the map in 3 shards (rank 0 holds
    two, rank 1 one, and each ID goes to its shard's rank): a run resumed mid-epoch ends
    bitwise where the uninterrupted one does (rows and map), 2 ranks evaluate with the
    lookups of 1, and the epoch-end checkpoint continues at 1 rank, which holds every
    shard. (Every sharding, and the dynamic table on disk: the model's job test.)"""
    job = ("--set", "distributed.nproc=2", "--set", "distributed.sharding=row_wise",
           "--set", "features.map_shards=3")  # fmt: skip
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    result = train(whole, registered, 6, *job)
    assert result.exit_code == 0, result.output
    counts = json.loads(result.output)["id_maps"]["item_id"]
    assert counts["evicted"] > 0 and counts["rows_in_use"] > 0
    assert train(halves, registered, 3, *job).exit_code == 0
    assert train(halves, registered, 6, *job).exit_code == 0
    rows, maps, embeddings = _final(whole)
    assert int(embeddings.step) == 6
    assert {key.split(".")[0] for key in maps} == {"0", "1", "2"}
    other_rows, other_maps, _ = _final(halves)
    assert torch.equal(rows, other_rows)
    for key, array in maps.items():
        assert np.array_equal(array, other_maps[key]), key
    scored = {}
    for nproc in (1, 2):
        evaluated = runner.invoke(app, ["evaluate", "--run-dir", str(whole), "--nproc", str(nproc)])
        assert evaluated.exit_code == 0, evaluated.output
        scored[nproc] = json.loads(evaluated.output)["id_maps"]["item_id"]
    assert scored[1]["lookups"] == 800  # the test day's item_id, one a row
    assert scored[2] == scored[1]
    more = runner.invoke(
        app,
        ["train", "--run-dir", str(whole), "--data", str(registered), *OWN_TRAIN, *MODEL,
         "--set", "train.epochs=4", "--set", "features.map_shards=3"],
    )  # fmt: skip
    assert more.exit_code == 0, more.output
    assert int(_final(whole)[2].step) == 10  # 4 more steps of 200 rows at 1 rank


def test_exports_carry_the_map_and_the_program_maps_raw_ids_without_dlrmflow(registered, tmp_path):
    run_dir = tmp_path / "run"
    assert train(run_dir, registered, 6).exit_code == 0
    program = tmp_path / "m.pt2"
    exported = runner.invoke(
        app,
        ["export", "--run-dir", str(run_dir), "--out", str(program), "--format",
         "torch-export"],
    )  # fmt: skip
    assert exported.exit_code == 0, exported.output
    # The export's own check: the program scored the held-out day as the checkpoint does.
    check = json.loads(exported.output)["verify"]
    assert check["max_abs_diff"] < 1e-6, check
    ckpt = load_checkpoint(run_dir)
    item_map = ckpt.model.embeddings.maps["item_id"]
    assert item_map.rows_in_use > 0
    # Raw item IDs: every admitted one, some never seen (the default row), in 40 samples.
    keys, _ = item_map.frozen()
    unseen = np.array([10**12, -5, 2**62], np.int64)
    raw = np.concatenate([keys, unseen])[:40]
    samples = len(raw)
    features = [f.name for f in ckpt.spec.sparse]
    bags = {name: np.arange(samples) % 7 for name in features}  # hashed features: any row
    bags["item_id"] = raw
    values = torch.from_numpy(np.concatenate([bags[name] for name in features]))
    offsets = torch.arange(len(features) * samples + 1, dtype=torch.int64)
    weighted = any(f.weights is not None for f in ckpt.spec.sparse)
    weights = torch.ones(len(values)) if weighted else None
    dense = torch.linspace(0, 1, samples * len(ckpt.spec.dense)).view(samples, -1)
    inputs = (dense, values, offsets) + (() if weights is None else (weights,))
    torch.save(inputs, tmp_path / "inputs.pt")
    script = (
        "import sys, torch\n"
        f"torch.set_num_threads({torch.get_num_threads()})\n"
        "inputs = torch.load(sys.argv[1])\n"
        "with torch.no_grad():\n"
        "    torch.save(torch.export.load(sys.argv[2]).module()(*inputs), sys.argv[3])\n"
        "assert 'dlrmflow' not in sys.modules, sorted(sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "inputs.pt"), str(program),
         str(tmp_path / "out.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    served = torch.load(tmp_path / "out.pt")
    # The checkpoint's model on the same raw IDs: its map looks them up (evaluation's
    # way, admitting nothing), unseen ones on the default row.
    ckpt.model.eval()
    kjt = KeyedJaggedTensor(features, values, torch.ones(len(values), dtype=torch.int32), weights)
    with torch.no_grad():
        expected = torch.sigmoid(ckpt.model(dense, kjt))
    assert torch.allclose(served, expected, atol=1e-6, rtol=0)
    assert np.array_equal(item_map.rows_of(unseen), np.zeros(3, np.int64))
    # The weights' export carries the map beside the rows it indexes.
    out = tmp_path / "m.safetensors"
    result = runner.invoke(app, ["export", "--run-dir", str(run_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    tensors = load_file(str(out))
    for key, array in item_map.arrays().items():
        assert np.array_equal(tensors[f"id_maps.item_id.{key}"].numpy(), array), key


def test_a_resume_with_other_map_shards_is_refused_naming_them(registered, tmp_path):
    run_dir = tmp_path / "run"
    assert train(run_dir, registered, 2).exit_code == 0
    result = train(run_dir, registered, 4, "--set", "features.map_shards=2")
    assert result.exit_code == 1
    assert "feature item_id map_shards" in str(result.exception)
    assert "-> 2" in str(result.exception)


def test_dynamic_settings_on_another_mapping_are_refused():
    with pytest.raises(SchemaError, match="item_id: ttl is for ids: dynamic"):
        parse_schema(
            {"label": "y", "sparse": [{"column": "item_id", "ids": "hash", "ttl": 3}]}, "s.yaml"
        )


def test_a_line_records_what_each_days_map_admitted_evicted_and_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    data = write_own_dataset(tmp_path / "data", days=3, rows=400)
    dynamic = {"ids": "dynamic", "rows": 256, "ttl": 4, "evict_every": 2}
    sparse = tuple(
        f.model_copy(update=dynamic) if f.column == "item_id" else f for f in SCHEMA.sparse
    )
    register_dataset(str(data), SCHEMA.model_copy(update={"sparse": sparse}))
    line = tmp_path / "line"
    start = tmp_path / "line.json"
    start.write_text(
        tiny_run_config(str(data), tmp_path / "unused", batch_size=100).model_dump_json()
    )
    code, _, err = run_cli(monkeypatch, capsys, "line", "--line", str(line), "--config", str(start))
    assert code == 0, err
    made = versions(line)
    # Day 0 admitted its items; later days admit only items new to the map.
    assert made[0].id_maps["item_id"]["admitted"] == made[0].id_maps["item_id"]["rows_in_use"] > 0
    assert all(set(v.id_maps["item_id"]) == {"admitted", "evicted", "rows_in_use"} for v in made)
    records = history(line)
    assert [r["day"] for r in records] == [1, 2]
    for record in records:
        counts = record["id_maps"]["item_id"]
        assert {"admitted", "evicted", "rows_in_use", "default_share"} <= set(counts)
        # The next day's items are the same 100: nearly all were admitted the day before.
        assert 0.0 <= counts["default_share"] < 0.5


def test_a_table_too_small_for_one_batch_is_refused_before_training(registered, tmp_path):
    def smaller(features: dict) -> dict:
        sparse = [{**f, "rows": 64} if f["column"] == "item_id" else f for f in features["sparse"]]
        return {**features, "sparse": sparse}

    data = Path(_with_features(str(registered), tmp_path / "small", smaller))
    result = train(tmp_path / "run", data, 2)
    assert result.exit_code == 1 and isinstance(result.exception, SchemaError)
    # item_id holds 100 distinct IDs (registration's sketch counts 99): fewer than a
    # batch's 200 samples, so they bound what one batch can hold.
    assert str(result.exception) == (
        "sparse feature item_id: ids dynamic with rows 64 cannot hold one batch's IDs "
        "(the dataset's 99 distinct IDs, and the default row); give it rows >= 100"
    )


def test_features_ids_dynamic_gives_every_id_column_of_the_preset_a_map(tiny_dataset, tmp_path):
    """Criteo's layout has no schema to declare ``ids: dynamic`` in: the run's
    ``features.ids`` does it for every ID column, with the run's dynamic settings."""
    dynamic = ("--set", "features.ids=dynamic", "--set", "features.ttl=5",
               "--set", "features.admit_after=2")  # fmt: skip
    tiny = ("--set", "train.batch_size=256", "--set", "train.num_workers=0",
            "--set", "model.embedding_dim=8", "--set", "model.bottom_mlp=[16,8]",
            "--set", "model.top_mlp=[16]")  # fmt: skip
    run_dir = tmp_path / "run"
    result = runner.invoke(
        app,
        ["train", "--run-dir", str(run_dir), "--data", tiny_dataset, *tiny, *dynamic,
         "--set", "train.max_steps=4"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    checkpoint = load_checkpoint(run_dir)
    embeddings = checkpoint.model.embeddings
    assert isinstance(embeddings, DynamicIdEmbeddings)
    assert sorted(embeddings.maps) == sorted(f"C{i}" for i in range(1, 27))
    assert {(f.ids, f.ttl, f.admit_after, f.evict_every) for f in checkpoint.spec.sparse} == {
        ("dynamic", 5, 2, None)
    }
    assert all(m.rows_in_use > 0 for m in embeddings.maps.values())


def test_a_table_capped_below_one_batch_is_refused_naming_the_batch(tiny_dataset, tmp_path):
    result = runner.invoke(
        app,
        ["train", "--run-dir", str(tmp_path / "run"), "--data", tiny_dataset,
         "--set", "features.ids=dynamic", "--set", "features.max_rows_per_table=300",
         "--set", "train.batch_size=512", "--set", "train.max_steps=1"],
    )  # fmt: skip
    assert result.exit_code == 1 and isinstance(result.exception, SchemaError)
    assert re.fullmatch(
        r"sparse feature C\d+: ids dynamic with rows 300 cannot hold one batch's IDs "
        r"\(train\.batch_size 512 x 1 feature\(s\), and the default row\); give it rows >= 513",
        str(result.exception),
    )


def test_a_map_that_does_not_fit_the_memory_budget_is_refused_before_training(registered, tmp_path):
    result = train(tmp_path / "run", registered, 2, "--set", "train.embedding_memory_bytes=27952")
    assert result.exit_code == 1 and isinstance(result.exception, SchemaError)
    assert str(result.exception) == (
        "sparse feature item_id: ids dynamic: its map takes 27952 bytes (27952 for every "
        "dynamic table), which leaves nothing of train.embedding_memory_bytes 27952 for the "
        "rows; raise it or give the table fewer rows"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()
