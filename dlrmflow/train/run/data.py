"""Composes ingest and features into the loaders the trainer and the evaluator consume.

This is where the two stages join (with ``reader_servers``, the server side of the remote
loader): the reader runs the feature transform on each decoded row group in its own threads,
so preprocessing overlaps training. The trainer's batches come either from those threads
(the default) or from reader servers over Arrow Flight (``distributed.readers``, see
``dlrmflow.ingest.service``), decoded from their record batches here; ``make_train_loader``
picks one, and both give the same batches in the same order, resumable from the same states.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlrmflow.config import RunConfig
from dlrmflow.days import windows
from dlrmflow.features.batch import Batch
from dlrmflow.features.fit import feature_ids, needs_statistics
from dlrmflow.features.fit import fit_features as fit_mapping
from dlrmflow.features.ids import FeatureIds, HashIds, Vocabulary
from dlrmflow.features.spec import FeatureSpec, dataset_schema
from dlrmflow.features.transform import BatchTransform
from dlrmflow.features.wire import decode_batch, features_digest
from dlrmflow.ingest.loader import ReaderLoader, make_loader
from dlrmflow.ingest.manifest import Manifest
from dlrmflow.ingest.reader import ParquetBatchDataset, pass_steps
from dlrmflow.ingest.splits import list_splits
from dlrmflow.ingest.stats.results import read_stats
from dlrmflow.supervise import beat
from dlrmflow.train.model.dynamic_ids import check_capacity

if TYPE_CHECKING:
    from dlrmflow.ingest.service.client import RemoteBatchSource

VOCAB_FILE = "vocab.npz"

IdMapper = HashIds | Vocabulary | FeatureIds


def day_windows(config: RunConfig, manifest: Manifest) -> tuple[list[int], list[int]]:
    """``(train days, eval days)`` of this run on ``manifest``'s dataset: its windows
    (``data.train_days``, ``data.eval_days``, see ``dlrmflow.days``) against the days the
    dataset has."""
    available = [f.day for f in manifest.files]
    return windows(config.data.train_days, config.data.eval_days, available, manifest.test_day)


def pass_count(config: RunConfig, train_days: list[int]) -> int:
    """The passes a run makes over its data: ``train.epochs``, or one a day in day order."""
    return len(train_days) if config.train.order == "days" else config.train.epochs


def pass_steps_of_run(config: RunConfig, train_days: list[int], loader: TrainLoader) -> list[int]:
    """The steps of each of the run's passes (``pass_count`` of them), as its readers will
    cut them: local readers list the row groups themselves, reader servers list them for
    the trainer, so a schedule is the same whichever reads."""
    passes = pass_count(config, train_days)
    return [loader.pass_steps(epoch, config.train.num_workers) for epoch in range(passes)]


def train_paths(config: RunConfig, manifest: Manifest) -> list[str]:
    """The files of the training days, none of them also listed under a held-out day."""
    train, held_out = day_windows(config, manifest)
    return manifest.day_paths(config.data.url, train, held_out=held_out)


def fit_features(
    config: RunConfig, manifest: Manifest, run_dir: Path | None = None, keep: bool = False
) -> tuple[FeatureSpec, IdMapper]:
    """The feature spec and ID mapping for training, fitting a vocabulary where the schema
    (or ``features.ids``) looks IDs up in one (``features.fit``).

    The vocabulary is counted on the training days only (never a held-out day) and saved in
    ``run_dir`` so evaluation maps IDs exactly as training did. Reader servers pass no
    ``run_dir``: they fit the same mapping from the same data and keep it in memory.
    ``keep``: the run continues (in day order, over a window grown since it started), so
    the vocabulary it started with stays, and IDs new since then share the OOV row. The
    dataset's statistics are read where the schema takes values from them (a standardized
    column's mean and deviation, a bucketized one's quantiles).
    """
    schema = dataset_schema(manifest)
    stats = read_stats(config.data.url) if needs_statistics(schema) else None
    kept = run_dir / VOCAB_FILE if run_dir is not None else None
    reuse = keep and kept is not None and kept.is_file()
    vocab = Vocabulary.load(str(kept)) if reuse else None
    spec, ids, vocab = fit_mapping(
        manifest,
        config.features,
        config.model,
        train_paths(config, manifest) if vocab is None else [],
        stats=stats,
        vocabulary=vocab,
    )
    if vocab is not None and kept is not None and not reuse:
        vocab.save(str(kept))
    # A job's maps see every rank's batch in each step.
    ranks = config.distributed.nproc * config.distributed.nnodes
    check_capacity(
        spec,
        config.train.batch_size * ranks,
        manifest.cardinalities,
        config.train.embedding_memory_bytes,
        ranks,
    )
    return spec, ids


def load_ids(kind: str, spec: FeatureSpec, run_dir: Path) -> IdMapper:
    """The ID mapping a checkpoint was trained with (``kind``: its ``features.ids``)."""
    looks_up = any(f.mapping(kind) == "vocab" for f in spec.sparse)
    vocab = Vocabulary.load(str(run_dir / VOCAB_FILE)) if looks_up else None
    return feature_ids(spec, kind, vocab)


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
    transform: BatchTransform | None = None,
    threads: int | None = None,
    pin_memory: bool = False,
    by_day: bool = False,
    days: Mapping[str, int] | None = None,
) -> tuple[ParquetBatchDataset, ReaderLoader]:
    """A resumable loader of ``Batch`` objects over the given day files.

    ``transform`` replaces ``BatchTransform(spec, ids)``; the readers benchmark passes one
    with an artificial cost so that the local and the remote readers do the same work.
    ``threads`` is each reader's (``make_loader``'s default: ``reader_threads``).
    ``pin_memory``: the readers hand out page-locked batches (for a CUDA trainer).
    ``by_day``: each pass reads one day (``ParquetBatchDataset``). ``days``: each path's
    day, from the manifest (``Manifest.path_days``), for files that do not record theirs.
    """
    transform = BatchTransform(spec, ids) if transform is None else transform
    dataset = ParquetBatchDataset(
        list_splits(paths, days),
        spec.columns,
        batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        shuffle=shuffle,
        shuffle_window=shuffle_window,
        validate=transform.validate,
        transform=transform,
        by_day=by_day,
    )
    loader = make_loader(dataset, num_workers=num_workers, threads=threads, pin_memory=pin_memory)
    return dataset, loader


class TrainLoader:
    """The trainer's batches: one rank's share of every epoch, resumable, with its wait time.

    ``for batch in loader`` runs a pass over the epoch chosen with ``set_epoch`` (or resumes
    the pass a loaded state was taken in, right after its last batch), exactly as the
    ``torchdata`` ``Loader`` it wraps. ``wait_seconds`` adds up the time the consumer spent
    blocked waiting for a batch, starting a pass included: the trainer reads it per step to
    tell a data-starved step from a compute-bound one. ``failovers`` counts the times a
    remote reader stream moved to another endpoint (always 0 for local readers).
    ``close()`` ends the pass: remote streams at once, and the reader threads, which it
    waits for; a batch that cannot be read closes the loader before its error is raised.
    """

    def __init__(
        self,
        loader: ReaderLoader,
        dataset: ParquetBatchDataset | RemoteBatchSource,
        remote: RemoteBatchSource | None = None,
    ) -> None:
        self._loader = loader
        self._dataset = dataset
        self._remote = remote
        self.wait_seconds = 0.0

    @property
    def remote(self) -> bool:
        """Whether the batches come from reader servers."""
        return self._remote is not None

    @property
    def failovers(self) -> int:
        return 0 if self._remote is None else self._remote.failovers

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next fresh pass reads (a loaded state keeps its own)."""
        self._dataset.set_epoch(epoch)

    def pass_steps(self, epoch: int, num_workers: int) -> int:
        """The steps the job takes over pass ``epoch`` (see ``reader.pass_steps``); reader
        servers list their files' row groups for it."""
        if self._remote is not None:
            return self._remote.pass_steps(epoch, num_workers)
        return pass_steps(self._dataset, epoch, num_workers)

    def __iter__(self) -> Iterator[Batch]:
        clock = time.perf_counter
        start = clock()
        it = iter(self._loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                self.wait_seconds += clock() - start
                return
            except BaseException:
                # The other readers' threads stop now rather than run on while the error
                # travels up (and possibly past the interpreter's exit).
                self.close()
                raise
            self.wait_seconds += clock() - start
            beat()  # this rank's main thread is making progress (see supervise.Watchdog)
            yield batch
            start = clock()

    def state_dict(self) -> dict[str, Any]:
        """Where the current pass stands: the same format for local and remote readers."""
        return self._loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the next ``for batch in loader`` from ``state`` (see ``state_dict``)."""
        self._loader.load_state_dict(state)

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()
        self._loader.close()

    def __enter__(self) -> TrainLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_train_loader(
    config: RunConfig,
    spec: FeatureSpec,
    ids: IdMapper,
    paths: list[str],
    *,
    rank: int = 0,
    world_size: int = 1,
    pin_memory: bool = False,
    days: Mapping[str, int] | None = None,
) -> TrainLoader:
    """Rank ``rank``'s training batches over ``paths``, from local readers or reader servers.

    ``days``: each path's day as the manifest lists it (``Manifest.path_days``), which a
    run in day order needs for files whose footer records none (registered data).

    ``pin_memory``: local readers hand out page-locked batches (a CUDA trainer's copies to
    the device are then asynchronous); remote batches are pinned by the trainer.

    ``distributed.readers`` empty: ``train.num_workers`` reader threads in this process.
    Otherwise the same number of streams from those servers (see ``dlrmflow.ingest.service``
    for how they are divided); ``paths`` must then lie under ``data.url``, which the servers
    serve under their own root. Either way the batches and states are the same.
    """
    train = config.train
    if not config.distributed.readers:
        dataset, loader = batch_loader(
            paths,
            spec,
            ids,
            batch_size=train.batch_size,
            num_workers=train.num_workers,
            shuffle=train.shuffle,
            shuffle_window=train.shuffle_window,
            seed=train.seed,
            rank=rank,
            world_size=world_size,
            pin_memory=pin_memory,
            by_day=train.order == "days",
            days=days,
        )
        return TrainLoader(loader, dataset)
    source = _remote_source(config, spec, ids, paths, rank=rank, world_size=world_size)
    return TrainLoader(source.loader(train.num_workers), source, remote=source)


def _remote_source(
    config: RunConfig,
    spec: FeatureSpec,
    ids: IdMapper,
    paths: list[str],
    *,
    rank: int,
    world_size: int,
) -> RemoteBatchSource:
    """The ``Batch``es of ``config.distributed.readers`` for ``paths`` (under ``data.url``),
    from a server that hangs failing over after ``distributed.reader_timeout_s``."""
    # Imported here: only trainers that read from reader servers load Flight (gRPC).
    from dlrmflow.ingest.service.client import RemoteBatchSource
    from dlrmflow.ingest.service.security import ReaderSecurity

    root = config.data.url.rstrip("/") + "/"
    outside = [p for p in paths if not p.startswith(root)]
    if outside:
        raise ValueError(
            f"remote readers resolve files under their own data root, so every path must "
            f"lie under data.url {config.data.url}; {outside[0]} does not"
        )
    train = config.train
    return RemoteBatchSource(
        config.distributed.readers,
        [p.removeprefix(root) for p in paths],
        features_digest(spec, ids),
        batch_size=train.batch_size,
        seed=train.seed,
        shuffle=train.shuffle,
        shuffle_window=train.shuffle_window,
        rank=rank,
        world_size=world_size,
        decode=decode_batch,
        timeout_s=config.distributed.reader_timeout_s,
        # The secret is read here, in the rank, from its file or the environment: it is
        # never part of the configuration the launcher writes down.
        security=ReaderSecurity.load(config.distributed.reader_security, serving=False),
    )
