"""The tensors one training step consumes: ``Batch`` and its jagged sparse part.

The layout follows TorchRec's ``KeyedJaggedTensor`` (key-major values with one length per
key and sample) so that the sharded trainer can split it by key without copying.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KeyedJaggedTensor:
    """Variable-length ID lists for several keys over one batch.

    ``values`` holds, key after key, the embedding rows of every sample; ``lengths`` has
    ``len(keys) * batch_size`` entries, key-major, so that ``lengths[k * B + i]`` is the
    number of IDs of sample ``i`` for key ``k``.
    """

    keys: list[str]
    values: torch.Tensor  # int64 [sum(lengths)]
    lengths: torch.Tensor  # int32 [len(keys) * B]
    weights: torch.Tensor | None = None  # float32 [sum(lengths)], optional per-ID weights

    @property
    def stride(self) -> int:
        """The batch size."""
        return self.lengths.numel() // max(len(self.keys), 1)

    def offsets(self) -> torch.Tensor:
        """Exclusive prefix sum of ``lengths`` (int64, one more entry than ``lengths``)."""
        out = torch.zeros(self.lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(self.lengths, 0, out=out[1:])
        return out

    def length_per_key(self) -> list[int]:
        """How many values each key has in this batch."""
        return self.lengths.view(len(self.keys), -1).sum(1).tolist()

    def split_by_key(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{key: (values, offsets)}`` as ``torch.nn.EmbeddingBag`` takes them."""
        out = {}
        lengths = self.lengths.view(len(self.keys), -1)
        for key, vals, lens in zip(
            self.keys, self.values.split(self.length_per_key()), lengths, strict=True
        ):
            offs = torch.zeros(lens.numel(), dtype=torch.int64)
            torch.cumsum(lens[:-1], 0, out=offs[1:])
            out[key] = (vals, offs)
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys=self.keys,
            values=self.values.to(device, non_blocking=non_blocking),
            lengths=self.lengths.to(device, non_blocking=non_blocking),
            weights=None
            if self.weights is None
            else self.weights.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys=self.keys,
            values=self.values.pin_memory(),
            lengths=self.lengths.pin_memory(),
            weights=None if self.weights is None else self.weights.pin_memory(),
        )


@dataclass
class Batch:
    """One batch: dense features, sparse IDs (already mapped to embedding rows) and labels."""

    dense: torch.Tensor  # float32 [B, n_dense]
    sparse: KeyedJaggedTensor
    labels: torch.Tensor  # float32 [B]

    def __len__(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory())
