import pytest
import torch

from dlrmflow.bench.kernels import unfused_interaction
from dlrmflow.kernels import cpu_tbe, interaction
from dlrmflow.kernels.interaction import dot_interaction


def _output_dim(n_vectors: int, dim: int) -> int:
    return dim + n_vectors * (n_vectors - 1) // 2


def _inputs(
    batch: int, n_sparse: int, dim: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, dim, generator=gen, dtype=torch.float64).to(dtype)
    pooled = torch.randn(batch, n_sparse, dim, generator=gen, dtype=torch.float64).to(dtype)
    return dense.requires_grad_(), pooled.requires_grad_()


def _forward_backward(fn, dense, pooled, grad_out):
    """Output and input gradients of ``fn`` for one upstream gradient, on fresh leaves."""
    dense = dense.detach().clone().requires_grad_()
    pooled = pooled.detach().clone().requires_grad_()
    out = fn(dense, pooled)
    out.backward(grad_out)
    return out.detach(), dense.grad, pooled.grad


def test_output_is_dense_then_lower_triangle_of_pairwise_dots():
    # v0 = dense = (1, 0), v1 = (0, 1), v2 = (2, 3): pairs (1,0), (2,0), (2,1).
    dense = torch.tensor([[1.0, 0.0]])
    pooled = torch.tensor([[[0.0, 1.0], [2.0, 3.0]]])
    assert dot_interaction(dense, pooled).tolist() == [[1.0, 0.0, 0.0, 2.0, 3.0]]


@pytest.mark.parametrize(
    ("batch", "n_sparse", "dim"),
    [(5, 1, 1), (1, 2, 3), (7, 26, 16), (3, 30, 128), (4, 0, 8), (2, 13, 64)],
)
def test_matches_reference_forward_and_gradients_in_float32(batch, n_sparse, dim):
    dense, pooled = _inputs(batch, n_sparse, dim)
    reference = unfused_interaction
    grad_out = torch.randn(batch, _output_dim(n_sparse + 1, dim))
    expected = _forward_backward(reference, dense, pooled, grad_out)
    actual = _forward_backward(dot_interaction, dense, pooled, grad_out)
    for got, want in zip(actual, expected, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_empty_batch_gives_empty_output_and_gradients():
    dense, pooled = _inputs(0, 26, 16)
    out, grad_dense, grad_pooled = _forward_backward(
        dot_interaction, dense, pooled, torch.zeros(0, _output_dim(27, 16))
    )
    assert out.shape == (0, 16 + 27 * 26 // 2)
    assert grad_dense.shape == (0, 16)
    assert grad_pooled.shape == (0, 26, 16)


@pytest.mark.parametrize(("batch", "n_sparse", "dim"), [(3, 4, 5), (1, 1, 1), (2, 0, 3)])
def test_hand_written_backward_passes_gradcheck(batch, n_sparse, dim):
    dense, pooled = _inputs(batch, n_sparse, dim, dtype=torch.float64)
    assert torch.autograd.gradcheck(dot_interaction, (dense, pooled))


def test_pooled_may_be_a_transposed_view_as_the_embedding_bags_return_it():
    # Key-major pooling hands the interaction a [B, F, d] view of an [F, B, d] tensor.
    key_major = torch.randn(5, 6, 8)
    dense = torch.randn(6, 8)
    grad_out = torch.randn(6, _output_dim(6, 8))
    results = []
    for fn in (unfused_interaction, dot_interaction):
        leaf = key_major.clone().requires_grad_()
        fn(dense, leaf.transpose(0, 1)).backward(grad_out)
        results.append((fn(dense, leaf.transpose(0, 1)).detach(), leaf.grad))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_bfloat16_stays_close_to_float32_reference():
    dense, pooled = _inputs(16, 26, 16, dtype=torch.bfloat16)
    grad_out = torch.randn(16, _output_dim(27, 16), dtype=torch.bfloat16)
    expected = _forward_backward(
        unfused_interaction, dense.float(), pooled.float(), grad_out.float()
    )
    actual = _forward_backward(dot_interaction, dense, pooled, grad_out)
    for got, want in zip(actual, expected, strict=True):
        assert got.dtype == torch.bfloat16
        # bfloat16 keeps 8 mantissa bits; sums over 16-27 terms lose a few more.
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-1)


def test_two_runs_are_bitwise_identical():
    dense, pooled = _inputs(64, 26, 16, seed=3)
    grad_out = torch.randn(64, _output_dim(27, 16))
    first = _forward_backward(dot_interaction, dense, pooled, grad_out)
    second = _forward_backward(dot_interaction, dense, pooled, grad_out)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("dense", "pooled", "message"),
    [
        (torch.zeros(4, 8), torch.zeros(4, 8), r"pooled \[B, F, d\]"),
        (torch.zeros(4, 8), torch.zeros(3, 2, 8), "batch size or vector dim"),
        (torch.zeros(4, 8), torch.zeros(4, 2, 7), "batch size or vector dim"),
        (torch.zeros(4, 0), torch.zeros(4, 2, 0), "must be positive"),
        (torch.zeros(4, 8), torch.zeros(4, 2, 8, dtype=torch.float64), "must match"),
    ],
)
def test_mismatched_inputs_are_rejected_with_their_shapes(dense, pooled, message):
    with pytest.raises(ValueError, match=message):
        dot_interaction(dense, pooled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_column_copies_are_torchs_bitwise(dtype, threads, monkeypatch):
    """``cpu_tbe.select_columns`` (split over threads from 1M elements) against torch's
    column copies, a negative column giving zeros; and the interaction through it against
    the interaction through torch's ops, forward and backward."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _compare_column_copies(dtype, monkeypatch)
    finally:
        torch.set_num_threads(before)


def _compare_column_copies(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(1500, 729).to(dtype)
    columns = torch.randint(0, 729, (900,))
    columns[::7] = -1
    got = cpu_tbe.select_columns(x, columns)
    want = x.index_select(1, columns.clamp(min=0)).masked_fill(columns < 0, 0)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(cpu_tbe.select_columns(x, columns[:0]), x[:, :0])

    dense, pooled = _inputs(2048, 26, 16, seed=5, dtype=dtype)
    grad_out = torch.randn(2048, _output_dim(27, 16)).to(dtype)
    compiled = _forward_backward(dot_interaction, dense, pooled, grad_out)
    monkeypatch.setattr(interaction, "_compiled", lambda x: False)
    torch_ops = _forward_backward(dot_interaction, dense, pooled, grad_out)
    for a, b in zip(compiled, torch_ops, strict=True):
        assert torch.equal(a, b)
