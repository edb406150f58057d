"""The reader's batches, pinned: the logs shape and Criteo's, read as training reads them,
must stay bitwise what they are (a digest of every tensor of every batch, in order).

The ingest path is tuned for speed (compiled loops, windows written in place, batches cut
without copies); these digests say that no such change moved a single value, row or
batch. A change that means to alter the batches must say why and update the digests.

The digests were taken on the project's image: the sparse rows, lengths, per-ID weights,
labels and sample weights are exact copies and integer hashes of the data (the same on any
machine), the dense values pass through libm's ``log1pf``, so a machine with another libm
could give other dense digests (the test names which part differs).
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from dlrmflow.config import DataConfig, FeaturesConfig, ModelConfig
from dlrmflow.features.batch import Batch
from dlrmflow.features.ids import HashIds
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.loader import make_loader
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.reader import ParquetBatchDataset
from dlrmflow.ingest.splits import list_splits
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.ingest.synthetic_logs import generate_logs_dataset

# Small and uneven: row groups that do not divide a day, windows of three row groups,
# batches that span row groups, windows and files.
DATA = {"days": 2, "rows_per_day": 2300, "row_group_size": 700, "seed": 5}
SHAPES = {
    "logs": (generate_logs_dataset, {"cardinality_scale": 0.001}),
    "criteo": (generate_dataset, {"cardinality_scale": 0.0005, "max_cardinality": 2000}),
    "criteo_multi_hot": (
        generate_dataset,
        {"cardinality_scale": 0.0005, "max_cardinality": 2000, "multi_hot": True},
    ),
}

# (shape, world_size, num_workers) -> part -> sha256 of that part of every batch, in order.
EXPECTED = {
    ("logs", 1, 1): {
        "sparse": "e6bd37125b36687e",
        "labels": "c7d00161d7b2d83a",
        "dense": "48c77855aad1446f",
        "rows": "b5e279b4ba31028e",
    },
    ("criteo", 1, 1): {
        "sparse": "85838411b6893f1d",
        "labels": "456f0752ca137c22",
        "dense": "b99c2e54a36b5be6",
        "rows": "aa6ebe7c83a4b519",
    },
    ("criteo_multi_hot", 1, 1): {
        "sparse": "daab89ac905fefc4",
        "labels": "4e083d2f75c28eec",
        "dense": "b99c2e54a36b5be6",
        "rows": "aa6ebe7c83a4b519",
    },
    ("logs", 2, 2): {
        "sparse": "1def2949858adedd",
        "labels": "e0e1451763706fa8",
        "dense": "197c4f6e2e2d6e8b",
        "rows": "c19015edbff04d86",
    },
    ("criteo_multi_hot", 2, 0): {
        "sparse": "2a9c940501e76a9c",
        "labels": "9e37065d260870d2",
        "dense": "4bbe81ee890b0d8e",
        "rows": "19ffa5bea229202a",
    },
}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("shapes")
    urls = {}
    for shape, (generate, options) in SHAPES.items():
        urls[shape] = str(root / shape)
        generate(DataConfig(url=urls[shape], **DATA, **options))
    return urls


def _digests(batches: list[Batch]) -> dict[str, str]:
    """sha256 of each part of ``batches``, one after another: the sparse part in the form
    it comes in (one-hot rows, or jagged values, lengths and weights)."""
    parts = {name: hashlib.sha256() for name in ("sparse", "labels", "dense", "rows")}
    for batch in batches:
        sparse = batch.sparse
        parts["rows"].update(f"{len(batch)},{sparse.keys};".encode())
        rows = sparse.one_hot_rows
        if rows is not None:
            tensors = [rows]
        else:
            tensors = [sparse.values, sparse.lengths]
            tensors += [] if sparse.weights is None else [sparse.weights]
        for t in tensors:
            parts["sparse"].update(f"{t.dtype}{tuple(t.shape)}".encode())
            parts["sparse"].update(t.contiguous().numpy().tobytes())
        for t in [batch.labels, batch.sample_weights]:
            parts["labels"].update(b"-" if t is None else t.contiguous().numpy().tobytes())
        assert batch.dense.dtype == torch.float32
        parts["dense"].update(batch.dense.contiguous().numpy().tobytes())
    return {name: h.hexdigest()[:16] for name, h in parts.items()}


def read_all(url: str, world_size: int, num_workers: int) -> list[Batch]:
    """Every batch of every rank over two epochs, rank after rank."""
    manifest = read_manifest(url)
    spec = FeatureSpec.for_dataset(manifest, FeaturesConfig(), ModelConfig())
    transform = BatchTransform(spec, HashIds.from_spec(spec, seed=1))
    splits = list_splits(manifest.day_paths(url))
    batches = []
    for rank in range(world_size):
        dataset = ParquetBatchDataset(
            splits,
            spec.columns,
            128,
            rank=rank,
            world_size=world_size,
            seed=11,
            shuffle_window=3,
            validate=transform.validate,
            transform=transform,
        )
        with make_loader(dataset, num_workers=num_workers, threads=2) as loader:
            for epoch in range(2):
                dataset.set_epoch(epoch)
                batches += list(loader)
    return batches


CASES = [(shape, 1, 1) for shape in SHAPES] + [("logs", 2, 2), ("criteo_multi_hot", 2, 0)]


@pytest.mark.parametrize(("shape", "world_size", "num_workers"), CASES)
def test_batches_are_bitwise_as_pinned(datasets, shape, world_size, num_workers):
    found = _digests(read_all(datasets[shape], world_size, num_workers))
    assert found == EXPECTED[(shape, world_size, num_workers)]
