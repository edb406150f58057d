"""``kernels="fbgemm"``: FBGEMM's table-batched embedding training the bag's own tensors.

FBGEMM's CPU build (fbgemm-gpu-cpu, installed for the TorchRec comparison) runs here; its
CUDA build takes the same path with the slots on the device. Each case trains the same
bag under FBGEMM and under the compiled kernels on the same batches, with the learning
rate changing every step, and compares every tensor of the two ``state_dict``s. FBGEMM
sums a row's gradients in its own order, so they agree to float rounding: at most 1.2e-7
apart after 30 steps on weights that training moved by 0.4-1.1 (measured); a wrong row, a
wrong scale or a missed update moves a weight by a whole step (~1e-2 here and more).
"""

from __future__ import annotations

import pytest
import torch

from dlrmflow.features.spec import SparseFeature
from dlrmflow.kernels import backends, fbgemm_tbe
from dlrmflow.kernels.backends import KernelUnavailable, check_kernels
from dlrmflow.kernels.optimizers import SGD, Adam, RowWiseAdagrad
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.kernels.tiered import _WorkingSet
from dlrmflow.sparse import KeyedJaggedTensor

pytestmark = pytest.mark.skipif(
    fbgemm_tbe.refusal("cpu") is not None,
    reason=f"FBGEMM's CPU kernels do not run here: {fbgemm_tbe.refusal('cpu')}",
)

# Two dims (two groups in our layout, one FBGEMM module), a mean-pooled table.
TABLES = [
    SparseFeature("a", 50, 8),
    SparseFeature("b", 30, 8, "mean"),
    SparseFeature("c", 20, 4),
]
STEPS = 30
# Largest difference between the backends' tensors, as a share of how far training moved
# them: measured at most 1.6e-7 (weights and Adagrad's sums alike).
AGREE = 2e-6


def _jagged(g: torch.Generator, batch: int, tables=TABLES, weighted: bool = False):
    lengths = torch.randint(0, 4, (len(tables) * batch,), generator=g).int()
    values = [
        torch.randint(
            0, t.num_embeddings, (int(lengths[k * batch : (k + 1) * batch].sum()),), generator=g
        )
        for k, t in enumerate(tables)
    ]
    ids = torch.cat(values)
    weights = torch.rand(ids.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor([t.name for t in tables], ids, lengths, weights)


def _one_hot(g: torch.Generator, batch: int, tables=TABLES):
    # -1: an empty bag, as the transform writes a missing value.
    rows = torch.stack(
        [torch.randint(-1, t.num_embeddings, (batch,), generator=g) for t in tables], 1
    )
    return KeyedJaggedTensor.from_one_hot([t.name for t in tables], rows)


def _train(kernels: str, optimizer, batches, tables=TABLES, start=None) -> TableBatchedEmbeddingBag:
    bag = TableBatchedEmbeddingBag(tables, optimizer, seed=3, kernels=kernels)
    if start is not None:
        bag.load_state_dict(start)
    for i, kjt in enumerate(batches):
        bag.set_learning_rate(optimizer.lr * (1 - i / (2 * len(batches))))
        out = bag(kjt)
        (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
    return bag


def _assert_agree(got: TableBatchedEmbeddingBag, want: TableBatchedEmbeddingBag, initial) -> None:
    got_state, want_state = got.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    for key, value in want_state.items():
        assert got_state[key].shape == value.shape and got_state[key].dtype == value.dtype
        moved = float((value - initial[key]).abs().max())
        apart = float((got_state[key] - value).abs().max())
        assert moved > 1e-3, f"{key}: training did not move it"
        assert apart <= AGREE * moved, f"{key}: {apart:.2e} apart, moved {moved:.2e}"


@pytest.mark.parametrize("optimizer", [RowWiseAdagrad(lr=0.1), SGD(lr=0.1)], ids=["adagrad", "sgd"])
@pytest.mark.parametrize("form", ["jagged", "one_hot", "weighted"])
def test_fbgemm_trains_as_the_compiled_kernels(optimizer, form: str, monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    tables = (
        [SparseFeature(t.name, t.num_embeddings, t.embedding_dim) for t in TABLES]
        if form == "weighted"
        else TABLES
    )
    if form == "one_hot":
        batches = [_one_hot(g, 16) for _ in range(STEPS)]
    else:
        batches = [_jagged(g, 16, tables, weighted=form == "weighted") for _ in range(STEPS)]
    initial = TableBatchedEmbeddingBag(tables, optimizer, seed=3).state_dict()
    calls = []
    real = fbgemm_tbe.FbgemmTables.lookup
    monkeypatch.setattr(
        fbgemm_tbe.FbgemmTables,
        "lookup",
        lambda self, *a, **k: calls.append(1) or real(self, *a, **k),
    )
    fbgemm = _train("fbgemm", optimizer, batches, tables)
    assert fbgemm.backend == "fbgemm" and len(calls) == STEPS
    _assert_agree(fbgemm, _train("compiled", optimizer, batches, tables), initial)


def test_a_state_continues_across_backends_in_both_directions() -> None:
    """The same tensors, the same layout: a state trained under one backend continues
    under the other as it continues under its own (also when a load replaces buffers)."""
    g = torch.Generator().manual_seed(1)
    first = [_jagged(g, 16) for _ in range(10)]
    then = [_jagged(g, 16) for _ in range(10)]
    opt = RowWiseAdagrad(lr=0.1)
    for a, b in (("compiled", "fbgemm"), ("fbgemm", "compiled")):
        start = {k: v.clone() for k, v in _train(a, opt, first).state_dict().items()}
        crossed = TableBatchedEmbeddingBag(TABLES, opt, seed=9, kernels=b)
        crossed.load_state_dict(
            {k: v.clone() for k, v in start.items()}, assign=True
        )  # new buffers: FBGEMM must follow them
        for kjt in then:
            crossed(kjt).sum().backward()
        own = TableBatchedEmbeddingBag(TABLES, opt, seed=9, kernels=a)
        own.load_state_dict(start)
        for kjt in then:
            own(kjt).sum().backward()
        _assert_agree(crossed, own, start)


def test_evaluation_reads_without_updating() -> None:
    g = torch.Generator().manual_seed(2)
    kjt = _jagged(g, 8)
    bag = _train("fbgemm", RowWiseAdagrad(lr=0.1), [_jagged(g, 8)])
    reference = TableBatchedEmbeddingBag(TABLES, RowWiseAdagrad(lr=0.1), kernels="compiled")
    reference.load_state_dict(bag.state_dict())
    before = bag.state_dict()
    bag.eval()
    out = bag(kjt)  # autograd on, but not training: no update may follow
    out.sum().backward() if out.requires_grad else None
    with torch.no_grad():
        bag.train()
        out_no_grad = bag(kjt)
    for key, value in bag.state_dict().items():
        assert torch.equal(value, before[key]), key
    reference.eval()
    torch.testing.assert_close(out, reference(kjt), rtol=0, atol=1e-6)
    torch.testing.assert_close(out_no_grad, out, rtol=0, atol=0)


def test_an_id_outside_its_table_is_named() -> None:
    bag = TableBatchedEmbeddingBag(TABLES, SGD(lr=0.1), kernels="fbgemm")
    rows = torch.tensor([[1, 2, 3], [4, 30, 5]])
    with pytest.raises(IndexError, match="feature 'b': ID 30 of sample 1"):
        bag(KeyedJaggedTensor.from_one_hot(["a", "b", "c"], rows))


def test_bags_fbgemm_cannot_update_run_auto_kernels_and_say_why() -> None:
    """Adam, weight decay, the sharded trainer's hooks and the disk tier's working set
    need a step between reduction and update, or an update FBGEMM does differently."""
    cases = {
        "Adam": TableBatchedEmbeddingBag(TABLES, Adam(lr=0.1), kernels="fbgemm"),
        "weight decay": TableBatchedEmbeddingBag(
            TABLES, SGD(lr=0.1, weight_decay=0.1), kernels="fbgemm"
        ),
        "across ranks": TableBatchedEmbeddingBag(TABLES, SGD(lr=0.1), kernels="fbgemm"),
        "extends the update": _WorkingSet(TABLES, SGD(lr=0.1), kernels="fbgemm"),
    }
    cases["across ranks"].gradient_hook = lambda g, rows, grads: (rows, grads)
    for reason, bag in cases.items():
        assert bag.backend == "compiled", reason
        assert reason in (bag.fbgemm_refusal() or ""), bag.fbgemm_refusal()
        g = torch.Generator().manual_seed(3)
        bag(_jagged(g, 4)).sum().backward()  # and they train


def test_auto_keeps_the_compiled_kernels_on_the_cpu() -> None:
    weight = torch.zeros(1)
    assert backends.choice("auto", weight)[0] == "compiled"
    assert backends.interaction("fbgemm", weight) == "torch"
    check_kernels("fbgemm", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: FBGEMM may run on it")
def test_fbgemm_on_cuda_needs_its_cuda_build() -> None:
    why = fbgemm_tbe.refusal("cuda")
    assert why is not None and "cpu build" in why
    with pytest.raises(
        KernelUnavailable, match="model.kernels=fbgemm cannot run on cuda: fbgemm_gpu"
    ):
        check_kernels("fbgemm", torch.device("cuda", 0))


def test_a_missing_fbgemm_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "fbgemm_gpu", None)
    fbgemm_tbe.refusal.cache_clear()
    try:
        assert fbgemm_tbe.refusal("cpu") == "fbgemm_gpu is not installed"
        with pytest.raises(
            KernelUnavailable, match="cannot run on cpu: fbgemm_gpu is not installed"
        ):
            check_kernels("fbgemm", torch.device("cpu"))
        bag = TableBatchedEmbeddingBag(TABLES, SGD(lr=0.1), kernels="fbgemm")
        assert bag.backend == "compiled"
    finally:
        fbgemm_tbe.refusal.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["jagged", "one_hot"])
def test_fbgemm_on_cuda_trains_as_the_compiled_kernels_on_the_cpu(form: str) -> None:
    """Where fbgemm_gpu's CUDA build runs (``make gpu-check``): the bag on cuda:0 under
    FBGEMM against the same bag on the CPU, moved back after every step's update."""
    why = fbgemm_tbe.refusal("cuda")
    if why is not None:
        pytest.skip(f"FBGEMM's CUDA kernels do not run here: {why}")
    g = torch.Generator().manual_seed(5)
    make = _one_hot if form == "one_hot" else _jagged
    batches = [make(g, 64) for _ in range(STEPS)]
    optimizer = RowWiseAdagrad(lr=0.1)
    initial = TableBatchedEmbeddingBag(TABLES, optimizer, seed=3).state_dict()
    gpu = TableBatchedEmbeddingBag(TABLES, optimizer, seed=3, kernels="fbgemm").to("cuda")
    for i, kjt in enumerate(batches):
        gpu.set_learning_rate(optimizer.lr * (1 - i / (2 * len(batches))))
        out = gpu(kjt.to("cuda"))
        (out * torch.linspace(-1, 1, out.shape[1], device="cuda")).sum().backward()
    assert gpu.backend == "fbgemm"
    _assert_agree(gpu.cpu(), _train("compiled", optimizer, batches), initial)
