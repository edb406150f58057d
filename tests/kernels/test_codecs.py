"""Communication codecs: wire sizes, documented error bounds, rounding, edge rows."""

from __future__ import annotations

import pytest
import torch

from dlrmflow.kernels.codecs import CODEC_NAMES, Encoded, get_codec

LOSSY = ("fp16", "bf16", "fp8", "int8")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FP16_OVERFLOW = 65520.0  # the smallest magnitude that rounds to inf in fp16


def _data(kind: str, rows: int = 96, dim: int = 48) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, kind)))

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    if kind == "normal":
        return normal(rows, dim)
    if kind == "heavy_tailed":  # Cauchy: a ratio of normals
        return normal(rows, dim) / normal(rows, dim)
    if kind == "with_zeros":
        x = normal(rows, dim) * (torch.rand(rows, dim, generator=gen) < 0.5)
        x[::7] = 0.0
        return x
    if kind == "constant_rows":
        return normal(rows, 1).expand(rows, dim).contiguous()
    if kind == "mixed_magnitudes":  # each row scaled by 10^k, k in [-30, 30]
        exponents = torch.randint(-30, 31, (rows, 1), generator=gen).double()
        return (normal(rows, dim).double() * 10.0**exponents).float()
    if kind == "large":
        return normal(rows, dim) * 1e4
    if kind == "tiny":
        return normal(rows, dim) * 1e-30
    if kind == "negative_offset":
        return -normal(rows, dim).abs() - 1000.0
    raise AssertionError(kind)


KINDS = (
    "normal",
    "heavy_tailed",
    "with_zeros",
    "constant_rows",
    "mixed_magnitudes",
    "large",
    "tiny",
    "negative_offset",
)


def _bound(name: str, x: torch.Tensor) -> torch.Tensor:
    """The documented per-element bound on |decode(encode(x)) - x|, in float64."""
    ax = x.double().abs()
    if name == "fp32":
        return torch.zeros_like(ax)
    if name == "fp16":
        return torch.clamp(ax * 2.0**-11, min=2.0**-25)
    if name == "bf16":
        return torch.clamp(ax * 2.0**-8, min=2.0**-134)
    if name == "fp8":
        row_max = ax.amax(dim=1, keepdim=True)
        return torch.maximum(ax * 2.0**-4, row_max * 2.0**-10 / 448) + row_max * 2.0**-20
    if name == "int8":
        lo, hi = x.double().aminmax(dim=1, keepdim=True)
        return (hi - lo) / 510 + torch.maximum(lo.abs(), hi.abs()) * 2.0**-20
    raise AssertionError(name)


def _roundtrip(name: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(name)
    return codec.decode(codec.encode(x))


def test_get_codec_knows_every_name_and_rejects_others() -> None:
    assert CODEC_NAMES == ("fp32", "fp16", "bf16", "fp8", "int8")
    assert [get_codec(n).name for n in CODEC_NAMES] == list(CODEC_NAMES)
    with pytest.raises(ValueError, match="'fp4'.*fp32, fp16, bf16, fp8, int8"):
        get_codec("fp4")


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("rows, dim", [(5, 7), (1, 3), (64, 64), (0, 64), (3, 0), (0, 0)])
def test_wire_format_and_row_nbytes(name: str, rows: int, dim: int) -> None:
    codec = get_codec(name)
    x = torch.randn(rows, dim)
    enc = codec.encode(x)
    per_row = {"fp32": 4 * dim, "fp16": 2 * dim, "bf16": 2 * dim, "fp8": dim + 4, "int8": dim + 8}
    assert enc.data.dtype == torch.uint8 and enc.data.is_contiguous()
    assert tuple(enc.data.shape) == (rows, per_row[name])
    assert enc.dim == dim and enc.rows == rows
    assert enc.nbytes == rows * codec.row_nbytes(dim) == rows * per_row[name]
    out = codec.decode(enc)
    assert out.dtype == torch.float32 and tuple(out.shape) == (rows, dim)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_error_within_documented_bound(name: str, kind: str, device: str) -> None:
    x = _data(kind).to(device)
    out = _roundtrip(name, x).cpu()
    x = x.cpu()
    if name == "fp16":  # overflow is documented, not bounded: check it, bound the rest
        over = x.abs() >= FP16_OVERFLOW
        assert torch.equal(out[over], torch.copysign(torch.tensor(torch.inf), x[over]))
        x, out = x[~over], out[~over]
        x, out = x.unsqueeze(0), out.unsqueeze(0)
    err = (out.double() - x.double()).abs()
    bound = _bound(name, x)
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"{name}/{kind}: x={x.flatten()[worst].item()!r} decoded "
        f"{out.flatten()[worst].item()!r}, bound {bound.flatten()[worst].item()!r}"
    )


@pytest.mark.parametrize("name", LOSSY)
def test_bounds_are_tight_on_normal_data(name: str) -> None:
    # The bounds are worst cases, not loose guesses: random data comes close to them.
    x = _data("normal", rows=256, dim=64)
    err = (_roundtrip(name, x).double() - x.double()).abs()
    assert (err / _bound(name, x)).max() > 0.75


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "name, values, expected",
    [
        # fp16: ulp at 1 is 2^-10; ties go to the even significand; 65520 overflows.
        (
            "fp16",
            [1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-11 + 2**-20, 65519.0, 65520.0, -7e4],
            [1.0, 1 + 2**-9, 1 + 2**-10, 65504.0, torch.inf, -torch.inf],
        ),
        # bf16: ulp at 1 is 2^-7.
        ("bf16", [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20], [1.0, 1 + 2**-6, 1 + 2**-7]),
        # fp8: the row max is 448, so the scale is exactly 1 and these are e4m3fn's own
        # roundings: ulp 2^-3 at 1, 1 at 8, 32 at 256, subnormal step 2^-9.
        (
            "fp8",
            [448.0, 1.0625, 1.1875, 1.0625 + 2**-10, 12.5, -13.5, 272.0, 304.0, 2**-10, 3 * 2**-10],
            [448.0, 1.0, 1.25, 1.125, 12.0, -14.0, 256.0, 320.0, 0.0, 2**-8],
        ),
        # int8: min 0 and max 255 give scale 1 and bias 0: levels are torch.round's.
        (
            "int8",
            [0.0, 255.0, 0.5, 1.5, 2.5, 3.25, 3.75, 254.5],
            [0.0, 255.0, 0.0, 2.0, 2.0, 3.0, 4.0, 254.0],
        ),
        # int8 with a negative bias: levels are counted from the row min.
        ("int8", [-10.0, 245.0, -9.5, -8.5, -7.5], [-10.0, 245.0, -10.0, -8.0, -8.0]),
    ],
)
def test_round_to_nearest_ties_to_even(
    name: str, values: list[float], expected: list[float], device: str
) -> None:
    x = torch.tensor([values], device=device)
    assert _roundtrip(name, x).cpu().tolist() == [expected]


def test_row_wise_metadata_on_the_wire() -> None:
    x = torch.tensor([[-3.0, 1.0, 2.0], [0.0, 0.0, 0.0], [4.0, 4.0, 4.0]])
    fp8 = get_codec("fp8").encode(x).data
    scales = fp8[:, 3:].clone().view(torch.float32).flatten()
    assert torch.equal(scales, torch.tensor([3.0, 0.0, 4.0]) / 448)
    int8 = get_codec("int8").encode(x).data
    scale_bias = int8[:, 3:].clone().view(torch.float32).tolist()
    assert scale_bias == [[pytest.approx(5 / 255), -3.0], [0.0, 0.0], [0.0, 4.0]]
    assert int8[:, :3].tolist() == [[0, 204, 255], [0, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_decode_matches_torch_cast_on_every_code(device: str) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scale = torch.tensor([1.0, 3.0, 2.0**-120]).view(torch.uint8).view(3, 4)
    data = torch.cat([codes.expand(3, 256), scale], dim=1).to(device)
    out = get_codec("fp8").decode(Encoded(data, 256)).cpu()
    expected = codes.view(torch.float8_e4m3fn).float() * torch.tensor([[1.0], [3.0], [2.0**-120]])
    numbers = ~expected.isnan()  # codes 0x7F and 0xFF, never encoded in a finite row
    assert numbers.sum() == 3 * 254
    assert torch.equal(out[numbers], expected[numbers])
    assert torch.equal(out[numbers].signbit(), expected[numbers].signbit())


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_zero_and_constant_rows(name: str) -> None:
    x = torch.zeros(4, 16)
    x[1] = -2.5
    x[3] = 1e-20
    out = _roundtrip(name, x)
    assert torch.equal(out[0], x[0]) and torch.equal(out[2], x[2])
    assert torch.isfinite(out).all()
    if name in ("fp32", "int8"):  # a constant row is its bias: exact
        assert torch.equal(out, x)


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_subnormal_scales_stay_inside_the_row(name: str) -> None:
    # Scale = 1.4 * 2^-149 rounds down to 2^-149: unclamped, the row max would need level
    # 357 (int8, wrapping around in uint8) or 627 (fp8, past e4m3fn's 448).
    step = 2.0**-149
    top = 357 * step if name == "int8" else 627 * step
    x = torch.tensor([[0.0, top / 2, top], [0.0, -top / 2, -top]])
    out = _roundtrip(name, x)
    assert torch.isfinite(out).all()
    assert (out[0] >= 0).all() and (out[0] <= top).all() and (out[0, 1:] > 0).all()
    assert (out[1] <= 0).all() and (out[1] >= -top).all()
    # Quantization keeps the order of the values (a wrapped level would break it).
    assert (out[0].diff() >= 0).all() and (out[1].diff() <= 0).all()


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_rows_are_independent_so_the_all_to_all_can_split_them(name: str) -> None:
    codec = get_codec(name)
    x = _data("heavy_tailed", rows=10, dim=12)
    enc = codec.encode(x)
    assert torch.equal(enc.data, torch.cat([codec.encode(x[:3]).data, codec.encode(x[3:]).data]))
    received = enc.data[3:7].clone()  # what a peer gets: a fresh buffer of whole rows
    assert torch.equal(codec.decode(Encoded(received, 12)), codec.decode(enc)[3:7])


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_deterministic_and_stride_independent(name: str) -> None:
    codec = get_codec(name)
    x = _data("mixed_magnitudes", rows=32, dim=40)
    first, second = codec.encode(x), codec.encode(x.clone())
    assert torch.equal(first.data, second.data)
    assert torch.equal(codec.decode(first), codec.decode(second))
    strided = x[:, ::2]
    assert torch.equal(codec.encode(strided).data, codec.encode(strided.contiguous()).data)


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_row_wise_codecs_turn_non_finite_rows_into_nan(name: str) -> None:
    x = torch.randn(4, 8)
    x[1, 3] = torch.inf
    x[2, 0] = torch.nan
    x[3, :2] = torch.tensor([-3e38, 3e38])  # finite, but int8's range overflows float32
    out = _roundtrip(name, x)
    assert torch.isnan(out[1:3]).all()
    assert torch.isnan(out[3]).all() == (name == "int8")
    finite = [0, 3] if name == "fp8" else [0]
    err = (out[finite].double() - x[finite].double()).abs()
    assert (err <= _bound(name, x[finite])).all()


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16"])
def test_casts_carry_non_finite_values(name: str) -> None:
    x = torch.tensor([[torch.inf, -torch.inf, torch.nan, 1.0]])
    out = _roundtrip(name, x)
    assert out[0, :2].tolist() == [torch.inf, -torch.inf]
    assert torch.isnan(out[0, 2]) and out[0, 3] == 1.0


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_bad_input_is_rejected(name: str) -> None:
    codec = get_codec(name)
    for bad in (torch.ones(3, 4, dtype=torch.float64), torch.ones(4), torch.ones(2, 2, 2)):
        with pytest.raises(ValueError, match=f"{name}: encode expects a float32"):
            codec.encode(bad)
    enc = codec.encode(torch.ones(3, 4))
    with pytest.raises(ValueError, match=f"{name}: decode expects uint8"):
        codec.decode(Encoded(enc.data, 5))
    with pytest.raises(ValueError, match=f"{name}: decode expects uint8"):
        codec.decode(Encoded(enc.data.float(), 4))
