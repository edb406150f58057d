"""A serving system without dlrmflow makes a torch-export's inputs from raw rows with the
recipe the archive carries (``raw_inputs``): string IDs hashed, IDs to rows (hashed, or
looked up in the run's vocabulary), lists cut, per-ID weights, crosses, buckets, dense
columns filled and transformed. Built here from that recipe alone, in plain Python and
numpy, the inputs are exactly dlrmflow's and the program scores exactly as dlrmflow scores,
for a model using every schema operation too."""

from __future__ import annotations

import json
import math
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from typer.testing import CliRunner

from dlrmflow.cli import app
from dlrmflow.config import build_config
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.register import register_dataset
from dlrmflow.schema import parse_schema
from dlrmflow.score.model import ModelNotFound
from dlrmflow.score.score import score_dataset
from dlrmflow.train.run.checkpoint import load_checkpoint
from dlrmflow.train.run.data import load_ids
from dlrmflow.train.run.exported_model import ServableError, export_servable, load_servable
from dlrmflow.train.run.trainer import train
from tests.ingest.own_data import SCHEMA, write_own_dataset
from tests.train.run.test_own_data_ops import write_days

MASK = (1 << 64) - 1


def _string_id(text: str) -> int:
    """FNV-1a 64, then splitmix64's finalizer, as the recipe says."""
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & MASK
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & MASK
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & MASK
    return h ^ (h >> 31)


def _mix(z: int) -> int:
    """The recipe's ``h``."""
    for multiplier in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB):
        z ^= z >> 32
        z = (z * multiplier) & MASK
    return z


def _row(raw: int, salt: int, rows: int) -> int:
    return ((_mix((raw + salt) & MASK) >> 32) * rows) >> 32


def _bits(x: int | str) -> int:
    """An ID's 64-bit pattern: a string's by the recipe's string hash."""
    return _string_id(x) if isinstance(x, str) else x & MASK


def _dense(value: float | None, declared: dict) -> np.float32:
    missing = value is None or math.isnan(value)
    x = np.float32(declared.get("fill", 0.0) if missing else value)
    transform = declared.get("transform", "log")
    if transform == "log":
        return np.log1p(np.maximum(x, np.float32(0)))
    if transform == "clip":
        low, high = np.float32(declared["clip_min"]), np.float32(declared["clip_max"])
        return np.minimum(np.maximum(x, low), high)
    if transform == "standardize":
        return (x - np.float32(declared["mean"])) / np.float32(declared["std"] or 1.0)
    return x


def _vocabularies(recipe: dict) -> dict[str, dict[int, int]]:
    """Each vocabulary feature's ID (64-bit pattern) -> row, read with numpy alone."""
    if "vocab" not in recipe:
        return {}
    with np.load(recipe["vocab"]["file"]) as npz:
        names = json.loads(str(npz["meta"]))["names"]
        return {
            name: {int(x): k + 1 for k, x in enumerate(npz[f"ids_{i}"].view(np.uint64))}
            for i, name in enumerate(names)
        }


def _bag(row: dict, feature: dict) -> tuple[list[int], list[float]]:
    """One feature's (raw ID bits, weights) in one row: nulls dropped, then the cut."""
    raw = row[feature["column"]]
    many = isinstance(raw, list)
    ids = [] if raw is None else raw if many else [raw]
    if "weights" in feature:
        given = row[feature["weights"]]
        weights = [] if given is None else given if many else [given]
    else:
        weights = [1.0] * len(ids)
    kept = [(_bits(x), w) for x, w in zip(ids, weights, strict=True) if x is not None]
    if "max_length" in feature and len(kept) > feature["max_length"]:
        n = feature["max_length"]
        kept = kept[-n:] if feature["keep"] == "last" else kept[:n]
    return [x for x, _ in kept], [float(np.float32(w)) for _, w in kept]


def _cross(row: dict, columns: list[str]) -> int | None:
    """The recipe's cross ID of one row, None when a crossed column is null."""
    if any(row[c] is None for c in columns):
        return None
    x = 0
    for i, column in enumerate(columns):
        z = _mix(_bits(row[column]) if i == 0 else (_bits(row[column]) + x) & MASK)
        x = z ^ (z >> 32)
    return x


def _inputs(rows: list[dict], recipe: dict) -> tuple[torch.Tensor, ...]:
    """The program's inputs, in the recipe's ``inputs`` order, from ``rows`` (pylist)."""
    dense = np.array(
        [[_dense(r[d["column"]], d) for d in recipe["dense"]] for r in rows], np.float32
    ).reshape(len(rows), len(recipe["dense"]))
    vocabularies = _vocabularies(recipe)
    values, weights, offsets = [], [], [0]
    for feature in recipe["sparse"]:
        for r in rows:
            if feature["ids"] == "bucket":
                value = r[feature["column"]]
                missing = value is None or math.isnan(value)
                v = np.float32(feature["fill"] if missing else value)
                boundaries = np.array(feature["boundaries"], np.float32)
                values.append(int(np.searchsorted(boundaries, v, side="right")))
                weights.append(1.0)
                offsets.append(len(values))
                continue
            if "cross" in feature:
                crossed = _cross(r, feature["cross"])
                bits, bag_weights = ([], []) if crossed is None else ([crossed], [1.0])
            else:
                bits, bag_weights = _bag(r, feature)
            for x in bits:
                if feature["ids"] == "vocab":
                    values.append(vocabularies[feature["name"]].get(x, 0))
                else:
                    values.append(_row(x, feature["salt"], feature["rows"]))
            weights += bag_weights
            offsets.append(len(values))
    made = {
        "dense": torch.from_numpy(dense),
        "values": torch.tensor(values, dtype=torch.int64),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "weights": torch.tensor(weights, dtype=torch.float32),
    }
    return tuple(made[name] for name in recipe["inputs"])


def _recipe(path: Path) -> dict:
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("servable.json"))
        return json.loads(archive.read(name))


def _checkpoint_probabilities(run_dir: Path, batch) -> torch.Tensor:
    model = load_checkpoint(run_dir).model
    with torch.no_grad():
        return torch.sigmoid(model(batch.dense, batch.sparse))


MODEL = {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]}


def test_inputs_made_from_the_archives_recipe_score_as_dlrmflow_does(tmp_path: Path):
    data = write_own_dataset(tmp_path / "data", days=3, rows=2000)
    register_dataset(str(data), SCHEMA)
    config = build_config(
        {
            "run_dir": str(tmp_path / "run"),
            "data": {"url": str(data)},
            "model": MODEL,
            "train": {"batch_size": 256, "num_workers": 0, "max_steps": 20},
        }
    )
    train(config)
    out = tmp_path / "model.pt2"
    export_servable(tmp_path / "run", out, verify_rows=0)
    metadata = _recipe(out)
    recipe = metadata["raw_inputs"]
    assert [f["column"] for f in recipe["sparse"]] == ["user_id", "item_id", "tags"]
    assert recipe["inputs"] == ["dense", "values", "offsets"] and "weights" not in recipe
    assert "weights" not in metadata["inputs"]
    table = pq.read_table(data / "day=2" / "part-0.parquet").slice(0, 300)
    dense, values, offsets = _inputs(table.to_pylist(), recipe)

    ckpt = load_checkpoint(tmp_path / "run")
    batch = BatchTransform(ckpt.spec, load_ids("hash", ckpt.spec, tmp_path / "run"))(table)
    assert torch.equal(dense, batch.dense)
    sparse = batch.sparse
    assert torch.equal(values, sparse.values) and torch.equal(offsets, sparse.offsets())
    program = torch.export.load(str(out)).module()  # no dlrmflow past this point
    with torch.no_grad():
        probs = program(dense, values, offsets)
    assert torch.equal(probs, load_servable(out).predict_batch(batch))


EVERY_OPERATION = """\
label: click
weight: importance
dense:
  - column: price
    fill: 5.0
    transform: standardize
  - column: quantity
    fill: 4.0
    transform: bucketize
    boundaries: [1, 3, 10]
sparse:
  - column: user_id
    ids: vocab
    min_count: 2
  - column: item_id
  - column: tags
    max_length: 2
    keep: last
    weights: tag_weights
crosses:
  - name: user_x_item
    columns: [user_id, item_id]
    rows: 4096
"""


@pytest.fixture(scope="module")
def every_operation(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """A tiny model of a schema with every operation, exported (``dlrmflow export --format
    torch-export``) and checked on its held-out day: (data, run directory, its result)."""
    root = tmp_path_factory.mktemp("every_operation")
    data = root / "data"
    write_days(data)
    register_dataset(str(data), parse_schema(yaml.safe_load(EVERY_OPERATION), "schema"))
    config = build_config(
        {
            "run_dir": str(root / "run"),
            "data": {"url": str(data)},
            "model": MODEL,
            "train": {"batch_size": 200, "num_workers": 0, "max_steps": 12},
        }
    )
    train(config)
    out = root / "model.pt2"
    exported = CliRunner().invoke(
        app,
        ["export", "--run-dir", str(root / "run"), "--out", str(out), "--format", "torch-export"],
    )
    assert exported.exit_code == 0, exported.output
    return data, root / "run", json.loads(exported.output)


def _raw_rows(data: Path) -> list[dict]:
    """The held-out day's rows, with what the writer never makes: a user outside the
    vocabulary, nulls inside tag lists (their weights dropped with them), a missing
    quantity and a list longer than the cut."""
    rows = pq.read_table(data / "day=2" / "part-0.parquet").to_pylist()[:300]
    rows[1]["user_id"] = "a user never seen"
    rows[2]["tags"], rows[2]["tag_weights"] = [None, 4, 9, None, 16], [9.0, 1.5, 2.5, 9.0, 3.25]
    rows[3]["quantity"] = None
    rows[4]["item_id"] = None
    return rows


def test_a_model_with_every_operation_exports_checked_and_scores_from_its_recipe(
    every_operation: tuple[Path, Path, dict],
):
    data, run_dir, result = every_operation
    # The export's own check: every held-out row, through the per-ID weights input.
    check = result["verify"]
    assert check["rows"] == 1200 and check["days"] == [2]
    assert check["max_abs_diff"] == 0.0 and check["auc_delta"] == 0.0
    out = Path(result["out"])
    metadata = _recipe(out)
    assert list(metadata["inputs"])[:4] == ["dense", "values", "offsets", "weights"]
    assert "tags" in metadata["inputs"]["weights"]
    recipe = metadata["raw_inputs"]
    assert recipe["inputs"] == ["dense", "values", "offsets", "weights"]
    assert [f["name"] for f in recipe["sparse"]] == [
        "user_id", "item_id", "tags", "quantity", "user_x_item"
    ]  # fmt: skip
    assert [f["ids"] for f in recipe["sparse"]] == ["vocab", "hash", "hash", "bucket", "hash"]
    assert recipe["weight"] == "importance" and "importance" not in json.dumps(recipe["sparse"])

    schema = pq.read_schema(data / "day=2" / "part-0.parquet")
    table = pa.Table.from_pylist(_raw_rows(data), schema=schema)
    inputs = _inputs(table.to_pylist(), recipe)

    ckpt = load_checkpoint(run_dir)
    batch = BatchTransform(ckpt.spec, load_ids("hash", ckpt.spec, run_dir))(table)
    dense, values, offsets, weights = inputs
    assert torch.equal(dense, batch.dense)
    assert torch.equal(values, batch.sparse.values)
    assert torch.equal(offsets, batch.sparse.offsets())
    assert torch.equal(weights, batch.sparse.weights)
    assert 0 in values[: int(offsets[300])].tolist()  # the unseen user's row

    program = torch.export.load(str(out)).module()  # no dlrmflow past this point
    with torch.no_grad():
        probs = program(*inputs)
    assert torch.equal(probs, _checkpoint_probabilities(run_dir, batch))
    assert torch.equal(probs, load_servable(out).predict_batch(batch))
    # The weights matter: without the tags' weights the scores move.
    with torch.no_grad():
        unweighted = program(dense, values, offsets, torch.ones_like(weights))
    assert not torch.equal(unweighted, probs)


def test_weights_are_required_where_the_program_takes_them_and_refused_elsewhere(
    every_operation: tuple[Path, Path, dict],
):
    data, run_dir, result = every_operation
    servable = load_servable(result["out"])
    table = pq.read_table(data / "day=2" / "part-0.parquet").slice(0, 8)
    ckpt = load_checkpoint(run_dir)
    batch = BatchTransform(ckpt.spec, load_ids("hash", ckpt.spec, run_dir))(table)
    sparse = batch.sparse
    args = (batch.dense, sparse.values, sparse.offsets())
    with pytest.raises(ServableError, match="takes per-ID weights .of tags.*none were given"):
        servable(*args)
    with pytest.raises(ServableError, match=f"{len(sparse.values) - 1} weights for"):
        servable(*args, sparse.weights[1:])
    bad = sparse.weights.clone()
    bad[0] = float("nan")
    with pytest.raises(RuntimeError, match="every weight must be finite"):
        servable(*args, bad)
    sparse.weights = None
    with pytest.raises(ServableError, match="per-ID weights .of tags.; this batch has none"):
        servable.predict_batch(batch)


@pytest.mark.parametrize(("quantize", "tolerance"), [("fp16", 1.5e-4), ("int8", 1e-3)])
def test_quantized_tables_take_per_id_weights(
    every_operation: tuple[Path, Path, dict], tmp_path: Path, quantize: str, tolerance: float
):
    """Quantized tables pool weighted bags too (FBGEMM's int8 kernel with its per-sample
    weights); the tolerances are test_exported_model.py's, measured on unweighted runs."""
    _, run_dir, _ = every_operation
    result = export_servable(run_dir, tmp_path / "model.pt2", quantize=quantize)
    check = result["verify"]
    assert check["rows"] == 1200 and 0 < check["max_abs_diff"] < tolerance, check


def test_scoring_with_the_export_equals_scoring_with_the_checkpoint(
    every_operation: tuple[Path, Path, dict], tmp_path: Path
):
    """``dlrmflow score --model model.pt2`` feeds the per-ID weights to the program."""
    data, run_dir, result = every_operation
    by_export = score_dataset(result["out"], str(data), tmp_path / "a", days="2")
    by_checkpoint = score_dataset(str(run_dir), str(data), tmp_path / "b", days="2")
    assert by_export["rows"] == by_checkpoint["rows"] == 1200
    a = pq.read_table(tmp_path / "a").sort_by("row")
    b = pq.read_table(tmp_path / "b").sort_by("row")
    assert a["prediction"].equals(b["prediction"])


def test_an_export_whose_vocabulary_is_gone_is_refused_in_one_line(
    every_operation: tuple[Path, Path, dict], tmp_path: Path
):
    """One feature's vocabulary (``ids: vocab``, the run hashing the others) lives in the
    run directory, not in the archive: scoring without it names the feature."""
    data, run_dir, _ = every_operation
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    export_servable(copy, tmp_path / "model.pt2", verify_rows=0)
    (copy / "vocab.npz").unlink()
    with pytest.raises(ModelNotFound) as failed:
        score_dataset(tmp_path / "model.pt2", str(data), tmp_path / "out", days="2")
    line = str(failed.value)
    assert "\n" not in line
    assert "its IDs map through a vocabulary (feature user_id: ids vocab), and " in line
    assert f"{copy / 'vocab.npz'} holds none" in line
