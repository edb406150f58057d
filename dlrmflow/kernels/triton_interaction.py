"""DLRM's dot interaction as Triton GPU kernels, forward and hand-written backward.

The CUDA twin of ``dlrmflow.kernels.interaction.dot_interaction``: the same output,
``[dense, strict lower triangle of V V^T]`` with ``V = [dense, pooled_1, ..., pooled_F]``,
pairs in ``torch.tril_indices`` order. One program per sample keeps that sample's
``(F + 1) x d`` vectors in registers: forward is one ``V V^T`` whose lower triangle is
stored straight into the output (no Gram matrix in memory, no ``cat`` of the inputs), and
backward builds the symmetric matrix ``S`` of output gradients from the output gradient
row and computes ``S V``, as the CPU op does, without atomics: bitwise repeatable.

The products are IEEE float32 (``input_precision="ieee"``), not TF32, so that results stay
within float32 rounding of the CPU op. float16 and bfloat16 inputs are computed in float32
too and the results rounded back to their dtype.

Importing this module never imports triton (see ``dlrmflow.kernels.triton_tbe``).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from dlrmflow.kernels.triton_tbe import available

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["available", "dot_interaction"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Bound to the compiled ``_load_vectors`` by ``_kernels``, which the kernels call.
_vectors = None

# tl.dot takes no side under 16.
_MIN_BLOCK = 16


def _load_vectors(
    dense_ptr,
    dense_stride0,
    dense_stride1,
    pooled_ptr,
    pooled_stride0,
    pooled_stride1,
    pooled_stride2,
    sample,
    i,
    c,
    N_VECTORS: tl.constexpr,
    DIM: tl.constexpr,
):
    """Sample ``sample``'s dense row and its ``V = [dense, pooled]`` in float32, zero-padded
    to the block (row ``i`` of ``V``, column ``c``): what both kernels start from."""
    dense = tl.load(
        dense_ptr + sample * dense_stride0 + c * dense_stride1, mask=c < DIM, other=0.0
    ).to(tl.float32)
    pooled = tl.load(
        pooled_ptr
        + sample * pooled_stride0
        + (i[:, None] - 1) * pooled_stride1
        + c[None, :] * pooled_stride2,
        mask=(i[:, None] >= 1) & (i[:, None] < N_VECTORS) & (c[None, :] < DIM),
        other=0.0,
    ).to(tl.float32)
    vectors = tl.where(i[:, None] == 0, dense[None, :], pooled)
    return dense, vectors


def _forward_kernel(
    dense_ptr,
    dense_stride0,
    dense_stride1,
    pooled_ptr,
    pooled_stride0,
    pooled_stride1,
    pooled_stride2,
    out_ptr,
    out_stride0,
    N_VECTORS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    sample = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_D)
    dense, vectors = _vectors(
        dense_ptr,
        dense_stride0,
        dense_stride1,
        pooled_ptr,
        pooled_stride0,
        pooled_stride1,
        pooled_stride2,
        sample,
        i,
        c,
        N_VECTORS,
        DIM,
    )
    gram = tl.dot(vectors, tl.trans(vectors), input_precision="ieee")
    out = out_ptr + sample * out_stride0
    tl.store(out + c, dense, mask=c < DIM)
    # Pair (i, j), i > j, is column i * (i - 1) / 2 + j of the triangle (tril_indices order).
    j = tl.arange(0, BLOCK_N)
    column = DIM + i[:, None] * (i[:, None] - 1) // 2 + j[None, :]
    tl.store(out + column, gram, mask=(i[:, None] > j[None, :]) & (i[:, None] < N_VECTORS))


def _backward_kernel(
    dense_ptr,
    dense_stride0,
    dense_stride1,
    pooled_ptr,
    pooled_stride0,
    pooled_stride1,
    pooled_stride2,
    grad_out_ptr,
    grad_out_stride0,
    grad_out_stride1,
    grad_dense_ptr,  # [B, DIM], contiguous
    grad_pooled_ptr,  # [B, N_VECTORS - 1, DIM], contiguous
    N_VECTORS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    sample = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_D)
    dense, vectors = _vectors(
        dense_ptr,
        dense_stride0,
        dense_stride1,
        pooled_ptr,
        pooled_stride0,
        pooled_stride1,
        pooled_stride2,
        sample,
        i,
        c,
        N_VECTORS,
        DIM,
    )
    # S[i, j] = S[j, i] = the gradient of output pair (max, min); zero on the diagonal.
    j = tl.arange(0, BLOCK_N)
    high = tl.maximum(i[:, None], j[None, :])
    low = tl.minimum(i[:, None], j[None, :])
    grad_row = grad_out_ptr + sample * grad_out_stride0
    sym = tl.load(
        grad_row + (DIM + high * (high - 1) // 2 + low) * grad_out_stride1,
        mask=(i[:, None] != j[None, :]) & (high < N_VECTORS),
        other=0.0,
    ).to(tl.float32)
    # d out_(i,j) / d V_i = g V_j and / d V_j = g V_i: the gradient of V is S V.
    grad_vectors = tl.dot(sym, vectors, input_precision="ieee")
    # Row 0 is dense's, which also passes through to the output's first DIM columns.
    pass_through = tl.load(grad_row + c * grad_out_stride1, mask=c < DIM, other=0.0)
    grad_dense = pass_through.to(tl.float32) + tl.sum(
        tl.where(i[:, None] == 0, grad_vectors, 0.0), axis=0
    )
    tl.store(grad_dense_ptr + sample * DIM + c, grad_dense, mask=c < DIM)
    grad_pooled = grad_pooled_ptr + sample * (N_VECTORS - 1) * DIM
    tl.store(
        grad_pooled + (i[:, None] - 1) * DIM + c[None, :],
        grad_vectors,
        mask=(i[:, None] >= 1) & (i[:, None] < N_VECTORS) & (c[None, :] < DIM),
    )


@functools.cache
def _kernels() -> SimpleNamespace:
    """The kernels, compiled by ``triton.jit`` on first use (see ``triton_tbe._kernels``)."""
    global tl, _vectors
    import triton
    import triton.language as tl

    _vectors = triton.jit(_load_vectors)  # the kernels call it by this global name
    return SimpleNamespace(
        forward=triton.jit(_forward_kernel), backward=triton.jit(_backward_kernel)
    )


def _blocks(n_vectors: int, dim: int) -> dict[str, int]:
    return {
        "N_VECTORS": n_vectors,
        "DIM": dim,
        "BLOCK_N": max(_MIN_BLOCK, 1 << (n_vectors - 1).bit_length()),
        "BLOCK_D": max(_MIN_BLOCK, 1 << (dim - 1).bit_length()),
    }


def _input_args(dense: torch.Tensor, pooled: torch.Tensor) -> dict[str, object]:
    return {
        "dense_ptr": dense,
        "dense_stride0": dense.stride(0),
        "dense_stride1": dense.stride(1),
        "pooled_ptr": pooled,
        "pooled_stride0": pooled.stride(0),
        "pooled_stride1": pooled.stride(1),
        "pooled_stride2": pooled.stride(2),
    }


class _TritonDotInteraction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        batch, n_sparse, dim = pooled.shape
        n_vectors = n_sparse + 1
        out = dense.new_empty(batch, dim + n_vectors * n_sparse // 2)
        if batch:
            _kernels().forward[(batch,)](
                **_input_args(dense, pooled),
                out_ptr=out,
                out_stride0=out.stride(0),
                **_blocks(n_vectors, dim),
            )
        # The inputs, not V: backward reads the vectors from them as forward did.
        ctx.save_for_backward(dense, pooled)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dense, pooled = ctx.saved_tensors
        batch, n_sparse, dim = pooled.shape
        grad_dense = torch.empty(batch, dim, dtype=dense.dtype, device=dense.device)
        grad_pooled = torch.empty(batch, n_sparse, dim, dtype=pooled.dtype, device=pooled.device)
        if batch:
            _kernels().backward[(batch,)](
                **_input_args(dense, pooled),
                grad_out_ptr=grad_out,
                grad_out_stride0=grad_out.stride(0),
                grad_out_stride1=grad_out.stride(1),
                grad_dense_ptr=grad_dense,
                grad_pooled_ptr=grad_pooled,
                **_blocks(n_sparse + 1, dim),
            )
        return grad_dense, grad_pooled


def dot_interaction(dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """``[dense, strict lower triangle of V V^T]`` for ``V = [dense, pooled]``, per sample.

    The same contract as ``dlrmflow.kernels.interaction.dot_interaction`` (``dense``
    ``[B, d]``, ``pooled`` ``[B, F, d]``, output ``[B, d + (F + 1) * F / 2]``, differentiable
    once), on the Triton kernels. float64 is not taken: the kernels compute in float32.
    """
    if (
        dense.dim() != 2
        or pooled.dim() != 3
        or dense.shape[0] != pooled.shape[0]
        or dense.shape[1] != pooled.shape[2]
        or dense.shape[1] == 0
        or dense.dtype != pooled.dtype
        or dense.dtype not in _DTYPES
        or dense.device != pooled.device
    ):
        raise ValueError(
            f"dot_interaction expects dense [B, d] and pooled [B, F, d] with d > 0, on one "
            f"device, both float32, bfloat16 or float16; got {dense.dtype} "
            f"{tuple(dense.shape)} on {dense.device} and {pooled.dtype} "
            f"{tuple(pooled.shape)} on {pooled.device}"
        )
    return _TritonDotInteraction.apply(dense, pooled)
