"""A shuffled window of ``Batch`` rows, built as the reader decodes its row groups.

The reader permutes each window of row groups (``ingest.shuffle.deal``: every batch gets a
random share of the window's rows) and cuts its batches out of the result. Permuting
costs a pass over every byte of the window, so it is folded into work done anyway:

* Criteo's layout (the compiled path): each row group is hashed and transformed straight
  into its rows' places (``BatchTransform._write``), and the batches are views.
* Every other layout: each row group is transformed into a ``Batch`` as it arrives, and
  its rows are placed at once, while it is still in cache, into arrays in emission order
  (``PlacedWindow``): dense features, labels, weights and one-hot rows as they are,
  jagged bags as one row of (length, slot) per sample, the ID of a key whose bags hold
  one at most kept in its slot, a list's slot saying where its IDs start. A batch is then
  rows ``a:b`` of those arrays: views, and one compiled pass that reads its bags in order
  (``jit.gather_placed_bags``). Only list bags read memory elsewhere, one read a bag.

``BatchTransform.window_writer`` (``features.transform.WindowWriter``) drives both as the
reader adds its row groups; this module knows nothing of the transform.

Blocks that cannot share one form (one-hot beside jagged, with and without weights) take
the plain way, ``Batch.concat(blocks).take(order)``, which also raises where they cannot
be joined.
"""

from __future__ import annotations

import numpy as np
import torch

from dlrmflow.features import jit
from dlrmflow.features.batch import Batch
from dlrmflow.sparse import KeyedJaggedTensor


def destinations(order: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(``order`` as int64, its inverse: where each of the ``n`` rows goes), checked."""
    order = np.asarray(order, dtype=np.int64)
    if order.ndim != 1 or len(order) != n:
        raise ValueError(f"window: order must hold {n} rows, got shape {order.shape}")
    dest = np.empty(n, np.int64)
    if not jit.inverse_permutation(order, dest):
        raise ValueError("window: order must be a permutation of the rows")
    return order, dest


def _form(b: Batch) -> tuple[object, ...]:
    """What blocks must share to be joined by ``shuffled`` or ``PlacedWindow``."""
    s = b.sparse
    rows = s.one_hot_rows
    return (
        b.dense.shape[1],
        b.dense.dtype,
        None if rows is None else rows.dtype,
        s.weights is None,
        b.sample_weights is None,
        tuple(s.keys),
    )


class PlacedWindow:
    """A window's rows in emission order, each block's rows placed as the block arrives.

    Dense features, labels, sample weights and one-hot rows go to their rows as they are.
    Jagged bags become a row-major [rows, keys] ``lengths`` and ``slots``: a bag of one
    ID holds it in its slot (and its weight in ``slot_weights``), a longer bag where its
    IDs start in the blocks' values one after another. Rows ``a:b`` then make a batch
    (``batch``) with views and one compiled pass.
    """

    def __init__(self, first: Batch, rows: int) -> None:
        self.form = _form(first)
        self.keys = list(first.sparse.keys)
        self.dense = torch.empty(rows, first.dense.shape[1], dtype=torch.float32)
        self.labels = torch.empty(rows, dtype=torch.float32)
        weighted_samples = first.sample_weights is not None
        self.sample_weights = torch.empty(rows, dtype=torch.float32) if weighted_samples else None
        one_hot = first.sparse.one_hot_rows
        self.rows = (
            None if one_hot is None else torch.empty(rows, len(self.keys), dtype=one_hot.dtype)
        )
        self.weighted = first.sparse.weights is not None
        if self.rows is None:
            keys = len(self.keys)
            self.lengths = np.empty((rows, keys), np.int32)
            self.slots = np.empty((rows, keys), np.int64)
            self.slot_weights = np.empty((rows, keys) if self.weighted else (0, 0), np.float32)
        # Keys whose bags hold at most one ID, as the first block with rows has them
        # (its one-hot columns, crosses, buckets): their IDs sit in their slots.
        self._scalar: np.ndarray | None = None
        self._values: list[np.ndarray] = []  # each jagged block's values, then joined
        self._weights: list[np.ndarray] = []
        self._base = 0  # where the next block's values start among all blocks'

    @classmethod
    def for_block(cls, first: Batch, rows: int) -> PlacedWindow | None:
        """The placed window for blocks of ``first``'s form, or None where that form has
        float dense features of another width than float32 (``shuffled``'s plain way)."""
        return cls(first, rows) if first.dense.dtype == torch.float32 else None

    def add(self, block: Batch, dest: np.ndarray) -> bool:
        """Place ``block``'s rows at ``dest``; False (nothing placed) for a block of
        another form."""
        if _form(block) != self.form:
            return False
        n = len(block)
        if n == 0:
            return True
        # ``dest`` runs on past the block: its later rows are asked for ahead.
        jit.scatter_samples(block.dense.numpy(), dest, self.dense.numpy())
        jit.scatter_samples(
            block.labels.numpy().reshape(n, 1), dest, self.labels.numpy().reshape(-1, 1)
        )
        if self.sample_weights is not None:
            assert block.sample_weights is not None
            weights = block.sample_weights.numpy().reshape(n, 1)
            jit.scatter_samples(weights, dest, self.sample_weights.numpy().reshape(-1, 1))
        sparse = block.sparse
        if self.rows is not None:
            assert sparse.one_hot_rows is not None
            jit.scatter_samples(sparse.one_hot_rows.numpy(), dest, self.rows.numpy())
            return True
        values = sparse.values.numpy()
        weights = sparse.weights.numpy() if self.weighted else np.zeros(0, np.float32)
        lengths = sparse.lengths.numpy().reshape(len(self.keys), n)
        if self._scalar is None:
            self._scalar = lengths.max(axis=1, initial=0) <= 1
        placed = jit.place_bags(
            lengths,
            values,
            weights,
            self.weighted,
            self._scalar,
            dest,
            self._base,
            self.lengths,
            self.slots,
            self.slot_weights,
        )
        if not placed:  # a key of single IDs so far holds a list here
            return False
        self._values.append(values)
        self._weights.append(weights)
        self._base += len(values)
        return True

    def batch(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop`` (of emission order) as a ``Batch``."""
        weights = self.sample_weights
        return Batch(
            dense=self.dense[start:stop],
            sparse=self._sparse(start, stop),
            labels=self.labels[start:stop],
            sample_weights=None if weights is None else weights[start:stop],
        )

    def _sparse(self, start: int, stop: int) -> KeyedJaggedTensor:
        if self.rows is not None:
            return KeyedJaggedTensor.from_one_hot(self.keys, self.rows[start:stop])
        if len(self._values) != 1:  # joined once, at the first batch
            self._values = [_joined(self._values, np.int64)]
            self._weights = [_joined(self._weights, np.float32)]
        lengths, values, weights = jit.gather_placed_bags(
            start,
            stop,
            self.lengths,
            self.slots,
            self.slot_weights,
            self._scalar if self._scalar is not None else np.zeros(len(self.keys), np.bool_),
            self._values[0],
            self._weights[0],
            self.weighted,
        )
        return KeyedJaggedTensor(
            self.keys,
            torch.from_numpy(values),
            torch.from_numpy(lengths),
            torch.from_numpy(weights) if self.weighted else None,
        )


def _joined(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)


def shuffled(blocks: list[Batch], order: np.ndarray) -> Batch:
    """``Batch.concat(blocks).take(order)``, gathered in one compiled pass per part.

    ``KeyedJaggedTensor.take`` works out every ID's position in numpy (a repeat and an
    arange the size of the window's IDs) before gathering; here each bag is copied in
    emission order straight from the joined blocks' values, the writes one sequential
    stream. (A scatter from each block to its place instead writes to every batch at
    once, at places a batch apart, which share cache sets.) Blocks of mixed forms (one-hot
    and jagged, with and without weights) take the plain way, which also raises where
    they cannot be joined.
    """

    forms = {_form(b) for b in blocks}
    if len(forms) != 1 or blocks[0].dense.dtype != torch.float32:
        return Batch.concat(blocks).take(order)
    n, first = len(order), blocks[0]
    keys = list(first.sparse.keys)

    def gathered(parts: list[torch.Tensor]) -> torch.Tensor:
        """Sample-major ``parts`` (one per block), joined and gathered in emission order."""
        arrays = [p.numpy() for p in parts]
        joined = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        out = np.empty((n, *joined.shape[1:]), joined.dtype)
        width = int(np.prod(joined.shape[1:]))  # 1 for a 1-D part
        jit.gather_samples(joined.reshape(n, width), order, out.reshape(n, width))
        return torch.from_numpy(out)

    weights_of_samples = [b.sample_weights for b in blocks]
    sample_weights = None
    if first.sample_weights is not None:
        sample_weights = gathered([w for w in weights_of_samples if w is not None])
    one_hot = [b.sparse.one_hot_rows for b in blocks]
    if first.sparse.one_hot_rows is not None:
        rows = gathered([r for r in one_hot if r is not None])
        sparse = KeyedJaggedTensor.from_one_hot(keys, rows)
    else:
        sparse = _gathered_bags([b.sparse for b in blocks], order)
    return Batch(
        dense=gathered([b.dense for b in blocks]),
        sparse=sparse,
        labels=gathered([b.labels for b in blocks]),
        sample_weights=sample_weights,
    )


def _gathered_bags(parts: list[KeyedJaggedTensor], order: np.ndarray) -> KeyedJaggedTensor:
    """``KeyedJaggedTensor.concat(parts).take(order)`` for jagged parts that all carry
    weights or none, in one compiled pass (``jit.gather_bags``)."""
    keys, n = list(parts[0].keys), len(order)
    lengths = np.empty((len(keys), n), np.int32)
    starts = np.empty((len(keys), n), np.int64)
    base = row = 0
    for p in parts:
        block_lengths = p.lengths.numpy().reshape(len(keys), p.stride)
        base = jit.bag_starts(block_lengths, row, base, lengths, starts)
        row += p.stride
    values = np.concatenate([p.values.numpy() for p in parts])
    weights = [p.weights.numpy() for p in parts if p.weights is not None]
    joined_weights = np.concatenate(weights) if weights else np.zeros(0, np.float32)
    out_lengths = np.empty((len(keys), n), np.int32)
    out_values = np.empty(len(values), np.int64)
    out_weights = np.empty(len(joined_weights), np.float32)
    jit.gather_bags(
        order, lengths, starts, values, joined_weights, out_lengths, out_values, out_weights
    )
    return KeyedJaggedTensor(
        keys,
        torch.from_numpy(out_values),
        torch.from_numpy(out_lengths.reshape(-1)),
        torch.from_numpy(out_weights) if weights else None,
    )
