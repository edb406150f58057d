"""``dlrmflow launch kubernetes``: a Kubeflow Trainer TrainJob that the resource's schema
(the Trainer API's own models) takes whole, each pod running ``dlrmflow train`` with the
runtime's node rank and address; bad options refused in one line. Never applied to a
cluster here."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

trainer_api = pytest.importorskip(
    "kubeflow_trainer_api.models", reason="kubeflow-trainer-api is not installed (make test does)"
)
BIN = Path(sys.executable).parent


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BIN / "dlrmflow", "launch", "kubernetes", *args], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def _round_trip(manifest: dict) -> dict:
    """The manifest as the TrainJob schema reads it back: a field it does not know is
    dropped, a value of the wrong type refused."""
    return trainer_api.TrainerV1alpha1TrainJob.from_dict(manifest).to_dict()


def test_the_manifest_is_a_train_job_whose_pods_each_run_dlrmflow_train(tmp_path):
    done = _launch("-c", "/mnt/runs/run.yaml", "--image", "registry.example/dlrmflow:1",
                   "--nodes", "2", "--nproc", "8", "--volume", "runs:/mnt/runs",
                   "--resource", "cpu=8", "--resource", "memory=32Gi",
                   "--set", "train.lr=0.1", "--out", str(tmp_path / "job.yaml"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    manifest = yaml.safe_load((tmp_path / "job.yaml").read_text())
    assert _round_trip(manifest) == manifest  # every field known, of its type
    assert (manifest["apiVersion"], manifest["kind"]) == (
        "trainer.kubeflow.org/v1alpha1",
        "TrainJob",
    )
    trainer = manifest["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 8)
    assert trainer["command"] == [
        "dlrmflow", "train", "--config", "/mnt/runs/run.yaml", "--set", "train.lr=0.1",
        "--nproc", "8", "--nnodes", "$(PET_NNODES)", "--node-rank", "$(PET_NODE_RANK)",
        "--rdzv-endpoint", "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
    ]  # fmt: skip
    assert trainer["resourcesPerNode"]["limits"] == {"cpu": "8", "memory": "32Gi"}
    [patch] = manifest["spec"]["runtimePatches"]
    [node] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "runs"}
    assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == "/mnt/runs"
    # The schema check is no formality: a misspelt field or a wrong type does not pass.
    misspelt = copy.deepcopy(manifest)
    misspelt["spec"]["trainer"]["numNode"] = misspelt["spec"]["trainer"].pop("numNodes")
    assert _round_trip(misspelt) != misspelt
    wrong = copy.deepcopy(manifest)
    wrong["spec"]["trainer"]["numNodes"] = "2"
    with pytest.raises(ValueError, match="numNodes"):
        _round_trip(wrong)


def test_one_pod_needs_no_host_flags_and_prints_to_standard_output():
    done = _launch("-c", "run.yaml", "--image", "dlrmflow", "--nproc", "4")
    assert done.returncode == 0, done.stderr
    manifest = yaml.safe_load(done.stdout)
    assert _round_trip(manifest) == manifest
    assert manifest["spec"]["trainer"]["command"][-2:] == ["--nproc", "4"]
    assert "runtimePatches" not in manifest["spec"]


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (("--volume", "runs"), "volume 'runs': give CLAIM:/mount/path"),
        (("--resource", "cpu"), "--resource 'cpu': give NAME=AMOUNT"),
        (("--nodes", "0"), "nodes and nproc must be at least 1"),
    ],
)
def test_a_bad_option_is_refused_in_one_line(option, message):
    done = _launch("-c", "run.yaml", "--image", "dlrmflow", *option)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and message in done.stderr
