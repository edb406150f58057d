"""A serving system without dlrmflow makes a torch-export's inputs from raw rows with the
recipe the archive carries (``raw_inputs``): string IDs hashed, IDs to rows, dense columns
filled and transformed. Built here from that recipe alone, in plain Python and numpy, the
inputs are exactly dlrmflow's and the program scores exactly as dlrmflow scores."""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from dlrmflow.config import build_config
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.register import register_dataset
from dlrmflow.train.run.checkpoint import load_checkpoint
from dlrmflow.train.run.data import load_ids
from dlrmflow.train.run.servable import export_servable, load_servable
from dlrmflow.train.run.trainer import train
from tests.ingest.own_data import SCHEMA, write_own_dataset

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


def _row(raw: int, salt: int, rows: int) -> int:
    z = (raw + salt) & MASK
    for multiplier in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB):
        z ^= z >> 32
        z = (z * multiplier) & MASK
    return ((z >> 32) * rows) >> 32


def _dense(value: float | None, declared: dict) -> float:
    x = np.float32(declared.get("fill", 0.0) if value is None or math.isnan(value) else value)
    if declared.get("transform", "log") == "log":
        return float(np.log1p(np.maximum(x, np.float32(0))))
    if declared["transform"] == "clip":
        return float(np.minimum(np.maximum(x, declared["clip_min"]), declared["clip_max"]))
    return float(x)


def _inputs(rows: list[dict], recipe: dict) -> tuple[torch.Tensor, ...]:
    dense = torch.tensor(
        [[_dense(r[d["column"]], d) for d in recipe["dense"]] for r in rows], dtype=torch.float32
    )
    values, offsets = [], [0]
    for feature in recipe["sparse"]:
        for r in rows:
            raw = r[feature["column"]]
            ids = [] if raw is None else raw if isinstance(raw, list) else [raw]
            for x in ids:
                if x is None:
                    continue  # a null inside a list is not an ID
                bits = _string_id(x) if isinstance(x, str) else x & MASK
                values.append(_row(bits, feature["salt"], feature["rows"]))
            offsets.append(len(values))
    return dense, torch.tensor(values, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)


def test_inputs_made_from_the_archives_recipe_score_as_dlrmflow_does(tmp_path: Path):
    data = write_own_dataset(tmp_path / "data", days=3, rows=2000)
    register_dataset(str(data), SCHEMA)
    config = build_config(
        {
            "run_dir": str(tmp_path / "run"),
            "data": {"url": str(data)},
            "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]},
            "train": {"batch_size": 256, "num_workers": 0, "max_steps": 20},
        }
    )
    train(config)
    out = tmp_path / "model.pt2"
    export_servable(tmp_path / "run", out, verify_rows=0)
    with zipfile.ZipFile(out) as archive:
        name = next(n for n in archive.namelist() if n.endswith("servable.json"))
        recipe = json.loads(archive.read(name))["raw_inputs"]
    assert [f["column"] for f in recipe["sparse"]] == ["user_id", "item_id", "tags"]
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
