"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): sharded, atomic, verified.

A checkpoint is a directory ``RUN_DIR/checkpoints/step_000000120/`` holding DCP's files
(every rank writes its own shards) and ``manifest.json``, written last by rank 0, with the
step, the configuration, the feature spec, the sharding plan, the evaluation metrics and
the SHA-256 of every file. The manifest is the commit mark: a directory without one is a
checkpoint that never finished (it was being written in ``.partial_step_...`` and is
ignored); one whose files do not match their checksums is corrupt and skipped, with a
warning, for the previous good one.

What is saved: the embedding tables and their fused optimizer state (model-parallel
tables as ``ShardedTensor`` with their global row and column offsets, so DCP reshards them
on load to any world size or plan), the dense layers and their optimizer (replicated),
and per rank its reader position and RNG state. Weights resumed from a checkpoint at the
same world size continue bitwise as if never interrupted. The manifest records whether
the readers stood inside an epoch (``mid_epoch``): such a position exists only for the
world size that took it (see ``restore``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from dlrmflow.atomic_writes import nearly_full
from dlrmflow.config import RunConfig, changed_keys, recorded_config
from dlrmflow.days import describe
from dlrmflow.errors import DlrmflowError
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.ingest.manifest import Manifest, read_manifest
from dlrmflow.supervise import signals_deferred
from dlrmflow.train.model.dlrm import DLRM
from dlrmflow.train.model.embeddings import EmbeddingCollection
from dlrmflow.train.model.parallelize import build_model, parallelize
from dlrmflow.train.run.recalibration import Recalibration, apply_recalibration

CHECKPOINTS_DIR = "checkpoints"
MANIFEST_FILE = "manifest.json"
PARTIAL_PREFIX = ".partial_"


class CheckpointError(DlrmflowError, RuntimeError):
    """A checkpoint could not be written or no usable checkpoint exists."""


@dataclass
class CheckpointInfo:
    """A complete checkpoint directory and its manifest."""

    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])


@dataclass
class Checkpoint:
    """A checkpoint loaded into one process, ready for inference."""

    model: DLRM
    config: RunConfig
    spec: FeatureSpec
    step: int
    rows: int
    path: Path
    trained_days: list[int] | None = None  # recorded since day windows
    # Whether it trained on multi-hot data; None: not recorded (see ``trained_multi_hot``).
    multi_hot: bool | None = None
    # The shift folded into the model's last bias (a line version's, fitted on its next day).
    recalibration: Recalibration | None = None


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it runs without a process group when one process saves or loads;
    that is the intended use for one-process training and evaluation."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def model_state(model: DLRM, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The DCP state dict of a ``DLRM`` (whichever its embeddings) and its dense optimizer.

    Every tensor is a view of the live one (DCP loads in place), keyed by what it is:
    ``emb.<table>.weight``, ``emb.<table>.<optimizer state>``, ``dense.<parameter>`` and
    ``dense_optim.<parameter>.<state>``, the same keys whatever the sharding.
    """
    state: dict[str, Any] = {}
    embeddings: EmbeddingCollection = model.embeddings
    state.update({f"emb.{k}": v for k, v in embeddings.checkpoint_state().items()})
    dense = model.dense_arch
    state.update({f"dense.{k}": v for k, v in dense.state_dict(keep_vars=False).items()})
    names = [name for name, _ in dense.named_parameters()]
    packed = optimizer.state_dict()["state"]
    for index, name in enumerate(names):
        for key, value in packed.get(index, {}).items():
            if isinstance(value, torch.Tensor):
                state[f"dense_optim.{name}.{key}"] = value
    return state


def _file_pages(model: DLRM) -> Callable[[], None]:
    """What unmaps the pages of the model's embedding files that a checkpoint item touched
    (nothing without tables on disk), so a checkpoint of tables on disk keeps one item
    of them resident at a time."""
    return model.embeddings.drop_file_pages


class _DroppingSavePlanner(DefaultSavePlanner):
    """DCP's planner, unmapping file pages before each item: the writer asks for item k + 1
    once item k is written, and keeps a reference to every item until its file is done,
    which costs nothing for a view of a file whose pages are unmapped."""

    def __init__(self, drop: Callable[[], None]) -> None:
        super().__init__()
        self._drop = drop

    def resolve_data(self, write_item):  # noqa: ANN001, ANN201 (DCP's signature)
        self._drop()
        return super().resolve_data(write_item)


class _DroppingLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, unmapping file pages after each item is loaded in place."""

    def __init__(self, drop: Callable[[], None]) -> None:
        super().__init__()
        self._drop = drop

    def commit_tensor(self, read_item, tensor) -> None:  # noqa: ANN001 (DCP's signature)
        super().commit_tensor(read_item, tensor)
        self._drop()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS_DIR / f"step_{step:09d}"


def save_checkpoint(
    run_dir: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: RunConfig,
    spec: FeatureSpec,
    progress: dict[str, Any],
    loader_state: dict[str, Any],
    plan: dict | None = None,
    metrics: dict[str, float] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint of step ``progress["step"]`` (a collective: every rank calls it).

    It becomes visible only once complete; if writing fails (a full disk, a lost mount)
    the partial directory is removed, the previous checkpoints are untouched, and
    ``CheckpointError`` says which step failed and why.
    """
    step = int(progress["step"])
    final = _step_dir(run_dir, step)
    partial = final.with_name(PARTIAL_PREFIX + final.name)
    rank = _rank()
    state = model_state(model, optimizer)
    # A string, which DCP stores whole (a dict would be flattened into many entries).
    state[f"rank{rank}.loader"] = json.dumps(loader_state)
    state[f"rank{rank}.rng"] = torch.get_rng_state()
    error: BaseException | None = None
    try:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier()
        drop = _file_pages(model)
        # A stopping signal interrupts after the write, not inside torch's C++ writer.
        with _single_process_quiet(), signals_deferred():
            try:
                dcp.save(state, checkpoint_id=str(partial), planner=_DroppingSavePlanner(drop))
            finally:
                drop()
    except (Exception, CheckpointException) as e:  # reported below with the step
        error = e
    # Each rank hashes the files it wrote, all ranks at once, and rank 0 gathers the
    # digests: no rank reads the others' shards, whatever the checkpoint's size.
    files: dict[str, str] = {}
    if error is None:
        try:
            files = _digests(_written_by(partial, rank))
        except OSError as e:
            error = e
    if dist.is_initialized():
        every: list[dict[str, str] | None] = [None] * _world()
        dist.all_gather_object(every, files)
        files = {name: d for part in every if part for name, d in part.items()}
    if error is None and rank == 0:
        try:
            manifest = {
                "step": step,
                "progress": progress,
                "world_size": _world(),
                "config": config.model_dump(),
                "spec": spec.to_dict(),
                "plan": plan,
                "metrics": metrics or {},
                # None: the readers stand at the start of progress["epoch"].
                "mid_epoch": loader_state is not None,
                **(extra or {}),
                "files": dict(sorted(files.items())),
                "created": time.time(),
            }
            (partial / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
        except OSError as e:
            error = e
    # Every rank learns whether any failed, so none waits for the others at a barrier.
    failed = torch.tensor([0.0 if error is None else 1.0], device="cpu")
    if dist.is_initialized():
        dist.all_reduce(failed)
    if bool(failed):
        reason = _reason(error, partial) if error is not None else "failed on another rank"
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(
            f"checkpoint of step {step} in {final.parent} could not be written: {reason}; "
            "the partial files were removed and the previous checkpoints are intact"
        ) from error
    _barrier()
    return final


def _causes(error: BaseException) -> list[BaseException]:
    """``error``, its causes and contexts, and what each rank raised inside DCP."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [exc for exc, _ in e.failures.values()]
    return seen


def _reason(error: BaseException, where: Path) -> str:
    """Why a checkpoint write failed, in a few words: the OS error when there is one."""
    for e in _causes(error):
        if isinstance(e, OSError) and e.errno is not None:
            return os.strerror(e.errno)
    if nearly_full(where):
        return os.strerror(errno.ENOSPC)
    innermost = _causes(error)[-1]
    text = str(innermost).strip().splitlines()
    return f"{type(innermost).__name__}: {text[-1] if text else ''}"


def dataset_digest(manifest: Manifest) -> str:
    """The SHA-256 of a dataset's manifest: the same days, files, rows and test day give
    the same digest wherever the dataset lives, so a checkpoint knows what it trained on."""
    canonical = json.dumps(manifest.model_dump(mode="json", by_alias=True), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


DATASET_KEY = "dataset (digest of manifest.json)"
# What a checkpoint written since day windows trained on: its training days and their files.
TRAIN_DATA_KEY = "training data (data.train_days and their files)"


@dataclass(frozen=True)
class DataIdentity:
    """What a run trains on: the whole dataset (its manifest's digest, kept for the record
    and for checkpoints written before day windows) and its training days, whose files'
    identities (``train_data``) decide whether a checkpoint belongs to this run. A dataset
    that grows by a day leaves a window of earlier days, and their checkpoints, valid."""

    dataset: str
    days: tuple[int, ...]
    train_data: str
    day_digests: tuple[str, ...]  # each training day's files, in ``days``' order
    # Whether its sparse columns hold lists: a model trained one-hot refuses to score
    # multi-hot data (``refuse_multi_hot``). A fact of the days, not another identity.
    multi_hot: bool = field(default=False, compare=False)

    @classmethod
    def of(cls, manifest: Manifest, train_days: list[int]) -> DataIdentity:
        days = tuple(sorted(set(train_days)))
        per_day = tuple(
            _digest(sorted((f.path, f.rows, f.digest) for f in manifest.files if f.day == day))
            for day in days
        )
        whole = _digest(list(zip(days, per_day, strict=True)))
        return cls(dataset_digest(manifest), days, whole, per_day, manifest.multi_hot)

    def record(self) -> dict[str, Any]:
        """The checkpoint manifest's keys for it."""
        return {
            "dataset_digest": self.dataset,
            "train_days": list(self.days),
            "train_data_digest": self.train_data,
            "train_day_digests": list(self.day_digests),
            "train_multi_hot": self.multi_hot,
        }

    def continues(self, manifest: dict[str, Any]) -> bool:
        """Whether a checkpoint's training days (``manifest``'s) are the first of these,
        with the same files: in day order, a window grown by later days goes on from it."""
        days = manifest.get("train_days")
        digests = manifest.get("train_day_digests")
        if days is None or digests is None or len(days) > len(self.days):
            return False
        n = len(days)
        return list(days) == list(self.days[:n]) and list(digests) == list(self.day_digests[:n])


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()


def differences(
    manifest: dict[str, Any],
    config: RunConfig,
    data: DataIdentity,
    keys: tuple[str, ...],
    ignore: tuple[str, ...] = (),
) -> dict[str, list]:
    """``{key: [the checkpoint's value, this configuration's]}`` for every configuration key
    under one of ``keys`` (a section such as "model", or one key such as "train.lr") and
    not in ``ignore`` that differs, plus ``TRAIN_DATA_KEY`` when the checkpoint trained on
    other days or other files of them (``DATASET_KEY``, another dataset, for a checkpoint
    written before day windows)."""
    recorded = recorded_config(manifest["config"])
    changed = changed_keys(recorded, config, keys, ignore)
    window = manifest.get("train_data_digest")
    if window is not None:
        days_order = config.train.order == "days" and recorded.train.order == "days"
        if window != data.train_data and not (days_order and data.continues(manifest)):
            days = manifest.get("train_days", [])
            if list(days) == list(data.days):
                changed[TRAIN_DATA_KEY] = [f"days {describe(days)}", "their files changed"]
            else:
                changed[TRAIN_DATA_KEY] = [f"days {describe(days)}", f"days {describe(data.days)}"]
        return changed
    digest = manifest.get("dataset_digest")
    if digest is not None and digest != data.dataset:
        changed[DATASET_KEY] = [digest[:12], data.dataset[:12]]
    return changed


def list_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """The complete checkpoints of a run (with a manifest), oldest first; unverified."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    found = []
    for path in sorted(root.glob("step_*")) if root.is_dir() else []:
        manifest_path = path / MANIFEST_FILE
        if not manifest_path.is_file():
            continue
        try:
            found.append(CheckpointInfo(path, json.loads(manifest_path.read_text())))
        except FileNotFoundError:
            continue  # pruned (by the training run's rank 0) while this listing ran
        except json.JSONDecodeError:
            warnings.warn(f"{manifest_path}: unreadable manifest; checkpoint skipped", stacklevel=2)
    return sorted(found, key=lambda c: c.step)


# Files hashed at once by one process: SHA-256 runs outside the GIL on large reads.
HASH_THREADS = 4


def _digests(paths: list[Path]) -> dict[str, str]:
    """``{file name: SHA-256}`` of ``paths``, hashed by a few threads."""
    if not paths:
        return {}
    with ThreadPoolExecutor(min(HASH_THREADS, len(paths)), thread_name_prefix="sha") as pool:
        return dict(zip((p.name for p in paths), pool.map(_sha256, paths), strict=True))


def _written_by(directory: Path, rank: int) -> list[Path]:
    """The files of a DCP checkpoint that ``rank`` wrote: its ``__<rank>_<n>.distcp``
    shards, and for rank 0 the rest (DCP's ``.metadata``, written by the coordinator)."""
    mine = []
    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.name == MANIFEST_FILE:
            continue
        shard = re.match(r"__(\d+)_\d+\.distcp$", path.name)
        if (int(shard.group(1)) if shard else 0) == rank:
            mine.append(path)
    return mine


def _check(info: CheckpointInfo, names: list[str]) -> str | None:
    """The first of ``names`` that is missing or altered, as a reason; else None."""
    present = [n for n in names if (info.path / n).is_file()]
    missing = [n for n in names if n not in present]
    if missing:
        return f"{info.path / missing[0]} is missing"
    found = _digests([info.path / n for n in present])
    for name in names:
        if found[name] != info.manifest["files"][name]:
            return f"{info.path / name} does not match its checksum"
    return None


def verify(info: CheckpointInfo) -> str | None:
    """Why the checkpoint is unusable (a missing or altered file), or None if it is intact.

    A collective when distributed: every rank checks every ``world_size``-th file (at any
    world size, not only the one that wrote it), and every rank gets the same answer.
    """
    names = sorted(info.manifest["files"])
    problem = _check(info, names[_rank() :: _world()])
    if not dist.is_initialized():
        return problem
    problems: list[str | None] = [None] * _world()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def latest_checkpoint(run_dir: Path) -> CheckpointInfo | None:
    """The newest intact checkpoint; corrupt ones are skipped with a warning naming them.

    Distributed: rank 0 lists the checkpoints and every rank verifies its share of each,
    newest first, so every rank resumes from the same one.
    """
    listed: list[Any] = [None]
    if _rank() == 0:
        listed[0] = [(str(c.path), c.manifest) for c in reversed(list_checkpoints(run_dir))]
    if dist.is_initialized():
        dist.broadcast_object_list(listed, src=0)
    for path, manifest in listed[0]:
        info = CheckpointInfo(Path(path), manifest)
        problem = verify(info)
        if problem is None:
            return info
        if _rank() == 0:
            warnings.warn(
                f"checkpoint {info.path.name} is corrupt ({problem}); using an older one",
                stacklevel=2,
            )
    return None


def restore(
    info: CheckpointInfo, model: DLRM, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any] | None:
    """Load a checkpoint into a live model (and dense optimizer) at any world size or plan.

    Returns this rank's reader state when the checkpoint was written at this world size
    (exact resume), else None: at another world size the splits are dealt differently and
    no reader can take up another's position, so only a checkpoint at an epoch's start
    (``mid_epoch`` false) continues exactly there; the trainer refuses the others.
    """
    rank = _rank()
    state = model_state(model, optimizer) if optimizer is not None else _weights_only(model)
    same_world = info.world_size == _world()
    if same_world:
        state[f"rank{rank}.loader"] = ""
        state[f"rank{rank}.rng"] = torch.get_rng_state()
    try:
        drop = _file_pages(model)
        with _single_process_quiet(), signals_deferred():
            try:
                dcp.load(state, checkpoint_id=str(info.path), planner=_DroppingLoadPlanner(drop))
            finally:
                drop()
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{info.path}: cannot be loaded: {_reason(e, info.path)}") from e
    prefix = "emb."
    model.embeddings.after_checkpoint_load(
        {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    )
    if not same_world:
        return None
    torch.set_rng_state(state[f"rank{rank}.rng"])
    return json.loads(state[f"rank{rank}.loader"])


def _weights_only(model: DLRM) -> dict[str, Any]:
    """The model's entries of ``model_state`` (for evaluation: no optimizer)."""
    dummy = torch.optim.SGD(model.dense_arch.parameters(), lr=0.0)
    return model_state(model, dummy)


def prune_checkpoints(run_dir: Path, keep: int, metric: str = "auc") -> None:
    """Keep the ``keep`` newest checkpoints and the best by ``metric`` (higher is better)."""
    found = list_checkpoints(run_dir)
    scored = [c for c in found if metric in c.manifest.get("metrics", {})]
    best = max(scored, key=lambda c: c.manifest["metrics"][metric], default=None)
    for info in found[: max(len(found) - keep, 0)]:
        if best is not None and info.path == best.path:
            continue
        shutil.rmtree(info.path, ignore_errors=True)


def read_checkpoint(path: str | Path, *, verified: bool = True) -> CheckpointInfo:
    """The checkpoint directory ``path`` (its manifest, and its files checked against their
    checksums unless ``verified=False``); a clear error when it is none or is corrupt."""
    path = Path(path)
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {MANIFEST_FILE})")
    try:
        recorded = json.loads(manifest.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        recorded = None
    if not _checkpoint_manifest(recorded):
        # A dataset's directory has a manifest.json too (of days and files, not shards).
        raise CheckpointError(
            f"{path}: not a checkpoint (its {MANIFEST_FILE} is not a checkpoint's); give a "
            f"checkpoint directory ({CHECKPOINTS_DIR}/step_N) or a run directory"
        )
    info = CheckpointInfo(path, recorded)
    problem = verify(info) if verified else None
    if problem is not None:
        raise ValueError(f"{path}: corrupt checkpoint ({problem})")
    return info


def _checkpoint_manifest(recorded: Any) -> bool:
    """Whether ``recorded`` has the fields every checkpoint manifest has."""
    if not isinstance(recorded, dict):
        return False
    needed = {"step": int, "progress": dict, "world_size": int, "config": dict, "files": dict}
    return all(isinstance(recorded.get(key), kind) for key, kind in needed.items())


def find_checkpoint(path: str | Path, *, verified: bool = True) -> CheckpointInfo:
    """The checkpoint ``path`` names: a checkpoint directory (verified against its
    checksums), or a run directory (its newest intact checkpoint). ``verified=False``
    only reads the manifest (of the newest complete checkpoint), for its configuration."""
    path = Path(path)
    if (path / MANIFEST_FILE).is_file():
        return read_checkpoint(path, verified=verified)
    if not verified:
        found = list_checkpoints(path)
        if found:
            return found[-1]
    info = latest_checkpoint(path)
    if info is None:
        raise FileNotFoundError(
            f"{path}: no complete checkpoint under {CHECKPOINTS_DIR}/; train first "
            "(`dlrmflow train`)"
        )
    return info


def load_checkpoint(
    path: str | Path,
    device: torch.device | str = "cpu",
    kernels: str = "auto",
    *,
    scratch: Path | None = None,
) -> Checkpoint:
    """The model of a checkpoint in this one process (whatever world size wrote it), on
    ``device`` (whatever device trained it: a checkpoint holds no device, and its values
    are read into the model's tensors wherever they live), running ``kernels`` (whichever
    trained it).

    ``path`` is a checkpoint directory or a run directory (its newest intact checkpoint).
    A checkpoint that carries a recalibration (``train.run.recalibration``: a model line's
    version) is loaded with its shift folded into the model's last bias.
    With ``scratch``, a run trained under ``train.embedding_memory_bytes`` keeps to it: its
    tables, when they exceed it, are loaded into a file there behind a cache (the caller
    removes it when done); without, every table is loaded into memory.
    """
    info = find_checkpoint(path)
    try:
        config = recorded_config(info.manifest["config"])
        config.model.kernels = kernels
        spec = FeatureSpec.from_dict(info.manifest["spec"])
        # Tables beyond train.embedding_memory_bytes on disk only where their rows are
        # served from: the host's memory.
        on_cpu = scratch is not None and torch.device(device).type == "cpu"
        model = parallelize(
            build_model(config, spec),
            config,
            device=torch.device(device),
            embeddings_dir=scratch if on_cpu else None,
            fill=False,
        )
        restore(info, model, None)
    except (KeyError, RuntimeError) as e:
        raise ValueError(f"{info.path}: unreadable or incompatible checkpoint ({e})") from e
    recalibration = apply_recalibration(info.path, model.dense_arch)
    model.eval()
    progress = info.manifest["progress"]
    days = info.manifest.get("train_days")
    return Checkpoint(
        model,
        config,
        spec,
        info.step,
        int(progress["rows"]),
        info.path,
        days,
        trained_multi_hot(info.manifest),
        recalibration,
    )


def trained_multi_hot(manifest: dict[str, Any]) -> bool | None:
    """Whether the checkpoint whose ``manifest`` this is trained on multi-hot data: as
    recorded, else (written before it was) as its training dataset's manifest says when
    that dataset is still the one it trained on; None when nothing tells."""
    recorded = manifest.get("train_multi_hot")
    if recorded is not None:
        return bool(recorded)
    try:
        url = manifest["config"]["data"]["url"]
        data = read_manifest(url)
    except (KeyError, TypeError, OSError, ValueError, DlrmflowError):
        return None
    return data.multi_hot if dataset_digest(data) == manifest.get("dataset_digest") else None
