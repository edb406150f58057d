"""The run configuration: one typed, validated model used by every command.

A configuration comes from defaults, then an optional file (YAML, JSON or TOML), then
``DLRMFLOW_SECTION__KEY=value`` environment variables, then ``section.key=value`` overrides
from the command line, in that order (a command's own flags come last). Unknown keys and bad
values fail with an error that names the key (and the variable, for the environment), so a
typo never silently falls back to a default.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import yaml
from pydantic import (
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from dlrmflow.days import parse_window
from dlrmflow.errors import DlrmflowError


class ConfigError(DlrmflowError, ValueError):
    """A configuration file or override that cannot be used; the message names the key."""


def _not_bool(value: Any) -> Any:
    # pydantic would read true as 1: a boolean where a number belongs is a mistake.
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    return value


# Numbers: never a boolean, and never an infinite or NaN rate or size (1e-3 written as
# text, which YAML leaves a string, still reads as a number).
Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool), AllowInfNan(False)]
Size = Annotated[Int, Field(ge=1)]

# How a table is spread over ranks (``distributed.sharding``). Named here, where every
# setting's values are, so that the configuration imports no stage above it; the plan's
# nouns (``dlrmflow.train.model.plan``) take it from here.
ShardingType = Literal["data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise"]
# Where a model runs (``train.device``) and what runs its embeddings and interaction
# (``model.kernels``): named so that commands taking them as flags (``dlrmflow evaluate``)
# check and list the same values.
DeviceType = Literal["auto", "cpu", "cuda"]
KernelsType = Literal["auto", "torch", "compiled", "triton", "fbgemm"]


def flat_keys(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested configuration (or any nested mapping) by dotted key: ``{"train.lr": 0.05}``."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            flat.update(flat_keys(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_keys(
    old: RunConfig, new: RunConfig, keys: Sequence[str], ignore: Sequence[str] = ()
) -> dict[str, list[Any]]:
    """``{key: [old's value, new's]}`` for every key under one of ``keys`` (a section such
    as "model", or one key such as "train.lr") and not in ``ignore`` that differs."""
    before = flat_keys(old.model_dump(mode="json"))
    after = flat_keys(new.model_dump(mode="json"))

    def wanted(key: str) -> bool:
        return key not in ignore and any(key == k or key.startswith(k + ".") for k in keys)

    return {
        key: [before.get(key), after.get(key)]
        for key in sorted(before.keys() | after.keys())
        if wanted(key) and before.get(key) != after.get(key)
    }


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    """Where the Parquet dataset lives and how the synthetic generator makes it."""

    url: str = Field("data/synthetic", description="dataset root: a local path or fsspec URL")
    days: Int = Field(6, ge=2, description="day partitions to generate; the last is the test day")
    rows_per_day: Int = Field(200_000, ge=1)
    seed: Int = 0
    multi_hot: bool = False
    cardinality_scale: Float = Field(
        0.002, gt=0, le=1, description="scales Criteo's per-feature cardinalities"
    )
    max_cardinality: Int = Field(
        50_000, ge=2, description="cap on any generated feature's cardinality"
    )
    positive_rate: Float = Field(0.25, gt=0, lt=1)
    row_group_size: Int = Field(65_536, ge=1, description="rows per Parquet row group")
    drift: Float = Field(
        0.0,
        ge=0,
        le=1,
        description="synthetic: how far the click model's effects move from one day to the "
        "next (an AR(1) step of correlation 1 - drift; data.churn turns the IDs over); 0 "
        "keeps the days i.i.d.",
    )
    base_rate_step: Float | None = Field(
        None,
        ge=0,
        le=1,
        description="synthetic: the daily step (standard deviation, in log-odds) of the "
        "click rate's random walk; None: 0.03 on days that move (drift or churn > 0), "
        "else 0. Each day's bias is set to its rate, so the click model's drift no longer "
        "moves it",
    )
    weekly: Float = Field(
        0.0,
        ge=0,
        le=2,
        description="synthetic: the amplitude (log-odds) of the click rate's weekly cycle",
    )
    churn: Float = Field(
        0.0,
        ge=0,
        lt=1,
        description="synthetic: the share of each feature's IDs born each day, at random "
        "popularity ranks, pushing older IDs down (their popularity decays); as many of the "
        "least popular stop appearing. 0: no churn",
    )
    landing: str | None = Field(
        None,
        description="a directory raw Criteo day files land in, a file a day: a model line "
        "(dlrmflow line, the recurring flow) converts each new one into url before "
        "training, day K being the K-th file in name order",
    )
    train_days: str | list[Int] | None = Field(
        None,
        description="days to train on: days (5), ranges (0-22), all, first N, last N, "
        "all_but_last N, joined by commas, or a list; default every day not evaluated on",
    )
    eval_days: str | list[Int] | None = Field(
        None,
        description="held-out days to score on, as train_days; default the dataset's test "
        "day (its last)",
    )

    @field_validator("train_days", "eval_days", mode="before")
    @classmethod
    def _one_day(cls, value: Any) -> Any:
        # One day, as ``--set data.eval_days=5`` gives it (YAML reads a number).
        return [value] if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("train_days", "eval_days")
    @classmethod
    def _check_window(cls, value: str | list[int] | None) -> str | list[int] | None:
        if value is not None:
            parse_window(value)  # a WindowError (a ValueError) says what a window looks like
        return value


class FeaturesConfig(_Section):
    """How raw IDs become embedding rows."""

    ids: Literal["hash", "vocab", "dynamic"] = Field(
        "hash",
        description="for every ID column whose schema sets no ids: hash, vocab (of the "
        "training days) or dynamic (a row per live ID, kept by the trainer)",
    )
    max_rows_per_table: Int = Field(
        100_000, ge=2, description="hash buckets (or vocabulary cap, or dynamic rows) per table"
    )
    hash_size_factor: Float = Field(
        4.0, ge=1, description="hash: buckets per distinct ID when the cardinality is known"
    )
    min_count: Int = Field(2, ge=1, description="vocab: IDs seen fewer times share the OOV row")
    pooling: Literal["sum", "mean"] = Field(
        "sum", description="how a bag of IDs is pooled (mean suits long multi-hot lists)"
    )
    admit_after: Int | None = Field(
        None, ge=1, description="dynamic: sightings before an ID gets a row (None: 1)"
    )
    ttl: Int | None = Field(
        None, ge=1, description="dynamic: training steps unseen before an ID's row is freed"
    )
    evict_every: Int | None = Field(
        None, ge=1, description="dynamic: steps between evictions (None: 1000)"
    )
    map_shards: Int | None = Field(
        None,
        ge=1,
        description="dynamic: shards of each map, held by a job's ranks in turn "
        "(None: one per 16,384 rows, at most 64)",
    )


class ModelConfig(_Section):
    """DLRM sizes. ``arch=dcnv2`` replaces the dot interaction with a cross network."""

    arch: Literal["dlrm", "dcnv2"] = "dlrm"
    embedding_dim: Int = Field(16, ge=1)
    bottom_mlp: list[Size] = Field(default_factory=lambda: [64, 16], min_length=1)
    top_mlp: list[Size] = Field(default_factory=lambda: [128, 64], min_length=1)
    dcn_layers: Int = Field(3, ge=1)
    dcn_low_rank: Int = Field(32, ge=1)
    kernels: KernelsType = Field(
        "auto",
        description="TBE and interaction kernels: auto (on CUDA FBGEMM's where fbgemm_gpu's "
        "CUDA build works, else Triton's; the compiled kernels on the CPU), plain torch ops, "
        "compiled (CPU), triton (CPU tensors need TRITON_INTERPRET=1) or fbgemm (fbgemm_gpu's "
        "CPU or CUDA build; the interaction runs auto's)",
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> ModelConfig:
        if self.arch == "dlrm" and self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"bottom_mlp must end in embedding_dim={self.embedding_dim} for the dot "
                f"interaction (got {self.bottom_mlp[-1]})"
            )
        return self


class LrScheduleConfig(_Section):
    """How the dense and the embedding learning rates move over training: a linear
    warm-up over the run's first steps, then constant, or a decay to ``floor`` over each
    pass (an epoch, or a day in day order) that restarts with the next. A pass's steps are
    counted as its readers will cut them (reader servers list the row groups for it) and
    kept in the checkpoints as it begins."""

    warmup_steps: Int = Field(0, ge=0, description="steps rising linearly to the full rates")
    decay: Literal["constant", "linear", "polynomial"] = Field(
        "linear", description="how the rates fall after decay_start (constant: they do not)"
    )
    decay_start: Float = Field(
        0.5, ge=0, lt=1, description="the share of each pass before the rates start to fall"
    )
    power: Float = Field(2.0, gt=0, description="polynomial: the exponent of the decay")
    floor: Float = Field(
        0.0, ge=0, le=1, description="the rates at each pass's end, as a share of the full ones"
    )


class TrainConfig(_Section):
    """The training loop and its data loading."""

    batch_size: Int = Field(2048, ge=1)
    epochs: Int = Field(1, ge=1)
    max_steps: Int | None = Field(None, ge=1, description="stop after this many steps")
    optimizer: Literal["adagrad", "sgd"] = Field(
        "adagrad",
        description="the embeddings' optimizer, fused into their backward (row-wise Adagrad or "
        "SGD), and the dense layers' unless train.dense_optimizer says otherwise",
    )
    dense_optimizer: Literal["adam", "adagrad", "sgd"] | None = Field(
        "adam", description="the dense layers' optimizer (null: train.optimizer's)"
    )
    lr: Float = Field(0.002, gt=0, description="the dense layers' learning rate")
    embedding_lr: Float | None = Field(
        0.05, gt=0, description="the embeddings' learning rate (null: train.lr)"
    )
    lr_schedule: LrScheduleConfig = Field(default_factory=LrScheduleConfig)
    seed: Int = 0
    log_every: Int = Field(50, ge=1, description="steps between metrics.jsonl records")
    num_workers: Int = Field(
        1, ge=0, description="reader threads decoding ahead (0: read in the training loop)"
    )
    shuffle: bool = True
    shuffle_window: Int = Field(4, ge=1, description="row groups whose rows are shuffled together")
    order: Literal["shuffled", "days"] = Field(
        "shuffled",
        description="shuffled: each epoch reads the training days' row groups in one shuffled "
        "order; days: each training day once, in day order, shuffled within itself by a seed "
        "from the day, so that a run continues when the window grows by a day",
    )
    threads: Int | None = Field(
        None, ge=1, description="torch intra-op threads (default: cores left by the readers)"
    )
    device: DeviceType = Field(
        "auto", description="where the model trains: auto is cuda:LOCAL_RANK when CUDA is present"
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="bf16: the dense arch under bfloat16 autocast (embeddings and optimizer "
        "state stay fp32)",
    )
    checkpoint_every: Int | None = Field(
        None, ge=1, description="steps between checkpoints (default: only at the end)"
    )
    keep_checkpoints: Int = Field(2, ge=1, description="complete checkpoints kept (plus the best)")
    embedding_memory_bytes: Int | None = Field(
        None,
        ge=1,
        description="per rank: memory for embedding rows and their optimizer state. A job's "
        "planner keeps the shards that fit in memory and puts the rest on disk "
        "(RUN_DIR/embeddings/rank{r}) behind a cache of hot rows in what is left; one process "
        "puts every table on disk, behind a cache this size, once they exceed it",
    )
    resume: str = Field(
        "auto",
        description='"auto": continue from the run dir\'s newest checkpoint; "never"; or a path',
    )
    eval_every: Int | None = Field(
        None, ge=1, description="steps between evaluations on the test day during training"
    )
    tracker: Literal["none", "tensorboard", "mlflow"] = Field(
        "none",
        description="also log metrics.jsonl's records and the config to TensorBoard "
        "(RUN_DIR/tensorboard) or MLflow; needs the dlrmflow[tensorboard] or [mlflow] extra",
    )
    tracking_uri: str | None = Field(
        None, description="mlflow: the tracking URI (default: the file store RUN_DIR/mlruns)"
    )
    experiment: str = Field("dlrmflow", min_length=1, description="mlflow: the experiment name")

    @model_validator(mode="after")
    def _check_order(self) -> TrainConfig:
        if self.order == "days" and self.epochs != 1:
            raise ValueError(
                f"train.order=days reads each training day once: train.epochs must be 1 "
                f"(got {self.epochs})"
            )
        return self


class ReaderSecurityConfig(_Section):
    """How reader services and their trainers trust each other: TLS, and a shared secret
    that every call carries. Only file paths live here, never the secret itself, since the
    resolved configuration is written to ``RUN_DIR/config.json`` and checkpoints."""

    tls: bool = Field(
        False,
        description="serve and connect over TLS (grpc+tls): servers present cert_file, "
        "trainers check it against ca_file",
    )
    cert_file: str | None = Field(
        None, description="server: its PEM certificate (chain), valid for the reader's address"
    )
    key_file: str | None = Field(None, description="server: the PEM private key of cert_file")
    ca_file: str | None = Field(
        None,
        description="trainer: PEM root certificates to check servers by (default: the system's)",
    )
    secret_file: str | None = Field(
        None,
        description="a file holding the secret every call must carry (or the environment's "
        "DLRMFLOW_READER_SECRET); servers refuse calls without it",
    )

    @model_validator(mode="after")
    def _check_tls(self) -> ReaderSecurityConfig:
        # A certificate given with TLS off would serve in plain text without a word.
        given = [k for k in ("cert_file", "key_file", "ca_file") if getattr(self, k) is not None]
        if given and not self.tls:
            raise ValueError(f"{', '.join(given)} given but tls is false: set tls: true")
        return self


class DistributedConfig(_Section):
    """How training is spread over processes: sharding, communication precision, launch."""

    nproc: Int = Field(1, ge=1, description="ranks on this host (>1: launched with torchrun)")
    ranks_per_host: Int | None = Field(
        None, ge=1, description="for planning; default: nproc (one host)"
    )
    sharding: ShardingType | None = Field(
        None, description="force one sharding type on every table (default: the planner picks)"
    )
    comms: Literal["fp32", "fp16", "bf16", "fp8", "int8"] = Field(
        "fp32", description="precision of the forward embedding all-to-all"
    )
    backward_comms: Literal["fp32", "fp16", "bf16"] = Field(
        "fp32", description="precision of the backward (gradient) all-to-all"
    )
    dense_comms: Literal["fp32", "fp16", "bf16"] = Field(
        "fp32", description="precision of the dense gradient allreduce (a DDP comm hook)"
    )
    pipeline: bool = Field(
        True, description="start the next batch's input all-to-all while this one computes"
    )
    timeout_s: Float = Field(
        300.0, gt=0, description="collective timeout: a dead peer ends the job after this"
    )
    readers: list[str] = Field(
        default_factory=list, description="remote reader endpoints HOST:PORT (default: local)"
    )
    reader_timeout_s: Float = Field(
        30.0,
        gt=0,
        description="a reader server that leaves a request or a stream's next batch "
        "unanswered this long counts as hung: its streams fail over to the next endpoint",
    )
    reader_security: ReaderSecurityConfig = Field(default_factory=ReaderSecurityConfig)
    # Many hosts: every host runs the same command with its own node_rank (and local_addr).
    nnodes: Int = Field(1, ge=1, description="hosts in the job (>1: c10d rendezvous)")
    node_rank: Int = Field(
        0, ge=0, description="this host's place: 0 runs the rendezvous and holds rank 0"
    )
    rdzv_endpoint: str | None = Field(
        None, description="HOST:PORT of node 0's rendezvous, reachable from every host"
    )
    local_addr: str | None = Field(
        None,
        description="the address this host advertises (default: its address on the route "
        "to rdzv_endpoint)",
    )
    connect_timeout_s: Float = Field(
        60.0,
        gt=0,
        description="start-up: each wait (the endpoint, the other hosts, their addresses) "
        "fails after this, naming the address",
    )


class EvalConfig(_Section):
    """Evaluation on the held-out test day."""

    batch_size: Int = Field(16_384, ge=1)
    max_rows: Int | None = Field(None, ge=1, description="evaluate on at most this many rows")


class GateConfig(_Section):
    """When a model line's version replaces the one serving (``dlrmflow line``): both are
    scored on the same day, one neither has trained on."""

    ne_margin: Float = Field(
        0.0,
        ge=0,
        description="promoted when its normalized entropy is at most the champion's times "
        "1 + this (0: no worse)",
    )
    calibration_min: Float = Field(
        0.8, gt=0, description="and its calibration (mean prediction / click rate) at least this"
    )
    calibration_max: Float = Field(1.25, gt=0, description="and at most this")
    ne: Literal["ne", "ne_recalibrated"] = Field(
        "ne_recalibrated",
        description="which NE the margin compares: ne_recalibrated (NE once each model's "
        "predictions are shifted to the day's click rate: sharpness and ranking, not "
        "calibration), or ne",
    )
    recalibration_share: Float = Field(
        0.25,
        ge=0,
        lt=1,
        description="the share of the next day's rows each version's recalibration "
        "(a shift of its logit) is fitted on; the rest judge it (0: none)",
    )
    recalibration_rows: Literal["spread", "first"] = Field(
        "spread",
        description="which rows fit it: spread (evenly over the day, by each row's place) "
        "or first (the day's first rows: its first hours, for logs in time order)",
    )
    calibration: Literal["recalibrated", "raw"] = Field(
        "recalibrated",
        description="which calibration the bounds judge: the version's once recalibrated "
        "(on the rows its recalibration was not fitted on), or raw (its own, on the day)",
    )
    calibration_follows_rate: bool = Field(
        False,
        description="with calibration: raw, judge it against the click rate of the days the "
        "version trained on rather than the day's (calibration x the day's rate / theirs): "
        "a day whose rate moved then holds no version back for that alone",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> GateConfig:
        if self.calibration_min >= self.calibration_max:
            raise ValueError(
                f"calibration_min ({self.calibration_min}) must be below calibration_max "
                f"({self.calibration_max})"
            )
        return self


class OrchestrationConfig(_Section):
    """Where the flows' tasks run (ingest's per-day conversion and statistics tasks) and
    where their cached results are kept."""

    task_runner: Literal["threads", "dask"] = Field(
        "threads", description="threads: in the flow's process; dask: on a Dask cluster"
    )
    dask_workers: Int = Field(
        2, ge=1, description="dask: worker processes (1 thread each) of a local cluster"
    )
    dask_address: str | None = Field(
        None, description="dask: an existing scheduler (tcp://HOST:PORT) instead of a local one"
    )
    result_storage: str | None = Field(
        None,
        description=(
            "where cached task results live, a path or fsspec URL every worker can reach "
            "(None: DATA_URL/_prefect_results)"
        ),
    )


class RunConfig(_Section):
    """Everything one run needs; the single source of truth for every command."""

    run_dir: str = "runs/demo"
    data: DataConfig = Field(default_factory=DataConfig)
    features: FeaturesConfig = Field(default_factory=FeaturesConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)

    @model_validator(mode="after")
    def _check_day_order(self) -> RunConfig:
        if self.train.order == "days" and self.distributed.readers:
            raise ValueError(
                "train.order=days: its days are read by local readers for now; leave "
                "distributed.readers empty"
            )
        return self


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last
    and drops the first without a word, so a file with two ``train:`` sections would lose
    half of its settings."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                first = seen[key].start_mark.line + 1
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} given twice (first on line {first})",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (``json`` keeps the last silently)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ConfigError(f"key {key!r} given twice in one object")
        data[key] = value
    return data


def _read_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
        elif p.suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_json_object)
        elif p.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"{p}: unknown config format (use .yaml, .yml, .json or .toml)")
    except yaml.MarkedYAMLError as e:
        where = f"line {e.problem_mark.line + 1}: " if e.problem_mark is not None else ""
        raise ConfigError(f"{p}: cannot parse: {where}{e.problem or e.context}") from e
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{p}: cannot parse: {e}") from e
    except ConfigError as e:
        if str(e).startswith(f"{p}: "):
            raise
        raise ConfigError(f"{p}: cannot parse: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections")
    return data


def _parse_value(what: str, raw: str) -> Any:
    """A value written as text (``--set``, the environment) read as YAML: 0.1, [64, 32]."""
    try:
        return yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what}: cannot parse value {raw!r}: {e}") from e


def _set_key(data: dict[str, Any], key: str, value: Any, what: str) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{what}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _apply_override(data: dict[str, Any], override: str) -> str:
    """Apply ``section.key=value`` to ``data``; returns the key."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {override!r}: expected KEY=VALUE, e.g. train.lr=0.1")
    _set_key(data, key, _parse_value(f"override {key}", raw), f"override {key}")
    return key


# Configuration from the environment: DLRMFLOW_SECTION__KEY=value (DLRMFLOW_RUN_DIR for a
# top-level key), values read as YAML like --set's. This is a small reader of os.environ
# on top of the --set machinery rather than pydantic-settings (installed, 2.16.3, with
# prefect): as a BaseSettings, RunConfig would read the environment wherever it is built
# (checkpoint manifests, flow parameters, every rank); its env source parses lists as JSON
# where --set takes YAML, silently ignores a variable naming no section
# (DLRMFLOW_TRIAN__LR), cannot name the variable in an error, and sits between the file
# and --set only with both split into custom sources.
ENV_PREFIX = "DLRMFLOW_"
ENV_SEPARATOR = "__"
# DLRMFLOW_ variables that mean something else; never read as configuration. Every other
# DLRMFLOW_ variable is configuration, so a misspelt one (DLRMFLOW_TRAIN_LR with one
# underscore, DLRMFLOW_RUNDIR) is an error rather than a setting silently ignored.
RESERVED_ENV = frozenset(
    {
        "DLRMFLOW_DEBUG",  # tracebacks instead of one-line errors (dlrmflow.errors)
        "DLRMFLOW_HELD_RUN_DIRS",  # run directories a parent holds (dlrmflow.train.run.rundir)
        "DLRMFLOW_MMAP_THRESHOLD",  # glibc's mmap threshold (dlrmflow.runtime.glibc_malloc)
        "DLRMFLOW_TEST_SEED",  # the test suite's random kill point, to replay one
        "DLRMFLOW_SUPERVISOR_PID",  # the process a job's agent must not outlive (train.supervise)
        "DLRMFLOW_HEARTBEAT_DIR",  # where a job's ranks record their progress (train.supervise)
        "DLRMFLOW_COMMAND",  # the token of the command a process was started by (guard)
        "DLRMFLOW_READER_SECRET",  # the reader services' secret (ingest.service), never a key
    }
)


def env_key(name: str) -> str | None:
    """The configuration key an environment variable sets (``DLRMFLOW_TRAIN__LR``:
    ``train.lr``; ``DLRMFLOW_RUN_DIR``: ``run_dir``), or None when it is not ours or is
    reserved. The key may not exist."""
    if not name.startswith(ENV_PREFIX) or name in RESERVED_ENV:
        return None
    return ".".join(name[len(ENV_PREFIX) :].lower().split(ENV_SEPARATOR))


def _env_name(key: str) -> str:
    return ENV_PREFIX + ENV_SEPARATOR.join(key.split(".")).upper()


def _section_keys(model: type[_Section], prefix: str = "") -> list[str]:
    """Every dotted key of a section, its sub-sections (``train.lr_schedule``) and their
    keys included."""
    keys = []
    for name, info in model.model_fields.items():
        keys.append(prefix + name)
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, _Section):
            keys += _section_keys(sub, f"{prefix}{name}.")
    return keys


def _known_key(key: str) -> bool:
    return key in _section_keys(RunConfig)


def _env_suggestion(name: str) -> str:
    """ ", did you mean DLRMFLOW_TRAIN__LR?" for the nearest variable that is a key."""
    names = [_env_name(key) for key in _section_keys(RunConfig)]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
    return f"; did you mean {close[0]}?" if close else ""


def env_overrides(environ: Mapping[str, str] | None = None) -> list[tuple[str, str, Any]]:
    """``(variable, key, value)`` for each configuration variable in ``environ`` (default:
    ``os.environ``), whole sections before their keys; an unknown key is a ``ConfigError``
    naming every such variable."""
    environ = os.environ if environ is None else environ
    found = [(name, key) for name in environ if (key := env_key(name)) is not None]
    unknown = [
        f"environment variable {name}: {key}: unknown key{_env_suggestion(name)}"
        for name, key in sorted(found)
        if not _known_key(key)
    ]
    if unknown:
        raise ConfigError("invalid configuration: " + "; ".join(unknown))
    found.sort(key=lambda item: (item[1].count("."), item[0]))
    return [
        (name, key, _parse_value(f"environment variable {name}", environ[name]))
        for name, key in found
    ]


class Source(NamedTuple):
    """Where a key's value came from: a file, an environment variable, --set or a flag."""

    kind: Literal["file", "env", "set", "flag"]
    name: str

    def __str__(self) -> str:
        return {
            "file": f"file {self.name}",
            "env": f"environment {self.name}",
            "set": "--set",
            "flag": "flag",
        }[self.kind]


@dataclass
class ResolvedConfig:
    """A ``RunConfig`` and, for each key a layer set, the last layer that set it."""

    config: RunConfig
    sources: dict[str, Source] = field(default_factory=dict)


def _leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        elif not isinstance(value, Mapping):
            yield f"{prefix}{key}"


def _set_origin(origins: dict[str, Source], key: str, source: Source) -> None:
    # A whole section set again replaces what set its keys before.
    for old in [k for k in origins if k.startswith(key + ".")]:
        del origins[old]
    origins[key] = source


def _origin_of(origins: Mapping[str, Source], key: str) -> Source | None:
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        if (source := origins.get(".".join(parts[:n]))) is not None:
            return source
    return None


def _format_errors(err: ValidationError, origins: Mapping[str, Source] | None = None) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        origin = _origin_of(origins or {}, key)
        where = f"environment variable {origin.name}: " if origin and origin.kind == "env" else ""
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}{key}: unknown key")
        elif isinstance(e.get("input"), dict):
            lines.append(f"{where}{key}: {e['msg']}")
        else:
            lines.append(f"{where}{key}: {e['msg']} (got {e.get('input')!r})")
    return "invalid configuration: " + "; ".join(lines)


def build_config(data: dict[str, Any], origins: Mapping[str, Source] | None = None) -> RunConfig:
    """Validate a nested mapping into a ``RunConfig``, raising ``ConfigError`` naming keys
    (and the environment variable that set one, given ``origins``)."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, origins)) from None


# Keys added since configurations were first recorded (in checkpoints' manifests, a model
# line's config.json), with the value that does what the versions before them did: a
# recorded configuration lacking one ran that way, whatever today's default is.
ADDED_KEYS: dict[str, Any] = {
    "train.lr_schedule": {"decay": "constant"},
    "train.dense_optimizer": None,
}


def recorded_config(data: Mapping[str, Any]) -> RunConfig:
    """The configuration a run recorded, read as the run it was: a key it lacks because it
    was added since (``ADDED_KEYS``) takes the value matching how that run trained, not
    today's default."""
    data = json.loads(json.dumps(data))  # a deep copy, as plain JSON
    for key, value in ADDED_KEYS.items():
        *sections, name = key.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
        node.setdefault(name, value)
    return build_config(data)


def resolve_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    flags: Mapping[str, Any] | None = None,
    *,
    env: bool | Mapping[str, str] = True,
) -> ResolvedConfig:
    """Defaults, then the file at ``path``, then the environment's ``DLRMFLOW_SECTION__KEY``
    variables (``env``: True for ``os.environ``, a mapping, or False for none), then
    ``section.key=value`` overrides, then ``flags`` (``{"section.key": value}``, None
    skipped), with where each set key came from."""
    data = _read_file(path) if path is not None else {}
    origins: dict[str, Source] = {}
    for key in _leaves(data):
        origins[key] = Source("file", str(path))
    if env is not False:
        for name, key, value in env_overrides(None if env is True else env):
            _set_key(data, key, value, f"environment variable {name}")
            _set_origin(origins, key, Source("env", name))
    for override in overrides or []:
        key = _apply_override(data, override)
        _set_origin(origins, key, Source("set", override))
    config = build_config(data, origins)
    set_keys = set(_leaves(data))
    if flags:
        given = {key: value for key, value in flags.items() if value is not None}
        config = apply_overrides(config, given)
        for key in given:
            _set_origin(origins, key, Source("flag", key))
            set_keys.add(key)
    sources = {}
    for key in _leaves(config.model_dump()):
        if key in set_keys and (source := _origin_of(origins, key)) is not None:
            sources[key] = source
    return ResolvedConfig(config, sources)


def given_keys(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> dict[str, Source]:
    """The keys the file at ``path`` and the ``section.key=value`` ``overrides`` set, each
    with the last of them that set it, before anything is validated: a command that takes
    only some keys (``evaluate``) refuses the others by name, not by what validating them
    against the defaults would say."""
    data = _read_file(path) if path is not None else {}
    origins = {key: Source("file", str(path)) for key in _leaves(data)}
    for override in overrides or []:
        _set_origin(origins, _apply_override(data, override), Source("set", override))
    return origins


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    env: bool | Mapping[str, str] = True,
) -> RunConfig:
    """Defaults, then the file at ``path``, then the environment (unless ``env`` is False:
    a rank reading the configuration its launcher resolved, which already holds the
    environment's values and any --set that overrode them), then ``section.key=value``
    overrides."""
    return resolve_config(path, overrides, env=env).config


def apply_overrides(config: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """A copy of ``config`` with ``{"section.key": value}`` applied and re-validated."""
    data = config.model_dump()
    for key, value in overrides.items():
        if value is None:
            continue
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = value
    return build_config(data)
