"""Experiment tracking: the metrics records of ``metrics.jsonl`` also sent to TensorBoard or
MLflow (``train.tracker``), from rank 0, at the same steps, with the configuration as
parameters.

``none`` does nothing. ``tensorboard`` writes event files under ``RUN_DIR/tensorboard/``
(``torch.utils.tensorboard``), the configuration as hparams and as a text summary; a
resumed run hides what the interrupted one logged past its checkpoint (``purge_step``),
as ``metrics.jsonl`` drops those records. ``mlflow`` logs one MLflow run per training run
to ``train.tracking_uri`` (default: the file store ``RUN_DIR/mlruns``) in the experiment
``train.experiment``; its id is kept in ``RUN_DIR/tracking.json`` so that a resumed run
continues the same MLflow run, and the run ends FINISHED, FAILED (training raised) or
KILLED (interrupted). A fresh run (nothing to resume in the run directory) starts a new
MLflow run and clears the previous run's ``tensorboard/`` and ``tracking.json``.

Both packages are optional extras, imported only when chosen:
``pip install 'dlrmflow[tensorboard]'`` or ``'dlrmflow[mlflow]'``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlparse

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.config import ConfigError, RunConfig, flat_keys

TENSORBOARD_DIR = "tensorboard"
MLRUNS_DIR = "mlruns"
TRACKING_FILE = "tracking.json"

# tracker -> (the module it imports, the extra that installs it)
_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow")}
# Shown in TensorBoard's HParams table beside each run's parameters.
_HPARAM_METRICS = ("loss", "samples_per_s", "data_wait_s", "eval/auc", "eval/logloss")
_MLFLOW_BATCH = 100  # params or tags per log_batch call (MLflow's limit)


def require_tracker(name: str) -> None:
    """A ``ConfigError`` naming ``train.tracker`` and the extra to install when the chosen
    tracker's package is missing (checked without importing it)."""
    if name not in _PACKAGES:
        return
    module, extra = _PACKAGES[name]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"train.tracker={name}: the {module} package is not installed; "
            f"pip install 'dlrmflow[{extra}]' (or set train.tracker=none)"
        )


def config_params(config: RunConfig) -> dict[str, str]:
    """The configuration as flat ``section.key`` parameters, values written as in --set
    (strings as they are, everything else as JSON: ``0.05``, ``null``, ``[64, 16]``)."""
    flat = flat_keys(config.model_dump(mode="json"))
    return {key: v if isinstance(v, str) else json.dumps(v) for key, v in flat.items()}


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics record by name: ``step`` left out (it is the step), nested
    mappings flattened with ``/`` (``comm_bytes_per_step/forward``), anything else
    (strings, lists, booleans, non-finite values) skipped."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" and not prefix:
            continue
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ):
            out[f"{prefix}{key}"] = float(value)
    return out


class Tracker:
    """Where a run's parameters and metrics go besides ``metrics.jsonl``. A context
    manager: leaving it closes the tracker, FAILED when an exception leaves it."""

    def log_params(self, params: Mapping[str, str]) -> None:
        """The run's configuration (``config_params``), once per training invocation."""
        raise NotImplementedError

    def log_metrics(self, record: Mapping[str, Any], step: int, prefix: str = "") -> None:
        """A metrics record's numbers (``scalars``) at ``step``, names prefixed."""
        raise NotImplementedError

    def close(self, status: str = "FINISHED") -> None:
        """Flush and end the run: FINISHED, FAILED or KILLED."""
        raise NotImplementedError

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error is None:
            status = "FINISHED"
        else:
            status = "FAILED" if isinstance(error, Exception) else "KILLED"
        try:
            self.close(status)
        except Exception as e:
            if error is None:
                raise
            # Never hide why training failed behind a tracking error.
            warnings.warn(f"train.tracker: could not close the run: {e}", stacklevel=2)


class NoTracker(Tracker):
    """``train.tracker: none`` (and every rank but 0): nothing is logged anywhere."""

    def log_params(self, params: Mapping[str, str]) -> None:
        pass

    def log_metrics(self, record: Mapping[str, Any], step: int, prefix: str = "") -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass


class TensorBoardTracker(Tracker):
    """Event files in ``logdir``; ``purge_step``: the first step a resumed run logs, so that
    TensorBoard hides what the interrupted run logged from there on."""

    def __init__(self, logdir: Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(logdir), purge_step=purge_step, flush_secs=10)

    def log_params(self, params: Mapping[str, str]) -> None:
        from torch.utils.tensorboard.summary import hparams

        from dlrmflow.runtime.tensorboard_summaries import add_summaries

        add_summaries(self._writer, hparams(dict(params), dict.fromkeys(_HPARAM_METRICS)))
        table = "\n".join(f"| {key} | {value} |" for key, value in params.items())
        self._writer.add_text("config", "| key | value |\n|---|---|\n" + table)

    def log_metrics(self, record: Mapping[str, Any], step: int, prefix: str = "") -> None:
        for name, value in scalars(record, prefix).items():
            self._writer.add_scalar(name, value, step)

    def close(self, status: str = "FINISHED") -> None:
        self._writer.close()


def mlflow_client(tracking_uri: str) -> Any:
    """An ``MlflowClient`` of ``tracking_uri``, offline: no usage telemetry leaves the
    machine unless the user asks for it (as the Prefect settings do with DO_NOT_TRACK)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    if urlparse(tracking_uri).scheme in ("", "file"):
        # MLflow 3 keeps its file store only for those who opt in; choosing a local
        # path or file: URI (the default) is that choice.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=tracking_uri)


def experiment_id_of(client: Any, experiment: str) -> str:
    """The id of the MLflow experiment named ``experiment``, created when missing."""
    found = client.get_experiment_by_name(experiment)
    return found.experiment_id if found is not None else client.create_experiment(experiment)


def tracking_uri_of(config: RunConfig, run_dir: Path) -> str:
    """``train.tracking_uri``, or the file store ``RUN_DIR/mlruns``."""
    return config.train.tracking_uri or (run_dir / MLRUNS_DIR).resolve().as_uri()


class MlflowTracker(Tracker):
    """One MLflow run: ``run_id`` continues that run (a resumed training run), None starts
    one in ``experiment`` named after the run directory."""

    def __init__(
        self, tracking_uri: str, experiment: str, run_dir: Path, run_id: str | None
    ) -> None:
        from mlflow.exceptions import MlflowException

        self._client = mlflow_client(tracking_uri)
        self._known: dict[str, str] = {}  # the params a continued run already has
        if run_id is not None:
            try:
                run = self._client.get_run(run_id)
            except MlflowException:
                run = None
            if run is not None and run.info.lifecycle_stage == "active":
                self.run_id = run_id
                self._known = dict(run.data.params)
                self._client.update_run(run_id, status="RUNNING")
                return
            warnings.warn(
                f"{run_dir / TRACKING_FILE}: MLflow run {run_id} is not in {tracking_uri}; "
                "starting a new MLflow run",
                stacklevel=3,
            )
        experiment_id = experiment_id_of(self._client, experiment)
        self.run_id = self._client.create_run(
            experiment_id,
            run_name=run_dir.resolve().name,
            tags={"dlrmflow.run_dir": str(run_dir.resolve())},
        ).info.run_id

    def log_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        # A param's value never changes in MLflow: a resumed run logs the params it lacks,
        # and each value changed since (train.max_steps, say) as the tag resumed.KEY.
        new = [Param(k, v) for k, v in params.items() if k not in self._known]
        changed = [
            RunTag(f"resumed.{k}", v)
            for k, v in params.items()
            if k in self._known and self._known[k] != v
        ]
        for start in range(0, max(len(new), len(changed)), _MLFLOW_BATCH):
            self._client.log_batch(
                self.run_id,
                params=new[start : start + _MLFLOW_BATCH],
                tags=changed[start : start + _MLFLOW_BATCH],
            )
        self._known.update(params)

    def log_metrics(self, record: Mapping[str, Any], step: int, prefix: str = "") -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = scalars(record, prefix)
        if values:
            metrics = [Metric(name, value, now, step) for name, value in values.items()]
            self._client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str = "FINISHED") -> None:
        self._client.set_terminated(self.run_id, status)


def _clear(run_dir: Path) -> None:
    """A fresh run: the previous run's TensorBoard events and MLflow run id go, as its
    ``metrics.jsonl`` does (the MLflow store itself stays: it may hold other runs)."""
    shutil.rmtree(run_dir / TENSORBOARD_DIR, ignore_errors=True)
    (run_dir / TRACKING_FILE).unlink(missing_ok=True)


def _recorded_run_id(run_dir: Path) -> str | None:
    path = run_dir / TRACKING_FILE
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    run_id = recorded.get("run_id") if isinstance(recorded, dict) else None
    return run_id if isinstance(run_id, str) and recorded.get("tracker") == "mlflow" else None


def open_tracker(
    config: RunConfig, run_dir: Path, resume_step: int | None, rank: int = 0
) -> Tracker:
    """The tracker of ``train.tracker`` on rank 0 (``NoTracker`` on the others).

    ``resume_step``: the step of the run directory's own checkpoint that training continues
    from, or None for a fresh run, whose predecessor's tracking state is cleared first.
    """
    if rank != 0:
        return NoTracker()
    if resume_step is None:
        _clear(run_dir)
    name = config.train.tracker
    require_tracker(name)
    if name == "tensorboard":
        return TensorBoardTracker(
            run_dir / TENSORBOARD_DIR, None if resume_step is None else resume_step + 1
        )
    if name == "mlflow":
        uri = tracking_uri_of(config, run_dir)
        previous = None if resume_step is None else _recorded_run_id(run_dir)
        tracker = MlflowTracker(uri, config.train.experiment, run_dir, previous)
        if tracker.run_id != previous:
            record = {"tracker": "mlflow", "tracking_uri": uri, "run_id": tracker.run_id}
            write_atomic(run_dir / TRACKING_FILE, json.dumps(record, indent=1) + "\n")
        return tracker
    return NoTracker()
