import copy
import multiprocessing

import pytest
import torch
from torch import nn

from dlrmflow.features.spec import SparseFeature
from dlrmflow.kernels import cpu_tbe
from dlrmflow.kernels.optimizers import SGD, Adam, RowWiseAdagrad
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.runtime import gomp
from dlrmflow.sparse import KeyedJaggedTensor
from tests.kernels.batches import random_jagged, random_one_hot

# Different dims (two runs of dim 4 around a dim-2 table, so three weight groups), both
# poolings, and tables small enough that a batch repeats IDs.
TABLES = [
    SparseFeature("a", 11, 4),
    SparseFeature("b", 7, 4, "mean"),
    SparseFeature("c", 5, 2),
    SparseFeature("d", 9, 4),
]
BATCH = 6


def _jagged(seed: int, tables=TABLES, batch=BATCH, max_len=3, weighted=False):
    return random_jagged(seed, tables, batch, max_len, weighted)


def _one_hot(seed: int, tables=TABLES, batch=BATCH):
    return random_one_hot(seed, tables, batch)


def _reference_bags(tbe: TableBatchedEmbeddingBag, sparse: bool) -> nn.ModuleList:
    """One ``nn.EmbeddingBag`` per table holding a copy of the fused module's rows."""
    bags = nn.ModuleList()
    for t in tbe.tables:
        bag = nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling, sparse=sparse)
        with torch.no_grad():
            bag.weight.copy_(tbe.table(t.name))
        bags.append(bag)
    return bags


def _reference_forward(bags: nn.ModuleList, kjt: KeyedJaggedTensor) -> torch.Tensor:
    split = kjt.split_by_key()
    counts = kjt.length_per_key()
    weights = kjt.weights.split(counts) if kjt.weights is not None else [None] * len(counts)
    outs = [
        bag(*split[key], per_sample_weights=w)
        for bag, key, w in zip(bags, kjt.keys, weights, strict=True)
    ]
    return torch.cat(outs, dim=1)


def _touched(kjt: KeyedJaggedTensor, tables=TABLES) -> list[torch.Tensor]:
    """Per table, a mask of the rows the batch looks up."""
    split = kjt.split_by_key()
    masks = []
    for t in tables:
        mask = torch.zeros(t.num_embeddings, dtype=torch.bool)
        mask[split[t.name][0]] = True
        masks.append(mask)
    return masks


def _grad_out(seed: int, tbe: TableBatchedEmbeddingBag, batch=BATCH) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(batch, tbe.output_dim, generator=gen)


def _train_fused(tbe, batches, lrs):
    for step, (kjt, lr) in enumerate(zip(batches, lrs, strict=True)):
        tbe.set_learning_rate(lr)
        tbe(kjt).backward(_grad_out(step, tbe, kjt.stride))


def _train_reference(tbe, bags, optimizer, batches, lrs, lazy=True, step_fn=None):
    """``optimizer`` over ``bags``; when ``lazy``, rows a batch misses are rolled back.

    Rolling back the weight and the state of untouched rows turns torch's dense-state
    optimizers into the touched-rows-only semantics of the fused module.
    """
    for step, (kjt, lr) in enumerate(zip(batches, lrs, strict=True)):
        for group in optimizer.param_groups:
            group["lr"] = lr
        before = [
            (b.weight.detach().clone(), copy.deepcopy(optimizer.state[b.weight])) for b in bags
        ]
        optimizer.zero_grad()
        _reference_forward(bags, kjt).backward(_grad_out(step, tbe, kjt.stride))
        optimizer.step()
        if not lazy:
            continue
        for bag, (weight, state), mask in zip(bags, before, _touched(kjt), strict=True):
            with torch.no_grad():
                bag.weight[~mask] = weight[~mask]
            for name, value in state.items():
                if name != "step":
                    optimizer.state[bag.weight][name][~mask] = value[~mask]


def _assert_tables_close(tbe, bags, **tol):
    for t, bag in zip(tbe.tables, bags, strict=True):
        torch.testing.assert_close(tbe.table(t.name), bag.weight.detach(), **tol)


def test_forward_matches_embedding_bag_per_table():
    tbe = TableBatchedEmbeddingBag(TABLES, SGD(lr=0.1), seed=3)
    bags = _reference_bags(tbe, sparse=False)
    kjt = _jagged(0)
    out = tbe(kjt)
    assert out.shape == (BATCH, 4 + 4 + 2 + 4)
    torch.testing.assert_close(out, _reference_forward(bags, kjt))
    assert torch.all(out[0, :4] == 0)  # the empty bag pools to zero


def test_forward_with_per_sample_weights():
    tables = [SparseFeature("a", 11, 4), SparseFeature("c", 5, 2)]
    tbe = TableBatchedEmbeddingBag(tables, SGD(lr=0.1))
    kjt = _jagged(1, tables=tables, weighted=True)
    torch.testing.assert_close(tbe(kjt), _reference_forward(_reference_bags(tbe, False), kjt))


def test_one_hot_form_equals_jagged_form_bitwise():
    one_hot = _one_hot(2)
    jagged = KeyedJaggedTensor(one_hot.keys, one_hot.values, one_hot.lengths)
    a = TableBatchedEmbeddingBag(TABLES, Adam(lr=0.1, weight_decay=0.01), seed=5)
    b = copy.deepcopy(a)
    initial = a.weight.clone()
    out_a, out_b = a(one_hot), b(jagged)
    assert torch.equal(out_a, out_b)
    grad = _grad_out(0, a)
    out_a.backward(grad)
    out_b.backward(grad)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.momentum2, b.momentum2)
    assert not torch.equal(a.weight, initial)


def test_sgd_matches_torch_sgd_with_lr_change():
    tbe = TableBatchedEmbeddingBag(TABLES, SGD(lr=0.5))
    bags = _reference_bags(tbe, sparse=True)
    initial = tbe.weight.clone()
    batches, lrs = [_jagged(s) for s in range(4)], [0.5, 0.5, 0.1, 0.02]
    _train_fused(tbe, batches, lrs)
    _train_reference(tbe, bags, torch.optim.SGD(bags.parameters(), lr=0.5), batches, lrs)
    _assert_tables_close(tbe, bags)
    assert not torch.equal(tbe.weight, initial)


def test_sgd_weight_decay_touches_only_looked_up_rows():
    tbe = TableBatchedEmbeddingBag(TABLES, SGD(lr=0.5, weight_decay=0.1))
    bags = _reference_bags(tbe, sparse=False)
    batches, lrs = [_jagged(s) for s in range(3)], [0.5, 0.2, 0.2]
    one_step = copy.deepcopy(tbe)
    _train_fused(one_step, batches[:1], lrs[:1])
    missed = ~_touched(batches[0])[0]
    assert missed.any()
    assert torch.equal(one_step.table("a")[missed], tbe.table("a")[missed])
    _train_fused(tbe, batches, lrs)
    optimizer = torch.optim.SGD(bags.parameters(), lr=0.5, weight_decay=0.1)
    _train_reference(tbe, bags, optimizer, batches, lrs)
    _assert_tables_close(tbe, bags)


def test_rowwise_adagrad_matches_hand_written_reference():
    opt = RowWiseAdagrad(lr=0.3, eps=1e-6, weight_decay=0.05)
    tbe = TableBatchedEmbeddingBag(TABLES, opt)
    bags = _reference_bags(tbe, sparse=False)
    batches, lrs = [_jagged(s) for s in range(4)], [0.3, 0.3, 0.1, 0.1]
    _train_fused(tbe, batches, lrs)
    state = [torch.zeros(t.num_embeddings) for t in TABLES]
    for step, (kjt, lr) in enumerate(zip(batches, lrs, strict=True)):
        for bag in bags:
            bag.weight.grad = None
        _reference_forward(bags, kjt).backward(_grad_out(step, tbe))
        with torch.no_grad():
            for bag, s, mask in zip(bags, state, _touched(kjt), strict=True):
                g = bag.weight.grad[mask] + opt.weight_decay * bag.weight[mask]
                s[mask] += g.pow(2).mean(1)
                bag.weight[mask] -= lr * g / (s[mask].sqrt() + opt.eps)[:, None]
    _assert_tables_close(tbe, bags)
    for t, s in zip(TABLES, state, strict=True):
        torch.testing.assert_close(tbe.state(t.name)["sum_squares"], s)


def test_rowwise_adagrad_of_dim_one_is_torch_sparse_adagrad():
    tables = [SparseFeature("a", 13, 1), SparseFeature("b", 4, 1)]
    tbe = TableBatchedEmbeddingBag(tables, RowWiseAdagrad(lr=0.2, eps=1e-10))
    bags = _reference_bags(tbe, sparse=True)
    batches, lrs = [_jagged(s, tables=tables) for s in range(4)], [0.2] * 4
    _train_fused(tbe, batches, lrs)
    optimizer = torch.optim.Adagrad(bags.parameters(), lr=0.2, eps=1e-10)
    _train_reference(tbe, bags, optimizer, batches, lrs, lazy=False)
    _assert_tables_close(tbe, bags)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_lazy_torch_adamw(weight_decay):
    tbe = TableBatchedEmbeddingBag(TABLES, Adam(lr=0.05, weight_decay=weight_decay))
    bags = _reference_bags(tbe, sparse=False)
    batches, lrs = [_jagged(s) for s in range(5)], [0.05, 0.05, 0.05, 0.01, 0.01]
    _train_fused(tbe, batches, lrs)
    optimizer = torch.optim.AdamW(bags.parameters(), lr=0.05, weight_decay=weight_decay)
    _train_reference(tbe, bags, optimizer, batches, lrs)
    _assert_tables_close(tbe, bags)
    assert int(tbe.step) == 5
    for t, bag in zip(TABLES, bags, strict=True):
        torch.testing.assert_close(
            tbe.state(t.name)["momentum2"], optimizer.state[bag.weight]["exp_avg_sq"]
        )


def _train_big(optimizer, threads: int) -> torch.Tensor:
    """A few steps on a batch large enough for torch to split its ops across threads."""
    tables = [SparseFeature(f"t{i}", n, 16) for i, n in enumerate([3000, 500, 50, 7])]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tbe = TableBatchedEmbeddingBag(tables, optimizer, seed=1)
        for step in range(3):
            kjt = _jagged(step, tables=tables, batch=2048, max_len=4)
            tbe(kjt).backward(_grad_out(step, tbe, batch=2048))
            one_hot = _one_hot(step, tables=tables, batch=2048)
            tbe(one_hot).backward(_grad_out(step + 10, tbe, batch=2048))
        return torch.cat([b.flatten().float() for b in tbe.state_dict().values()])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "optimizer",
    [SGD(0.1, weight_decay=0.1), RowWiseAdagrad(lr=0.1), Adam(lr=0.01, weight_decay=0.1)],
)
def test_bitwise_identical_across_runs_and_thread_counts(optimizer):
    one = _train_big(optimizer, threads=1)
    assert torch.equal(one, _train_big(optimizer, threads=1))
    assert torch.equal(one, _train_big(optimizer, threads=2))


def test_eval_and_no_grad_do_not_update():
    tbe = TableBatchedEmbeddingBag(TABLES, SGD(lr=1.0))
    weight = tbe.weight.clone()
    with torch.no_grad():
        assert not tbe(_jagged(0)).requires_grad
    tbe.eval()
    assert not tbe(_jagged(0)).requires_grad
    assert torch.equal(tbe.weight, weight)
    assert not tbe.weight.requires_grad


def test_state_dict_holds_weight_and_optimizer_state():
    tbe = TableBatchedEmbeddingBag(TABLES, Adam(lr=0.1))
    assert set(tbe.state_dict()) == {"weight", "momentum1", "momentum2", "step"}
    assert set(TableBatchedEmbeddingBag(TABLES, RowWiseAdagrad(lr=0.1)).state_dict()) == {
        "weight",
        "sum_squares",
    }


def test_bad_input_names_the_feature():
    tbe = TableBatchedEmbeddingBag(TABLES, SGD(lr=0.1))
    kjt = _jagged(0)
    bad = KeyedJaggedTensor(kjt.keys, kjt.values.clone(), kjt.lengths)
    bad.values[-1] = 9  # table "d" has 9 rows
    with pytest.raises(IndexError, match="'d'"):
        tbe(bad)
    rows = _one_hot(0).one_hot_rows.clone()
    rows[2, 2] = 5  # table "c" has 5 rows
    with pytest.raises(IndexError, match="'c'.*sample 2"):
        tbe(KeyedJaggedTensor.from_one_hot(kjt.keys, rows))
    rows = _one_hot(0).one_hot_rows.clone()
    rows[1, 0] = -2  # only -1 means missing
    with pytest.raises(IndexError, match="'a'.*ID -2 of sample 1"):
        tbe(KeyedJaggedTensor.from_one_hot(kjt.keys, rows))
    with pytest.raises(ValueError, match="keys"):
        tbe(KeyedJaggedTensor(["x"], kjt.values[:0], kjt.lengths[:BATCH] * 0))
    with pytest.raises(ValueError, match="sum pooling"):
        tbe(_jagged(0, weighted=True))
    with pytest.raises(ValueError, match="learning rate"):
        tbe.set_learning_rate(-1.0)
    with pytest.raises(ValueError, match="unique"):
        TableBatchedEmbeddingBag([TABLES[0], TABLES[0]], SGD(lr=0.1))


def _identity_hook(group: int, rows: torch.Tensor, grads: torch.Tensor):
    return rows, grads


@pytest.mark.parametrize(
    "optimizer",
    [SGD(0.3), SGD(0.2, weight_decay=0.1), RowWiseAdagrad(0.3), RowWiseAdagrad(0.2, 1e-6, 0.05)],
)
@pytest.mark.parametrize("form", ["jagged", "weighted", "one_hot"])
def test_compiled_cpu_step_matches_the_torch_ops_path(optimizer, form):
    # A gradient hook (even one that changes nothing) sends the update through the torch
    # ops (sort + CSR product); without one, the CPU runs the compiled step (cpu_tbe).
    tables = TABLES if form != "weighted" else [t for t in TABLES if t.pooling == "sum"]
    compiled = TableBatchedEmbeddingBag(tables, optimizer, seed=4)
    torch_ops = copy.deepcopy(compiled)
    torch_ops.gradient_hook = _identity_hook
    assert compiled._fused_on_cpu() and not torch_ops._fused_on_cpu()
    for step in range(6):
        if form == "one_hot":
            kjt = _one_hot(step, tables)
        else:
            kjt = _jagged(step, tables, weighted=form == "weighted")
        for tbe in (compiled, torch_ops):
            tbe(kjt).backward(_grad_out(step, tbe, kjt.stride))
    torch.testing.assert_close(compiled.weight, torch_ops.weight, rtol=1e-5, atol=1e-6)
    if isinstance(optimizer, RowWiseAdagrad):
        torch.testing.assert_close(compiled.sum_squares, torch_ops.sum_squares)
    # The per-row scratch is back to "no slot" after every step.
    assert compiled._scratch is not None and (compiled._scratch.slot == -1).all()


# Enough keys per group that 3 threads get 3 parts: dims 4, 4, 4, 4 (mean and sum), 2, 2.
MANY_TABLES = [
    SparseFeature("a", 11, 4),
    SparseFeature("b", 7, 4, "mean"),
    SparseFeature("c", 13, 4),
    SparseFeature("d", 9, 4),
    SparseFeature("e", 5, 2),
    SparseFeature("f", 6, 2),
]


@pytest.mark.parametrize("optimizer", [SGD(0.2, weight_decay=0.1), RowWiseAdagrad(0.2, 1e-6, 0.05)])
@pytest.mark.parametrize("form", ["jagged", "one_hot"])
@pytest.mark.parametrize("team", ["omp", "python"])
def test_compiled_step_split_over_threads_is_bitwise_the_same(optimizer, form, team, monkeypatch):
    # However many threads share a step (each takes a run of keys), every row's sum and
    # update is computed alike: the weights are bitwise those of one thread, on torch's
    # OpenMP threads and on the fallback pool of Python threads.
    if team == "python":
        monkeypatch.setattr(gomp, "omp_runner", lambda: None)
    elif gomp.omp_runner() is None:
        pytest.skip("torch here has no GNU OpenMP runtime to share")

    def train(threads: int) -> torch.Tensor:
        monkeypatch.setattr(cpu_tbe, "_threads", lambda elements: threads)
        tbe = TableBatchedEmbeddingBag(MANY_TABLES, optimizer, seed=5)
        for step in range(4):
            if form == "one_hot":
                kjt = _one_hot(step, MANY_TABLES, batch=12)
            else:
                kjt = _jagged(step, MANY_TABLES, batch=12)
            tbe(kjt).backward(_grad_out(step, tbe, kjt.stride))
        assert (tbe._scratch.slot == -1).all()
        return torch.cat([b.flatten().float() for b in tbe.state_dict().values()])

    one = train(1)
    assert torch.equal(one, train(3))
    assert torch.equal(one, train(2))


@pytest.mark.parametrize(
    ("key_counts", "parts"), [([5, 0, 9, 1, 30, 2], 2), ([5, 0, 9, 1, 30, 2], 3), ([1] * 6, 4)]
)
def test_key_major_parts_cover_every_id_once_in_runs_of_keys(key_counts, parts):
    n = sum(key_counts)
    spans = cpu_tbe._spans(n, len(key_counts), key_counts, parts)
    assert len(spans) == parts
    # Consecutive, non-empty runs of keys whose IDs tile [0, n) in order.
    assert [lo for _, _, lo, _ in spans] == [0] + [hi for _, _, _, hi in spans[:-1]]
    assert spans[-1][3] == n
    assert all(first == 0 and end == len(key_counts) for first, end, _, _ in spans)
    if parts == 2:  # the 30 IDs of key 4 cannot be cut: keys 0-3 | 4-5
        assert [hi - lo for _, _, lo, hi in spans] == [15, 32]


def test_sample_major_parts_split_the_keys():
    spans = cpu_tbe._spans(26 * 8, 26, None, 2)
    assert spans == [(0, 13, 0, 208), (13, 26, 0, 208)]
    assert cpu_tbe._spans(208, 26, None, 40)[-1] == (25, 26, 0, 208)  # at most a part per key


def test_a_forked_child_steps_without_torchs_openmp_threads():
    # libgomp's threads do not survive a fork: a parallel region in the child would hang,
    # so the child splits its steps over Python threads instead.
    tbe = TableBatchedEmbeddingBag(MANY_TABLES, SGD(0.1))
    kjt = _one_hot(0, MANY_TABLES, batch=12)

    def step() -> None:
        tbe(kjt).backward(_grad_out(0, tbe, kjt.stride))

    def child() -> None:
        assert gomp.omp_runner() is None
        step()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_tbe, "_threads", lambda elements: 2)
        step()  # the parent's team (if any) has run a region before the fork
        process = multiprocessing.get_context("fork").Process(target=child)
        process.start()
        process.join(timeout=60)
        if process.exitcode is None:
            process.kill()
        assert process.exitcode == 0


def test_out_of_range_jagged_id_is_named_on_the_compiled_path():
    tbe = TableBatchedEmbeddingBag(TABLES, SGD(0.1))
    kjt = _jagged(0)
    values = kjt.values.clone()
    per_key = kjt.length_per_key()
    values[sum(per_key[:2])] = 7  # first ID of table "c", which has 5 rows
    bad = KeyedJaggedTensor(kjt.keys, values, kjt.lengths)
    with pytest.raises(IndexError, match="'c'.*ID 7"):
        tbe(bad)


def test_gather_bf16_is_the_float32_gather_cast_bitwise():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 64, generator=gen) * torch.logspace(-42, 38, 64)
    weight[1, :4] = torch.tensor([float("inf"), -float("inf"), 3.3895e38, 1e-45])
    # Ties to even: low halves of exactly 0x8000 under even and odd high halves, and beside.
    high = torch.arange(0x3F80, 0x3F80 + 64, dtype=torch.int32) << 16
    low = torch.tensor([0x8000, 0x8000, 0x7FFF, 0x8001] * 16, dtype=torch.int32)
    weight[2] = (high | low).view(torch.float32)
    ids = torch.randint(0, 300, (70_000,), generator=gen)  # 4.5M elements: split over threads
    ids[:3] = torch.tensor([1, 2, 2])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = cpu_tbe.gather_bf16(weight, ids)
            assert got.dtype == torch.bfloat16
            expected = weight.index_select(0, ids).to(torch.bfloat16)
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    finally:
        torch.set_num_threads(before)
    weight[3, 7] = float("nan")
    assert cpu_tbe.gather_bf16(weight, torch.tensor([3]))[0, 7].isnan()


@pytest.mark.parametrize("form", ["one-hot", "jagged"])
@pytest.mark.parametrize("optimizer", [SGD(lr=0.3), RowWiseAdagrad(lr=0.3)])
def test_bf16_pooled_rows_train_bitwise_as_the_cast_float32_ones(form, optimizer):
    """Handing on bfloat16 (gathered straight into it, its gradient read by the fused
    step) equals casting the float32 rows and their gradient: the same weights and state
    after every step, the same outputs."""
    direct = TableBatchedEmbeddingBag(TABLES, optimizer, seed=3)
    direct.pooled_dtype = torch.bfloat16
    cast = copy.deepcopy(direct)
    cast.pooled_dtype = torch.float32
    for seed in range(4):
        kjt = _one_hot(seed) if form == "one-hot" else _jagged(seed)
        grad = _grad_out(seed, direct).to(torch.bfloat16)
        got = direct(kjt)
        want = cast(kjt).to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        got.backward(grad)
        want.backward(grad)
        for key, value in cast.state_dict().items():
            assert torch.equal(direct.state_dict()[key], value), key
    assert direct.backend == "compiled"
