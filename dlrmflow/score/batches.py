"""A share's rows as the model's ``Batch``es, each with the day-rows of its rows (and the
values of its key columns, when there are any: ``dlrmflow.score.keys``).

The reader and transform are the trainer's (``ParquetBatchDataset``, ``make_loader``,
``BatchTransform`` with the run's ID mapping), built here rather than through
``batch_loader`` for two reasons: the reader must read exactly the splits whose keys
``shares`` computed (no second listing, no rank arithmetic of its own), and a day without
a label column must be readable. One reader in the consumer's thread (``num_workers=0``:
its preparation threads still decode ahead) with no shuffle emits the rows in split
order, so each batch's keys are the next ``len(batch)`` of ``RowKeys`` (and its key
columns the next ``len(batch)`` rows of a ``KeyReader`` of the same splits).

Data to score need not have labels: ``UnlabeledTransform`` gives the transform a label
column of zeros (which nothing reads: the output's label is null for such rows), so
validation and the compiled transform run unchanged on the other columns.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dlrmflow.features.batch import Batch
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.features.transform import BatchTransform, WindowWriter
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.loader import make_loader
from dlrmflow.ingest.reader import ParquetBatchDataset
from dlrmflow.ingest.shares import RowKeys, Share
from dlrmflow.score.keys import KeyReader
from dlrmflow.train.run.data import IdMapper


def with_zero_labels(table: pa.Table, label: str) -> pa.Table:
    """``table`` plus an int8 ``label`` column of zeros, chunked as its first column (the
    compiled transform wants every column chunked alike)."""
    chunks = table.column(0).chunks if table.num_columns else [pa.array([], pa.int8())]
    zeros = pa.chunked_array([pa.array(np.zeros(len(c), np.int8)) for c in chunks], pa.int8())
    return table.append_column(pa.field(label, pa.int8(), nullable=False), zeros)


class _UnlabeledWindow:
    """A ``WindowWriter`` fed tables without labels."""

    def __init__(self, writer: WindowWriter, label: str) -> None:
        self._writer = writer
        self._label = label

    def add(self, table: pa.Table) -> None:
        self._writer.add(with_zero_labels(table, self._label))

    def finish(self) -> Batch:
        return self._writer.finish()


class UnlabeledTransform:
    """``BatchTransform`` for row groups without the label column (stateless, so as
    thread-safe as the transform it wraps)."""

    def __init__(self, transform: BatchTransform) -> None:
        self._transform = transform
        self._label = transform.spec.label

    def validate(self, table: pa.Table) -> None:
        self._transform.validate(with_zero_labels(table, self._label))

    def __call__(self, table: pa.Table) -> Batch:
        return self._transform(with_zero_labels(table, self._label))

    def window_writer(self, order: np.ndarray, dest: np.ndarray | None = None) -> _UnlabeledWindow:
        return _UnlabeledWindow(self._transform.window_writer(order, dest), self._label)


@dataclass
class KeyedBatch:
    """A batch of a share, the day-rows of its rows and their key columns' values."""

    batch: Batch
    rows: np.ndarray  # int64 [len(batch)]
    keys: pa.Table | None = None  # [len(batch)] rows; None without key columns


def share_batches(
    share: Share,
    spec: FeatureSpec,
    ids: IdMapper,
    *,
    batch_size: int,
    labeled: bool,
    limit: int | None = None,
    threads: int | None = None,
    keys: pa.Schema | None = None,
) -> Iterator[KeyedBatch]:
    """The batches of ``share`` in read order, keyed, up to ``limit`` rows in all; with
    ``keys`` (key columns' fields), each with those columns of its rows.

    Raises ``DataError`` when the reader's rows and the share's splits disagree in
    number: the keys would be wrong, so nothing is scored with them.
    """
    if not share.splits or limit == 0:
        return
    # A prediction never depends on the example weight, and data to score may lack it.
    spec = dataclasses.replace(spec, weight=None)
    transform = BatchTransform(spec, ids)
    columns = spec.columns if labeled else [c for c in spec.columns if c != spec.label]
    reads = transform if labeled else UnlabeledTransform(transform)
    dataset = ParquetBatchDataset(
        list(share.splits),
        columns,
        batch_size,
        shuffle=False,
        validate=reads.validate,
        transform=reads,
    )
    row_keys = RowKeys(share.splits, share.starts)
    with contextlib.ExitStack() as stack:
        columns_of = (
            stack.enter_context(KeyReader(share.splits, keys))
            if keys is not None and len(keys)
            else None
        )
        loader = stack.enter_context(make_loader(dataset, num_workers=0, threads=threads))
        seen = 0
        for batch in loader:
            take = len(batch) if limit is None else min(len(batch), limit - seen)
            try:
                rows = row_keys.take(take)
            except ValueError as e:
                raise DataError(f"day {share.day}: {e}") from e
            values = columns_of.take(take) if columns_of is not None else None
            yield KeyedBatch(batch if take == len(batch) else batch.slice(0, take), rows, values)
            seen += take
            if limit is not None and seen >= limit:
                return
    if row_keys.left:
        raise DataError(
            f"day {share.day}: the reader ended {row_keys.left} rows before the end of share "
            f"{share.index} of {share.count}; its row keys cannot be trusted"
        )
