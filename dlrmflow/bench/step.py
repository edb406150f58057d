"""Step benchmark: one process's training step against the machine's multiply-bound ceiling.

The training benchmark's model (13 dense features, 26 one-hot tables of 100k rows, dim
64, bottom MLP 512-256-64, top MLP 512-256-1, dot interaction, batch 4096, row-wise
Adagrad embeddings, dense Adagrad), trained in this process on a few pre-built batches of
Zipf IDs, in fp32 and in bf16 (``train.precision``). A step's time is the mean of 20
steps; the two precisions take turns over 5 rounds and each keeps its best
(``dlrmflow.bench.turns``), so that the bf16/fp32 ratio is not one slow spell's.

The ceiling is what the step's large matrix multiplies alone would allow: every
``nn.Linear`` of the MLPs does one multiply forward and two backward (the input's and the
weight's gradients), each timed here on its own with this process's threads, at the
step's shapes and dtype (bf16: as autocast runs them, weights cast once). Their summed
time is the fastest a step doing this arithmetic could take on this machine, so
``ceiling_fraction`` = (the ceiling's step time) / (the step's time) says how much of the
step is not those multiplies. A step faster than its ceiling would mean the multiplies
got cheaper inside the step than alone (they cannot: it is the same call).

Where the rest goes: the step's two other large parts, the embeddings (lookup and fused
update, memory-bound: each step reads and writes its rows scattered over tables far
larger than the caches) and the dot interaction (thousands of 27 x 64 products), are each
timed alone too, and ``three_parts_ceiling_fraction`` is the fraction a step of nothing
but the multiplies and those two parts would reach: a bound the target must fit under.
The per-op breakdown is torch's profiler over a few steps: each op's own CPU time per
step (``self_cpu``, the median over the profiled steps), the largest first.
Which instruction set ran: torch's CPU capability (``avx512``, ``avx512_bf16``,
``amx``...) and the CPU's flags.
"""

from __future__ import annotations

import statistics
import time
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from dlrmflow.bench.machine import describe_machine
from dlrmflow.bench.train import FULL, QUICK, bench_config, bench_spec, make_batches
from dlrmflow.bench.turns import best_of_turns
from dlrmflow.features.batch import Batch
from dlrmflow.kernels.interaction import dot_interaction
from dlrmflow.runtime.glibc_malloc import tune_allocator
from dlrmflow.runtime.mkldnn_bf16 import bf16_supported
from dlrmflow.train.model.dlrm import DLRM, DotInteraction, embedding_optimizer

PRECISIONS = ("fp32", "bf16")
# The profiler range around each profiled step (``op_breakdown``).
_STEP_MARK = "dlrmflow.bench.step"
CEILING_BASELINE = (
    "the step's MLP multiplies alone: every nn.Linear's forward and two backward multiplies "
    "at the step's shapes and dtype, timed one by one with the same threads; "
    "ceiling_fraction = their summed time / the step's time (1.0: nothing but multiplies)"
)


def _model(size: dict, precision: str) -> tuple[DLRM, torch.optim.Optimizer]:
    config = bench_config(size, None, "fp32", True)
    torch.manual_seed(0)
    model = DLRM(
        bench_spec(size), config.model, embedding_optimizer(config.train), precision=precision
    )
    return model, torch.optim.Adagrad(model.dense_parameters(), lr=config.train.lr)


def _step_fn(model: DLRM, optimizer: torch.optim.Optimizer) -> Callable[[Batch], None]:
    loss_fn = nn.BCEWithLogitsLoss()

    def step(batch: Batch) -> None:
        loss = loss_fn(model(batch.dense, batch.sparse), batch.labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def _mean_step_s(step: Callable[[Batch], None], batches: list[Batch], steps: int) -> float:
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    return (time.perf_counter() - start) / steps


def _warm(step: Callable[[Batch], None], batches: list[Batch], warmup: int) -> None:
    for i in range(warmup):
        step(batches[i % len(batches)])


def _best_step_s(
    step: Callable[[Batch], None], batches: list[Batch], warmup: int, steps: int, rounds: int
) -> float:
    _warm(step, batches, warmup)
    return min(_mean_step_s(step, batches, steps) for _ in range(rounds))


def _linear_shapes(model: DLRM) -> list[tuple[int, int]]:
    """(in, out) of every nn.Linear of the dense arch, in order."""
    return [
        (m.in_features, m.out_features)
        for m in model.dense_arch.modules()
        if isinstance(m, nn.Linear)
    ]


def multiply_ceiling(
    shapes: list[tuple[int, int]], batch: int, dtype: torch.dtype, repeats: int
) -> dict:
    """The seconds of one step's MLP multiplies, each timed alone (best of ``repeats``), and
    their FLOPs: forward ``x @ W.T``, backward ``g @ W`` and ``g.T @ x`` per layer."""
    gen = torch.Generator().manual_seed(0)
    total_s, flops = 0.0, 0
    for n_in, n_out in shapes:
        x = torch.randn(batch, n_in, generator=gen).to(dtype)
        w = torch.randn(n_out, n_in, generator=gen).to(dtype)
        g = torch.randn(batch, n_out, generator=gen).to(dtype)
        b = torch.zeros(n_out, dtype=dtype)
        calls = (
            lambda x=x, w=w, b=b: torch.addmm(b, x, w.t()),
            lambda g=g, w=w: torch.mm(g, w),
            lambda g=g, x=x: torch.mm(g.t(), x),
        )
        for call in calls:
            for _ in range(3):
                call()
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                call()
                best = min(best, time.perf_counter() - start)
            total_s += best
        flops += 3 * 2 * batch * n_in * n_out
    return {"seconds": total_s, "flops": flops, "gflop_per_s": flops / total_s / 1e9}


def op_breakdown(
    step: Callable[[Batch], None], batches: list[Batch], steps: int, top: int = 15
) -> list[dict]:
    """Each op's own CPU milliseconds per step, largest first: the median over ``steps``
    profiled steps of the op's summed self time within each.

    The median, not the mean: on a small shared machine a profiled step now and then
    stalls in one call for several times what the whole step takes unprofiled, and a
    mean over a few steps would hand that stall to whichever op it fell in.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            with record_function(_STEP_MARK):
                step(batches[i % len(batches)])
    events = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == _STEP_MARK)
    starts = [start for start, _ in spans]
    per_step: list[dict[str, float]] = [defaultdict(float) for _ in spans]
    calls: dict[str, int] = defaultdict(int)
    for e in events:
        if e.name == _STEP_MARK:
            continue
        k = bisect_right(starts, e.time_range.start) - 1
        if k >= 0 and e.time_range.start < spans[k][1]:
            per_step[k][e.name] += e.self_cpu_time_total / 1e3
            calls[e.name] += 1
    rows = [
        {
            "op": name,
            "self_cpu_ms": statistics.median(s.get(name, 0.0) for s in per_step),
            "calls": count // len(spans),
        }
        for name, count in calls.items()
    ]
    rows.sort(key=lambda r: -r["self_cpu_ms"])
    return [r for r in rows[:top] if r["self_cpu_ms"] > 0]


def part_times(
    model: DLRM,
    batches: list[Batch],
    dtype: torch.dtype,
    warmup: int,
    steps: int,
    rounds: int,
) -> dict[str, float]:
    """Seconds a step spends in its two other large parts, each timed alone on the step's
    batches with the same threads (best of ``rounds``, as the step): the embeddings'
    lookup with their fused update (a fixed small gradient handed to their output), and
    the dot interaction forward and backward (random inputs of the step's shapes and
    dtype). Beside the multiplies' ceiling they say where the step's time goes: what is
    left of the step is elementwise work (activations, bias sums, casts, the loss), the
    dense optimizer, and whatever the three parts cost more inside the step than alone.
    """
    gen = torch.Generator().manual_seed(0)
    batch = batches[0].dense.shape[0]
    pooled = model.embeddings(batches[0].sparse)
    grad = (torch.randn(pooled.shape, generator=gen) * 1e-3).to(pooled.dtype)
    del pooled

    def embeddings(b: Batch) -> None:
        model.embeddings(b.sparse).backward(grad)

    arch = model.dense_arch
    n, dim = arch.n_sparse, arch.dim
    dense = torch.randn(batch, dim, generator=gen).to(dtype).requires_grad_()
    vectors = torch.randn(batch, n, dim, generator=gen).to(dtype).requires_grad_()
    out_grad = torch.randn(batch, DotInteraction.output_dim(n + 1, dim), generator=gen).to(dtype)

    def interaction(_: Batch) -> None:
        dense.grad = vectors.grad = None
        dot_interaction(dense, vectors, arch.interaction.kernels).backward(out_grad)

    return {
        "embeddings_s": _best_step_s(embeddings, batches, warmup, steps, rounds),
        "interaction_s": _best_step_s(interaction, batches, warmup, steps, rounds),
    }


def instruction_set() -> dict[str, object]:
    """What torch's CPU kernels dispatch to here, and the CPU's matrix/bf16 flags."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": [f for f in wanted if f in flags],
        "mkldnn_bf16": bf16_supported(),
    }


def run_step_benchmark(quick: bool = False, steps: int | None = None) -> dict[str, object]:
    """Time the step in fp32 and bf16 against their ceilings; return the JSON record."""
    tune_allocator()
    size = QUICK if quick else FULL
    steps = steps or (2 if quick else 20)
    warmup, rounds, repeats = (1, 1, 2) if quick else (5, 5, 10)
    batches = make_batches(size, 0)
    # Both precisions' models at once, their steps timed in turns (``bench.turns``): a
    # slow spell of a shared machine then hits both sides of the bf16/fp32 ratio alike.
    models = {precision: _model(size, precision) for precision in PRECISIONS}
    steps_of = {precision: _step_fn(*models[precision]) for precision in PRECISIONS}
    for step in steps_of.values():
        _warm(step, batches, warmup)
    step_times = best_of_turns(
        {
            precision: lambda step=step: _mean_step_s(step, batches, steps)
            for precision, step in steps_of.items()
        },
        rounds,
        key=lambda seconds: seconds,
        lowest=True,
    )
    results: dict[str, dict] = {}
    for precision in PRECISIONS:
        model, _ = models[precision]
        step, step_s = steps_of[precision], step_times[precision]
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        ceiling = multiply_ceiling(_linear_shapes(model), size["batch"], dtype, repeats)
        ops = op_breakdown(step, batches, 2 if quick else 10)
        parts = part_times(model, batches, dtype, warmup, steps, rounds)
        alone = ceiling["seconds"] + parts["embeddings_s"] + parts["interaction_s"]
        results[precision] = {
            "step_s": step_s,
            "samples_per_s": size["batch"] / step_s,
            "ceiling_step_s": ceiling["seconds"],
            "ceiling_samples_per_s": size["batch"] / ceiling["seconds"],
            "multiply_gflop_per_s": ceiling["gflop_per_s"],
            "mlp_flops_per_sample": ceiling["flops"] / size["batch"],
            "ceiling_fraction": ceiling["seconds"] / step_s,
            **parts,
            "rest_s": step_s - alone,
            # The fraction a step would reach were nothing but these three parts left,
            # each as fast as alone: the bound the embeddings and the interaction set.
            "three_parts_ceiling_fraction": ceiling["seconds"] / alone,
            "ops": ops,
        }
    fp32, bf16 = results["fp32"], results["bf16"]
    return {
        "benchmark": "step",
        "baseline": CEILING_BASELINE,
        "config": {k: size[k] for k in ("rows", "dim", "bottom", "top", "batch")},
        "steps": steps,
        "rounds": rounds,
        "results": results,
        "ratios": {
            "fp32_ceiling_fraction": fp32["ceiling_fraction"],
            "bf16_ceiling_fraction": bf16["ceiling_fraction"],
            "bf16_vs_fp32_samples_per_s": bf16["samples_per_s"] / fp32["samples_per_s"],
        },
        "instruction_set": instruction_set(),
        "machine": describe_machine(),
    }
