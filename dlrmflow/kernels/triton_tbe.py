"""Triton GPU kernels of the table-batched embedding bag: pooled lookup and fused optimizer.

Each public function is the CUDA twin of one CPU step of ``TableBatchedEmbeddingBag`` in
``dlrmflow.kernels.tbe`` and takes the same flat weight, row-wise state, ``TableGroup``
layout and ``GroupLookup`` record (``tbe_layout``), so the module dispatches on its tensors'
device with a line per step:

- ``lookup_jagged``     for ``TableBatchedEmbeddingBag._lookup_jagged``;
- ``reduce_by_row``     for ``_reduce_by_row`` (when a gradient hook needs the row gradients);
- ``update_rows``       for ``TableBatchedEmbeddingBag._update`` (SGD and RowWiseAdagrad);
- ``reduce_and_update`` for both at once: the row gradients are never written to memory.

Determinism: backward sorts the IDs stably (torch), then one program per unique row sums the
gradients of that row's occurrences in sorted order and updates the row. Every row is
written by exactly one program and nothing accumulates with atomics, so the weights after
any number of steps are bitwise repeatable; the order is the CPU's, (table, sample, position
in bag), so the sums also match the CPU TBE's to rounding.

Division and square root use the IEEE-rounded ``div_rn``/``sqrt_rn``, not Triton's default
approximate GPU instructions, so that what differs from the CPU path is only rounding order:
fused multiply-adds, and the order of the sum in RowWiseAdagrad's mean of squares.

Importing this module never imports triton: the kernels are plain functions here, compiled
by ``_kernels`` on first use, so CPU-only installs and processes import it for nothing.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from dlrmflow.kernels.optimizers import EmbeddingOptimizer
from dlrmflow.kernels.tbe_layout import GroupLookup, TableGroup
from dlrmflow.sparse import KeyedJaggedTensor

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["available", "lookup_jagged", "reduce_and_update", "reduce_by_row", "update_rows"]


def available() -> bool:
    """Whether the Triton kernels can run on this machine: a CUDA device and triton installed.

    CUDA is asked first, so that a process without a GPU never imports triton.
    """
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _pool_kernel(
    weight_ptr,  # the flat weight
    weight_start,  # the group's first element in it
    values_ptr,  # the batch's IDs, key-major, table-local
    per_sample_weights_ptr,  # one float per ID, or None
    offsets_ptr,  # the batch's bag offsets over every key (lengths' prefix sum)
    local_start_ptr,  # per key: its table's first row in the group
    is_mean_ptr,  # per key
    out_ptr,  # [batch, n_keys * DIM]
    ids_ptr,  # out: one group-local row per ID of the group
    positions_ptr,  # out: the sample-major bag of each ID
    divisor_ptr,  # out (HAS_MEAN): the divisor of each ID's bag
    batch,
    first_key,
    n_keys,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_MEAN: tl.constexpr,
):
    """One program per bag of the group (key-major): the pooled row and its IDs' lookup record."""
    bag = tl.program_id(0).to(tl.int64)
    key = bag // batch
    sample = bag - key * batch
    first_bag = first_key * batch
    group_start = tl.load(offsets_ptr + first_bag)
    start = tl.load(offsets_ptr + first_bag + bag)
    end = tl.load(offsets_ptr + first_bag + bag + 1)
    local_start = tl.load(local_start_ptr + first_key + key)
    position = sample * n_keys + key
    columns = tl.arange(0, BLOCK_D)
    in_row = columns < DIM
    if HAS_MEAN:
        is_mean = tl.load(is_mean_ptr + first_key + key)
        divisor = tl.where(is_mean, tl.maximum(end - start, 1), 1).to(tl.float32)
    pooled = tl.zeros([BLOCK_D], dtype=tl.float32)
    # One ID after another in bag order, as the CPU's embedding_bag sums them.
    for i in range(start, end):
        row = tl.load(values_ptr + i) + local_start
        tl.store(ids_ptr + i - group_start, row)
        tl.store(positions_ptr + i - group_start, position)
        if HAS_MEAN:
            tl.store(divisor_ptr + i - group_start, divisor)
        vector = tl.load(weight_ptr + weight_start + row * DIM + columns, mask=in_row, other=0.0)
        if HAS_WEIGHTS:
            vector = vector * tl.load(per_sample_weights_ptr + i)
        pooled += vector
    if HAS_MEAN:
        pooled = tl.div_rn(pooled, divisor)
    tl.store(out_ptr + sample * n_keys * DIM + key * DIM + columns, pooled, mask=in_row)


def _row_kernel(
    rows_ptr,  # unique, sorted group-local rows
    row_starts_ptr,  # row r's occurrences are sorted occurrences row_starts[r] .. [r + 1]
    bags_ptr,  # per sorted occurrence: its row of bag_grads
    scale_ptr,  # per sorted occurrence: its factor, or None for 1
    bag_grads_ptr,
    bag_grads_stride0,
    bag_grads_stride1,
    row_grads_ptr,  # [n_rows, DIM]: written if REDUCE and not UPDATE, read if not REDUCE
    weight_ptr,  # the flat weight
    weight_start,  # the group's first element in it
    sum_squares_ptr,  # the flat row-wise Adagrad state, or None
    first_row,  # the group's first row in it
    lr,
    weight_decay,
    eps,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    REDUCE: tl.constexpr,
    UPDATE: tl.constexpr,
    ADAGRAD: tl.constexpr,
):
    """One program per unique row: sum its gradients in sorted order and/or apply the optimizer."""
    r = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK_D)
    in_row = columns < DIM
    if REDUCE:
        grad = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in range(tl.load(row_starts_ptr + r), tl.load(row_starts_ptr + r + 1)):
            bag = tl.load(bags_ptr + i)
            addresses = bag_grads_ptr + bag * bag_grads_stride0 + columns * bag_grads_stride1
            bag_grad = tl.load(addresses, mask=in_row, other=0.0)
            if HAS_SCALE:
                bag_grad = tl.load(scale_ptr + i) * bag_grad
            grad += bag_grad
    else:
        grad = tl.load(row_grads_ptr + r * DIM + columns, mask=in_row, other=0.0)
    if UPDATE:
        row = tl.load(rows_ptr + r)
        weight_addresses = weight_ptr + weight_start + row * DIM + columns
        weight = tl.load(weight_addresses, mask=in_row, other=0.0)
        grad = grad + weight_decay * weight
        if ADAGRAD:
            squares = tl.div_rn(tl.sum(grad * grad, axis=0), DIM)
            state = tl.load(sum_squares_ptr + first_row + row) + squares
            tl.store(sum_squares_ptr + first_row + row, state)
            grad = tl.div_rn(grad, tl.sqrt_rn(state) + eps)
        tl.store(weight_addresses, weight - lr * grad, mask=in_row)
    else:
        tl.store(row_grads_ptr + r * DIM + columns, grad, mask=in_row)


@functools.cache
def _kernels() -> SimpleNamespace:
    """The kernels, compiled by ``triton.jit`` on first use.

    triton is imported here, not at the top, and bound as this module's global ``tl``
    because the kernels resolve ``tl`` in the module's globals when they are compiled.
    To run them on CPU tensors, set TRITON_INTERPRET=1 before triton is first imported.
    """
    global tl
    import triton
    import triton.language as tl

    return SimpleNamespace(pool=triton.jit(_pool_kernel), row=triton.jit(_row_kernel))


def _block(dim: int) -> int:
    return 1 << (dim - 1).bit_length()


def lookup_jagged(
    weight: torch.Tensor,
    group: TableGroup,
    kjt: KeyedJaggedTensor,
    local_start: torch.Tensor,
    is_mean: torch.Tensor,
) -> tuple[torch.Tensor, GroupLookup]:
    """The pooled rows ``[B, n_keys * dim]`` (sample-major) of one group, and its lookup record.

    The same result as ``TableBatchedEmbeddingBag._lookup_jagged(group, kjt)``: ``weight``,
    ``local_start`` and ``is_mean`` are that module's ``weight``, ``_local_start`` and
    ``_is_mean``. The IDs must already be checked to lie in their tables, as ``forward``
    does. One kernel pools every bag and writes the record's ``ids``, ``positions`` and
    ``divisor``; the only host sync is the group's ID count, which sizes the record.
    """
    batch = kjt.stride
    n_keys = group.end_key - group.first_key
    device = weight.device
    offsets = torch.zeros(kjt.lengths.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(kjt.lengths, 0, dtype=torch.int64, out=offsets[1:])
    first, last = offsets[[group.first_key * batch, group.end_key * batch]].tolist()
    pooled = torch.empty(batch, n_keys * group.dim, dtype=weight.dtype, device=device)
    ids = torch.empty(last - first, dtype=torch.int64, device=device)
    positions = torch.empty_like(ids)
    divisor = torch.empty(ids.shape, dtype=weight.dtype, device=device) if group.has_mean else None
    if batch:
        _kernels().pool[(n_keys * batch,)](
            weight_ptr=weight,
            weight_start=group.first_element,
            values_ptr=kjt.values,
            per_sample_weights_ptr=kjt.weights,
            offsets_ptr=offsets,
            local_start_ptr=local_start,
            is_mean_ptr=is_mean,
            out_ptr=pooled,
            ids_ptr=ids,
            positions_ptr=positions,
            divisor_ptr=divisor,
            batch=batch,
            first_key=group.first_key,
            n_keys=n_keys,
            DIM=group.dim,
            BLOCK_D=_block(group.dim),
            HAS_WEIGHTS=kjt.weights is not None,
            HAS_MEAN=group.has_mean,
        )
    weights = None if kjt.weights is None else kjt.weights[first:last]
    return pooled, GroupLookup(ids, positions, divisor, weights)


def _reduction_args(
    ids: torch.Tensor,
    bag_grads: torch.Tensor,
    bags: torch.Tensor | None,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, object]]:
    """The unique sorted rows of ``ids``, and the row kernel's arguments to reduce onto them.

    A stable sort keeps each row's occurrences in input order, the order the CPU sums them
    in; the kernel then reads each row's occurrences as one contiguous CSR range.
    """
    sorted_ids, order = torch.sort(ids, stable=True)
    rows, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    row_starts = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=row_starts[1:])
    sorted_scale = None if scale is None else scale.index_select(0, order).float()
    return rows, {
        "row_starts_ptr": row_starts,
        "bags_ptr": order if bags is None else bags.index_select(0, order),
        "scale_ptr": sorted_scale,
        "bag_grads_ptr": bag_grads,
        "bag_grads_stride0": bag_grads.stride(0),
        "bag_grads_stride1": bag_grads.stride(1),
        "HAS_SCALE": sorted_scale is not None,
        "REDUCE": True,
    }


def _update_args(
    weight: torch.Tensor,
    sum_squares: torch.Tensor | None,
    group: TableGroup,
    optimizer: EmbeddingOptimizer,
    lr: float,
) -> dict[str, object]:
    """The row kernel's arguments to apply ``optimizer`` to the group's rows."""
    if optimizer.fused_rule is None:
        raise TypeError(
            f"the Triton TBE kernels implement SGD and RowWiseAdagrad, not {optimizer!r}"
        )
    adagrad = optimizer.fused_rule == "rowwise_adagrad"
    if adagrad and sum_squares is None:
        raise ValueError("RowWiseAdagrad needs its sum_squares state")
    return {
        "weight_ptr": weight,
        "weight_start": group.first_element,
        "sum_squares_ptr": sum_squares if adagrad else None,
        "first_row": group.first_row,
        "lr": float(lr),
        "weight_decay": float(optimizer.weight_decay),
        "eps": float(getattr(optimizer, "eps", 0.0)) if adagrad else 0.0,
        "ADAGRAD": adagrad,
        "UPDATE": True,
    }


_READ_ROW_GRADS = {
    "row_starts_ptr": None,
    "bags_ptr": None,
    "scale_ptr": None,
    "bag_grads_ptr": None,
    "bag_grads_stride0": 0,
    "bag_grads_stride1": 0,
    "HAS_SCALE": False,
    "REDUCE": False,
}
_WRITE_ROW_GRADS = {
    "weight_ptr": None,
    "weight_start": 0,
    "sum_squares_ptr": None,
    "first_row": 0,
    "lr": 0.0,
    "weight_decay": 0.0,
    "eps": 0.0,
    "ADAGRAD": False,
    "UPDATE": False,
}


def _run_row_kernel(
    rows: torch.Tensor,
    dim: int,
    reduction: dict[str, object],
    update: dict[str, object],
    row_grads: torch.Tensor | None = None,
) -> None:
    if rows.numel():
        _kernels().row[(rows.numel(),)](
            rows_ptr=rows,
            row_grads_ptr=row_grads,
            DIM=dim,
            BLOCK_D=_block(dim),
            **reduction,
            **update,
        )


def reduce_by_row(
    ids: torch.Tensor,
    bag_grads: torch.Tensor,
    bags: torch.Tensor | None,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique sorted ``ids`` and each one's gradient, as ``tbe._reduce_by_row`` returns them.

    Row ``r``'s gradient is the sum, over its occurrences in input order, of
    ``scale[i] * bag_grads[bags[i]]`` (``bags`` None: occurrence ``i`` is bag ``i``; ``scale``
    None: 1). For a gradient hook between reduction and update; without one,
    ``reduce_and_update`` does both without writing the gradients out.
    """
    rows, reduction = _reduction_args(ids, bag_grads, bags, scale)
    dim = bag_grads.shape[1]
    row_grads = torch.empty(rows.numel(), dim, dtype=torch.float32, device=ids.device)
    _run_row_kernel(rows, dim, reduction, _WRITE_ROW_GRADS, row_grads)
    return rows, row_grads


def update_rows(
    weight: torch.Tensor,
    sum_squares: torch.Tensor | None,
    group: TableGroup,
    rows: torch.Tensor,
    grads: torch.Tensor,
    optimizer: EmbeddingOptimizer,
    lr: float,
) -> None:
    """One optimizer step on the unique group-local ``rows``, as ``TBE._update`` takes one.

    ``weight`` and ``sum_squares`` (RowWiseAdagrad's per-row state, else None) are the
    module's flat buffers, updated in place; ``grads`` is ``[len(rows), group.dim]``.
    """
    update = _update_args(weight, sum_squares, group, optimizer, lr)
    _run_row_kernel(rows, group.dim, _READ_ROW_GRADS, update, grads.float().contiguous())


def reduce_and_update(
    weight: torch.Tensor,
    sum_squares: torch.Tensor | None,
    group: TableGroup,
    ids: torch.Tensor,
    bag_grads: torch.Tensor,
    bags: torch.Tensor | None,
    scale: torch.Tensor | None,
    optimizer: EmbeddingOptimizer,
    lr: float,
) -> None:
    """``update_rows(..., *reduce_by_row(ids, bag_grads, bags, scale), ...)`` in one kernel.

    Each row's gradient stays in registers between its reduction and its update, so the
    backward writes nothing but the touched rows of ``weight`` and ``sum_squares``.
    """
    update = _update_args(weight, sum_squares, group, optimizer, lr)
    rows, reduction = _reduction_args(ids, bag_grads, bags, scale)
    _run_row_kernel(rows, group.dim, reduction, update)
