"""``dlrmflow bench``: benchmarks that print a JSON record of ratios against a named
baseline (``--json FILE`` also writes it), the report that runs them all, and the docs
regenerated from it. Each command calls one ``dlrmflow.bench`` function."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dlrmflow.cli.options import JsonOpt, QuickOpt, echo_json, emit_benchmark
from dlrmflow.config import ConfigError

app = typer.Typer(help="Benchmarks that print JSON ratios against a named baseline.")


@app.command("ingest")
def bench_ingest(
    json_out: JsonOpt = None,
    rows: Annotated[int, typer.Option(help="Rows in the benchmark dataset.")] = 1_000_000,
    data: Annotated[str | None, typer.Option(help="Existing dataset URL to use.")] = None,
    repeats: Annotated[
        int, typer.Option(min=1, help="Runs per measurement; each side's best counts.")
    ] = 5,
    shape: Annotated[
        str,
        typer.Option(
            help="The generated dataset's shape: criteo, or logs (string IDs, a weighted "
            "list of IDs, declared dense transforms). Not used with --data."
        ),
    ] = "criteo",
) -> None:
    """Reader + transform rows/s against plain pyarrow.parquet decode, at 1 and 2 workers."""
    from dlrmflow.bench.ingest import run_ingest_benchmark

    result = run_ingest_benchmark(rows=rows, data_url=data, repeats=repeats, shape=shape)
    emit_benchmark(result, json_out)


@app.command("kernels")
def bench_kernels(
    json_out: JsonOpt = None,
    quick: QuickOpt = False,
    repeats: Annotated[
        int, typer.Option(min=1, help="Rounds per comparison; each side's best time counts.")
    ] = 10,
    device: Annotated[
        str,
        typer.Option(
            help="cpu, or cuda (ours on the Triton kernels, torch and FBGEMM on the GPU)."
        ),
    ] = "cpu",
) -> None:
    """TBE training steps and the fused interaction against plain torch ops and optimizers,
    and against FBGEMM's TBE where fbgemm_gpu runs on the device."""
    from dlrmflow.bench.kernels import run_kernel_benchmark

    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, not {device!r}")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible to torch")
    result = run_kernel_benchmark(quick=quick, repeats=repeats, device=device)
    emit_benchmark(result, json_out)


@app.command("step")
def bench_step(json_out: JsonOpt = None, quick: QuickOpt = False) -> None:
    """One process's training step (the training benchmark's model) in fp32 and bf16
    against the multiply-bound ceiling measured here, with its per-op breakdown."""
    from dlrmflow.bench.step import run_step_benchmark

    emit_benchmark(run_step_benchmark(quick=quick), json_out)


@app.command("precision")
def bench_precision(
    json_out: JsonOpt = None,
    quick: QuickOpt = False,
    data: Annotated[
        str | None, typer.Option(help="Existing dataset URL (default: the demo's, generated).")
    ] = None,
    rounds: Annotated[
        int, typer.Option(min=1, help="fp32/bf16 runs of each config; the best counts.")
    ] = 1,
) -> None:
    """train.precision bf16 against fp32: samples/s and AUC of the demo's and the training
    benchmark's models, one epoch each on the CPU."""
    from dlrmflow.bench.precision import run_precision_benchmark

    emit_benchmark(run_precision_benchmark(data, rounds=rounds, quick=quick), json_out)


@app.command("scale")
def bench_scale(
    json_out: JsonOpt = None,
    quick: QuickOpt = False,
    days: Annotated[int, typer.Option(min=2, help="Days generated; the last is the test day.")] = (
        3
    ),
    rows_per_day: Annotated[int, typer.Option(min=1, help="Rows in each day.")] = 1_000_000,
    budget: Annotated[
        int, typer.Option(min=1, help="train.embedding_memory_bytes of each rank.")
    ] = 1 << 28,
    work_dir: Annotated[
        Path | None,
        typer.Option(help="Keep the data, runs and logs here (default: a temporary directory)."),
    ] = None,
) -> None:
    """Criteo's full cardinalities (33.8M rows at dim 64) on 2 ranks under a per-rank
    memory budget, against the same job all in memory: samples/s, peak memory, AUC."""
    from dlrmflow.bench.scale import run_scale_benchmark

    result = run_scale_benchmark(
        days=days, rows_per_day=rows_per_day, budget_bytes=budget, work_dir=work_dir, quick=quick
    )
    emit_benchmark(result, json_out)


@app.command("readers")
def bench_readers(
    json_out: JsonOpt = None,
    rows: Annotated[int, typer.Option(help="Rows in the benchmark dataset.")] = 400_000,
) -> None:
    """Trainer samples/s and data-wait share: local readers against 1 and 2 reader servers."""
    from dlrmflow.bench.readers import run_readers_benchmark

    result = run_readers_benchmark(rows=rows)
    emit_benchmark(result, json_out)


@app.command("report")
def bench_report(
    out: Annotated[Path, typer.Option(help="Directory for report.md, report.json and plots.")],
    quick: Annotated[
        bool, typer.Option(help="Tiny sizes: checks the report end to end, in a minute.")
    ] = False,
    torchrec: Annotated[
        bool, typer.Option("--torchrec/--no-torchrec", help="Also train TorchRec's DLRM.")
    ] = True,
) -> None:
    """Every benchmark in one markdown report with plots, side by side with TorchRec."""
    from dlrmflow.bench.report import run_report

    record = run_report(out, quick=quick, torchrec=torchrec)
    typer.echo((out / "report.md").read_text())
    typer.echo(f"report: {out / 'report.md'}, plots: {', '.join(record['plots'])}")


@app.command("ingest-days")
def bench_ingest_days(
    json_out: JsonOpt = None,
    quick: QuickOpt = False,
    repeats: Annotated[int, typer.Option(min=1, help="Rounds; each runner's best counts.")] = 2,
) -> None:
    """Days converted per minute by the ingest flow on a Dask cluster of 2 workers against 1."""
    from dlrmflow.bench.ingest_days import run_ingest_days_benchmark

    emit_benchmark(run_ingest_days_benchmark(quick=quick, repeats=repeats), json_out)


@app.command("docs")
def bench_docs(
    report: Annotated[
        Path, typer.Option(help="A report.json written by `dlrmflow bench report`.")
    ] = Path("bench-results/report/report.json"),
    docs_dir: Annotated[Path, typer.Option(help="Where benchmarks.md/.json go.")] = Path("docs"),
    readme: Annotated[Path, typer.Option(help="The README whose results table is rewritten.")] = (
        Path("README.md")
    ),
    scale: Annotated[
        Path | None, typer.Option(help="A `dlrmflow bench scale` JSON to add to the report.")
    ] = None,
    recurring: Annotated[
        Path | None,
        typer.Option(help="A `dlrmflow bench recurring` JSON (its plot beside it) to add."),
    ] = None,
    schedule: Annotated[
        Path | None, typer.Option(help="A `dlrmflow bench schedule` JSON to add.")
    ] = None,
    kernels: Annotated[
        Path | None,
        typer.Option(help="A `dlrmflow bench kernels` JSON in place of the report's kernels run."),
    ] = None,
    step: Annotated[
        Path | None,
        typer.Option(help="A `dlrmflow bench step` JSON in place of the report's step run."),
    ] = None,
    ingest: Annotated[
        Path | None,
        typer.Option(help="A `dlrmflow bench ingest` JSON in place of the report's ingest run."),
    ] = None,
    movielens: Annotated[
        Path | None, typer.Option(help="A `dlrmflow bench movielens` JSON to add.")
    ] = None,
    ingest_logs: Annotated[
        Path | None,
        typer.Option(
            help="A `dlrmflow bench ingest --shape logs` JSON in place of the report's "
            "logs-shape ingest run."
        ),
    ] = None,
    dynamic: Annotated[
        Path | None, typer.Option(help="A `dlrmflow bench dynamic` JSON to add.")
    ] = None,
) -> None:
    """Regenerate docs/benchmarks.md and the README's results table from a report's JSON."""
    from dlrmflow.bench.docs import write_docs

    echo_json(
        write_docs(
            report,
            docs_dir,
            readme,
            scale,
            recurring,
            schedule,
            kernels,
            step,
            ingest,
            movielens,
            ingest_logs,
            dynamic,
        )
    )


@app.command("dynamic")
def bench_dynamic(
    json_out: JsonOpt = None,
    quick: QuickOpt = False,
    days: Annotated[int | None, typer.Option(min=3, help="Churning days generated.")] = None,
    rows_per_day: Annotated[int | None, typer.Option(min=1, help="Rows in each day.")] = None,
    churn: Annotated[float | None, typer.Option(help="data.churn of the days (0-1).")] = None,
) -> None:
    """Model lines with dynamic ID tables against hashing (the same rows and four times
    as many) and a day-0 vocabulary on churning days: next-day AUC, rows, memory, and the
    maps' cost in a training step."""
    from dlrmflow.bench.dynamic import run_dynamic_benchmark

    result = run_dynamic_benchmark(quick, days=days, rows_per_day=rows_per_day, churn=churn)
    emit_benchmark(result, json_out)


@app.command("movielens")
def bench_movielens(json_out: JsonOpt = None, quick: QuickOpt = False) -> None:
    """MovieLens-100k (from the recbole wheel) registered by week and trained as a model line,
    its next-week AUC against each movie's past click rate."""
    from dlrmflow.bench.movielens import run_movielens

    emit_benchmark(run_movielens(quick=quick), json_out)


@app.command("recurring")
def bench_recurring(
    json_out: JsonOpt = None,
    quick: QuickOpt = False,
    days: Annotated[int | None, typer.Option(min=3, help="Drifting days generated.")] = None,
    rows_per_day: Annotated[int | None, typer.Option(min=1, help="Rows in each day.")] = None,
    drift: Annotated[float | None, typer.Option(help="data.drift of the days (0-1).")] = None,
) -> None:
    """A model line continued daily against retraining from scratch daily and a model
    frozen after day 0, on drifting days: next-day AUC and CPU-seconds per day. With
    --json, the plot (recurring_auc.png) is written beside the JSON."""
    from dlrmflow.bench.recurring import PLOT, plot_recurring, run_recurring_benchmark

    result = run_recurring_benchmark(quick, days=days, rows_per_day=rows_per_day, drift=drift)
    emit_benchmark(result, json_out)
    if json_out is not None:
        plot_recurring(result, json_out.parent / PLOT)


@app.command("schedule")
def bench_schedule(json_out: JsonOpt = None, quick: QuickOpt = False) -> None:
    """The learning-rate sweep behind the defaults: candidate rates, schedules and batch
    sizes trained on the demo's data, two seeds each, scored against the Bayes AUC."""
    from dlrmflow.bench.schedule import run_schedule_sweep

    emit_benchmark(run_schedule_sweep(quick), json_out)


@app.command("train")
def bench_train(
    json_out: JsonOpt = None,
    quick: QuickOpt = False,
    steps: Annotated[int | None, typer.Option(help="Timed steps per mode.")] = None,
) -> None:
    """Sharded training samples/s per sharding type and codec, at world sizes 1 and 2."""
    from dlrmflow.bench.train import run_train_benchmark

    result = run_train_benchmark(quick=quick, steps=steps)
    emit_benchmark(result, json_out)
