"""What a reader server serves: the streams of one Parquet dataset, as the local loader reads.

A request's splits are read by a ``SplitReader`` over a ``ParquetBatchDataset`` built from
the request's fields, so a remote stream's batches, order and state are exactly the local
reader's. Every stream of a server shares its ``workers`` preprocessing slots: however many
trainers read, at most that many row groups are validated or transformed at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from dlrmflow.ingest.manifest import Manifest, join_url
from dlrmflow.ingest.reader import Block, ParquetBatchDataset, SplitReader
from dlrmflow.ingest.service.protocol import Endpoint, StreamRequest
from dlrmflow.ingest.service.server import BatchStream
from dlrmflow.ingest.splits import Split, list_splits


class _Throttled:
    """``fn`` run under one of the server's preprocessing slots, so that however many
    streams are open, at most ``workers`` row groups are validated or transformed at once."""

    def __init__(self, fn: Callable[[pa.Table], Any], slots: threading.Semaphore) -> None:
        self._fn = fn
        self._slots = slots

    def __call__(self, table: pa.Table) -> Any:
        with self._slots:
            return self._fn(table)


class _ThrottledTransform(_Throttled):
    """A transform with a window writer (``BatchTransform``), throttled alike: each row
    group a writer takes, and each window it finishes, holds a slot. The reader then builds
    windows as it does locally, each row group written to its shuffled place."""

    def window_writer(self, order: np.ndarray, dest: np.ndarray | None = None) -> _ThrottledWriter:
        return _ThrottledWriter(self._fn.window_writer(order, dest), self._slots)  # type: ignore[attr-defined]


class _ThrottledWriter:
    def __init__(self, writer: Any, slots: threading.Semaphore) -> None:
        self._writer = writer
        self._slots = slots

    def add(self, table: pa.Table) -> None:
        with self._slots:
            self._writer.add(table)

    def finish(self) -> Any:
        with self._slots:
            return self._writer.finish()


class _SplitStream:
    """A ``SplitReader``'s batches, encoded, as a ``BatchStream`` with the reader's state."""

    def __init__(self, reader: SplitReader, encode: Callable[[Any], pa.RecordBatch] | None):
        self._reader = reader
        self._encode = encode

    def __iter__(self) -> _SplitStream:
        return self

    def __next__(self) -> pa.RecordBatch:
        batch = next(self._reader)
        return batch if self._encode is None else self._encode(batch)

    def state_dict(self) -> dict[str, Any]:
        return self._reader.state_dict()

    def cursor(self) -> dict[str, Any]:
        state = self._reader.state_dict()
        return {key: state[key] for key in ("epoch", "window", "offset")}


class ParquetStreams:
    """The streams of one Parquet dataset (a ``StreamFactory``): each request's splits read
    by a ``SplitReader`` exactly as the local loader reads them.

    ``manifest`` lists the files the dataset at ``root`` holds; requests name files
    relative to ``root``. ``columns``, ``validate`` and ``transform`` are those of
    ``ParquetBatchDataset``, run under ``workers`` preprocessing slots that every stream
    shares. ``encode`` turns a batch into a record batch (none: the batches are record
    batches already, as without a transform).
    """

    def __init__(
        self,
        root: str,
        manifest: Manifest,
        columns: Sequence[str],
        *,
        workers: int,
        validate: Callable[[pa.Table], None] | None = None,
        transform: Callable[[pa.Table], Block] | None = None,
        encode: Callable[[Any], pa.RecordBatch] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be positive, got {workers}")
        self.root = root
        self.workers = workers
        self._files = {f.path for f in manifest.files}
        self._columns = list(columns)
        slots = threading.BoundedSemaphore(workers)
        self._validate = None if validate is None else _Throttled(validate, slots)
        self._transform: _Throttled | None = None
        if transform is not None:
            throttled = _ThrottledTransform if hasattr(transform, "window_writer") else _Throttled
            self._transform = throttled(transform, slots)
        self._encode = encode
        self._splits: dict[tuple[str, ...], list[Split]] = {}
        self._lock = threading.Lock()

    def __call__(self, request: StreamRequest, endpoint: Endpoint) -> BatchStream:
        """The request's reader, reset to its state (checked) or to the start of its epoch."""
        dataset = ParquetBatchDataset(
            self._list_splits(request.files, endpoint),
            self._columns,
            request.batch_size,
            rank=request.rank,
            world_size=request.world_size,
            seed=request.seed,
            shuffle=request.shuffle,
            shuffle_window=request.shuffle_window,
            validate=self._validate,
            transform=self._transform,
        )
        dataset.set_epoch(request.epoch)
        reader = SplitReader(dataset, request.worker, request.num_workers)
        reader.reset(request.state)
        return _SplitStream(reader, self._encode)

    def splits(self, request: StreamRequest, endpoint: Endpoint) -> list[list[Any]]:
        """The request's row groups as ``Split`` fields, each path relative to ``root`` as
        the request names it (what the trainer needs to count a pass's steps)."""
        prefix = {join_url(self.root, f): f for f in request.files}
        return [
            [prefix[s.path], s.row_group, s.num_rows, s.day, s.digest]
            for s in self._list_splits(request.files, endpoint)
        ]

    def _list_splits(self, files: tuple[str, ...], endpoint: Endpoint) -> list[Split]:
        with self._lock:
            if files not in self._splits:
                unknown = [f for f in files if f not in self._files]
                if unknown:
                    raise ValueError(
                        f"reader {endpoint}: {', '.join(unknown)} not in the manifest "
                        f"of its dataset {self.root}"
                    )
                self._splits[files] = list_splits([join_url(self.root, f) for f in files])
            return self._splits[files]
