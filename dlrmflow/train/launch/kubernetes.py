"""A training job as a Kubeflow Trainer ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``):
the cluster's ``torch-distributed`` runtime places the pods, and each pod runs
``dlrmflow train`` once, its node rank and node 0's address taken from the variables the
runtime sets in every pod (``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
``PET_MASTER_PORT``), which Kubernetes substitutes into the command (``$(NAME)``).

So each pod runs the launcher of a job started by hand, with its supervision; the runtime
would otherwise start torchrun there. The configuration, the data and the run directory
must be on storage every pod reads: ``volume`` mounts a PersistentVolumeClaim into the
trainer container of every pod (a runtime patch of the ``node`` job and container that
the ``torch-distributed`` runtime defines); an object store needs none.

Generated and checked against the resource's schema (the Trainer API's own models), never
applied to a cluster here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

__all__ = ["TrainJob", "train_job_manifest"]

API_VERSION = "trainer.kubeflow.org/v1alpha1"
# The trainer's job and container in the runtimes Kubeflow Trainer ships.
TRAINER_NODE = "node"
# Who owns the volume patch, as the API asks of every runtime patch.
PATCH_MANAGER = "dlrmflow"
SHARED_VOLUME = "dlrmflow-shared"


@dataclass(frozen=True)
class TrainJob:
    """``dlrmflow train --config config`` (with ``overrides``) on ``nodes`` pods of
    ``nproc`` ranks each, in ``image``; ``volume`` ("CLAIM:/mount/path") mounts a
    PersistentVolumeClaim in every pod; ``resources`` are each pod's requests and limits
    (``cpu``, ``memory``, ``nvidia.com/gpu``...)."""

    name: str
    config: str
    nodes: int
    nproc: int
    image: str
    runtime: str = "torch-distributed"
    overrides: tuple[str, ...] = ()
    volume: str | None = None
    resources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nproc < 1:
            raise ValueError(f"nodes and nproc must be at least 1, got {self.nodes}, {self.nproc}")
        if self.volume is not None:
            claim, _, path = self.volume.partition(":")
            if not claim or not PurePosixPath(path).is_absolute():
                raise ValueError(f"volume {self.volume!r}: give CLAIM:/mount/path")


def train_job_manifest(job: TrainJob) -> dict[str, Any]:
    """The ``TrainJob`` resource of ``job``, as plain data (``yaml.safe_dump`` writes it)."""
    command = ["dlrmflow", "train", "--config", job.config]
    for override in job.overrides:
        command += ["--set", override]
    command += ["--nproc", str(job.nproc)]
    if job.nodes > 1:
        command += [
            "--nnodes", "$(PET_NNODES)",
            "--node-rank", "$(PET_NODE_RANK)",
            "--rdzv-endpoint", "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
        ]  # fmt: skip
    trainer: dict[str, Any] = {
        "image": job.image,
        "command": command,
        "numNodes": job.nodes,
        "numProcPerNode": job.nproc,
    }
    if job.resources:
        amounts = dict(job.resources)
        trainer["resourcesPerNode"] = {"requests": amounts, "limits": dict(amounts)}
    spec: dict[str, Any] = {"runtimeRef": {"name": job.runtime}, "trainer": trainer}
    if job.volume is not None:
        claim, _, path = job.volume.partition(":")
        pod = {
            "volumes": [{"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": claim}}],
            "containers": [
                {"name": TRAINER_NODE, "volumeMounts": [{"name": SHARED_VOLUME, "mountPath": path}]}
            ],
        }
        replicated = {"name": TRAINER_NODE, "template": {"spec": {"template": {"spec": pod}}}}
        spec["runtimePatches"] = [
            {
                "manager": PATCH_MANAGER,
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [replicated]}}},
            }
        ]
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": {"name": job.name},
        "spec": spec,
    }
