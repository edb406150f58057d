"""``model.kernels``: every implementation of the TBE and the interaction, in training.

The Triton kernels are the GPU path; here they run on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1, set before triton is first imported: see
``tests/kernels/test_triton.py``), so what is tested is their wiring into the DLRM, the
sharded collection and the fused optimizer state, the same code a CUDA run takes. Each
backend trains a few steps of the same run; the weights agree within float32 rounding
(the backends sum in the same order; fused multiply-adds and the order of the row-wise
mean differ), measured against how far training moved each tensor: Adagrad's first steps
divide a gradient by its own size, so a rounding difference in a tiny gradient moves a
weight by up to ~1e-4 of its step (measured, 16 rows a step: at most 7e-6 apart, 3e-5 of
the move), while a wrong row, a wrong sum or a missed update moves it by a whole step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlrmflow.config import DataConfig, RunConfig
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.kernels import backends, fbgemm_tbe, triton_interaction, triton_tbe
from dlrmflow.kernels.backends import KernelUnavailable, check_kernels
from dlrmflow.kernels.optimizers import RowWiseAdagrad
from dlrmflow.train.model.dlrm import DLRM
from dlrmflow.train.run.checkpoint import load_checkpoint
from dlrmflow.train.run.trainer import train
from tests.conftest import TINY_DATA, tiny_run_config

if not torch.cuda.is_available():
    if "triton.language" in sys.modules:
        assert backends._interpreting(), "triton was imported before TRITON_INTERPRET was set"
    os.environ["TRITON_INTERPRET"] = "1"
# Where CUDA is present the Triton kernels compile for it instead, and the ``gpu`` tests
# (tests/train/model/test_device.py) train on them; these run them on CPU tensors.
interpreted = pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton on CPU tensors: the gpu tests cover CUDA"
)

STEPS = 3
# The largest difference allowed between two backends' tensors, as a fraction of the
# largest change training made to that tensor.
DRIFT = 1e-3


@pytest.fixture(scope="module")
def multi_hot_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny dataset with multi-hot features: jagged bags, so the Triton lookup runs."""
    url = str(tmp_path_factory.mktemp("multi_hot") / "data")
    generate_dataset(DataConfig(url=url, **{**TINY_DATA, "multi_hot": True}))
    return url


def _config(
    data: str,
    run_dir: Path,
    kernels: str,
    multi_hot: bool = True,
    steps: int = STEPS,
    batch_size: int = 16,  # the interpreter runs a program per bag and per row
) -> RunConfig:
    cfg = tiny_run_config(data, run_dir, batch_size=batch_size, max_steps=steps, device="cpu")
    cfg.data.multi_hot = multi_hot
    cfg.model.kernels = kernels
    return cfg


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir).model.state_dict()


def _initial(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights and optimizer state the run started from (its seed's draws)."""
    ckpt = load_checkpoint(run_dir)
    model = DLRM(ckpt.spec, ckpt.config.model, RowWiseAdagrad(lr=0.0), ckpt.config.train.seed)
    return model.state_dict()


def _assert_close(got_dir: Path, want_dir: Path) -> None:
    """Every tensor of the run in ``got_dir`` within ``DRIFT`` of ``want_dir``'s, relative
    to how far ``want_dir``'s run moved it (which must be somewhere)."""
    got, want, initial = _weights(got_dir), _weights(want_dir), _initial(want_dir)
    assert got.keys() == want.keys() == initial.keys()
    for key in want:
        moved = float((want[key] - initial[key]).abs().max())
        apart = float((got[key] - want[key]).abs().max())
        assert moved > 0, f"{key}: training did not change it"
        assert apart <= DRIFT * moved, f"{key}: {apart:.2e} apart, moved {moved:.2e}"


class _Spy:
    """Counts the calls of module functions while passing them through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, int] = {}
        self._monkeypatch = monkeypatch

    def watch(self, module, name: str) -> None:
        real = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return real(*args, **kwargs)

        self._monkeypatch.setattr(module, name, counted)


@pytest.fixture(scope="module")
def compiled_run(multi_hot_data: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("compiled")
    train(_config(multi_hot_data, run_dir, "compiled"))
    return run_dir


@interpreted
def test_forced_triton_runs_the_triton_kernels_in_training(
    multi_hot_data: str, compiled_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _Spy(monkeypatch)
    for name in ("lookup_jagged", "reduce_and_update"):
        spy.watch(triton_tbe, name)
    spy.watch(triton_interaction, "dot_interaction")
    result = train(_config(multi_hot_data, tmp_path, "triton"))
    # Every step looks up, updates and interacts on the Triton kernels (one weight group).
    assert spy.calls == {
        "lookup_jagged": STEPS,
        "reduce_and_update": STEPS,
        "dot_interaction": STEPS,
    }
    assert result.kernels == {"tbe": "triton", "interaction": "triton"}
    _assert_close(tmp_path, compiled_run)


def test_torch_ops_train_as_the_compiled_kernels(
    multi_hot_data: str, compiled_run: Path, tmp_path: Path
) -> None:
    result = train(_config(multi_hot_data, tmp_path, "torch"))
    assert result.kernels == {"tbe": "torch", "interaction": "torch"}
    _assert_close(tmp_path, compiled_run)


def _launch(cfg: RunConfig, sharding: str) -> dict:
    """``dlrmflow train --nproc 2`` as a user runs it; the result JSON it prints."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    config_path = run_dir / "config.json"
    config_path.write_text(json.dumps(cfg.model_dump()))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "dlrmflow", "train", "--config", str(config_path),
         "--nproc", "2", "--sharding", sharding],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run_dir / "train_result.json").read_text())


@interpreted
@pytest.mark.parametrize("sharding", ["table_wise", "data_parallel"])
def test_forced_triton_trains_the_sharded_collection(
    tiny_dataset: str, tmp_path: Path, sharding: str
) -> None:
    """Two ranks: table-wise shards (the fused reduce and update on each rank's bag) and
    data-parallel tables (the Triton reduction, the allreduce hook, the Triton update)."""
    # Two steps of 8 rows a rank: the interpreter runs a program per bag and per row.
    small = {"multi_hot": False, "steps": 2, "batch_size": 8}
    reference = _launch(_config(tiny_dataset, tmp_path / "compiled", "compiled", **small), sharding)
    forced = _launch(_config(tiny_dataset, tmp_path / "triton", "triton", **small), sharding)
    plan = json.loads((tmp_path / "triton" / "plan.json").read_text())
    assert {table["sharding"] for table in plan["tables"]} == {sharding}
    assert reference["kernels"] == {"tbe": "compiled", "interaction": "torch"}
    assert forced["kernels"] == {"tbe": "triton", "interaction": "triton"}
    assert forced["steps"] == reference["steps"] == small["steps"]
    _assert_close(tmp_path / "triton", tmp_path / "compiled")


def test_kernels_that_cannot_run_fail_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KernelUnavailable, match="compiled runs on CPU tensors only"):
        check_kernels("compiled", torch.device("cuda", 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelUnavailable, match="set TRITON_INTERPRET=1"):
        check_kernels("triton", torch.device("cpu"))
    check_kernels("torch", torch.device("cpu"))
    check_kernels("auto", torch.device("cuda", 0))


@interpreted
def test_triton_on_cpu_without_the_interpreter_is_one_line(
    tiny_dataset: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "dlrmflow", "train", "--data", tiny_dataset,
         "--run-dir", str(tmp_path / "run"), "--set", "model.kernels=triton",
         "--set", "train.max_steps=1"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines == [
        "error: model.kernels=triton on CPU tensors runs under Triton's interpreter: set "
        "TRITON_INTERPRET=1 in the environment before starting"
    ]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_continues_under_other_kernels(tiny_dataset: str, tmp_path: Path) -> None:
    """The kernels say how a step is computed, not what: ``resume: auto`` continues a
    run under others (a GPU run on the CPU, say) and records no change of run."""
    train(tiny_run_config(tiny_dataset, tmp_path, max_steps=2))
    cfg = tiny_run_config(tiny_dataset, tmp_path, max_steps=4)
    cfg.model.kernels = "torch"
    result = train(cfg)
    assert (result.resumed_from_step, result.steps, result.trained_steps) == (2, 4, 2)
    assert result.changed_on_resume == {}
    assert result.kernels["tbe"] == "torch"


fbgemm_runs = pytest.mark.skipif(
    fbgemm_tbe.refusal("cpu") is not None,
    reason=f"FBGEMM's CPU kernels do not run here: {fbgemm_tbe.refusal('cpu')}",
)


@fbgemm_runs
def test_fbgemm_trains_as_the_compiled_kernels(
    multi_hot_data: str, compiled_run: Path, tmp_path: Path
) -> None:
    result = train(_config(multi_hot_data, tmp_path, "fbgemm"))
    assert result.kernels == {"tbe": "fbgemm", "interaction": "torch"}
    assert result.kernels_reason == "model.kernels=fbgemm"
    _assert_close(tmp_path, compiled_run)


@fbgemm_runs
@pytest.mark.parametrize("first, then", [("compiled", "fbgemm"), ("fbgemm", "compiled")])
def test_a_checkpoint_continues_under_the_other_backend(
    multi_hot_data: str, tmp_path: Path, first: str, then: str
) -> None:
    """Kernels are not part of a run's identity: a run checkpointed under one backend
    resumes under the other and ends where it ends under its own."""
    crossed, own = tmp_path / "crossed", tmp_path / "own"
    for run_dir in (crossed, own):
        train(_config(multi_hot_data, run_dir, first, steps=2))
    train(_config(multi_hot_data, crossed, then, steps=4))
    result = train(_config(multi_hot_data, own, first, steps=4))
    assert result.resumed_from_step == 2
    _assert_close(crossed, own)


@fbgemm_runs
def test_fbgemm_trains_the_sharded_collection(tiny_dataset: str, tmp_path: Path) -> None:
    """Two ranks: FBGEMM runs each rank's table-wise shards; data-parallel tables, whose
    row gradients are allreduced between reduction and update, run the compiled kernels,
    and the result says so. Every sharding type trains the same model within rounding
    (tests/train/model/test_sharded.py), so each run is the other's reference."""
    small = {"multi_hot": False, "steps": 2, "batch_size": 8}
    forced = _launch(_config(tiny_dataset, tmp_path / "fbgemm", "fbgemm", **small), "table_wise")
    replicated = _launch(_config(tiny_dataset, tmp_path / "dp", "fbgemm", **small), "data_parallel")
    assert forced["kernels"] == {"tbe": "fbgemm", "interaction": "torch"}
    assert replicated["kernels"]["tbe"] == "compiled"
    assert "reduces this bag's gradients across ranks" in replicated["kernels_reason"]
    assert forced["steps"] == replicated["steps"] == 2
    _assert_close(tmp_path / "fbgemm", tmp_path / "dp")


@fbgemm_runs
def test_fbgemm_with_tables_on_disk_says_why_fbgemm_does_not_run_them(
    tiny_dataset: str, tmp_path: Path
) -> None:
    # A budget below the tables' bytes puts them on disk, behind a DRAM cache.
    cfg = tiny_run_config(tiny_dataset, tmp_path, max_steps=2, embedding_memory_bytes=100_000)
    cfg.model.kernels = "fbgemm"
    result = train(cfg)
    assert result.kernels["tbe"] == "tiered"
    assert result.kernels_reason.startswith("model.kernels=fbgemm; TieredEmbeddings bags run")
    assert "rows live on disk behind a DRAM cache" in result.kernels_reason
