"""dlrmflow's TorchX components: ``torchx run -s local_cwd`` trains a job of two "hosts" of
two ranks bitwise as ``dlrmflow train --nproc 4`` with the same plan, evaluates it, each
host gets its flags, and a stopped ``torchx run`` leaves no process and an unlocked run
directory."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dlrmflow.train.launch.job import free_port
from dlrmflow.train.run.rundir import run_dir_lock
from tests.conftest import same_weights, tiny_run_config
from tests.train.launch.processes import described, job_processes

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchx") is None,
    reason="TorchX is not installed (make test installs it: Makefile's TORCHX_PKGS)",
)
BIN = Path(sys.executable).parent


def _component(name: str) -> str:
    path = subprocess.run(
        [BIN / "dlrmflow", "launch", "torchx"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert Path(path).is_file()
    return f"{path}:{name}"


def _env() -> dict[str, str]:
    # The hosts run `dlrmflow` from PATH, as in an activated environment.
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def _config(tmp_path: Path, data: str, name: str, **train: object) -> Path:
    config = tiny_run_config(data, tmp_path / name, **{"max_steps": 6, **train}).model_dump()
    config["distributed"]["sharding"] = "row_wise"  # one plan at any number of hosts
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _torchx(*args: str) -> list[str]:
    return [str(BIN / "torchx"), "run", "-s", "local_cwd", *args]


def test_two_hosts_of_two_ranks_train_as_one_host_of_four_and_evaluate(tiny_dataset, tmp_path):
    config = _config(tmp_path, tiny_dataset, "torchx")
    port = str(free_port())
    done = subprocess.run(
        _torchx(_component("train"), "-j", "2x2", "--rdzv_port", port, "--config", str(config)),
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Job finished: SUCCEEDED" in done.stderr
    alone = _config(tmp_path, tiny_dataset, "alone")
    by_hand = subprocess.run(
        [BIN / "dlrmflow", "train", "--config", str(alone), "--nproc", "4"],
        capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    same_weights(tmp_path / "torchx", tmp_path / "alone")
    plans = [json.loads((tmp_path / d / "plan.json").read_text()) for d in ("torchx", "alone")]
    assert plans[0]["tables"] == plans[1]["tables"]
    assert (plans[0]["ranks_per_host"], plans[1]["ranks_per_host"]) == (2, 4)
    # The evaluation component (one rank: its command on several hosts is checked below).
    scored = subprocess.run(
        _torchx(_component("evaluate"), "-j", "1", "--rdzv_port", str(free_port()),
                "--run_dir", str(tmp_path / "torchx")),
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert scored.returncode == 0, scored.stderr[-3000:]
    metrics = json.loads((tmp_path / "torchx" / "eval.json").read_text())
    assert metrics["world_size"] == 1 and 0.5 < metrics["auc"] <= 1.0


@pytest.mark.serial
def test_a_stopped_torchx_run_leaves_no_process_and_no_lock(tiny_dataset, tmp_path):
    config = _config(tmp_path, tiny_dataset, "long", epochs=1000, max_steps=None)
    run = subprocess.Popen(
        _torchx(_component("train"), "-j", "2x1", "--rdzv_port", str(free_port()),
                "--config", str(config)),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path,
    )  # fmt: skip
    metrics = tmp_path / "long" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
        assert run.poll() is None, run.stderr.read()[-3000:] if run.stderr else ""
        time.sleep(0.5)
    assert metrics.stat().st_size, "the job logged no step in 120 s"
    run.send_signal(signal.SIGTERM)
    run.wait(timeout=60)
    deadline = time.monotonic() + 30
    while job_processes(tmp_path / "long") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert described(job_processes(tmp_path / "long")) == []
    with run_dir_lock(str(tmp_path / "long"), "test"):
        pass  # the run directory is free for the next run


def test_the_components_give_each_host_its_flags_and_refuse_a_bad_shape():
    spec = importlib.util.spec_from_file_location("components", _component("train")[:-6])
    assert spec is not None and spec.loader is not None
    components = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(components)
    one = components.train("train.lr=0.1", config="c.yaml", j="4")
    [role] = one.roles
    assert role.num_replicas == 1 and role.entrypoint == "bash"
    assert role.args == ["-c", "dlrmflow train --config c.yaml --set train.lr=0.1 --nproc 4"]
    two = components.evaluate(run_dir="runs/a b", j="2x8", rdzv_port=29999)
    [role] = two.roles
    assert role.num_replicas == 2 and role.port_map == {"rendezvous": 29999}
    # TorchX fills in ${replica_id} and ${rank0_env}; "$$" is its literal "$".
    assert role.args[1] == (
        "dlrmflow evaluate --run-dir 'runs/a b' --nproc 8 --nnodes 2 --node-rank "
        '${replica_id} --rdzv-endpoint "$${${rank0_env}:=localhost}:29999"'
    )
    with pytest.raises(ValueError, match="-j '2x': give HOSTSxRANKS"):
        components.train(config="c.yaml", j="2x")
