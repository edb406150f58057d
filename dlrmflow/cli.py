"""The ``dlrmflow`` command: one sub-command per stage, plus the demo and benchmarks.

Every command that trains or reads data resolves the same ``RunConfig``: defaults, then
``--config FILE``, then ``--set section.key=value`` overrides, then the command's own flags.
Heavy imports (torch, pyarrow, prefect) happen inside the commands so ``--help`` is quick.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from dlrmflow.config import ConfigError, RunConfig, apply_overrides, env_overrides, load_config
from dlrmflow.memory import tune_allocator

app = typer.Typer(
    help="Train DLRM recommendation models end to end: Parquet -> features -> DLRM -> eval.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks that print JSON ratios against a named baseline.")
app.add_typer(bench_app, name="bench")
readers_app = typer.Typer(help="Reader services that preprocess batches for remote trainers.")
app.add_typer(readers_app, name="readers")

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML, JSON or TOML run configuration.")
]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write the JSON result here.")]
QuickOpt = Annotated[
    bool, typer.Option(help="Tiny tables and batch: checks the benchmark runs, in seconds.")
]
# The schedule of `serve` and `deploy`.
CronOpt = Annotated[str | None, typer.Option(help='Schedule the flow with cron, e.g. "0 3 * * *".')]
IntervalOpt = Annotated[
    float | None, typer.Option(help="Schedule the flow every this many seconds.")
]
ScheduledFlowOpt = Annotated[
    str, typer.Option(help="The flow the schedule runs: ingest, train, evaluate, end_to_end.")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config key, e.g. --set train.lr=0.1."),
]
# Joining a job of several hosts (`train` and `evaluate`): distributed.nnodes and the rest.
NnodesOpt = Annotated[
    int | None,
    typer.Option(help="Hosts in the job (>1: the same command on each, with its --node-rank)."),
]
NodeRankOpt = Annotated[
    int | None,
    typer.Option(help="This host's place, 0..nnodes-1; node 0 serves the rendezvous, rank 0."),
]
RdzvEndpointOpt = Annotated[
    str | None,
    typer.Option(help="HOST:PORT of node 0's rendezvous, reachable from every host."),
]
LocalAddrOpt = Annotated[
    str | None,
    typer.Option(
        help="The address this host advertises (default: its address on the route to "
        "--rdzv-endpoint)."
    ),
]
ConnectTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--connect-timeout",
        help="Seconds each start-up wait (the endpoint, the hosts, their addresses) may take.",
    ),
]


def _hosts(
    nnodes: int | None,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    local_addr: str | None,
    connect_timeout: float | None,
) -> dict[str, Any]:
    """The multi-host flags as ``distributed.*`` overrides (None: not given)."""
    return {
        "distributed.nnodes": nnodes,
        "distributed.node_rank": node_rank,
        "distributed.rdzv_endpoint": rdzv_endpoint,
        "distributed.local_addr": local_addr,
        "distributed.connect_timeout_s": connect_timeout,
    }


def _host_result(node_rank: int, joined: dict[str, Any] | None) -> dict[str, Any]:
    """What a command prints: rank 0's result on node 0; elsewhere, that this host's ranks
    finished (rank 0 prints the result on node 0)."""
    return joined if joined is not None else {"node_rank": node_rank, "finished": True}


def _config(path: Path | None, sets: list[str] | None, **flags: Any) -> RunConfig:
    """Defaults, then ``path``, then DLRMFLOW_SECTION__KEY variables, then ``sets``, then
    the command's flags (``{"section.key": value}``, None when not given)."""
    from dlrmflow.config import resolve_config

    return resolve_config(path, sets, flags).config


class _Progress:
    """A tqdm bar that stays silent when stderr is not a terminal (CI, Prefect workers)."""

    def __init__(self, total: int | None, desc: str, unit: str = "rows") -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=None)

    def __call__(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _echo_json(data: dict[str, Any]) -> None:
    typer.echo(json.dumps(data, indent=2))


def _emit_benchmark(result: dict[str, Any], json_out: Path | None) -> None:
    """Print a benchmark's record, and also write it to ``json_out`` when given."""
    _echo_json(result)
    if json_out is not None:
        from dlrmflow.outputs import write_atomic

        write_atomic(json_out, json.dumps(result, indent=2) + "\n")


@app.command()
def config(
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Print the resolved configuration (defaults + file + DLRMFLOW_SECTION__KEY environment
    variables + --set overrides) as YAML, then, as YAML comments, where each value that is
    not a default came from."""
    import yaml

    from dlrmflow.config import resolve_config

    resolved = resolve_config(config, set_)
    typer.echo(yaml.safe_dump(resolved.config.model_dump(), sort_keys=False).rstrip())
    if not resolved.sources:
        typer.echo("# sources: all defaults")
        return
    typer.echo("# sources:")
    for key, source in resolved.sources.items():
        typer.echo(f"#   {key}: {source}")


@app.command()
def generate(
    out: Annotated[str | None, typer.Option(help="Dataset URL (default: data.url).")] = None,
    days: Annotated[int | None, typer.Option(help="Day partitions; the last is held out.")] = None,
    rows_per_day: Annotated[int | None, typer.Option(help="Rows in each day.")] = None,
    seed: Annotated[int | None, typer.Option(help="Generator seed.")] = None,
    multi_hot: Annotated[
        bool | None, typer.Option("--multi-hot/--one-hot", help="Lists of IDs per feature.")
    ] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Write synthetic Criteo-like data as day-partitioned Parquet plus manifest.json."""
    from dlrmflow.ingest.synthetic import generate_dataset

    cfg = _config(
        config,
        set_,
        **{
            "data.url": out,
            "data.days": days,
            "data.rows_per_day": rows_per_day,
            "data.seed": seed,
            "data.multi_hot": multi_hot,
        },
    )
    bar = _Progress(cfg.data.days * cfg.data.rows_per_day, "generate")
    manifest = generate_dataset(cfg.data, progress=bar)
    bar.close()
    _echo_json(
        {
            "url": cfg.data.url,
            "rows": manifest.rows,
            "days": manifest.days,
            "test_day": manifest.test_day,
            "positive_rate": manifest.positive_rate,
            "bayes_auc": manifest.bayes_auc,
            "bayes_logloss": manifest.bayes_logloss,
        }
    )


@app.command()
def convert(
    input_: Annotated[
        list[str], typer.Option("--input", "-i", help="Raw Criteo TSV day files (.gz ok).")
    ],
    out: Annotated[str, typer.Option(help="Output dataset URL.")],
    max_bad_fraction: Annotated[
        float, typer.Option(help="Fail when a file has more malformed lines than this.")
    ] = 0.001,
    row_group_size: Annotated[int, typer.Option(help="Rows per Parquet row group.")] = 65_536,
) -> None:
    """Convert raw Criteo TSV days to Parquet, quarantining malformed lines."""
    from dlrmflow.ingest.criteo import convert_criteo

    bar = _Progress(None, "convert", unit="lines")
    result = convert_criteo(
        input_,
        out,
        max_bad_fraction=max_bad_fraction,
        row_group_size=row_group_size,
        progress=bar,
    )
    bar.close()
    _echo_json(
        {
            "url": out,
            "rows": result.rows,
            "days": result.manifest.days,
            "bad_lines": result.bad_lines,
            "quarantine": result.quarantine,
        }
    )


@app.command("train")
def train_cmd(
    run_dir: Annotated[str | None, typer.Option(help="Where metrics and checkpoint go.")] = None,
    data: Annotated[str | None, typer.Option(help="Dataset URL (default: data.url).")] = None,
    nproc: Annotated[
        int | None, typer.Option(help="Ranks on this host (>1: torchrun, sharded embeddings).")
    ] = None,
    sharding: Annotated[
        str | None,
        typer.Option(
            help="Force one sharding type on every table: data_parallel, table_wise, "
            "row_wise, column_wise or table_row_wise (default: the planner chooses)."
        ),
    ] = None,
    comms: Annotated[
        str | None,
        typer.Option(help="Forward embedding all-to-all precision: fp32, fp16, bf16, fp8, int8."),
    ] = None,
    readers: Annotated[
        str | None,
        typer.Option(help="Reader servers HOST:PORT,HOST:PORT (default: read locally)."),
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(help='A checkpoint dir to continue from, "auto" (default) or "never".'),
    ] = None,
    nnodes: NnodesOpt = None,
    node_rank: NodeRankOpt = None,
    rdzv_endpoint: RdzvEndpointOpt = None,
    local_addr: LocalAddrOpt = None,
    connect_timeout: ConnectTimeoutOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Train a DLRM on the dataset's training days (one process, or --nproc ranks).

    A run directory that holds a checkpoint continues from its newest intact one. On many
    hosts, run it on each with --nnodes, its --node-rank and node 0's --rdzv-endpoint.
    """
    import contextlib

    from dlrmflow.train.launch import launch_training
    from dlrmflow.train.rundir import run_dir_lock

    cfg = _config(
        config,
        set_,
        run_dir=run_dir,
        **{
            "data.url": data,
            "distributed.nproc": nproc,
            "distributed.sharding": sharding,
            "distributed.comms": comms,
            "distributed.readers": readers.split(",") if readers else None,
            "train.resume": resume,
            **_hosts(nnodes, node_rank, rdzv_endpoint, local_addr, connect_timeout),
        },
    )
    bar = _Progress(None, "train", unit="steps")
    last = [0]

    def show(record: dict) -> None:
        bar(record["step"] - last[0])
        last[0] = record["step"]
        bar.bar.set_postfix(loss=f"{record['loss']:.4f}")

    def echo(line: str) -> None:
        if not line.startswith("result "):
            typer.echo(line, err=True)

    # Held here, so that a job's ranks (and its config.json) run under it; by node 0 alone
    # in a job of several hosts (rank 0 runs there): they share the run directory.
    node_rank = cfg.distributed.node_rank
    lock = run_dir_lock(cfg.run_dir, "dlrmflow train") if node_rank == 0 else None
    with lock or contextlib.nullcontext():
        result = launch_training(cfg, on_line=echo, on_record=show)
    bar.close()
    _echo_json(_host_result(node_rank, None if result is None else result.to_dict()))


@app.command("plan")
def plan_cmd(
    world_size: Annotated[int, typer.Option(help="Ranks to plan for.")] = 2,
    ranks_per_host: Annotated[
        int | None, typer.Option(help="Ranks per host (default: all on one host).")
    ] = None,
    preset: Annotated[
        str | None, typer.Option(help="A built-in model instead of the config's: paper-12t.")
    ] = None,
    device_memory: Annotated[
        float | None, typer.Option(help="Device memory per rank, bytes (e.g. 80e9).")
    ] = None,
    dram_memory: Annotated[
        float | None, typer.Option(help="Host DRAM per rank for embeddings, bytes.")
    ] = None,
    ssd_memory: Annotated[
        float | None, typer.Option(help="SSD per rank for embeddings, bytes.")
    ] = None,
    cache_load_factor: Annotated[
        float | None,
        typer.Option(help="Share of each DRAM/SSD shard's rows cached in device memory (0-1)."),
    ] = None,
    max_shards: Annotated[int, typer.Option(help="Shards listed per rank (text).")] = 12,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Plan how the embedding tables shard over the ranks: per rank, its shards (sharding,
    tier, memory, estimated load, cache hit rate) and totals.

    The config's model is planned with the dataset's stats.json (pooling factors, access
    skew) when it has one, on the topology its job would have (all in RAM, or within
    train.embedding_memory_bytes per rank and the rest on disk); memory options replace it.
    """
    import dataclasses

    from dlrmflow.train import planner

    overrides = {
        key: value
        for key, value in (
            ("device_bytes", device_memory),
            ("dram_bytes", dram_memory),
            ("ssd_bytes", ssd_memory),
            ("cache_load_factor", cache_load_factor),
        )
        if value is not None
    }
    if preset is not None:
        if preset != "paper-12t":
            raise ConfigError(f"--preset: unknown preset {preset!r} (known: paper-12t)")
        tables, topology, batch_size = planner.paper_12t()
        topology = dataclasses.replace(topology, **overrides)
        plan = planner.plan_sharding(tables, topology, batch_size)
    else:
        from dlrmflow.features.spec import FeatureSpec
        from dlrmflow.ingest.manifest import read_manifest

        cfg = _config(config, set_)
        spec = FeatureSpec.for_dataset(read_manifest(cfg.data.url), cfg.features, cfg.model)
        per_host = ranks_per_host or world_size
        # Without memory options: the plan a job of this configuration runs (a budget in
        # train.embedding_memory_bytes puts shards on disk, as the trainer's plan does).
        topology = (
            dataclasses.replace(planner.cpu_topology(world_size, per_host), **overrides)
            if overrides
            else None
        )
        plan = planner.plan_for_config(cfg, spec, world_size, per_host, topology=topology)
    if json_out:
        _echo_json(plan.to_dict())
    else:
        typer.echo(planner.format_plan(plan, max_shards=max_shards))


@app.command("evaluate")
def evaluate_cmd(
    run_dir: Annotated[str, typer.Option(help="Run directory holding the checkpoint.")],
    data: Annotated[str | None, typer.Option(help="Dataset URL (default: the run's).")] = None,
    checkpoint: Annotated[
        str | None, typer.Option(help="A checkpoint directory (default: the newest intact).")
    ] = None,
    max_rows: Annotated[int | None, typer.Option(help="Score at most this many rows.")] = None,
    nproc: Annotated[
        int, typer.Option(help="Ranks that score it (the checkpoint reshards to them).")
    ] = 1,
    nnodes: NnodesOpt = None,
    node_rank: NodeRankOpt = None,
    rdzv_endpoint: RdzvEndpointOpt = None,
    local_addr: LocalAddrOpt = None,
    connect_timeout: ConnectTimeoutOpt = None,
    device: Annotated[
        str, typer.Option(help="auto (CUDA when present), cpu or cuda, whatever trained it.")
    ] = "auto",
    kernels: Annotated[
        str, typer.Option(help="auto, torch, compiled or triton, as model.kernels.")
    ] = "auto",
) -> None:
    """Evaluate a trained model on the held-out test day; writes RUN_DIR/eval.json.

    On many hosts, run it on each with --nnodes, its --node-rank and --rdzv-endpoint.
    """
    # Checked before anything starts (torchrun would fail on them in many lines).
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, not {nproc}")
    from dlrmflow.train.checkpoint import find_checkpoint
    from dlrmflow.train.evaluate import check_run_dir
    from dlrmflow.train.launch import launch_evaluation

    check_run_dir(run_dir)  # never created: eval.json goes beside the run it scores
    find_checkpoint(checkpoint or run_dir, verified=False)  # a checkpoint, or one line

    # The job's hosts: flags, else DLRMFLOW_DISTRIBUTED__* variables (one per host).
    hosts = _config(
        None, None, **_hosts(nnodes, node_rank, rdzv_endpoint, local_addr, connect_timeout)
    ).distributed
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, not {device!r}")
    from dlrmflow.kernels.backends import KERNELS

    if kernels not in KERNELS:
        raise ConfigError(f"--kernels must be one of {', '.join(KERNELS)}, not {kernels!r}")
    bar = _Progress(None, "evaluate")
    if nproc == 1 and hosts.nnodes == 1:
        from dlrmflow.train.evaluate import evaluate

        metrics = evaluate(
            run_dir,
            data_url=data,
            checkpoint=checkpoint,
            max_rows=max_rows,
            progress=bar,
            device=device,
            kernels=kernels,
        )
    else:
        metrics = launch_evaluation(
            run_dir,
            nproc,
            data_url=data,
            checkpoint=checkpoint,
            max_rows=max_rows,
            distributed=hosts,
            device=device,
            kernels=kernels,
        )
    bar.close()
    _echo_json(_host_result(hosts.node_rank, metrics))


@app.command("export")
def export_cmd(
    run_dir: Annotated[str, typer.Option(help="Run directory (its newest intact checkpoint).")],
    out: Annotated[str, typer.Option(help="The safetensors file to write.")],
    checkpoint: Annotated[str | None, typer.Option(help="A checkpoint directory.")] = None,
) -> None:
    """Write the whole model (every table, every dense parameter) as one safetensors file."""
    from dlrmflow.train.export import export_model

    _echo_json(export_model(checkpoint or run_dir, out))


DEMO_RANKS = 2
QUICK = {
    "data.days": 3,
    "data.rows_per_day": 20_000,
    "data.row_group_size": 8_192,
    "train.batch_size": 1024,
    "train.log_every": 10,
}


@app.command()
def demo(
    run_dir: Annotated[str, typer.Option(help="Where data, metrics and summary go.")] = "runs/demo",
    quick: Annotated[bool, typer.Option(help="Tiny data: ends in under a minute.")] = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run the end-to-end Prefect flow: generate -> train -> evaluate -> report.

    Trains sharded over two ranks unless --set distributed.nproc=N says otherwise; the
    dataset is reused when unchanged (Prefect's cache), the training starts afresh. A
    directory holding a `dlrmflow train` run is refused (--set train.resume=never
    replaces it).
    """
    import shutil

    base = load_config(config, set_)
    overrides: dict[str, Any] = dict(QUICK) if quick else {}
    overrides["run_dir"] = run_dir
    if "url" not in base.data.model_fields_set:
        # A demo keeps its data beside its results unless the user chose a dataset URL.
        overrides["data.url"] = str(Path(run_dir) / "data")
    if "nproc" not in base.distributed.model_fields_set:
        overrides["distributed.nproc"] = DEMO_RANKS
    nproc = overrides.get("distributed.nproc", base.distributed.nproc)
    if "batch_size" not in base.train.model_fields_set:
        # train.batch_size is per rank: split the demo's global batch over its ranks, so
        # that it takes as many steps (and reaches the same AUC) as one process would.
        global_batch = overrides.get("train.batch_size", base.train.batch_size)
        overrides["train.batch_size"] = max(1, global_batch // nproc)
    cfg = apply_overrides(base, overrides)
    from dlrmflow.flows.api import require_api
    from dlrmflow.flows.end_to_end import end_to_end
    from dlrmflow.train.rundir import run_dir_lock
    from dlrmflow.train.trainer import END_TO_END_KIND, claim_run_dir

    require_api()
    typer.echo(
        f"end_to_end flow: generate {cfg.data.days} x {cfg.data.rows_per_day} rows -> train on "
        f"{cfg.distributed.nproc} rank(s) -> evaluate -> report, in {run_dir} "
        "(task logs go to the Prefect API)",
        err=True,
    )
    with run_dir_lock(run_dir, "dlrmflow demo"):
        # Another kind of run (a `dlrmflow train` run) is never replaced unasked.
        replace = cfg.train.resume == "never"
        claim_run_dir(Path(run_dir), END_TO_END_KIND, replace=replace, command="dlrmflow demo")
        # A new demo, not the continuation of the last one (the train task still resumes
        # from this run's own checkpoints when Prefect retries it).
        shutil.rmtree(Path(run_dir) / "checkpoints", ignore_errors=True)
        summary = end_to_end(cfg)
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        typer.echo(f"{key:<{width}}  {shown}")
    typer.echo(f"summary: {Path(run_dir) / 'summary.json'}")


@bench_app.command("ingest")
def bench_ingest(
    json_out: JsonOpt = None,
    rows: Annotated[int, typer.Option(help="Rows in the benchmark dataset.")] = 1_000_000,
    data: Annotated[str | None, typer.Option(help="Existing dataset URL to use.")] = None,
    repeats: Annotated[
        int, typer.Option(min=1, help="Runs per measurement; each side's best counts.")
    ] = 5,
) -> None:
    """Reader + transform rows/s against plain pyarrow.parquet decode, at 1 and 2 workers."""
    from dlrmflow.bench.ingest import run_ingest_benchmark

    result = run_ingest_benchmark(rows=rows, data_url=data, repeats=repeats)
    _emit_benchmark(result, json_out)


@bench_app.command("kernels")
def bench_kernels(
    json_out: JsonOpt = None,
    quick: QuickOpt = False,
    repeats: Annotated[
        int, typer.Option(min=1, help="Rounds per comparison; each side's best time counts.")
    ] = 10,
    device: Annotated[
        str, typer.Option(help="cpu, or cuda (ours on the Triton kernels, torch on the GPU).")
    ] = "cpu",
) -> None:
    """TBE training steps and the fused interaction against plain torch ops and optimizers."""
    from dlrmflow.bench.kernels import run_kernel_benchmark

    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, not {device!r}")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible to torch")
    result = run_kernel_benchmark(quick=quick, repeats=repeats, device=device)
    _emit_benchmark(result, json_out)


@app.command("serve")
def serve_cmd(
    cron: CronOpt = None,
    interval: IntervalOpt = None,
    flow: ScheduledFlowOpt = "end_to_end",
    limit: Annotated[int, typer.Option(help="Flow runs executing at once.")] = 1,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Serve the flows as Prefect deployments (on PREFECT_API_URL's server, or locally)."""
    from dlrmflow.flows.serve import serve_flows

    if cron is not None and interval is not None:
        raise ConfigError("give --cron or --interval, not both")
    serve_flows(_config(config, set_), cron=cron, interval=interval, scheduled=flow, limit=limit)


@app.command("deploy")
def deploy_cmd(
    pool: Annotated[
        str, typer.Option(help="The process work pool (created when missing) workers serve.")
    ],
    cron: CronOpt = None,
    interval: IntervalOpt = None,
    flow: ScheduledFlowOpt = "end_to_end",
    working_dir: Annotated[
        str | None,
        typer.Option(help="Where workers start runs (relative paths resolve there); default: cwd."),
    ] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Deploy the flows to a work pool on PREFECT_API_URL's server, for `prefect worker start`.

    Runs import dlrmflow from each worker's environment: install it on every worker host.
    """
    from dlrmflow.flows.deploy import deploy_flows

    if cron is not None and interval is not None:
        raise ConfigError("give --cron or --interval, not both")
    result = deploy_flows(
        pool,
        _config(config, set_),
        cron=cron,
        interval=interval,
        scheduled=flow,
        working_dir=working_dir,
    )
    _echo_json(result)


@app.command("stats")
def stats_cmd(
    data: Annotated[str | None, typer.Option(help="Dataset URL (default: data.url).")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Per-column statistics of a dataset (missing rates, distinct IDs, dense ranges)."""
    from dlrmflow.ingest.stats import dataset_stats, write_stats

    url = _config(config, set_, **{"data.url": data}).data.url
    stats = dataset_stats(url)
    write_stats(url, stats)
    _echo_json(stats.to_dict())


@readers_app.command("serve")
def readers_serve(
    listen: Annotated[str, typer.Option(help="HOST:PORT to serve on (port 0: any free port).")],
    data: Annotated[str | None, typer.Option(help="Dataset URL (default: data.url).")] = None,
    workers: Annotated[int, typer.Option(help="Row groups preprocessed at once.")] = 2,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Serve preprocessed batches over Arrow Flight until SIGINT/SIGTERM.

    Use the trainers' configuration (the same features and batch size); trainers connect
    with `dlrmflow train --readers HOST:PORT,...`.
    """
    import logging

    from dlrmflow.train.reader_servers import serve_readers

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = _config(config, set_, **{"data.url": data})
    serve_readers(cfg, listen, workers)


@bench_app.command("precision")
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

    _emit_benchmark(run_precision_benchmark(data, rounds=rounds, quick=quick), json_out)


@bench_app.command("scale")
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
    _emit_benchmark(result, json_out)


@bench_app.command("readers")
def bench_readers(
    json_out: JsonOpt = None,
    rows: Annotated[int, typer.Option(help="Rows in the benchmark dataset.")] = 400_000,
) -> None:
    """Trainer samples/s and data-wait share: local readers against 1 and 2 reader servers."""
    from dlrmflow.bench.readers import run_readers_benchmark

    result = run_readers_benchmark(rows=rows)
    _emit_benchmark(result, json_out)


@bench_app.command("report")
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


@bench_app.command("ingest-days")
def bench_ingest_days(
    json_out: JsonOpt = None,
    quick: QuickOpt = False,
    repeats: Annotated[int, typer.Option(min=1, help="Rounds; each runner's best counts.")] = 2,
) -> None:
    """Days converted per minute by the ingest flow on a Dask cluster of 2 workers against 1."""
    from dlrmflow.bench.ingest_days import run_ingest_days_benchmark

    _emit_benchmark(run_ingest_days_benchmark(quick=quick, repeats=repeats), json_out)


@bench_app.command("docs")
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
) -> None:
    """Regenerate docs/benchmarks.md and the README's results table from a report's JSON."""
    from dlrmflow.bench.docs import write_docs

    _echo_json(write_docs(report, docs_dir, readme, scale))


@bench_app.command("train")
def bench_train(
    json_out: JsonOpt = None,
    quick: QuickOpt = False,
    steps: Annotated[int | None, typer.Option(help="Timed steps per mode.")] = None,
) -> None:
    """Sharded training samples/s per sharding type and codec, at world sizes 1 and 2."""
    from dlrmflow.bench.train import run_train_benchmark

    result = run_train_benchmark(quick=quick, steps=steps)
    _emit_benchmark(result, json_out)


def _one_line(error: BaseException) -> str:
    """The message of an expected failure as one line (nested causes joined by ': ')."""
    text = str(error) or type(error).__name__
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        text = f"{error.filename}: {error.strerror}"
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def main() -> None:
    """Entry point: turns expected failures (bad config, bad data, a busy or full disk, a
    failed rank) into one line and exit 1; ``DLRMFLOW_DEBUG=1`` shows the traceback."""
    import warnings

    from dlrmflow.errors import DlrmflowError

    # A warning is one line too (the run record keeps it where it matters).
    warnings.formatwarning = lambda message, category, *_: f"warning: {message}\n"
    try:
        env_overrides()  # a DLRMFLOW_ variable naming no key fails every command, not some
        tune_allocator()
        app()
    except (DlrmflowError, ValueError, OSError) as e:
        # The message names the key, file, row group, column, step or rank; a traceback
        # would only bury it.
        if os.environ.get("DLRMFLOW_DEBUG"):
            raise
        typer.echo(f"error: {_one_line(e)}", err=True)
        sys.exit(1)
    except Exception as e:
        # Prefect's client fails with a chain of tracebacks when its API does not answer;
        # any command whose flows talk to one says so in a line.
        unreachable = _prefect_unreachable(e)
        if unreachable is None or os.environ.get("DLRMFLOW_DEBUG"):
            raise
        typer.echo(f"error: {_one_line(unreachable)}", err=True)
        sys.exit(1)


def _prefect_unreachable(error: BaseException) -> Exception | None:
    """The one-line error when ``error`` is Prefect's API not answering (only a command
    that imported Prefect can have met it)."""
    if "prefect" not in sys.modules:
        return None
    from dlrmflow.flows.api import unreachable_api

    return unreachable_api(error)
