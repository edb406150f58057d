"""The tensors one training step consumes: ``Batch``, whose sparse part is a
``dlrmflow.sparse.KeyedJaggedTensor``.

The reader builds training batches by transforming whole row groups, concatenating the
row groups of a shuffle window (``concat``) and gathering permuted samples out of it
(``take``). Both are vectorized over all keys: a few tensor operations per call, never a
Python loop per sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dlrmflow.sparse import KeyedJaggedTensor, checked_indices


@dataclass
class Batch:
    """One batch: dense features, sparse IDs (already mapped to embedding rows), labels and,
    where the dataset declares a weight column, each example's weight.

    ``sample_weights`` scale each example's loss (an importance or a sampling correction);
    None when the schema has no weight column, so such batches are exactly as they were.
    Every operation keeps it beside its row.
    """

    dense: torch.Tensor  # float32 [B, n_dense]
    sparse: KeyedJaggedTensor
    labels: torch.Tensor  # float32 [B]
    sample_weights: torch.Tensor | None = None  # float32 [B], finite and >= 0

    @classmethod
    def empty(
        cls,
        n_dense: int,
        keys: list[str],
        device: torch.device | str = "cpu",
        weighted: bool = False,
    ) -> Batch:
        """A batch of no rows (a sharded job's rank whose data ran out keeps stepping with
        these, since every rank takes part in each step's exchanges). ``weighted``: it
        carries (no) sample weights, like the batches of a dataset with a weight column."""
        rows = torch.zeros(0, len(keys), dtype=torch.int64, device=device)
        return cls(
            torch.zeros(0, n_dense, device=device),
            KeyedJaggedTensor.from_one_hot(keys, rows),
            torch.zeros(0, device=device),
            torch.zeros(0, device=device) if weighted else None,
        )

    def __len__(self) -> int:
        return self.labels.shape[0]

    def take(self, indices: np.ndarray | torch.Tensor) -> Batch:
        """The rows ``indices`` (1-D, in ``[0, len(self))``) in that order."""
        idx = checked_indices(indices, len(self))
        weights = self.sample_weights
        return Batch(
            dense=self.dense.index_select(0, idx),
            sparse=self.sparse.take(idx),
            labels=self.labels.index_select(0, idx),
            sample_weights=None if weights is None else weights.index_select(0, idx),
        )

    def slice(self, start: int, stop: int) -> Batch:
        """Rows ``start`` to ``stop``: views where the layout allows (the one-hot form)."""
        start, stop, _ = slice(start, stop).indices(len(self))
        stop = max(start, stop)
        weights = self.sample_weights
        return Batch(
            dense=self.dense[start:stop],
            sparse=self.sparse.slice(start, stop),
            labels=self.labels[start:stop],
            sample_weights=None if weights is None else weights[start:stop],
        )

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """One batch holding the rows of ``batches`` one batch after another.

        Its ``dense`` and ``labels`` (and ``sample_weights``) are views of one
        [B, n_dense + 1 (+ 1)] buffer, each label beside its row's features: a ``take``
        then finds a row's label in the cache line its features brought in, instead of
        missing the cache once more per row. All batches or none carry sample weights.
        """
        if not batches:
            raise ValueError("concat: no Batch to concatenate")
        weighted = {b.sample_weights is not None for b in batches}
        if len(weighted) > 1:
            raise ValueError("concat: some batches have sample weights and some do not")
        extra = 2 if weighted == {True} else 1
        n_dense = batches[0].dense.shape[1]
        rows = torch.empty(sum(len(b) for b in batches), n_dense + extra, dtype=torch.float32)
        start = 0
        for b in batches:
            rows[start : start + len(b), :n_dense] = b.dense
            rows[start : start + len(b), n_dense] = b.labels
            if b.sample_weights is not None:
                rows[start : start + len(b), n_dense + 1] = b.sample_weights
            start += len(b)
        return cls(
            dense=rows[:, :n_dense],
            sparse=KeyedJaggedTensor.concat([b.sparse for b in batches]),
            labels=rows[:, n_dense],
            sample_weights=rows[:, n_dense + 1] if extra == 2 else None,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        weights = self.sample_weights
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            sample_weights=None
            if weights is None
            else weights.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        weights = self.sample_weights
        return Batch(
            self.dense.pin_memory(),
            self.sparse.pin_memory(),
            self.labels.pin_memory(),
            None if weights is None else weights.pin_memory(),
        )
