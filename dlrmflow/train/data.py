"""Composes ingest and features into the loaders the trainer and the evaluator consume.

This is the only place that joins the two stages: the reader runs the feature transform on
each decoded row group in its own threads, so preprocessing overlaps training.
"""

from __future__ import annotations

from pathlib import Path

from torchdata.nodes import Loader

from dlrmflow.config import RunConfig
from dlrmflow.features.ids import HashIds, Vocabulary, build_vocabulary
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.manifest import Manifest
from dlrmflow.ingest.reader import ParquetBatchDataset, list_splits, make_loader
from dlrmflow.ingest.schema import SPARSE

VOCAB_FILE = "vocab.npz"

IdMapper = HashIds | Vocabulary


def fit_features(
    config: RunConfig, manifest: Manifest, run_dir: Path
) -> tuple[FeatureSpec, IdMapper]:
    """The feature spec and ID mapping for training, fitting a vocabulary if configured.

    The vocabulary is counted on the training days only (never the test day) and saved in
    the run directory so evaluation maps IDs exactly as training did.
    """
    if config.features.ids == "vocab":
        paths = manifest.day_paths(config.data.url, manifest.train_days())
        vocab = build_vocabulary(
            paths,
            list(SPARSE),
            min_count=config.features.min_count,
            max_size=config.features.max_rows_per_table - 1,
        )
        vocab.save(str(run_dir / VOCAB_FILE))
        spec = FeatureSpec.for_dataset(manifest, config.features, config.model, vocab.table_rows)
        return spec, vocab
    spec = FeatureSpec.for_dataset(manifest, config.features, config.model)
    return spec, HashIds.from_spec(spec)


def load_ids(kind: str, spec: FeatureSpec, run_dir: Path) -> IdMapper:
    """The ID mapping a checkpoint was trained with."""
    if kind == "vocab":
        return Vocabulary.load(str(run_dir / VOCAB_FILE))
    return HashIds.from_spec(spec)


def batch_loader(
    paths: list[str],
    spec: FeatureSpec,
    ids: IdMapper,
    *,
    batch_size: int,
    num_workers: int,
    shuffle: bool,
    shuffle_window: int = 4,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[ParquetBatchDataset, Loader]:
    """A resumable loader of ``Batch`` objects over the given day files."""
    transform = BatchTransform(spec, ids)
    dataset = ParquetBatchDataset(
        list_splits(paths),
        spec.columns,
        batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        shuffle=shuffle,
        shuffle_window=shuffle_window,
        validate=transform.validate,
        transform=transform,
    )
    return dataset, make_loader(dataset, num_workers=num_workers)
