"""FBGEMM's table-batched embedding (``fbgemm_gpu``) running a bag's lookups and fused updates.

FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` is the kernel TorchRec and most large
DLRM deployments train with: hand-tuned CUDA (and CPU) code for the lookup and for the
backward that reduces each row's gradient and applies the optimizer in place. Its storage
is the same as ``TableBatchedEmbeddingBag``'s: every table's rows back to back in one flat
float32 weight, and for row-wise Adagrad one float per row back to back. So the bag keeps
its own tensors (its checkpoints, its ``state_dict`` and every other backend read them
unchanged) and FBGEMM's module is pointed at them: its weight and optimizer-state slots
hold views of the bag's buffers, and its in-place update writes the bag's memory. A
checkpoint written under one backend continues under another with the same tensors.

Covered: SGD and row-wise Adagrad without weight decay (FBGEMM's ``EXACT_SGD`` and
``EXACT_ROWWISE_ADAGRAD``; its SGD has no weight decay and its row-wise Adagrad's differs
from ours), sum and mean pooling, per-sample weights, one-hot and jagged
batches, any mix of dims, on the CPU (the ``fbgemm-gpu-cpu`` build) and CUDA (the CUDA
build). A bag whose update needs something between the reduction and the update (the
sharded trainer's hooks: replicated tables allreduce their row gradients, column shards
share row-wise Adagrad's sums) cannot use a fused backward, and neither can Adam's global
step count as FBGEMM advances it on every forward: such bags run ``auto``'s kernels
(``TableBatchedEmbeddingBag.fbgemm_refusal`` says why).

The results agree with the other backends to float rounding, not bitwise: FBGEMM sums a
row's gradients in its own order.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from dlrmflow.kernels.optimizers import EmbeddingOptimizer, RowWiseAdagrad
from dlrmflow.sparse import EmbeddingTable, KeyedJaggedTensor

__all__ = ["FbgemmTables", "fbgemm_inputs", "refusal"]


@functools.cache
def refusal(device_type: str) -> str | None:
    """None when FBGEMM's training TBE runs on ``device_type`` here, else why not (one line).

    "Runs" is tested, not inferred from versions: the package must import (a build made for
    another torch fails to load its operators), be a build for the device (the CPU build
    has no CUDA kernels), and train two rows of a tiny table on the device.
    """
    try:
        import fbgemm_gpu
        from fbgemm_gpu import split_table_batched_embeddings_ops_training  # noqa: F401
    except ImportError as e:
        if getattr(e, "name", None) == "fbgemm_gpu":
            return "fbgemm_gpu is not installed"
        return f"fbgemm_gpu does not load with torch {torch.__version__}: {_first_line(e)}"
    except Exception as e:  # an operator library built for another torch
        return f"fbgemm_gpu does not load with torch {torch.__version__}: {_first_line(e)}"
    version = getattr(fbgemm_gpu, "__version__", "?")
    variant = getattr(fbgemm_gpu, "__variant__", "?")
    if device_type == "cuda" and variant not in ("cuda", "rocm"):
        return f"fbgemm_gpu {version} is its {variant} build, without GPU kernels"
    if device_type not in ("cpu", "cuda"):
        return f"fbgemm_gpu has no kernels for {device_type} tensors"
    try:
        _smoke_test(torch.device(device_type))
    except Exception as e:
        return f"fbgemm_gpu {version} ({variant}) fails on {device_type}: {_first_line(e)}"
    return None


def describe() -> str:
    """The installed fbgemm_gpu, e.g. "fbgemm_gpu 1.8.0 (cpu build)"."""
    import fbgemm_gpu

    version = getattr(fbgemm_gpu, "__version__", "?")
    return f"fbgemm_gpu {version} ({getattr(fbgemm_gpu, '__variant__', '?')} build)"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _smoke_test(device: torch.device) -> None:
    """Train one step of a 4-row table on ``device`` and check the update FBGEMM made."""
    tables = [EmbeddingTable("smoke", 4, 4)]
    weight = torch.ones(16, device=device)
    state = torch.zeros(4, device=device)
    fb = FbgemmTables(tables, RowWiseAdagrad(lr=1.0), device)
    fb.bind(weight, state)
    kjt = KeyedJaggedTensor(
        ["smoke"],
        torch.tensor([1], device=device),
        torch.tensor([1], dtype=torch.int32, device=device),
    )
    fb.lookup(kjt, lr=1.0, mean_tables=None, train=True).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # Row 1 saw a gradient of ones: s = 1, w = 1 - 1 / (1 + eps); the other rows are as they were.
    if not (abs(float(weight[4]) - 1e-8) < 1e-6 and float(weight[0]) == 1.0):
        raise RuntimeError("a test update did not change the rows it should have")


def _module_class():
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return SplitTableBatchedEmbeddingBagsCodegen


class FbgemmTables:
    """One FBGEMM training TBE over a bag's tables on one device, working in the bag's
    tensors (``bind``). Not an ``nn.Module`` of the bag: its slots hold views of the bag's
    buffers, which must not be saved, moved or handed to an optimizer a second time."""

    def __init__(
        self,
        tables: Sequence[EmbeddingTable],
        optimizer: EmbeddingOptimizer,
        device: torch.device,
        *,
        check_ids: bool = False,
    ) -> None:
        """``check_ids``: FBGEMM's own bounds check (its default, which warns and clamps);
        off for the bag, which checks IDs itself and names the feature."""
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode,
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice

        refusal = optimizer.fbgemm_refusal()
        if refusal is not None:
            raise ValueError(refusal)
        cuda = device.type == "cuda"
        location = EmbeddingLocation.DEVICE if cuda else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if cuda else ComputeDevice.CPU
        specs = [(t.num_embeddings, t.embedding_dim, location, compute) for t in tables]
        rowwise = optimizer.fused_rule == "rowwise_adagrad"
        self.module = _module_class()(
            specs,
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD if rowwise else EmbOptimType.EXACT_SGD,
            learning_rate=optimizer.lr,
            eps=getattr(optimizer, "eps", 1e-8),
            pooling_mode=PoolingMode.SUM,  # mean pooling: per-sample weights of 1 / length
            weights_precision=SparseType.FP32,
            output_dtype=SparseType.FP32,
            bounds_check_mode=BoundsCheckMode.WARNING if check_ids else BoundsCheckMode.NONE,
            device=device,
        )
        self.rowwise = rowwise
        self.device = device
        self._weight_slot = "weights_dev" if cuda else "weights_host"
        self._state_slot = "momentum1_dev" if cuda else "momentum1_host"
        self._lr: float | None = None
        self._check_layout(tables)

    def _check_layout(self, tables: Sequence[EmbeddingTable]) -> None:
        """FBGEMM's table offsets must be the bag's: tables back to back, rows unpadded."""
        starts, rows = [0], [0]
        for t in tables[:-1]:
            starts.append(starts[-1] + t.num_embeddings * t.embedding_dim)
            rows.append(rows[-1] + t.num_embeddings)
        numel = sum(t.num_embeddings * t.embedding_dim for t in tables)
        got = self.module.weights_offsets.tolist()
        slot = getattr(self.module, self._weight_slot)
        if got != starts or slot.numel() != numel:
            raise ValueError(
                f"FBGEMM lays these tables out at {got} ({slot.numel()} floats), not "
                f"back to back at {starts} ({numel})"
            )
        if self.rowwise and self.module.momentum1_offsets.tolist() != rows:
            raise ValueError("FBGEMM keeps row-wise Adagrad's state in another layout")

    def weight_slot(self) -> torch.Tensor:
        """The flat weight FBGEMM trains (the bag's, once bound)."""
        return getattr(self.module, self._weight_slot).detach()

    def bind(self, weight: torch.Tensor, sum_squares: torch.Tensor | None) -> None:
        """Point FBGEMM's weight (and row-wise Adagrad state) slots at the bag's tensors;
        cheap when they already are (checked on every lookup: a load or a move may have
        replaced a buffer)."""
        self._put(self._weight_slot, weight)
        if self.rowwise:
            assert sum_squares is not None
            self._put(self._state_slot, sum_squares)

    def _put(self, slot: str, tensor: torch.Tensor) -> None:
        current = getattr(self.module, slot)
        if current.data_ptr() == tensor.data_ptr() and current.numel() == tensor.numel():
            return
        if current.numel() != tensor.numel() or current.dtype != tensor.dtype:
            raise ValueError(
                f"FBGEMM's {slot} holds {current.numel()} {current.dtype}, not {tensor.numel()}"
            )
        # setattr on a registered slot replaces it (a Parameter where it holds one).
        if isinstance(current, nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=False)
        setattr(self.module, slot, tensor)

    def lookup(
        self,
        kjt: KeyedJaggedTensor,
        *,
        lr: float,
        mean_tables: torch.Tensor | None,
        train: bool,
    ) -> torch.Tensor:
        """Pooled ``[B, sum of dims]``; with ``train`` (and autograd on), its backward
        updates the looked-up rows at ``lr``. ``mean_tables``: a bool per table, pooled by
        their mean (None: all sum)."""
        if self._lr != lr:
            self.module.set_learning_rate(lr)
            self._lr = lr
        self.module.train(train)
        indices, offsets, weights = fbgemm_inputs(kjt, mean_tables)
        return self.module(indices, offsets, per_sample_weights=weights)


def fbgemm_inputs(
    kjt: KeyedJaggedTensor, mean_tables: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """FBGEMM's (indices, offsets, per-sample weights): key-major bags, as a jagged batch
    already holds them; a one-hot batch's -1 entries become empty bags."""
    rows = kjt.one_hot_rows
    if rows is not None:
        # Mean pooling of a bag of one (or none) is the bag itself: no weights needed.
        flat = rows.t().reshape(-1).long()
        present = flat >= 0
        if bool(present.all()):
            offsets = torch.arange(flat.numel() + 1, device=flat.device)
            return flat, offsets, None
        offsets = torch.zeros(flat.numel() + 1, dtype=torch.int64, device=flat.device)
        torch.cumsum(present, 0, out=offsets[1:])
        return flat[present], offsets, None
    values = kjt.values.long()
    offsets = kjt.offsets()
    weights = kjt.weights
    if mean_tables is not None and bool(mean_tables.any()):
        lengths = kjt.lengths.long()
        batch = kjt.stride
        is_mean = mean_tables.repeat_interleave(batch)
        per_bag = torch.where(is_mean, 1.0 / lengths.clamp(min=1), 1.0).float()
        scale = per_bag.repeat_interleave(lengths, output_size=values.numel())
        weights = scale if weights is None else weights * scale
    return values, offsets, weights
