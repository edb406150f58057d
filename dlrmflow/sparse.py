"""The sparse batch types every layer shares: ``KeyedJaggedTensor`` and ``EmbeddingTable``.

They sit below the kernels and every stage: the features stage builds jagged IDs, the
kernels look them up in tables, and the trainer shards both, so none of them may own the
types without the others importing a stage above them.

The layout follows TorchRec's ``KeyedJaggedTensor`` (key-major values with one length per
key and sample) so that the sharded trainer can split it by key without copying. Its
operations (``concat``, ``take``) are vectorized over all keys: a few tensor operations per
call, never a Python loop per sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch


def checked_indices(indices: np.ndarray | torch.Tensor, size: int) -> torch.Tensor:
    """``indices`` as a 1-D int64 tensor, checked to lie in ``[0, size)``.

    Checked because a stray index would not fail in the key-major gather: it would read
    another key's or another sample's IDs.
    """
    idx = torch.as_tensor(indices, dtype=torch.int64)
    if idx.dim() != 1:
        raise ValueError(f"take: indices must be 1-D, got shape {tuple(idx.shape)}")
    if idx.numel():
        low, high = (int(v) for v in torch.aminmax(idx))
        if low < 0 or high >= size:
            raise IndexError(f"take: indices must be in [0, {size}), got [{low}, {high}]")
    return idx


def _jagged_from_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, lengths) of one-hot ``rows`` [B, n_keys], where -1 means no ID.

    numpy, not torch, on the CPU: its compress is faster than ``masked_select`` here.
    """
    if rows.device.type != "cpu":
        key_major = rows.t().reshape(-1)
        present = key_major >= 0
        return key_major[present].long(), present.int()
    key_major = np.ascontiguousarray(rows.numpy().T).reshape(-1)
    present = key_major >= 0
    values = np.compress(present, key_major).astype(np.int64, copy=False)
    return torch.from_numpy(values), torch.from_numpy(present.astype(np.int32))


class KeyedJaggedTensor:
    """Variable-length ID lists for several keys over one batch.

    ``values`` holds, key after key, the embedding rows of every sample; ``lengths`` has
    ``len(keys) * batch_size`` entries, key-major, so that ``lengths[k * B + i]`` is the
    number of IDs of sample ``i`` for key ``k``. ``weights``, when present, has one float
    per value.

    One-hot data (every bag holds one ID or none) can instead be stored sample-major with
    ``from_one_hot``: one row of IDs per sample. That is the form the transform gives row
    groups: a ``take`` from it reads one contiguous row per sample instead of a length, an
    offset and a value per key scattered over the key-major arrays (less time in cache
    misses). ``values`` and ``lengths`` are then built on first access; ``take``
    keeps the form, and the model reads ``one_hot_rows`` without building them.

    Treat it as immutable: the offsets and the built forms are kept once computed, so that
    the many ``take`` calls on one concatenated window pay for them once. ``take`` and the
    one-hot form work on CPU tensors (the loader's side); ``to`` moves either form.
    """

    def __init__(
        self,
        keys: list[str],
        values: torch.Tensor,  # int64 [sum(lengths)]
        lengths: torch.Tensor,  # int32 [len(keys) * B]
        weights: torch.Tensor | None = None,  # float32 [sum(lengths)], optional per-ID weights
    ) -> None:
        self.keys = keys
        self.weights = weights
        self._values: torch.Tensor | None = values
        self._lengths: torch.Tensor | None = lengths
        self._rows: torch.Tensor | None = None
        self._offsets: torch.Tensor | None = None
        self._bags_of_one: bool | None = None  # every length is 0 or 1

    @classmethod
    def from_one_hot(cls, keys: list[str], rows: torch.Tensor) -> KeyedJaggedTensor:
        """One-hot IDs stored sample-major: ``rows[i, k]`` is sample ``i``'s ID for key ``k``.

        ``rows`` is an int32 or int64 tensor [B, len(keys)]; -1 marks an empty bag. No
        weights. The jagged form is built from it on the CPU only (the loader's side).
        """
        if rows.dim() != 2 or rows.shape[1] != len(keys):
            raise ValueError(
                f"from_one_hot: rows must be [B, {len(keys)}], got {tuple(rows.shape)}"
            )
        if rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"from_one_hot: rows must be int32 or int64, got {rows.dtype}")
        kjt = cls(keys, rows.new_zeros(0, dtype=torch.int64), rows.new_zeros(0, dtype=torch.int32))
        kjt._values = kjt._lengths = None
        kjt._rows = rows
        kjt._bags_of_one = True
        return kjt

    @property
    def one_hot_rows(self) -> torch.Tensor | None:
        """The sample-major [B, n_keys] rows (-1: empty bag) of the one-hot form, else None."""
        return self._rows

    @property
    def values(self) -> torch.Tensor:
        if self._values is None:
            self._build_jagged()
        assert self._values is not None
        return self._values

    @property
    def lengths(self) -> torch.Tensor:
        if self._lengths is None:
            self._build_jagged()
        assert self._lengths is not None
        return self._lengths

    def _build_jagged(self) -> None:
        assert self._rows is not None
        self._values, self._lengths = _jagged_from_rows(self._rows)

    @property
    def stride(self) -> int:
        """The batch size."""
        if self._rows is not None:
            return self._rows.shape[0]
        return self.lengths.numel() // max(len(self.keys), 1)

    def offsets(self) -> torch.Tensor:
        """Exclusive prefix sum of ``lengths`` (int64, one more entry than ``lengths``).

        Computed on first use and kept; do not modify the returned tensor.
        """
        if self._offsets is None:
            lengths = self.lengths
            out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
            torch.cumsum(lengths, 0, out=out[1:])
            self._offsets = out
        return self._offsets

    def length_per_key(self) -> list[int]:
        """How many values each key has in this batch."""
        return self.lengths.view(len(self.keys), self.stride).sum(1).tolist()

    def split_by_key(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{key: (values, offsets)}`` as ``torch.nn.EmbeddingBag`` takes them."""
        out = {}
        lengths = self.lengths.view(len(self.keys), -1)
        for key, vals, lens in zip(
            self.keys, self.values.split(self.length_per_key()), lengths, strict=True
        ):
            offs = torch.zeros(lens.numel(), dtype=torch.int64, device=lens.device)
            torch.cumsum(lens[:-1], 0, out=offs[1:])
            out[key] = (vals, offs)
        return out

    def take(self, indices: np.ndarray | torch.Tensor) -> KeyedJaggedTensor:
        """The samples ``indices`` (1-D, in ``[0, stride)``) in that order, for every key.

        Repeated indices repeat their samples. The one-hot form stays one-hot (the model
        reads it directly; ``values``/``lengths`` are built only if asked for).
        """
        if self._rows is not None:
            idx = checked_indices(indices, self.stride)
            return KeyedJaggedTensor.from_one_hot(self.keys, self._rows.index_select(0, idx))
        if not self.keys:  # no key, no samples: nothing to gather and no stride to check
            weights = None if self.weights is None else self.weights[:0]
            return KeyedJaggedTensor([], self.values[:0], self.lengths[:0], weights)
        idx = checked_indices(indices, self.stride).numpy()
        # Slots of (key k, sample idx[j]) in ``lengths``, key-major like the output. numpy,
        # not torch: its gathers and repeat are faster here.
        slots = (np.arange(len(self.keys)) * self.stride)[:, None] + idx
        lengths = self.lengths.numpy().take(slots.reshape(-1))
        starts = self.offsets().numpy().take(slots.reshape(-1))
        if self._all_bags_of_one():
            positions = np.compress(lengths.astype(np.bool_), starts)  # the non-empty bags
        else:
            # Each ID's position: its bag's start plus its rank inside the bag, i.e. the
            # running count over the output minus the count before its bag.
            ends = np.cumsum(lengths, dtype=np.int64)
            total = int(ends[-1]) if len(ends) else 0
            positions = np.arange(total) + np.repeat(starts - (ends - lengths), lengths)
        weights = None if self.weights is None else self.weights[torch.from_numpy(positions)]
        out = KeyedJaggedTensor(
            self.keys,
            torch.from_numpy(self.values.numpy().take(positions)),
            torch.from_numpy(lengths),
            weights,
        )
        out._bags_of_one = self._bags_of_one  # a subset of bags of one is bags of one
        return out

    def slice(self, start: int, stop: int) -> KeyedJaggedTensor:
        """Samples ``start`` to ``stop`` (a view in the one-hot form, a copy otherwise)."""
        start, stop, _ = slice(start, stop).indices(self.stride)
        stop = max(start, stop)
        if self._rows is not None:
            return KeyedJaggedTensor.from_one_hot(self.keys, self._rows[start:stop])
        n_keys, stride = len(self.keys), self.stride
        lengths = self.lengths.view(n_keys, stride)[:, start:stop].reshape(-1)
        offsets = self.offsets()
        at = [k * stride for k in range(n_keys)]
        cuts = [(int(offsets[k + start]), int(offsets[k + stop])) for k in at]
        values = torch.cat([self.values[a:b] for a, b in cuts]) if cuts else self.values[:0]
        weights = None
        if self.weights is not None:
            weights = torch.cat([self.weights[a:b] for a, b in cuts]) if cuts else self.weights[:0]
        out = KeyedJaggedTensor(self.keys, values, lengths.clone(), weights)
        out._bags_of_one = self._bags_of_one
        return out

    def _all_bags_of_one(self) -> bool:
        if self._bags_of_one is None:
            lengths = self.lengths
            self._bags_of_one = lengths.numel() == 0 or int(lengths.max()) <= 1
        return self._bags_of_one

    @classmethod
    def concat(cls, parts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """One KJT holding the samples of ``parts`` one part after another.

        All parts must have the same keys, and either all or none carry weights. Parts all
        in the one-hot form give the one-hot form.
        """
        if not parts:
            raise ValueError("concat: no KeyedJaggedTensor to concatenate")
        keys = parts[0].keys
        for part in parts:
            if part.keys != keys:
                raise ValueError(f"concat: keys differ: {keys} and {part.keys}")
        if all(p._rows is not None for p in parts):
            return cls.from_one_hot(keys, torch.cat([p._rows for p in parts]))
        weighted = {p.weights is not None for p in parts}
        if len(weighted) > 1:
            raise ValueError("concat: some parts have weights and some do not")
        n_keys = len(keys)
        lengths = torch.cat([p.lengths.view(n_keys, p.stride) for p in parts], dim=1).view(-1)
        sizes = [p.length_per_key() for p in parts]

        def key_major(tensors: list[torch.Tensor]) -> torch.Tensor:
            # Key k of every part, then key k + 1: one copy of each piece into place.
            pieces = [t.split(s) for t, s in zip(tensors, sizes, strict=True)]
            ordered = [piece[k] for k in range(n_keys) for piece in pieces]
            return torch.cat(ordered) if ordered else tensors[0][:0].clone()

        values = key_major([p.values for p in parts])
        weights = key_major([p.weights for p in parts]) if weighted == {True} else None
        out = cls(keys, values, lengths, weights)
        if all(p._bags_of_one is not None for p in parts):
            out._bags_of_one = all(p._bags_of_one for p in parts)
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
        """This batch's IDs on ``device``, one-hot when this batch has that form (the
        lookup's fast path), else jagged."""
        if self._rows is not None:
            return KeyedJaggedTensor.from_one_hot(
                self.keys, self._rows.to(device, non_blocking=non_blocking)
            )
        return KeyedJaggedTensor(
            keys=self.keys,
            values=self.values.to(device, non_blocking=non_blocking),
            lengths=self.lengths.to(device, non_blocking=non_blocking),
            weights=None
            if self.weights is None
            else self.weights.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> KeyedJaggedTensor:
        """A copy in page-locked memory (what an asynchronous copy to a GPU needs), in the
        same form as ``to``."""
        if self._rows is not None:
            return KeyedJaggedTensor.from_one_hot(self.keys, self._rows.pin_memory())
        return KeyedJaggedTensor(
            keys=self.keys,
            values=self.values.pin_memory(),
            lengths=self.lengths.pin_memory(),
            weights=None if self.weights is None else self.weights.pin_memory(),
        )

    def __repr__(self) -> str:
        form = "one-hot" if self._rows is not None and self._values is None else "jagged"
        return f"KeyedJaggedTensor(keys={self.keys}, stride={self.stride}, {form})"


@dataclass(frozen=True)
class EmbeddingTable:
    """An embedding table as the kernels see it (TorchRec's ``EmbeddingBagConfig``): its
    name, its rows, their width and how a bag of IDs pools. The features stage's
    ``SparseFeature`` extends it with where the IDs come from; the kernels read nothing
    else."""

    name: str
    num_embeddings: int
    embedding_dim: int
    pooling: Literal["sum", "mean"] = "sum"
