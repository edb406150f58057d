"""Commands that run a model: ``config``, ``train``, ``plan``, ``evaluate``, ``export`` and
``demo``.

Each parses its flags into the configuration and prints what the library returns: the
work (planning a topology, the demo's configuration, which evaluation settings may
change) is in the library, where the flows and tests call it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, get_args

import typer

from dlrmflow.cli.options import (
    ConfigOpt,
    ConnectTimeoutOpt,
    LocalAddrOpt,
    NnodesOpt,
    NodeRankOpt,
    Progress,
    RdzvEndpointOpt,
    SetOpt,
    echo_json,
    host_flags,
    host_result,
    resolve,
)
from dlrmflow.config import ConfigError, DeviceType, KernelsType, load_config


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


def train(
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

    from dlrmflow.train.launch.job import launch_training
    from dlrmflow.train.run.rundir import run_dir_lock

    cfg = resolve(
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
            **host_flags(nnodes, node_rank, rdzv_endpoint, local_addr, connect_timeout),
        },
    )
    bar = Progress(None, "train", unit="steps")
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
    echo_json(host_result(node_rank, None if result is None else result.to_dict()))


def plan(
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
    from dlrmflow.train import planner

    memory = {
        "device_bytes": device_memory,
        "dram_bytes": dram_memory,
        "ssd_bytes": ssd_memory,
        "cache_load_factor": cache_load_factor,
    }
    if preset is not None:
        if preset not in planner.PRESETS:
            known = ", ".join(planner.PRESETS)
            raise ConfigError(f"--preset: unknown preset {preset!r} (known: {known})")
        result = planner.plan_preset(preset, **memory)
    else:
        cfg = resolve(config, set_)
        result = planner.plan_for_dataset(cfg, world_size, ranks_per_host, **memory)
    if json_out:
        echo_json(result.to_dict())
    else:
        typer.echo(planner.format_plan(result, max_shards=max_shards))


def evaluate(
    run_dir: Annotated[str, typer.Option(help="Run directory holding the checkpoint.")],
    data: Annotated[str | None, typer.Option(help="Dataset URL (default: the run's).")] = None,
    checkpoint: Annotated[
        str | None, typer.Option(help="A checkpoint directory (default: the newest intact).")
    ] = None,
    max_rows: Annotated[int | None, typer.Option(help="Score at most this many rows.")] = None,
    nproc: Annotated[
        int | None,
        typer.Option(
            help="Ranks that score it, 1 by default (the checkpoint reshards to them).",
            show_default=False,
        ),
    ] = None,
    nnodes: NnodesOpt = None,
    node_rank: NodeRankOpt = None,
    rdzv_endpoint: RdzvEndpointOpt = None,
    local_addr: LocalAddrOpt = None,
    connect_timeout: ConnectTimeoutOpt = None,
    device: Annotated[
        str | None,
        typer.Option(
            help=f"{', '.join(get_args(DeviceType)[:-1])} or {get_args(DeviceType)[-1]} "
            "(auto, the default: CUDA when present), whatever trained it.",
            show_default=False,
        ),
    ] = None,
    kernels: Annotated[
        str | None,
        typer.Option(
            help=f"{', '.join(get_args(KernelsType)[:-1])} or {get_args(KernelsType)[-1]}, "
            "as model.kernels (default auto).",
            show_default=False,
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="YAML, JSON or TOML evaluation settings: data.url, eval.*, train.device, "
            "model.kernels, distributed.nproc and the hosts' keys (the model is the run's).",
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", "-s", help="Set an evaluation key, e.g. --set eval.max_rows=100000."),
    ] = None,
) -> None:
    """Evaluate a trained model on the held-out test day; writes RUN_DIR/eval.json.

    On many hosts, run it on each with --nnodes, its --node-rank and --rdzv-endpoint.
    """
    # Checked before anything starts (torchrun would fail on them in many lines).
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, not {nproc}")
    from dlrmflow.train.launch.job import launch_evaluation
    from dlrmflow.train.launch.multihost import Hosts
    from dlrmflow.train.run.checkpoint import find_checkpoint
    from dlrmflow.train.run.evaluate import check_run_dir, evaluation_settings

    # Flags, --config and --set, typed by the configuration; the job's hosts also from
    # DLRMFLOW_DISTRIBUTED__* variables (one per host). Never the model: the run's own.
    settings = evaluation_settings(
        config,
        set_,
        {
            "data.url": data,
            "eval.max_rows": max_rows,
            "distributed.nproc": nproc,
            "train.device": device,
            "model.kernels": kernels,
            **host_flags(nnodes, node_rank, rdzv_endpoint, local_addr, connect_timeout),
        },
    )
    hosts = settings.distributed
    Hosts.from_config(hosts)  # a bad host option is named before the run is looked at
    check_run_dir(run_dir)  # never created: eval.json goes beside the run it scores
    find_checkpoint(checkpoint or run_dir, verified=False)  # a checkpoint, or one line
    bar = Progress(None, "evaluate")
    if settings.nproc == 1 and hosts.nnodes == 1:
        from dlrmflow.train.run.evaluate import evaluate as evaluate_run

        metrics = evaluate_run(
            run_dir,
            data_url=settings.data_url,
            checkpoint=checkpoint,
            max_rows=settings.max_rows,
            progress=bar,
            device=settings.device,
            kernels=settings.kernels,
            batch_size=settings.batch_size,
            eval_days=settings.eval_days,
        )
    else:
        metrics = launch_evaluation(
            run_dir,
            settings.nproc,
            data_url=settings.data_url,
            checkpoint=checkpoint,
            max_rows=settings.max_rows,
            distributed=hosts,
            device=settings.device,
            kernels=settings.kernels,
            batch_size=settings.batch_size,
            eval_days=settings.eval_days,
        )
    bar.close()
    echo_json(host_result(hosts.node_rank, metrics))


def export(
    run_dir: Annotated[str, typer.Option(help="Run directory (its newest intact checkpoint).")],
    out: Annotated[str, typer.Option(help="The file to write (.safetensors or .pt2).")],
    checkpoint: Annotated[str | None, typer.Option(help="A checkpoint directory.")] = None,
    format_: Annotated[
        str,
        typer.Option(
            "--format",
            help="safetensors: the weights by parameter name; torch-export: a servable "
            "torch.export program (.pt2) that torch.export.load runs without dlrmflow.",
        ),
    ] = "safetensors",
    quantize: Annotated[
        str,
        typer.Option(help="torch-export: the embedding tables as none (fp32), fp16 or int8."),
    ] = "none",
    verify_rows: Annotated[
        int | None,
        typer.Option(
            help="torch-export: held-out rows scored by both the export and the checkpoint "
            "(default 50000; 0 skips the check).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Write the whole model (every table, every dense parameter) as one file.

    --format safetensors (the default) writes the checkpoint's weights by name with the
    run's config and feature spec. --format torch-export writes a servable program: plain
    tensors in (dense [B, n_dense], key-major IDs values [N] and offsets [T*B+1]), click
    probabilities out, the metadata inside; --quantize fp16 or int8 shrinks its tables.
    Before it is published, the program is loaded back and scored against the checkpoint
    on up to --verify-rows rows of the run's test day; the result states the tables' bytes
    and the largest probability difference and the AUC change it found.
    """
    from dlrmflow.train.run.exported_model import export_run

    echo_json(
        export_run(
            run_dir,
            out,
            checkpoint=checkpoint,
            fmt=format_,
            quantize=quantize,
            verify_rows=verify_rows,
        )
    )


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
    base = load_config(config, set_)
    from dlrmflow.flows.api import require_api
    from dlrmflow.flows.end_to_end import demo_config, run_demo

    cfg = demo_config(base, run_dir, quick)
    require_api()
    typer.echo(
        f"end_to_end flow: generate {cfg.data.days} x {cfg.data.rows_per_day} rows -> train on "
        f"{cfg.distributed.nproc} rank(s) -> evaluate -> report, in {run_dir} "
        "(task logs go to the Prefect API)",
        err=True,
    )
    summary = run_demo(cfg)
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        typer.echo(f"{key:<{width}}  {shown}")
    typer.echo(f"summary: {Path(run_dir) / 'summary.json'}")
