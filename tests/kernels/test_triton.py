"""The Triton kernels against the CPU TBE and interaction they must match.

Without a GPU the kernels run on CPU tensors under Triton's interpreter, which needs
TRITON_INTERPRET=1 before ``triton.language`` is first imported (its own jit'd helpers such
as ``tl.sum`` are wrapped then). This module sets it at its top, at collection, because a
fixture is too late: any test that steps a ``torch.optim`` optimizer imports triton through
torch._dynamo. Nothing collected before it imports triton (the assertion below says so if
that changes), and no other test runs Triton code, so the variable changes no other test;
a conftest would do the same for a whole folder. With a GPU the variable is left alone and
the same tests compile the kernels and run them on the GPU.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dlrmflow.features.spec import SparseFeature
from dlrmflow.kernels import triton_interaction, triton_tbe
from dlrmflow.kernels.interaction import dot_interaction
from dlrmflow.kernels.optimizers import SGD, Adam, RowWiseAdagrad
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.sparse import KeyedJaggedTensor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    assert "triton" not in sys.modules, "triton was imported before TRITON_INTERPRET was set"
    os.environ["TRITON_INTERPRET"] = "1"
# The dev extra installs triton, so these tests run everywhere the suite does; a missing
# triton fails them loudly rather than skipping.
needs_triton = pytest.mark.usefixtures("triton_installed")
pytestmark = pytest.mark.triton  # make gpu-check runs these on the GPU


@pytest.fixture
def triton_installed() -> None:
    assert importlib.util.find_spec("triton") is not None, "pip install -e '.[dev]' for triton"


# Three weight groups (dims 4, 2, 4), both poolings, tables small enough to repeat IDs.
TABLES = [
    SparseFeature("a", 11, 4),
    SparseFeature("b", 7, 4, "mean"),
    SparseFeature("c", 5, 2),
    SparseFeature("d", 9, 4),
]
SUM_TABLES = [SparseFeature("a", 11, 4), SparseFeature("c", 5, 3), SparseFeature("d", 9, 3)]
BATCH = 6


def _jagged(seed: int, tables=TABLES, weighted=False, empty_key=None) -> KeyedJaggedTensor:
    """A key-major batch with empty bags and duplicate IDs (``empty_key``: no IDs at all)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(tables), BATCH), generator=gen)
    lengths[0, 0] = 0
    if empty_key is not None:
        lengths[empty_key] = 0
    values = torch.cat(
        [
            torch.randint(0, t.num_embeddings, (int(n),), generator=gen)
            for t, n in zip(tables, lengths.sum(1), strict=True)
        ]
    )
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    names = [t.name for t in tables]
    return KeyedJaggedTensor(names, values, lengths.view(-1).to(torch.int32), weights)


def _triton_forward(tbe: TableBatchedEmbeddingBag, weight: torch.Tensor, kjt: KeyedJaggedTensor):
    """What ``TableBatchedEmbeddingBag.forward`` does on CUDA: one Triton lookup per group."""
    parts = [
        triton_tbe.lookup_jagged(
            weight, group, kjt, tbe._local_start.to(DEVICE), tbe._is_mean.to(DEVICE)
        )
        for group in tbe.groups
    ]
    return torch.cat([pooled for pooled, _ in parts], dim=1), [lookup for _, lookup in parts]


def _triton_step(tbe, weight, sum_squares, kjt, grad_out, lr, split=False) -> None:
    """One training step on the Triton kernels, dispatched as ``_apply_gradient`` would."""
    _, lookups = _triton_forward(tbe, weight, kjt)
    for group, lookup in zip(tbe.groups, lookups, strict=True):
        width = (group.end_key - group.first_key) * group.dim
        bag_grads = grad_out[:, group.first_column : group.first_column + width]
        bag_grads = bag_grads.reshape(-1, group.dim)
        scale = None if lookup.divisor is None else lookup.divisor.reciprocal()
        if lookup.weights is not None:
            scale = lookup.weights if scale is None else scale * lookup.weights
        args = (lookup.ids, bag_grads, lookup.positions, scale)
        if split:  # the gradient-hook path: rows and their gradients pass through memory
            rows, grads = triton_tbe.reduce_by_row(*args)
            triton_tbe.update_rows(weight, sum_squares, group, rows, grads, tbe.optimizer, lr)
        else:
            triton_tbe.reduce_and_update(weight, sum_squares, group, *args, tbe.optimizer, lr)


def _grad_out(step: int, width: int) -> torch.Tensor:
    return torch.randn(BATCH, width, generator=torch.Generator().manual_seed(100 + step))


def _train_both(tables, optimizer, lrs, weighted=False, split=False):
    """CPU TBE and Triton kernels trained from the same start on the same batches.

    Returns the CPU module and the Triton side's (weight, sum_squares) moved to the CPU.
    """
    tbe = TableBatchedEmbeddingBag(tables, optimizer, seed=4)
    weight = tbe.weight.clone().to(DEVICE)
    state = tbe.sum_squares.clone().to(DEVICE) if isinstance(optimizer, RowWiseAdagrad) else None
    for step, lr in enumerate(lrs):
        kjt = _jagged(step, tables, weighted)
        grad_out = _grad_out(step, tbe.output_dim)
        _triton_step(tbe, weight, state, kjt.to(DEVICE), grad_out.to(DEVICE), lr, split)
        tbe.set_learning_rate(lr)
        tbe(kjt).backward(grad_out)
    return tbe, weight.cpu(), None if state is None else state.cpu()


def test_import_never_needs_triton_and_cpu_processes_never_import_it():
    script = textwrap.dedent(
        """
        import sys
        import torch
        from dlrmflow.kernels import interaction, tbe, triton_interaction, triton_tbe
        cuda = torch.cuda.is_available()
        assert triton_tbe.available() is triton_interaction.available() is cuda and (
            cuda or "triton" not in sys.modules
        )
        for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
            del sys.modules[name]
        sys.modules["triton"] = None  # what an install without triton finds
        torch.cuda.is_available = lambda: True
        assert not triton_tbe.available()
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr


@needs_triton
def test_available_with_cuda_and_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert triton_tbe.available() and triton_interaction.available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not triton_tbe.available()


@needs_triton
@pytest.mark.parametrize(
    ("tables", "weighted", "empty_key"),
    [(TABLES, False, None), (TABLES, False, 2), (SUM_TABLES, True, None), (SUM_TABLES, True, 0)],
    ids=["sum-and-mean", "empty-table", "weighted", "weighted-empty-table"],
)
def test_lookup_matches_cpu_pooling_and_lookup_record(tables, weighted, empty_key):
    tbe = TableBatchedEmbeddingBag(tables, SGD(lr=0.1), seed=1).eval()
    kjt = _jagged(7, tables, weighted, empty_key)
    pooled, lookups = _triton_forward(tbe, tbe.weight.to(DEVICE), kjt.to(DEVICE))
    expected = tbe(kjt)
    assert pooled.shape == expected.shape == (BATCH, sum(t.embedding_dim for t in tables))
    torch.testing.assert_close(pooled.cpu(), expected, rtol=1e-6, atol=1e-6)
    assert torch.all(pooled[0, : tables[0].embedding_dim] == 0)  # the empty bag
    if empty_key is not None:
        start = sum(t.embedding_dim for t in tables[:empty_key])
        assert torch.all(pooled[:, start : start + tables[empty_key].embedding_dim] == 0)
    # Backward reads the record: it must be the CPU's exactly.
    for group, lookup in zip(tbe.groups, lookups, strict=True):
        cpu = tbe._lookup_jagged(group, kjt)[1]
        for field in ("ids", "positions", "divisor", "weights"):
            got, want = getattr(lookup, field), getattr(cpu, field)
            assert (got is None) == (want is None), field
            assert got is None or torch.equal(got.cpu(), want), field


@needs_triton
def test_lookup_of_a_batch_without_ids():
    tbe = TableBatchedEmbeddingBag(TABLES, SGD(lr=0.1)).eval()
    kjt = KeyedJaggedTensor(
        tbe.names, torch.zeros(0, dtype=torch.int64), torch.zeros(4 * BATCH, dtype=torch.int32)
    )
    pooled, lookups = _triton_forward(tbe, tbe.weight.to(DEVICE), kjt.to(DEVICE))
    assert pooled.shape == (BATCH, 14) and not pooled.any()
    assert all(lookup.ids.numel() == 0 for lookup in lookups)


@needs_triton
@pytest.mark.parametrize(
    ("tables", "optimizer", "weighted"),
    [
        (TABLES, SGD(lr=0.5, weight_decay=0.1), False),
        (TABLES, RowWiseAdagrad(lr=0.3, eps=1e-6, weight_decay=0.05), False),
        (SUM_TABLES, RowWiseAdagrad(lr=0.3, eps=1e-6), True),
    ],
    ids=["sgd", "rowwise-adagrad", "rowwise-adagrad-weighted"],
)
def test_three_steps_match_the_cpu_tbe(tables, optimizer, weighted):
    lrs = [optimizer.lr, optimizer.lr, optimizer.lr / 3]
    initial = TableBatchedEmbeddingBag(tables, optimizer, seed=4).weight
    tbe, weight, state = _train_both(tables, optimizer, lrs, weighted)
    torch.testing.assert_close(weight, tbe.weight, rtol=1e-5, atol=1e-6)
    if state is not None:
        torch.testing.assert_close(state, tbe.sum_squares, rtol=1e-5, atol=1e-7)
        assert state.count_nonzero() == tbe.sum_squares.count_nonzero() > 0
    # Only touched rows move: exactly the rows the CPU TBE moved.
    assert torch.equal(weight != initial, tbe.weight != initial)


@needs_triton
def test_rowwise_adagrad_state_is_exact_when_sums_are_in_the_same_order():
    # Unit scales and dims of 1 and 2: each row gradient is the CPU's sum in the CPU's order,
    # and a mean of one or two squares does not depend on the order of its sum.
    tables = [SparseFeature("x", 5, 1), SparseFeature("y", 4, 2), SparseFeature("z", 3, 1)]
    optimizer = RowWiseAdagrad(lr=0.2)
    tbe, weight, state = _train_both(tables, optimizer, [0.2, 0.2, 0.1])
    assert torch.equal(state, tbe.sum_squares)
    torch.testing.assert_close(weight, tbe.weight, rtol=1e-6, atol=1e-7)


@needs_triton
@pytest.mark.parametrize("optimizer", [SGD(lr=0.4, weight_decay=0.1), RowWiseAdagrad(lr=0.3)])
def test_updates_are_bitwise_repeatable_and_equal_on_the_hook_path(optimizer):
    lrs = [0.3, 0.3, 0.1]
    fused = [_train_both(TABLES, optimizer, lrs)[1:] for _ in range(2)]
    split = _train_both(TABLES, optimizer, lrs, split=True)[1:]
    for a, b in [(fused[0], fused[1]), (fused[0], split)]:
        for x, y in zip(a, b, strict=True):
            assert (x is None and y is None) or torch.equal(x, y)


@needs_triton
def test_reduce_by_row_sums_each_rows_occurrences():
    ids = torch.tensor([3, 1, 3, 0, 3, 1])
    bag_grads = torch.arange(12.0).view(6, 2)  # bag k is (2k, 2k + 1)
    bags = torch.tensor([0, 1, 2, 3, 3, 0])
    scale = torch.tensor([1.0, 2.0, 0.5, 1.0, -1.0, 4.0])
    rows, grads = triton_tbe.reduce_by_row(
        ids.to(DEVICE), bag_grads.to(DEVICE), bags.to(DEVICE), scale.to(DEVICE)
    )
    assert rows.tolist() == [0, 1, 3]
    # row 0: bag 3; row 1: 2 * bag 1 + 4 * bag 0; row 3: bag 0 + 0.5 * bag 2 - bag 3.
    assert grads.tolist() == [[6.0, 7.0], [4.0, 10.0], [-4.0, -3.5]]
    _, unscaled = triton_tbe.reduce_by_row(ids.to(DEVICE), bag_grads.to(DEVICE), None, None)
    assert unscaled.tolist() == [[6.0, 7.0], [12.0, 14.0], [12.0, 15.0]]  # ID i is bag i


@needs_triton
def test_update_rejects_adam_and_adagrad_without_state():
    tbe = TableBatchedEmbeddingBag(TABLES, SGD(lr=0.1))
    rows, grads = torch.tensor([1]), torch.ones(1, 4)
    with pytest.raises(TypeError, match="SGD and RowWiseAdagrad, not Adam"):
        triton_tbe.update_rows(tbe.weight, None, tbe.groups[0], rows, grads, Adam(lr=0.1), 0.1)
    with pytest.raises(ValueError, match="sum_squares"):
        triton_tbe.update_rows(
            tbe.weight, None, tbe.groups[0], rows, grads, RowWiseAdagrad(lr=0.1), 0.1
        )


def _interaction_pass(fn, dense, pooled, grad_out):
    dense = dense.detach().clone().requires_grad_()
    pooled = pooled.detach().clone().requires_grad_()
    out = fn(dense, pooled)
    out.backward(grad_out)
    return out.detach().cpu(), dense.grad.cpu(), pooled.grad.cpu()


@needs_triton
@pytest.mark.parametrize(
    ("batch", "n_sparse", "dim"), [(3, 4, 5), (2, 26, 16), (4, 0, 1), (1, 18, 33), (0, 3, 8)]
)
def test_interaction_matches_the_cpu_op(batch, n_sparse, dim):
    gen = torch.Generator().manual_seed(batch * 100 + n_sparse)
    dense = torch.randn(batch, dim, generator=gen)
    pooled = torch.randn(batch, n_sparse, dim, generator=gen)
    grad_out = torch.randn(batch, dim + (n_sparse + 1) * n_sparse // 2, generator=gen)
    expected = _interaction_pass(dot_interaction, dense, pooled, grad_out)
    on_device = [t.to(DEVICE) for t in (dense, pooled, grad_out)]
    actual = _interaction_pass(triton_interaction.dot_interaction, *on_device)
    for got, want in zip(actual, expected, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    again = _interaction_pass(triton_interaction.dot_interaction, *on_device)
    assert all(torch.equal(a, b) for a, b in zip(actual, again, strict=True))


@needs_triton
def test_interaction_reads_strided_inputs_and_keeps_their_dtype():
    gen = torch.Generator().manual_seed(5)
    # pooled as a transposed view; dense a column slice of a wider tensor.
    pooled = torch.randn(3, 2, 4, generator=gen).transpose(0, 1).to(DEVICE)
    dense = torch.randn(2, 9, generator=gen)[:, :4].to(DEVICE)
    out = triton_interaction.dot_interaction(dense, pooled)
    torch.testing.assert_close(out.cpu(), dot_interaction(dense.cpu(), pooled.cpu()))
    low = triton_interaction.dot_interaction(dense.bfloat16(), pooled.bfloat16())
    assert low.dtype == torch.bfloat16
    expected = dot_interaction(dense.bfloat16().float(), pooled.bfloat16().float()).bfloat16()
    torch.testing.assert_close(low.cpu(), expected.cpu())


def test_interaction_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match=r"pooled \[B, F, d\].*\(2, 3\).*\(2, 4, 5\)"):
        triton_interaction.dot_interaction(torch.zeros(2, 3), torch.zeros(2, 4, 5))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16; got torch.float64"):
        triton_interaction.dot_interaction(
            torch.zeros(2, 3).double(), torch.zeros(2, 4, 3).double()
        )


@needs_triton
def test_lookup_leaves_the_module_untouched():
    tbe = TableBatchedEmbeddingBag(TABLES, SGD(lr=0.1))
    before = copy.deepcopy(tbe.state_dict())
    _triton_forward(tbe, tbe.weight.to(DEVICE), _jagged(3).to(DEVICE))
    assert all(torch.equal(before[k], v) for k, v in tbe.state_dict().items())
