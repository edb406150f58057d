"""Kernel benchmark: one TBE training step and the fused interaction against plain torch.

The setup is Criteo-like: 26 tables with Criteo's cardinalities capped (200k rows by
default, so that ours, both baselines and the naive line's element-wise Adagrad state
stay within a few GB at dim 128), Zipf(1.1) IDs scattered over each table by a fixed
permutation (hot IDs are not neighbours in real data either), one-hot batches and
multi-hot ones with 20 IDs per bag. A step is what training does per batch: forward, the
backward of a fixed random output gradient, and the optimizer update.

The baseline is the strongest way to run the same algorithm with torch alone: every table
stacked in one ``nn.EmbeddingBag(mode="sum", sparse=True)`` (one lookup for all features,
its bags in sample-major order so that the pooled output is already ``[batch, tables *
dim]``), and the same optimizer over its sparse gradient: ``torch.optim.SGD``, or
``TorchRowWiseAdagrad`` below for row-wise Adagrad, which torch does not ship (coalesce
the gradient, add each row's mean squared gradient to its one state value, update the
row). A second, labelled "naive user" line is what one writes without thinking of
batching: one ``nn.EmbeddingBag`` per table and ``torch.optim.SGD`` or
``torch.optim.Adagrad``; the latter is element-wise, another algorithm with one state
value per element rather than per row, so that line is context, never the headline ratio.
Both torch sides get their inputs ready-made (stacked or split per table), outside the
timed step; ours reads the ``KeyedJaggedTensor`` as the trainer hands it over. All sides
run in this process with the same torch threads and allocator setting (``runtime.glibc_malloc``,
applied here too), take turns within each repeat after one untimed warm-up round, and
the best time of each counts (``dlrmflow.bench.turns``).

A third line is FBGEMM's table-batched embedding (fbgemm_gpu's
``SplitTableBatchedEmbeddingBagsCodegen``, the kernels TorchRec trains with) with its own
fused SGD or row-wise Adagrad, its key-major inputs made outside the timed step: its CPU
build on the CPU, its CUDA build on a GPU, wherever it runs (``model.kernels: fbgemm``
puts the same kernels on our tensors). Its ratios (its time / ours) are reported beside
the headline ones; the interaction has no FBGEMM counterpart.

With ``device="cuda"`` every side runs on the GPU: ours on the Triton kernels (TBE and
interaction), the baselines on torch's CUDA ops and FBGEMM's CUDA build, each timed step
ending in a device synchronize; the copy bandwidth is then the GPU memory's.

Bandwidth: a step must at least read every looked-up row, then read and write each
touched row and its optimizer state once; those bytes over the step's time, as a share
of what ``copy_`` achieves on this machine, say how far a step is from memory-bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from dlrmflow.bench.machine import describe_machine
from dlrmflow.bench.turns import best_of_turns
from dlrmflow.features.spec import SparseFeature
from dlrmflow.ingest.schema import CRITEO_CARDINALITIES
from dlrmflow.kernels import fbgemm_tbe
from dlrmflow.kernels.backends import besides_fbgemm
from dlrmflow.kernels.fbgemm_tbe import FbgemmTables, fbgemm_inputs
from dlrmflow.kernels.interaction import dot_interaction
from dlrmflow.kernels.optimizers import SGD, RowWiseAdagrad
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.runtime.glibc_malloc import applied_threshold, tune_allocator
from dlrmflow.sparse import KeyedJaggedTensor

POOLING = 20
ZIPF_ALPHA = 1.1
LR = 0.01
FLOAT_BYTES = 4


def table_sizes(rows_per_table: int) -> list[int]:
    """Criteo's 26 cardinalities, each capped at ``rows_per_table``."""
    return [min(c, rows_per_table) for c in CRITEO_CARDINALITIES]


def zipf_ids(rng: np.random.Generator, num_rows: int, count: int) -> np.ndarray:
    """``count`` IDs in ``[0, num_rows)``: Zipf(1.1) ranks mapped to rows by a permutation.

    Sampled from the truncated distribution (inverse CDF) rather than ``rng.zipf`` modulo
    the table size, which would fold the long tail back onto the head.
    """
    weights = np.arange(1, num_rows + 1, dtype=np.float64) ** -ZIPF_ALPHA
    cdf = np.cumsum(weights)
    ranks = np.searchsorted(cdf, rng.random(count) * cdf[-1], side="right")
    ranks = np.minimum(ranks, num_rows - 1)  # guards the float edge at the top of the CDF
    return rng.permutation(num_rows)[ranks]


def make_batches(
    sizes: Sequence[int], batch_size: int, seed: int = 0
) -> dict[str, KeyedJaggedTensor]:
    """A one-hot and a multi-hot (``POOLING`` IDs per bag) batch over tables of ``sizes``."""
    rng = np.random.default_rng(seed)
    keys = [f"C{k + 1}" for k in range(len(sizes))]
    one_hot = np.stack([zipf_ids(rng, n, batch_size) for n in sizes], axis=1)
    multi_hot = np.concatenate([zipf_ids(rng, n, batch_size * POOLING) for n in sizes])
    lengths = torch.full((len(sizes) * batch_size,), POOLING, dtype=torch.int32)
    return {
        "onehot": KeyedJaggedTensor.from_one_hot(keys, torch.from_numpy(one_hot)),
        "multihot": KeyedJaggedTensor(keys, torch.from_numpy(multi_hot), lengths),
    }


def _touched(kjt: KeyedJaggedTensor, sizes: Sequence[int]) -> tuple[int, int]:
    """IDs looked up and distinct rows touched (over all tables) by one batch."""
    starts = torch.tensor(np.concatenate([[0], np.cumsum(sizes)[:-1]]))
    per_key = torch.tensor(kjt.length_per_key())
    rows = kjt.values + starts.repeat_interleave(per_key)
    return rows.numel(), torch.unique(rows).numel()


def copy_bandwidth(megabytes: int, repeats: int, device: str = "cpu") -> float:
    """The memory bandwidth of ``device`` in bytes/s: bytes read + written by the best
    ``copy_``."""
    src = torch.ones(megabytes * 2**20 // FLOAT_BYTES, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    best = min(_elapsed(lambda: dst.copy_(src)) for _ in range(max(repeats, 3)))
    return 2 * src.numel() * FLOAT_BYTES / best


def _elapsed(run: Callable[[], object]) -> float:
    """Seconds ``run`` takes, including the device work it queued."""
    start = time.perf_counter()
    run()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _best_times(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Best seconds of each step over ``repeats`` rounds in turn, after one warm-up round."""
    timed = {name: (lambda step=step: _elapsed(step)) for name, step in steps.items()}
    return best_of_turns(timed, repeats, key=float, lowest=True, warmup_rounds=1)


class TorchRowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``, our ``RowWiseAdagrad``) in
    torch ops, for the sparse gradients of ``nn.EmbeddingBag(sparse=True)`` weights.

    One state value per row: ``s += mean(g^2)`` over the row's elements, then
    ``w -= lr * g / (sqrt(s) + eps)``, for the rows the gradient touches only.
    """

    def __init__(self, params, lr: float, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None) -> None:  # torch.optim's signature; closure unused
        for group in self.param_groups:
            for weight in group["params"]:
                if weight.grad is None:
                    continue
                state = self.state[weight]
                if not state:
                    state["sum_squares"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
                # Coalesced: one entry per distinct row, its IDs' gradients summed.
                grad = weight.grad.coalesce()
                rows, values = grad.indices()[0], grad.values()
                sums = state["sum_squares"]
                s = sums.index_select(0, rows).add_(values.square().mean(1))
                sums.index_copy_(0, rows, s)
                update = values / s.sqrt_().add_(group["eps"])[:, None]
                weight.index_add_(0, rows, update, alpha=-group["lr"])


def stacked_inputs(
    kjt: KeyedJaggedTensor, sizes: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, offsets)`` of ``kjt`` for one ``nn.EmbeddingBag`` over every table stacked
    in order: IDs moved to their table's rows, bags in sample-major order (sample 0's bag
    of every table, then sample 1's ...), so the pooled output views as ``[B, T * dim]``."""
    n_keys, batch = len(kjt.keys), kjt.stride
    starts = torch.tensor(np.concatenate([[0], np.cumsum(sizes)[:-1]]), dtype=torch.int64)
    values = kjt.values + starts.repeat_interleave(torch.tensor(kjt.length_per_key()))
    lengths = kjt.lengths.long()
    key_major_offsets = kjt.offsets()[:-1]
    order = torch.arange(n_keys * batch).view(n_keys, batch).t().reshape(-1)
    new_lengths = lengths[order]
    new_offsets = torch.zeros(n_keys * batch, dtype=torch.int64)
    torch.cumsum(new_lengths[:-1], 0, out=new_offsets[1:])
    # Each value's place in the key-major array: its bag's old start plus its position.
    position = torch.arange(int(new_lengths.sum())) - new_offsets.repeat_interleave(new_lengths)
    source = key_major_offsets[order].repeat_interleave(new_lengths) + position
    return values[source], new_offsets


def _stacked_bag(tbe: TableBatchedEmbeddingBag) -> nn.EmbeddingBag:
    """Every table of the TBE in one ``EmbeddingBag(sparse=True)``, starting from its weights."""
    weight = torch.cat([tbe.table(t.name) for t in tbe.tables])
    bag = nn.EmbeddingBag(weight.shape[0], weight.shape[1], mode="sum", sparse=True)
    with torch.no_grad():
        bag.weight.copy_(weight)
    return bag


def _stacked_step(
    bag: nn.EmbeddingBag,
    optimizer: torch.optim.Optimizer,
    inputs: tuple[torch.Tensor, torch.Tensor],
    grad: torch.Tensor,
):
    values, offsets = inputs

    def step() -> None:
        bag(values, offsets).view(grad.shape).backward(grad)
        # Opting out explicitly silences torch's warning; the checks are off by default anyway.
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _tbe_step(tbe: TableBatchedEmbeddingBag, kjt: KeyedJaggedTensor, grad: torch.Tensor):
    def step() -> None:
        tbe(kjt).backward(grad)

    return step


def _fbgemm_step(
    tables: FbgemmTables, inputs: tuple[torch.Tensor, torch.Tensor], grad: torch.Tensor
):
    indices, offsets = inputs

    def step() -> None:
        tables.module(indices, offsets).backward(grad)

    return step


def _per_table_step(
    bags: nn.ModuleList,
    optimizer: torch.optim.Optimizer,
    inputs: list[tuple[torch.Tensor, torch.Tensor]],
    grad: torch.Tensor,
):
    def step() -> None:
        out = torch.cat([bag(v, o) for bag, (v, o) in zip(bags, inputs, strict=True)], dim=1)
        out.backward(grad)
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _per_table_bags(tbe: TableBatchedEmbeddingBag) -> nn.ModuleList:
    """One ``EmbeddingBag(sparse=True)`` per table, starting from the TBE's weights."""
    bags = nn.ModuleList()
    for table in tbe.tables:
        bag = nn.EmbeddingBag(table.num_embeddings, table.embedding_dim, mode="sum", sparse=True)
        with torch.no_grad():
            bag.weight.copy_(tbe.table(table.name))
        bags.append(bag)
    return bags


def unfused_interaction(dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """The interaction as plain torch ops; autograd's backward of the index is a scatter-add."""
    vectors = torch.cat([dense.unsqueeze(1), pooled], dim=1)
    gram = torch.bmm(vectors, vectors.transpose(1, 2))
    n = vectors.shape[1]
    rows, cols = torch.tril_indices(n, n, offset=-1, device=vectors.device)
    return torch.cat([dense, gram[:, rows, cols]], dim=1)


def _interaction_times(
    batch_size: int, n_tables: int, dim: int, repeats: int, device: str = "cpu"
) -> dict:
    gen = torch.Generator().manual_seed(dim)
    dense = torch.randn(batch_size, dim, generator=gen).to(device).requires_grad_()
    pooled = torch.randn(batch_size, n_tables, dim, generator=gen).to(device).requires_grad_()
    width = dim + (n_tables + 1) * n_tables // 2
    grad = torch.randn(batch_size, width, generator=gen).to(device)

    def step(op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            op(dense, pooled).backward(grad)
            dense.grad = pooled.grad = None

        return run

    return _best_times(
        {"ours": step(dot_interaction), "baseline": step(unfused_interaction)}, repeats
    )


FBGEMM_BASELINE = (
    "fbgemm_gpu's SplitTableBatchedEmbeddingBagsCodegen (its CPU build on the CPU, "
    "its CUDA build on CUDA) with its fused EXACT_SGD or EXACT_ROWWISE_ADAGRAD, as TorchRec "
    "trains with it: its own weights, key-major indices and offsets made outside the timed "
    "step, its default bounds check. Ratios are its time / our time (> 1: ours faster)."
)
BASELINE = (
    "TBE steps: the same algorithm with torch alone: every table stacked in one "
    "torch.nn.EmbeddingBag(mode='sum', sparse=True), inputs stacked outside the timed step, "
    "+ torch.optim.SGD, or row-wise Adagrad in torch ops (TorchRowWiseAdagrad: coalesce, "
    "per-row mean of squared gradient into a per-row state, update the rows); "
    "interaction: cat, bmm, indexing with tril_indices, cat, differentiated by autograd. "
    "A step is forward, backward of a fixed random output gradient and the update. "
    "Ratios are baseline time / our time (> 1: ours faster), best of the repeats."
)
NAIVE = (
    "naive user (context, not the headline): one torch.nn.EmbeddingBag(sparse=True) per "
    "table, inputs split per table outside the timed step, + torch.optim.SGD or "
    "torch.optim.Adagrad (element-wise: another algorithm, one state value per element "
    "where ours keeps one per row)"
)


def run_kernel_benchmark(
    *,
    batch_size: int = 4096,
    dims: Sequence[int] = (64, 128),
    rows_per_table: int = 200_000,
    repeats: int = 10,
    quick: bool = False,
    device: str = "cpu",
) -> dict[str, object]:
    """Time TBE steps and the interaction against plain torch; return the JSON record.

    ``rows_per_table`` caps each Criteo cardinality. ``quick`` overrides the sizes (batch
    256, dim 8, at most 1000 rows per table, a small copy buffer, at most 2 repeats) for a
    run of seconds that checks the benchmark itself, not the kernels' speed. ``device`` is
    where every side runs ("cuda": ours on the Triton kernels).
    """
    tune_allocator()
    copy_mb = 256
    if quick:
        batch_size, dims, rows_per_table, copy_mb = 256, (8,), 1000, 16
        repeats = min(repeats, 2)
    sizes = table_sizes(rows_per_table)
    host_batches = make_batches(sizes, batch_size)
    touched = {form: _touched(kjt, sizes) for form, kjt in host_batches.items()}
    bandwidth = copy_bandwidth(copy_mb, repeats, device)
    # Built once, outside the timed steps: the torch sides' inputs, stacked and per table.
    stacked = {
        form: tuple(t.to(device) for t in stacked_inputs(kjt, sizes))
        for form, kjt in host_batches.items()
    }
    split = {
        form: [(v.to(device), o.to(device)) for v, o in kjt.split_by_key().values()]
        for form, kjt in host_batches.items()
    }
    batches = {form: kjt.to(device) for form, kjt in host_batches.items()}
    # Ours: our own kernels on the device (``auto`` would pick FBGEMM's on CUDA, timed
    # beside them here as the named baseline they are).
    ours_kernels = besides_fbgemm(torch.empty(0, device=device))
    fbgemm_refusal = fbgemm_tbe.refusal(torch.device(device).type)
    fbgemm_batches = (
        {}
        if fbgemm_refusal is not None
        else {
            form: tuple(t.to(device) for t in fbgemm_inputs(kjt, None)[:2])
            for form, kjt in host_batches.items()
        }
    )

    results: dict[str, dict[str, float]] = {}
    ratios: dict[str, float] = {}
    naive_ratios: dict[str, float] = {}
    fbgemm_ratios: dict[str, float] = {}
    shares: dict[str, float] = {}
    for dim in dims:
        tables = [SparseFeature(f"C{k + 1}", n, dim) for k, n in enumerate(sizes)]
        grad = torch.randn(
            batch_size, len(tables) * dim, generator=torch.Generator().manual_seed(0)
        ).to(device)
        for name, optimizer in (("sgd", SGD(LR)), ("rowwise_adagrad", RowWiseAdagrad(LR))):
            tbe = TableBatchedEmbeddingBag(tables, optimizer, kernels=ours_kernels)
            bag, bags = _stacked_bag(tbe).to(device), _per_table_bags(tbe).to(device)
            tbe = tbe.to(device)
            fbgemm = None
            if fbgemm_refusal is None:
                fbgemm = FbgemmTables(tables, optimizer, torch.device(device), check_ids=True)
                fbgemm.weight_slot().copy_(tbe.weight)  # the same starting rows as ours
            if name == "sgd":
                torch_opt = torch.optim.SGD(bag.parameters(), lr=LR)
                naive_opt = torch.optim.SGD(bags.parameters(), lr=LR)
            else:
                torch_opt = TorchRowWiseAdagrad(bag.parameters(), lr=LR, eps=optimizer.eps)
                naive_opt = torch.optim.Adagrad(bags.parameters(), lr=LR)
            for form, kjt in batches.items():
                sides = {
                    "ours": _tbe_step(tbe, kjt, grad),
                    "baseline": _stacked_step(bag, torch_opt, stacked[form], grad),
                    "naive": _per_table_step(bags, naive_opt, split[form], grad),
                }
                if fbgemm is not None:
                    sides["fbgemm"] = _fbgemm_step(fbgemm, fbgemm_batches[form], grad)
                times = _best_times(sides, repeats)
                n_ids, n_rows = touched[form]
                state_bytes = 2 * n_rows * FLOAT_BYTES if name == "rowwise_adagrad" else 0
                touched_bytes = (n_ids + 2 * n_rows) * dim * FLOAT_BYTES + state_bytes
                key = f"tbe_{name}_step_{form}_d{dim}"
                results[key] = {
                    "ours_s": times["ours"],
                    "baseline_s": times["baseline"],
                    "naive_s": times["naive"],
                    "ids": n_ids,
                    "distinct_rows": n_rows,
                    "bytes_touched": touched_bytes,
                    "ours_bandwidth_share": touched_bytes / times["ours"] / bandwidth,
                    "baseline_bandwidth_share": touched_bytes / times["baseline"] / bandwidth,
                }
                ratios[key] = times["baseline"] / times["ours"]
                naive_ratios[key] = times["naive"] / times["ours"]
                if fbgemm is not None:
                    results[key]["fbgemm_s"] = times["fbgemm"]
                    fbgemm_ratios[key] = times["fbgemm"] / times["ours"]
                shares[key] = results[key]["ours_bandwidth_share"]
            del tbe, bag, bags, torch_opt, naive_opt, fbgemm  # free these before the next
        times = _interaction_times(batch_size, len(sizes), dim, repeats, device)
        key = f"interaction_fwd_bwd_d{dim}"
        results[key] = {"ours_s": times["ours"], "baseline_s": times["baseline"]}
        ratios[key] = times["baseline"] / times["ours"]
    return {
        "benchmark": "kernels",
        "baseline": BASELINE,
        "naive_baseline": NAIVE,
        "batch_size": batch_size,
        "dims": list(dims),
        "table_rows": sizes,
        "pooling_multihot": POOLING,
        "zipf_alpha": ZIPF_ALPHA,
        "repeats": repeats,
        "device": device,
        # What ran ours: our own kernels for this device.
        "ours_kernels": ours_kernels,
        "fbgemm_baseline": FBGEMM_BASELINE,
        # FBGEMM's build, or why it did not run (then no fbgemm ratios).
        "fbgemm": fbgemm_tbe.describe() if fbgemm_refusal is None else f"not run: {fbgemm_refusal}",
        # Every side ran in this process, with these threads and this allocator setting.
        "torch_threads": torch.get_num_threads(),
        "malloc_mmap_threshold": applied_threshold(),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "results": results,
        "ratios": ratios,
        # Naive-user time / our time: labelled context, not the headline ``ratios``.
        "naive_ratios": naive_ratios,
        # FBGEMM's time / our time, per TBE step (absent where FBGEMM does not run).
        "fbgemm_ratios": fbgemm_ratios,
        "bandwidth_share": shares,
        "machine": describe_machine(),
    }
