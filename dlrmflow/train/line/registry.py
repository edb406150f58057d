"""A line's versions as MLflow models (``train.tracker: mlflow``).

Each version becomes an MLflow logged model in the experiment ``train.experiment`` of the
line's tracking store (``train.tracking_uri``, default the file store under the line's run
directory): its weights (``model.safetensors``, as ``dlrmflow export`` writes them) and
``version.json`` as artifacts, its lineage as parameters (day, parent, days seen, steps,
configuration digest) and next-day validation as tags. Where the store has a model
registry, the model is registered as a version of the registered model named after the
line's directory, and a version the gate promotes gets that registered model's
``champion`` alias, as ``LINE/models/current`` points at it. A store without a registry
keeps the logged models, and ``mlflow.json`` says why nothing was registered. A version's
weights are logged as trained; the recalibration its next day gives it comes later, as
the logged model's ``recalibration.*`` tags (the published model has it in its last bias).

What was logged is kept in ``LINE/versions/NNNN/mlflow.json``, so a version is logged
once; a version written by a line killed before logging it is logged by the next call.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.config import RunConfig
from dlrmflow.train.run.export import export_model
from dlrmflow.train.run.tracking import experiment_id_of, mlflow_client, tracking_uri_of

MLFLOW_FILE = "mlflow.json"
CHAMPION_ALIAS = "champion"
MODEL_TYPE = "dlrmflow-dlrm"


def registered_name(line_dir: Path) -> str:
    """The registered model of a line: its directory's name."""
    return f"dlrmflow-{line_dir.resolve().name}"


def log_version(line: RunConfig, line_dir: Path, version_dir: Path) -> dict[str, Any] | None:
    """Log the version at ``version_dir`` as an MLflow model (once); its record, or None
    when the line does not track with MLflow."""
    if line.train.tracker != "mlflow":
        return None
    path = version_dir / MLFLOW_FILE
    if path.is_file():
        return json.loads(path.read_text())
    from mlflow.entities import LoggedModelStatus
    from mlflow.exceptions import MlflowException

    lineage = json.loads((version_dir / "version.json").read_text())
    uri = tracking_uri_of(line, Path(line.run_dir))
    client = mlflow_client(uri)
    model = client.create_logged_model(
        experiment_id_of(client, line.train.experiment),
        name=f"version-{version_dir.name}",
        params={
            key: json.dumps(lineage[key])
            for key in ("number", "day", "parent", "days", "steps", "rows", "config_digest")
        },
        tags={
            "dlrmflow.line": str(line_dir.resolve()),
            **{f"validation.{k}": str(v) for k, v in (lineage["validation"] or {}).items()},
        },
        model_type=MODEL_TYPE,
    )
    with tempfile.TemporaryDirectory(prefix="dlrmflow-version-") as scratch:
        export_model(version_dir / "checkpoint", Path(scratch) / "model.safetensors")
        (Path(scratch) / "version.json").write_text(json.dumps(lineage, indent=1) + "\n")
        client.log_model_artifacts(model.model_id, scratch)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    record: dict[str, Any] = {"tracking_uri": uri, "model_id": model.model_id}
    name = registered_name(line_dir)
    try:
        with _global_tracking_uri(uri):
            try:
                client.get_registered_model(name)
            except MlflowException:
                client.create_registered_model(name)
            registered = client.create_model_version(
                name, source=model.artifact_location, model_id=model.model_id
            )
        record |= {"registered_model": name, "registered_version": int(registered.version)}
    except MlflowException as e:
        record |= {"registered_model": None, "not_registered": str(e).splitlines()[0]}
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    return record


@contextmanager
def _global_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow 3.17's file-store registry looks a version's logged model up through the
    process's tracking URI, not its client's: point that at ``uri`` for the call (it would
    otherwise open a SQLite store in the working directory)."""
    import mlflow

    # MLflow keeps its set URI in MLFLOW_TRACKING_URI too; None unsets both again.
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)


def mark_champion(line: RunConfig, version_dir: Path) -> None:
    """Point the registered model's ``champion`` alias at the version (when registered)."""
    path = version_dir / MLFLOW_FILE
    if line.train.tracker != "mlflow" or not path.is_file():
        return
    record = json.loads(path.read_text())
    if record.get("registered_model"):
        client = mlflow_client(record["tracking_uri"])
        with _global_tracking_uri(record["tracking_uri"]):
            client.set_registered_model_alias(
                record["registered_model"], CHAMPION_ALIAS, str(record["registered_version"])
            )


def tag_recalibration(line: RunConfig, version_dir: Path, fitted: dict[str, Any]) -> None:
    """Tag the version's logged model with the recalibration its next day gave it (its
    weights were logged as trained, before that day came: ``recalibration.shift`` is to be
    added to its last bias, as the published model has it)."""
    path = version_dir / MLFLOW_FILE
    if line.train.tracker != "mlflow" or not path.is_file():
        return
    record = json.loads(path.read_text())
    tags = {f"recalibration.{k}": str(fitted[k]) for k in ("shift", "day", "fit_rows", "rows")}
    mlflow_client(record["tracking_uri"]).set_logged_model_tags(record["model_id"], tags)
