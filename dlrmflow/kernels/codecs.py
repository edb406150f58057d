"""Quantization codecs for the embedding all-to-all: fp32, fp16, bf16, fp8 and int8 row-wise.

The sharded trainer sends pooled embeddings ``[rows, dim]`` float32 forward and their
gradients backward. A codec turns such a tensor into bytes (``encode``), and the bytes
back into float32 (``decode``), with ``row_nbytes`` giving the exact wire size of a row so
the trainer can count bytes sent per step.

Wire format: ``Encoded.data`` is one contiguous uint8 tensor ``[rows, row_nbytes(dim)]``
whose row ``i`` holds the payload of input row ``i`` followed by that row's scale (and
bias). Packed rather than payload and scales as two tensors because the all-to-all splits
by rows (``all_to_all_single`` with per-rank row counts): each row then travels with its
own metadata, in one collective instead of two. Scales are float32 in native byte order
(every supported platform is little-endian).

Rounding is round-to-nearest, ties-to-even, everywhere: torch's float casts do that, and
``torch.round`` rounds halves to even. Error bounds, for each element ``x`` of a row and
its decoded value ``x'`` (all derived in the codec docstrings and tested):

========  ==========  ======================================================================
codec     bytes/row   bound on ``|x' - x|``
========  ==========  ======================================================================
fp32      4 dim       0 (identity)
fp16      2 dim       ``max(2^-11 |x|, 2^-25)`` for ``|x| < 65520``; beyond that +-inf
bf16      2 dim       ``max(2^-8 |x|, 2^-134)`` for ``|x| < 2^128 (1 - 2^-9)``; beyond +-inf
fp8       dim + 4     ``max(2^-4 |x|, 2^-10 m / 448) + 2^-20 m``, ``m`` = row max of ``|x|``
int8      dim + 8     ``(hi - lo) / 510 + 2^-20 max(|lo|, |hi|)``, row min ``lo``, max ``hi``
========  ==========  ======================================================================

So fp16 and bf16 keep a relative error per element; the row-wise codecs keep an absolute
error relative to the row's magnitude, and values much smaller than the row's largest lose
most or all of their digits. fp16 turns values beyond 65504 into inf and flushes those
below 2^-25 to zero (small gradients can be that small); bf16 trades precision for fp32's
range.

Non-finite values: fp32, fp16 and bf16 carry inf and NaN through. The row-wise codecs
cannot scale a row holding inf or NaN (or whose range overflows float32); such a row gets
a NaN scale and decodes to all NaN, so the failure shows in the loss instead of passing as
plausible numbers. Checking for it eagerly would cost a device sync per call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max  # 448
_FP8_TO_FP16_BITS = 0xBF80 - 0x10000  # sign bit 15 and bits 13..7, as an int16
_UINT8_LEVELS = 255


@dataclass(frozen=True)
class Encoded:
    """A ``[rows, dim]`` float32 tensor in a codec's wire format.

    ``data`` is uint8 ``[rows, row_nbytes(dim)]``, contiguous, ready for
    ``all_to_all_single``. The receiver rebuilds an ``Encoded`` around the bytes it got and
    the ``dim`` it knows, since ``dim`` cannot be recovered from the row width alone for
    every codec.
    """

    data: torch.Tensor
    dim: int

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class Codec(ABC):
    """Encodes float32 ``[rows, dim]`` tensors row by row into uint8 rows of fixed width."""

    name: str

    @abstractmethod
    def row_nbytes(self, dim: int) -> int:
        """Bytes on the wire for one row of ``dim`` values, scales and biases included."""

    @abstractmethod
    def _encode(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _decode(self, data: torch.Tensor, dim: int) -> torch.Tensor: ...

    def encode(self, x: torch.Tensor) -> Encoded:
        """``x`` (float32 ``[rows, dim]``, any device and strides) in this codec's format."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.float32:
            got = (
                f"{x.dtype} tensor of shape {tuple(x.shape)}"
                if isinstance(x, torch.Tensor)
                else type(x).__name__
            )
            raise ValueError(f"{self.name}: encode expects a float32 [rows, dim] tensor, got {got}")
        return Encoded(self._encode(x), x.shape[1])

    def decode(self, enc: Encoded) -> torch.Tensor:
        """The float32 ``[rows, dim]`` tensor that ``enc`` stands for, on ``enc``'s device."""
        data, expected = enc.data, self.row_nbytes(enc.dim)
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != expected:
            raise ValueError(
                f"{self.name}: decode expects uint8 [rows, {expected}] for dim {enc.dim}, "
                f"got {data.dtype} of shape {tuple(data.shape)}"
            )
        return self._decode(data.contiguous(), enc.dim)


@dataclass(frozen=True)
class CastCodec(Codec):
    """A plain cast to a narrower float type (``float32`` itself is the identity codec).

    The cast rounds to nearest, ties to even: one rounding at the target's precision,
    decoding is exact. With ``p`` bits of significand (fp16: 11, bf16: 8) the error is at
    most half a unit in the last place, ``2^-p |x|`` for normal values, and half the
    smallest subnormal below the normal range (fp16: ``2^-25``, bf16: ``2^-134``).
    Values rounding above the largest finite value become +-inf (fp16: ``|x| >= 65520``;
    bf16 shares fp32's exponent range so only ``|x| >= 2^128 (1 - 2^-9)`` overflows).
    The identity codec (fp32) returns views: no copy when ``x`` is contiguous.
    """

    name: str
    dtype: torch.dtype

    def row_nbytes(self, dim: int) -> int:
        return dim * self.dtype.itemsize

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype).contiguous().view(torch.uint8)

    def _decode(self, data: torch.Tensor, dim: int) -> torch.Tensor:
        return data.view(self.dtype).to(torch.float32)


def _row_min_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (min, max) as ``[rows, 1]``; zeros for ``dim == 0``, which amin refuses.

    Two reductions rather than ``torch.aminmax``: on the CPU that one pass is slower.
    """
    if x.shape[1] == 0:
        zeros = x.new_zeros((x.shape[0], 1))
        return zeros, zeros
    return x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)


def _as_bytes(values: torch.Tensor) -> torch.Tensor:
    """float32 ``[rows, k]`` as its uint8 ``[rows, 4 k]`` (flattened first: reductions over
    zero rows come back with strides that ``view(torch.uint8)`` rejects)."""
    rows, k = values.shape
    return values.flatten().view(torch.uint8).view(rows, 4 * k)


def _floats(raw: torch.Tensor) -> torch.Tensor:
    """uint8 ``[rows, 4 k]`` as float32 ``[rows, k]``; copied so that the float32 view
    starts 4-byte aligned (the bytes sit after ``dim`` payload bytes in each row)."""
    return raw.clone(memory_format=torch.contiguous_format).view(torch.float32)


@dataclass(frozen=True)
class Fp8RowwiseCodec(Codec):
    """fp8 e4m3fn values with one float32 scale per row: ``x' = q * s``, ``s = m / 448``.

    ``m`` is the row's largest ``|x|``, so it maps onto e4m3fn's largest finite value and
    the row uses the format's whole range. e4m3fn has 4 significand bits: in a binade
    ``[2^e, 2^(e+1))`` (``e >= -6``) the spacing is ``2^(e-3)``, so rounding ``y = x / s``
    errs by at most ``2^-4 |y|``; below ``2^-6`` the spacing is the subnormal step
    ``2^-9``, an error of at most ``2^-10``. Scaled back, per element::

        |x' - x| <= max(2^-4 |x|, 2^-10 m / 448) + 2^-20 m      (never above m / 15)

    where the last term covers the float32 roundings of ``m / 448``, ``x / s`` and
    ``q * s`` (each ``2^-24`` relative). Elements with ``|x| <= m / 458752`` decode to
    zero. The bound holds while ``s`` is a normal float32 (``m >= 2^-116``). An all-zero
    row gets ``s = 0`` and decodes to zeros.

    ``x / s`` is clamped to +-448 before the cast: float32 rounding can put the row max a
    hair above 448, and a scale below the normal range far above it. torch 2.13's
    vectorized CPU cast saturates such values, but c10's scalar conversion (also used by
    GPU kernels) maps ``|y| >= 480`` to NaN; the clamp makes both paths agree.
    """

    name: str = "fp8"

    def row_nbytes(self, dim: int) -> int:
        return dim + 4

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        rows, dim = x.shape
        lo, hi = _row_min_max(x)
        row_max = torch.maximum(-lo, hi)
        scale = torch.where(row_max.isfinite(), row_max / _FP8_MAX, torch.nan)
        divisor = torch.where(scale > 0, scale, 1.0)  # zero rows: 0 / 1, not 0 / 0
        wire = torch.empty((rows, dim + 4), dtype=torch.uint8, device=x.device)
        wire[:, :dim].view(_FP8).copy_((x / divisor).clamp_(-_FP8_MAX, _FP8_MAX))
        wire[:, dim:] = _as_bytes(scale)
        return wire

    def _decode(self, data: torch.Tensor, dim: int) -> torch.Tensor:
        scale = _floats(data[:, dim:])
        # torch's fp8 -> fp32 cast is a scalar loop on the CPU; these integer ops are
        # faster and give the same bits. e4m3fn's fields s.eeee.mmm moved into fp16's
        # (sign bit 15, exponent and mantissa bits 13..7) make q / 256, exactly, normal or
        # subnormal, and the 256 folds exactly into the scale. NaN codes come out finite,
        # but only rows with a NaN scale hold them.
        half = data[:, :dim].view(torch.int8).to(torch.int16)  # sign copied into 8..15
        half <<= 7
        half &= _FP8_TO_FP16_BITS
        return half.view(torch.float16).to(torch.float32).mul_(scale * 256)


@dataclass(frozen=True)
class Int8RowwiseCodec(Codec):
    """uint8 levels with a float32 scale and bias per row: ``x' = q * s + lo``.

    Min/max affine quantization: ``lo``/``hi`` are the row's min and max,
    ``s = (hi - lo) / 255`` and ``q = round((x - lo) / s)`` in ``0..255``, rounded half to
    even by ``torch.round``. Rounding errs by at most half a level, ``s / 2``; the float32
    roundings of ``hi - lo``, ``s``, ``x - lo``, the division, ``q * s`` and ``+ lo`` add
    at most ``2^-20 max(|lo|, |hi|)``. Per element::

        |x' - x| <= (hi - lo) / 510 + 2^-20 max(|lo|, |hi|)

    The bound holds while ``s`` is a normal float32 (``hi - lo >= 2^-118``); ``q`` is
    clamped to ``0..255`` so narrower ranges cannot wrap around. A constant row
    (including an all-zero one) gets ``s = 0`` and decodes exactly to ``lo``.
    """

    name: str = "int8"

    def row_nbytes(self, dim: int) -> int:
        return dim + 8

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        rows, dim = x.shape
        lo, hi = _row_min_max(x)
        span = hi - lo
        # A NaN scale decodes the row to NaN whatever its levels: casting NaN to uint8
        # gives no defined level, and inf * level would decode 0 * inf = NaN, others inf.
        scale = torch.where(span.isfinite(), span / _UINT8_LEVELS, torch.nan)
        divisor = torch.where(scale > 0, scale, 1.0)  # constant rows: 0 / 1, not 0 / 0
        levels = (x - lo).div_(divisor).round_().clamp_(0, _UINT8_LEVELS)
        wire = torch.empty((rows, dim + 8), dtype=torch.uint8, device=x.device)
        wire[:, :dim] = levels
        wire[:, dim:] = _as_bytes(torch.cat([scale, lo], dim=1))
        return wire

    def _decode(self, data: torch.Tensor, dim: int) -> torch.Tensor:
        scale, bias = _floats(data[:, dim:]).split(1, dim=1)
        return data[:, :dim].to(torch.float32).mul_(scale).add_(bias)


_CODECS: dict[str, Codec] = {
    codec.name: codec
    for codec in (
        CastCodec("fp32", torch.float32),
        CastCodec("fp16", torch.float16),
        CastCodec("bf16", torch.bfloat16),
        Fp8RowwiseCodec(),
        Int8RowwiseCodec(),
    )
}
CODEC_NAMES: tuple[str, ...] = tuple(_CODECS)


def get_codec(name: str) -> Codec:
    """The codec called ``name`` (one of ``CODEC_NAMES``)."""
    try:
        return _CODECS[name]
    except KeyError:
        raise ValueError(
            f"unknown codec {name!r}; valid codecs: {', '.join(CODEC_NAMES)}"
        ) from None
