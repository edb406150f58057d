"""A team's own logs, as the tests make them: day-partitioned Parquet in no layout of ours.

Each day holds ``click`` (int8), ``user_id`` (strings, some null), ``item_id`` (int64),
``price`` (float32, some null or NaN) and ``tags`` (lists of int64, some null or empty).
The click depends on the user, the item and the price, so a model has something to learn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dlrmflow.schema import DenseFeature, FeatureSchema, SparseFeature

SCHEMA = FeatureSchema(
    label="click",
    dense=(DenseFeature(column="price", fill=0.0, transform="log"),),
    sparse=(
        SparseFeature(column="user_id"),
        SparseFeature(column="item_id"),
        SparseFeature(column="tags"),
    ),
)

SCHEMA_YAML = """\
label: click
dense:
  - column: price
    transform: log
sparse:
  - column: user_id
  - column: item_id
  - column: tags
"""


def own_day(rng: np.random.Generator, rows: int) -> tuple[pa.Table, np.ndarray]:
    """A day's table and each row's true click probability."""
    users = rng.integers(0, 60, rows)
    items = rng.integers(0, 100, rows)
    price = rng.gamma(2.0, 10.0, rows).astype(np.float32)
    user_effect = np.sin(users * 1.7)
    item_effect = np.cos(items * 0.9)
    logit = 1.5 * user_effect + 1.5 * item_effect - 0.02 * price
    probability = 1 / (1 + np.exp(-logit))
    click = (rng.random(rows) < probability).astype(np.int8)
    user_id = pa.array([None if u % 17 == 0 else f"user-{u}" for u in users.tolist()], pa.string())
    price_col = pa.array(
        [
            None if i % 11 == 0 else (float("nan") if i % 13 == 0 else float(p))
            for i, p in enumerate(price)
        ],
        pa.float32(),
    )
    tags = pa.array(
        [None if i % 7 == 0 else [int(t) for t in rng.integers(0, 50, i % 4)] for i in range(rows)],
        pa.list_(pa.int64()),
    )
    table = pa.table(
        {
            "click": pa.array(click, pa.int8()),
            "user_id": user_id,
            "item_id": pa.array(items, pa.int64()),
            "price": price_col,
            "tags": tags,
            "request_id": pa.array(np.arange(rows), pa.int64()),  # not a feature
        }
    )
    return table, probability


def write_own_dataset(
    root: Path, days: int = 3, rows: int = 2000, seed: int = 0, partition: str = "day"
) -> Path:
    """``days`` day folders (``day=N`` or ``dt=2026-11-0N``) of two Parquet files each."""
    write_own_days(root, days, rows, seed, partition)
    return root


def write_own_days(
    root: Path, days: int = 3, rows: int = 2000, seed: int = 0, partition: str = "day"
) -> float:
    """``write_own_dataset``; returns the Bayes AUC of the last day (its true probabilities)."""
    import torch
    from torchmetrics.functional.classification import binary_auroc

    rng = np.random.default_rng(seed)
    bayes = 0.0
    for day in range(days):
        folder = root / (f"day={day}" if partition == "day" else f"dt=2026-11-{day + 1:02d}")
        folder.mkdir(parents=True)
        table, probability = own_day(rng, rows)
        labels = torch.from_numpy(table.column("click").to_numpy().astype(np.int64))
        bayes = float(binary_auroc(torch.from_numpy(probability), labels))
        half = rows // 2
        pq.write_table(table.slice(0, half), folder / "part-0.parquet", row_group_size=500)
        pq.write_table(table.slice(half), folder / "part-1.parquet", row_group_size=500)
        (folder / "_SUCCESS").write_text("")
    return bayes
