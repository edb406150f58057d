"""Checkpoints: exact resume after SIGKILL, resharding, corruption fallback, faults."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dlrmflow.train.run.checkpoint as checkpoint_module
from dlrmflow.config import RunConfig
from dlrmflow.runtime.teardown import exit_without_teardown
from dlrmflow.supervise import children_of
from dlrmflow.train.launch.job import launch_command, launch_training
from dlrmflow.train.run.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
)
from dlrmflow.train.run.rank import join_spawned_job
from dlrmflow.train.run.trainer import TrainResult, train
from tests.conftest import tiny_run_config

# A rank stuck in a collective fails its test after this instead of hanging the suite.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)

STEPS = 40
EVERY = 4


def _config(data: str, run_dir: Path, epochs: int = 3, **train_options) -> RunConfig:
    cfg = tiny_run_config(
        data,
        run_dir,
        batch_size=128,
        epochs=epochs,
        max_steps=STEPS,
        checkpoint_every=EVERY,
        keep_checkpoints=3,
        **train_options,
    )
    cfg.distributed.nproc = 2
    return cfg


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir).model.state_dict()


def _start_job(cfg: RunConfig) -> subprocess.Popen:
    """The launcher's own torchrun command, in a session of its own so it can be killed."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"
    config_path.write_text(json.dumps(cfg.model_dump()))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        launch_command(config_path, 2, None),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )


def _kill_tree(job: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank at once, as a lost machine would."""
    ranks = children_of(job.pid)
    os.killpg(job.pid, signal.SIGKILL)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.wait()


@pytest.fixture(scope="module")
def uninterrupted(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank run of ``STEPS``; it keeps its last 4 checkpoints (steps 28 to 40), one
    more than the other runs here, for the corrupt-file test below."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    cfg = _config(tiny_dataset, run_dir)
    cfg.train.keep_checkpoints = 4
    launch_training(cfg)
    return run_dir


def test_resume_after_sigkill_is_bitwise_equal(
    tiny_dataset: str, tmp_path: Path, uninterrupted: Path
) -> None:
    cfg = _config(tiny_dataset, tmp_path / "killed")
    # A different kill point on each run of the suite, printed and replayable:
    # DLRMFLOW_TEST_SEED=<seed> pytest -k sigkill
    seed = int(os.environ.get("DLRMFLOW_TEST_SEED", random.SystemRandom().randrange(10**6)))
    kill_after = random.Random(seed).choice(range(EVERY, STEPS - EVERY, EVERY))
    print(f"kill point: after step {kill_after} (DLRMFLOW_TEST_SEED={seed})")
    job = _start_job(cfg)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job.poll() is None:
        done = [c.step for c in list_checkpoints(Path(cfg.run_dir))]
        if done and max(done) >= kill_after:
            break
        time.sleep(0.02)
    _kill_tree(job)
    killed_at = max(c.step for c in list_checkpoints(Path(cfg.run_dir)))
    assert killed_at < STEPS, "the job finished before it could be killed"

    result = launch_training(cfg)  # the run dir has checkpoints: it resumes
    assert result.resumed_from_step == killed_at and result.steps == STEPS
    got, want = _weights(Path(cfg.run_dir)), _weights(uninterrupted)
    for key in want:
        assert torch.equal(got[key], want[key]), (f"DLRMFLOW_TEST_SEED={seed}", killed_at, key)


def _predict_worker(rank: int, world: int, store: str, run_dir: str, sharding, out: str) -> None:
    from dlrmflow.train.model.dlrm import embedding_optimizer
    from dlrmflow.train.model.parallelize import sharded_dlrm
    from dlrmflow.train.planner import plan_for_config
    from dlrmflow.train.run.checkpoint import restore

    join_spawned_job(store, rank, world, COLLECTIVE_TIMEOUT)
    torch.set_num_threads(1)
    info = latest_checkpoint(Path(run_dir))
    ckpt = load_checkpoint(info.path)
    config = ckpt.config.model_copy(deep=True)
    config.distributed.sharding = sharding
    plan = plan_for_config(config, ckpt.spec, world, world)
    model = sharded_dlrm(ckpt.spec, config, plan, embedding_optimizer(config.train))
    restore(info, model, None)
    model.eval()
    batch = torch.load(Path(run_dir) / "probe.pt", weights_only=False)
    n = len(batch)
    mine = batch.take(torch.arange(rank * n // world, (rank + 1) * n // world))
    with torch.no_grad():
        logits = model(mine.dense, mine.sparse)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(logits, gathered, dst=0)
    if rank == 0:
        torch.save({"logits": torch.cat(gathered), "plan": plan.to_dict()}, out)
    dist.barrier()
    exit_without_teardown()


@pytest.mark.parametrize(("world", "sharding"), [(3, None), (3, "row_wise"), (2, "column_wise")])
def test_a_world_size_2_checkpoint_reshards(
    uninterrupted: Path, tiny_dataset: str, tmp_path: Path, world: int, sharding
) -> None:
    """Loaded at world size 1, and at 2 or 3 under another plan: the same predictions."""
    from dlrmflow.ingest.manifest import read_manifest
    from dlrmflow.train.run.data import batch_loader, load_ids

    ckpt = load_checkpoint(uninterrupted)
    manifest = read_manifest(tiny_dataset)
    _, loader = batch_loader(
        manifest.day_paths(tiny_dataset, [manifest.test_day]),
        ckpt.spec,
        load_ids("hash", ckpt.spec, uninterrupted),
        batch_size=300,
        num_workers=0,
        shuffle=False,
    )
    probe = next(iter(loader))
    torch.save(probe, uninterrupted / "probe.pt")
    with torch.no_grad():
        want = ckpt.model(probe.dense, probe.sparse)
    out = tmp_path / "logits.pt"
    mp.spawn(
        _predict_worker,
        args=(world, str(tmp_path / "store"), str(uninterrupted), sharding, str(out)),
        nprocs=world,
    )
    got = torch.load(out, weights_only=False)
    saved_plan = json.loads((uninterrupted / "plan.json").read_text())
    assert got["plan"] != saved_plan  # really another layout
    torch.testing.assert_close(got["logits"], want, atol=1e-5, rtol=1e-5)


def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(
    tiny_dataset: str, tmp_path: Path
) -> None:
    cfg = tiny_run_config(tiny_dataset, tmp_path / "run", max_steps=8, checkpoint_every=4)
    train(cfg)
    steps = [c.step for c in list_checkpoints(tmp_path / "run")]
    assert steps == [4, 8]
    newest = list_checkpoints(tmp_path / "run")[-1].path
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"step_000000008 is corrupt .*checksum"):
        info = latest_checkpoint(tmp_path / "run")
    assert info.step == 4
    # Training again resumes from step 4 and ends at step 8 with the uninterrupted weights.
    with pytest.warns(UserWarning, match="corrupt"):
        result = train(cfg)
    assert result.resumed_from_step == 4
    train(tiny_run_config(tiny_dataset, tmp_path / "clean", max_steps=8, checkpoint_every=4))
    got, want = _weights(tmp_path / "run"), _weights(tmp_path / "clean")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_full_disk_fails_clearly_and_keeps_the_previous_checkpoint(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny_run_config(tiny_dataset, tmp_path / "run", max_steps=4)
    train(cfg)
    real_save = checkpoint_module.dcp.save

    def full_disk(state, checkpoint_id, **options):
        real_save(state, checkpoint_id=checkpoint_id, **options)  # files, then a full disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module.dcp, "save", full_disk)
    with pytest.raises(CheckpointError, match="step 8 .*No space left.*previous checkpoints"):
        train(cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": 8})}))
    assert [c.step for c in list_checkpoints(tmp_path / "run")] == [4]
    assert not any(p.name.startswith(".partial") for p in (tmp_path / "run/checkpoints").iterdir())
    assert load_checkpoint(tmp_path / "run").step == 4


def test_a_killed_rank_ends_the_job_within_the_collective_timeout(
    tiny_dataset: str, tmp_path: Path
) -> None:
    cfg = _config(tiny_dataset, tmp_path / "run", epochs=1000)
    cfg.train.max_steps = None
    cfg.train.checkpoint_every = None
    cfg.distributed.timeout_s = 20
    job = _start_job(cfg)
    try:
        deadline = time.monotonic() + 120
        while not (Path(cfg.run_dir) / "metrics.jsonl").is_file():
            assert time.monotonic() < deadline and job.poll() is None, "training never started"
            time.sleep(0.05)
        ranks = children_of(job.pid)
        assert len(ranks) == 2
        killed = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        code = job.wait(timeout=cfg.distributed.timeout_s + 30)
        assert code != 0
        assert time.monotonic() - killed < cfg.distributed.timeout_s + 30
    finally:
        if job.poll() is None:
            _kill_tree(job)


def test_resume_from_a_path_that_is_no_checkpoint_fails_clearly(
    tiny_dataset: str, tmp_path: Path
) -> None:
    cfg = tiny_run_config(tiny_dataset, tmp_path / "run", max_steps=2)
    cfg.train.resume = str(tmp_path / "nowhere" / "step_000000004")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        train(cfg)


def test_listing_skips_a_checkpoint_pruned_while_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 prunes old checkpoints while the other ranks go on: a listing that meets a
    directory removed between finding it and reading its manifest passes it by."""
    for step in (4, 8, 12):
        path = tmp_path / "checkpoints" / f"step_{step:09d}"
        path.mkdir(parents=True)
        (path / "manifest.json").write_text(json.dumps({"step": step}))
    real_read = Path.read_text

    def pruned_first(path: Path, *args, **kwargs) -> str:
        if path.parent.name == "step_000000004":
            shutil.rmtree(path.parent)
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", pruned_first)
    assert [c.step for c in list_checkpoints(tmp_path)] == [8, 12]


def test_resuming_from_another_runs_checkpoint_writes_one_of_its_own(
    tiny_dataset: str, tmp_path: Path
) -> None:
    train(tiny_run_config(tiny_dataset, tmp_path / "a", max_steps=4))
    cfg = tiny_run_config(tiny_dataset, tmp_path / "b", max_steps=4)
    cfg.train.resume = str(list_checkpoints(tmp_path / "a")[-1].path)
    result = train(cfg)  # nothing left to train: it only records where it stands
    assert result.resumed_from_step == 4
    assert Path(result.checkpoint).parent == tmp_path / "b" / "checkpoints"
    assert [c.step for c in list_checkpoints(tmp_path / "b")] == [4]


# Each victim in a checkpoint of its own, newest first: one 2-rank resume must skip all
# three to reach the intact checkpoint below them (an undetected one is resumed instead).
VICTIMS = {"__0_0.distcp": STEPS, "__1_0.distcp": STEPS - EVERY, ".metadata": STEPS - 2 * EVERY}
INTACT = STEPS - 3 * EVERY


@pytest.fixture(scope="module")
def corrupt_resume(
    uninterrupted: Path, tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[int, dict], TrainResult]:
    """A copy of the uninterrupted run with one file damaged in each of its three newest
    checkpoints (``VICTIMS``), resumed by a 2-rank job: the manifests as written, and the
    job's result."""
    run_dir = tmp_path_factory.mktemp("corrupt") / "run"
    shutil.copytree(uninterrupted, run_dir)
    manifests = {c.step: c.manifest for c in list_checkpoints(run_dir)}
    assert sorted(manifests) == [INTACT, *sorted(VICTIMS.values())]
    for victim, step in VICTIMS.items():
        shard = run_dir / "checkpoints" / f"step_{step:09d}" / victim
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    cfg = _config(tiny_dataset, run_dir)
    cfg.train.keep_checkpoints = 4
    cfg.train.max_steps = STEPS + EVERY  # more steps: the newest intact one is resumed
    return manifests, launch_training(cfg)


@pytest.mark.parametrize("victim", list(VICTIMS))
def test_each_rank_hashes_its_own_files_and_any_corrupt_one_is_skipped(
    corrupt_resume: tuple[dict[int, dict], TrainResult], victim: str
) -> None:
    """Written at world size 2: the manifest holds every rank's digests (each rank hashed
    the files it wrote), and a damaged file of either rank, or DCP's metadata, makes the
    2-rank resume fall back to an older checkpoint. One resume covers the three: each
    victim is damaged in a checkpoint of its own, newest first, so the resume reaches the
    intact one below them only if it skipped every one (one it missed would be resumed)."""
    manifests, result = corrupt_resume
    step = VICTIMS[victim]
    assert set(manifests[step]["files"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    assert result.resumed_from_step == INTACT < step, victim
    assert result.checkpoint_verify_s > 0 and result.checkpoint_save_s > 0
    assert result.steps == STEPS + EVERY
