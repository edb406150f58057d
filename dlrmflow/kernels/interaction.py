"""DLRM's dot interaction as one autograd op with a hand-written backward (torch ops).

The output matches ``dlrmflow.train.model.dlrm.DotInteraction``: ``[dense, tri(V V^T)]`` where
``V = [dense, pooled_1, ..., pooled_F]`` and ``tri`` is the strict lower triangle of each
sample's Gram matrix in ``torch.tril_indices(F + 1, F + 1, offset=-1)`` order.

Why not let autograd differentiate ``gram[:, rows, cols]``: the backward of advanced
indexing is an accumulating ``index_put_`` into a zero ``[B, F+1, F+1]`` tensor, serial
and slow on CPU, followed by two bmms (one per side of ``V V^T``). Here backward is one
gather (every entry of the symmetric gradient is a copy of one output gradient, so no
accumulation is needed and the result is deterministic) and one bmm.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from dlrmflow.kernels import backends, cpu_tbe

__all__ = ["dot_interaction"]


@lru_cache(maxsize=64)
def _indices(n_vectors: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions of the strict lower triangle, and where each Gram entry's gradient lives.

    The second tensor maps every flat position ``i * n + j`` of an ``n x n`` matrix to the
    triangle column that holds ``V_i . V_j`` (the same column for ``(i, j)`` and ``(j, i)``).
    Diagonal entries are not in the output; they point at column ``-1`` (an arbitrary valid
    column once the dense width is added) and the backward zeroes them afterwards.
    """
    rows, cols = torch.tril_indices(n_vectors, n_vectors, offset=-1)
    lower = rows * n_vectors + cols
    upper = cols * n_vectors + rows
    triangle = torch.arange(lower.numel())
    source = torch.full((n_vectors * n_vectors,), -1, dtype=torch.int64)
    source[lower] = triangle
    source[upper] = triangle
    return lower.to(device), source.to(device)


@lru_cache(maxsize=8)
def _rows_of(columns: torch.Tensor, batch: int) -> torch.Tensor:
    """``columns`` repeated for every sample, contiguous: ``gather``'s index. On 16-bit
    tensors ``index_select`` along dim 1 takes a slow path that a ``gather`` with this
    index avoids (float32: both the same)."""
    return columns.expand(batch, -1).contiguous()


def _compiled(x: torch.Tensor) -> bool:
    """Whether ``cpu_tbe.select_columns`` takes ``x``'s column copies (CPU, contiguous)."""
    return x.device.type == "cpu" and x.is_contiguous() and x.element_size() in (2, 4)


def _columns(x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``x[:, columns]``: the same copy by whichever op is fast for ``x``'s dtype and
    device."""
    if _compiled(x):
        return cpu_tbe.select_columns(x, columns)
    if x.element_size() == 2:
        return torch.gather(x, 1, _rows_of(columns, x.shape[0]))
    return x.index_select(1, columns)


@lru_cache(maxsize=8)
def _shifted(source: torch.Tensor, dim: int, keep_diagonal: bool) -> torch.Tensor:
    """The backward's gather columns: past the dense pass-through's ``dim`` columns; the
    diagonal's -1 kept (the compiled copy writes zeros there) or shifted too (a column to
    zero afterwards)."""
    if keep_diagonal:
        return torch.where(source >= 0, source + dim, source)
    return source + dim


class _DotInteraction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        batch, n_vectors = pooled.shape[0], pooled.shape[1] + 1
        vectors = torch.cat([dense.unsqueeze(1), pooled], dim=1)
        gram = torch.bmm(vectors, vectors.transpose(1, 2)).view(batch, n_vectors * n_vectors)
        lower, _ = _indices(n_vectors, vectors.device)
        # Only the vectors are kept: the Gram matrix itself is not needed for the gradient.
        ctx.save_for_backward(vectors)
        return torch.cat([dense, _columns(gram, lower)], dim=1)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (vectors,) = ctx.saved_tensors
        batch, n_vectors, dim = vectors.shape
        _, source = _indices(n_vectors, vectors.device)
        # d out_t / d V_i = g_t V_j and d out_t / d V_j = g_t V_i for t = (i, j), so the
        # gradient of V is S V with S the symmetric matrix holding g_t at (i, j) and (j, i).
        # The diagonal holds zeros: the compiled copy writes them for its -1 columns; torch's
        # ops copy the last dense column there (-1 + dim), zeroed afterwards, which is
        # cheaper than padding the gradient with a zero column to point them at.
        compiled = _compiled(grad_out)
        columns = _shifted(source, dim, compiled)
        sym = _columns(grad_out, columns).view(batch, n_vectors, n_vectors)
        if not compiled:
            sym.diagonal(dim1=1, dim2=2).zero_()
        # Two bmms over row slices of S rather than one sliced afterwards: the pooled gradient
        # comes out contiguous (no copy downstream) and the dense pass-through is fused in.
        grad_pooled = torch.bmm(sym[:, 1:], vectors)
        grad_dense = torch.baddbmm(grad_out[:, None, :dim], sym[:, :1], vectors)
        return grad_dense.squeeze(1), grad_pooled


def dot_interaction(
    dense: torch.Tensor, pooled: torch.Tensor, kernels: str = "auto"
) -> torch.Tensor:
    """``[dense, strict lower triangle of V V^T]`` for ``V = [dense, pooled]``, per sample.

    Args:
        dense: ``[B, d]`` output of the bottom MLP.
        pooled: ``[B, F, d]`` pooled embeddings, one per sparse feature.

    Returns:
        ``[B, d + (F + 1) * F / 2]``, laid out as ``DotInteraction``
        in ``dlrmflow.train.model.dlrm``
        (pairs ``(i, j)`` with ``i > j`` in ``torch.tril_indices`` order, index 0 being dense).
        Differentiable once with respect to both inputs.

    ``kernels`` (``dlrmflow.kernels.backends``): "triton" runs the Triton kernels (CUDA, or
    CPU tensors under the interpreter), "auto" does so for CUDA tensors when triton is
    installed; otherwise the torch op of this module runs (the CPU has no compiled one).
    """
    if dense.dim() != 2 or pooled.dim() != 3:
        raise ValueError(
            f"dot_interaction expects dense [B, d] and pooled [B, F, d], "
            f"got {tuple(dense.shape)} and {tuple(pooled.shape)}"
        )
    if dense.shape[0] != pooled.shape[0] or dense.shape[1] != pooled.shape[2]:
        raise ValueError(
            f"dot_interaction: dense {tuple(dense.shape)} and pooled {tuple(pooled.shape)} "
            "disagree on batch size or vector dim"
        )
    if dense.shape[1] == 0:
        raise ValueError("dot_interaction: vector dim d must be positive")
    if dense.dtype != pooled.dtype or dense.device != pooled.device:
        raise ValueError(
            f"dot_interaction: dense is {dense.dtype} on {dense.device}, "
            f"pooled is {pooled.dtype} on {pooled.device}; they must match"
        )
    if backends.interaction(kernels, dense) == "triton":
        from dlrmflow.kernels import triton_interaction

        return triton_interaction.dot_interaction(dense, pooled)
    return _DotInteraction.apply(dense, pooled)
