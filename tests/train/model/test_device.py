"""``train.device`` and ``train.precision``: where a run computes and in which precision.

The CPU tests run everywhere; the ``gpu`` ones run where torch sees CUDA (``make
gpu-check``) and are skipped, saying so, elsewhere. Both take the same trainer code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlrmflow.config import ConfigError
from dlrmflow.features.batch import Batch
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.device import BatchStager, process_group_backend, resolve_device
from dlrmflow.train.run.checkpoint import load_checkpoint
from dlrmflow.train.run.evaluate import evaluate
from dlrmflow.train.run.export import export_model
from dlrmflow.train.run.trainer import train
from tests.conftest import tiny_run_config

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def _one_hot_batch(rows: int = 4) -> Batch:
    ids = torch.arange(rows * 2, dtype=torch.int64).view(rows, 2) % 3
    return Batch(
        torch.randn(rows, 3), KeyedJaggedTensor.from_one_hot(["a", "b"], ids), torch.ones(rows)
    )


@no_cuda
def test_auto_is_the_cpu_without_cuda() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu", local_rank=3) == torch.device("cpu")
    with pytest.raises(ConfigError, match="train.device=cuda: no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="evaluate --device must be auto, cpu or cuda"):
        resolve_device("gpu", key="evaluate --device")


@no_cuda
def test_cuda_without_a_gpu_is_one_line_from_the_cli(tiny_dataset: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dlrmflow", "train", "--data", tiny_dataset,
         "--run-dir", str(tmp_path / "run"), "--set", "train.device=cuda"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: train.device=cuda: no CUDA device")


def test_process_groups_carry_cuda_over_nccl_and_control_values_over_gloo() -> None:
    assert process_group_backend(torch.device("cpu")) == "gloo"
    assert process_group_backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"


def test_the_stager_hands_cpu_batches_through_untouched() -> None:
    stager = BatchStager(torch.device("cpu"))
    batch = _one_hot_batch()
    assert stager.stage(batch) is batch
    assert stager.ready(batch) is batch
    assert stager.stage(None) is None
    assert stager.wait_seconds == 0.0


def test_moving_a_batch_keeps_its_one_hot_form() -> None:
    """The one-hot form is the fast path of the lookup and of the input exchange: a copy
    to the device must not turn it into the jagged one."""
    batch = _one_hot_batch()
    _ = batch.sparse.values  # the jagged form built too (as the benchmarks' counting does)
    moved = batch.to("cpu")
    assert moved.sparse.one_hot_rows is not None
    assert torch.equal(moved.sparse.one_hot_rows, batch.sparse.one_hot_rows)
    assert torch.equal(moved.sparse.values, batch.sparse.values)
    empty = Batch.empty(3, ["a", "b"], device="cpu")
    assert len(empty) == 0 and empty.sparse.one_hot_rows.shape == (0, 2)


def test_bf16_runs_the_dense_arch_in_bfloat16_and_keeps_state_in_float32(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Autocast covers the MLPs and the interaction; the logits, every parameter, the
    embeddings and their optimizer state stay float32, and the run trains to within
    bfloat16's precision of the float32 run (its loss differs, so bf16 was really on)."""
    fp32 = train(tiny_run_config(tiny_dataset, tmp_path / "fp32", max_steps=6))
    cfg = tiny_run_config(tiny_dataset, tmp_path / "bf16", max_steps=6, precision="bf16")
    bf16 = train(cfg)
    assert (fp32.precision, bf16.precision) == ("fp32", "bf16")
    assert bf16.final_loss != fp32.final_loss
    assert abs(bf16.final_loss - fp32.final_loss) < 0.01 * fp32.final_loss
    model = load_checkpoint(tmp_path / "bf16").model
    assert all(t.dtype == torch.float32 for t in model.state_dict().values())

    seen: list[torch.dtype] = []
    model.dense_arch.top[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    spec = load_checkpoint(tmp_path / "bf16").spec
    dense = torch.randn(4, len(spec.dense))
    rows = torch.zeros(4, len(spec.sparse), dtype=torch.int64)
    logits = model(dense, KeyedJaggedTensor.from_one_hot(spec.sparse_names, rows))
    assert seen == [torch.bfloat16] and logits.dtype == torch.float32


def test_a_cpu_run_records_where_and_how_it_trained(tiny_dataset: str, tmp_path: Path) -> None:
    result = train(tiny_run_config(tiny_dataset, tmp_path, max_steps=2, device="cpu"))
    recorded = json.loads((tmp_path / "train_result.json").read_text())
    assert recorded["device"] == result.device == "cpu"
    assert recorded["kernels"] == {"tbe": "compiled", "interaction": "torch"}


# -- on a GPU (make gpu-check) --------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_training_matches_cpu_training(tiny_dataset: str, tmp_path: Path) -> None:
    """The same run on cuda:0 (Triton kernels) and on the CPU (compiled kernels)."""
    gpu = train(tiny_run_config(tiny_dataset, tmp_path / "gpu", max_steps=6, device="cuda"))
    cpu = train(tiny_run_config(tiny_dataset, tmp_path / "cpu", max_steps=6, device="cpu"))
    assert gpu.device == "cuda:0" and gpu.kernels["tbe"] == "triton"
    assert abs(gpu.final_loss - cpu.final_loss) < 1e-3 * cpu.final_loss
    on_gpu = load_checkpoint(tmp_path / "gpu").model.state_dict()
    on_cpu = load_checkpoint(tmp_path / "cpu").model.state_dict()
    for key, value in on_cpu.items():
        torch.testing.assert_close(on_gpu[key], value, rtol=1e-3, atol=1e-4, msg=key)


@pytest.mark.gpu
def test_gpu_training_is_bitwise_repeatable(tiny_dataset: str, tmp_path: Path) -> None:
    for name in ("a", "b"):
        train(tiny_run_config(tiny_dataset, tmp_path / name, max_steps=6, device="cuda"))
    a = load_checkpoint(tmp_path / "a").model.state_dict()
    b = load_checkpoint(tmp_path / "b").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
def test_checkpoints_cross_devices(tiny_dataset: str, tmp_path: Path) -> None:
    """Trained on the GPU, continued on the CPU, and the reverse: each ends where the
    uninterrupted run on the first device ends, within the devices' rounding; evaluate
    and export run on either."""
    run = tmp_path / "gpu_then_cpu"
    train(tiny_run_config(tiny_dataset, run, max_steps=3, device="cuda"))
    resumed = train(tiny_run_config(tiny_dataset, run, max_steps=6, device="cpu"))
    assert resumed.resumed_from_step == 3 and resumed.steps == 6 and resumed.device == "cpu"
    run = tmp_path / "cpu_then_gpu"
    train(tiny_run_config(tiny_dataset, run, max_steps=3, device="cpu"))
    resumed = train(tiny_run_config(tiny_dataset, run, max_steps=6, device="cuda"))
    assert resumed.resumed_from_step == 3 and resumed.device == "cuda:0"
    whole = tmp_path / "whole"
    train(tiny_run_config(tiny_dataset, whole, max_steps=6, device="cuda"))
    for crossed in ("gpu_then_cpu", "cpu_then_gpu"):
        got = load_checkpoint(tmp_path / crossed).model.state_dict()
        for key, value in load_checkpoint(whole).model.state_dict().items():
            torch.testing.assert_close(got[key], value, rtol=1e-3, atol=1e-4, msg=key)
    on_cpu = evaluate(whole, device="cpu")
    on_gpu = evaluate(whole, device="cuda")
    assert abs(on_cpu["auc"] - on_gpu["auc"]) < 1e-4
    export_model(whole, tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    assert all(t.device.type == "cpu" for t in load_file(tmp_path / "model.safetensors").values())


@pytest.mark.gpu
def test_gpu_batches_are_copied_ahead_from_pinned_memory() -> None:
    stager = BatchStager(torch.device("cuda", 0))
    batch = _one_hot_batch(1024).pin_memory()
    staged = stager.stage(batch)
    assert staged.dense.is_cuda and staged.sparse.one_hot_rows.is_cuda
    ready = stager.ready(staged)
    assert torch.equal(ready.dense.cpu(), batch.dense)
    assert torch.equal(ready.sparse.one_hot_rows.cpu(), batch.sparse.one_hot_rows)


@pytest.mark.gpu
def test_bf16_on_the_gpu_trains_close_to_fp32(tiny_dataset: str, tmp_path: Path) -> None:
    fp32 = train(tiny_run_config(tiny_dataset, tmp_path / "a", max_steps=6, device="cuda"))
    cfg = tiny_run_config(
        tiny_dataset, tmp_path / "b", max_steps=6, device="cuda", precision="bf16"
    )
    bf16 = train(cfg)
    assert abs(bf16.final_loss - fp32.final_loss) < 0.01 * fp32.final_loss


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpu_ranks_train_over_nccl(tiny_dataset: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tiny_run_config(tiny_dataset, run, max_steps=6, device="cuda")
    cfg.distributed.nproc = 2
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.model_dump()))
    done = subprocess.run(
        [sys.executable, "-m", "dlrmflow", "train", "--config", str(run / "config.json")],
        capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((run / "train_result.json").read_text())
    assert result["world_size"] == 2 and result["device"] == "cuda:0"


FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "eye", "rand"}
FACTORIES |= {"randn", "randint", "linspace"}


def test_every_tensor_the_training_code_makes_names_its_device() -> None:
    """Nothing in ``dlrmflow/train`` (its folders too) may assume CPU tensors: each tensor
    it makes from nothing names its device, the model's (``device=...``) or, for the host's control
    values that travel over gloo, ``device="cpu"``; the rest derive from their inputs."""
    import ast

    import dlrmflow.train

    root = Path(dlrmflow.train.__file__).resolve().parent
    unnamed = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and node.func.attr in FACTORIES
                and not any(k.arg == "device" for k in node.keywords)
            ):
                unnamed.append(f"{path.relative_to(root)}:{node.lineno} torch.{node.func.attr}")
    assert unnamed == []


def test_a_checkpoint_written_on_a_gpu_continues_on_the_cpu(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU run's checkpoint files tag every tensor with its device ("cuda:0"); loaded on
    a machine without CUDA they must be mapped to the host, not refused. Here the tags are
    written as a GPU run writes them, then the run continues, is scored and exported on
    the CPU, ending bitwise where the uninterrupted run ends."""
    import torch.serialization

    run = tmp_path / "gpu_tagged"
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        train(tiny_run_config(tiny_dataset, run, max_steps=3))
    data_files = list((run / "checkpoints").glob("step_*/*.distcp"))
    assert data_files and all(b"cuda:0" in f.read_bytes() for f in data_files)
    resumed = train(tiny_run_config(tiny_dataset, run, max_steps=6))
    assert (resumed.resumed_from_step, resumed.steps) == (3, 6)
    whole = tmp_path / "whole"
    train(tiny_run_config(tiny_dataset, whole, max_steps=6))
    got = load_checkpoint(run).model.state_dict()
    want = load_checkpoint(whole).model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)

    tagged = tmp_path / "tagged_eval"
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        train(tiny_run_config(tiny_dataset, tagged, max_steps=3))
    assert evaluate(tagged, device="cpu")["rows"] > 0
    export_model(tagged, tmp_path / "model.safetensors")
