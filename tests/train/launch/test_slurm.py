"""``dlrmflow launch slurm``: the batch script gives each node its flags (checked with
stand-ins for Slurm's commands), and against a real Slurm controller with two daemons on
this host, a job of two nodes trains, ``scancel`` stops it in one line with nothing left
running and the run directory unlocked, and submitted again it ends bitwise where one
host's uninterrupted run ends."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dlrmflow.train.run.rundir import run_dir_lock
from tests.conftest import same_weights, tiny_run_config
from tests.slurm_cluster import slurm_cluster, slurm_unavailable
from tests.train.launch.processes import described, job_processes

BIN = Path(sys.executable).parent


def _launch(*args: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run(
        [BIN / "dlrmflow", "launch", "slurm", *args],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _stand_in(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_the_batch_script_starts_dlrmflow_train_on_each_node_with_its_place(tmp_path):
    config = tmp_path / "my run.yaml"  # a space, quoted all the way to the nodes
    config.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run")}))
    written = _launch("--config", str(config), "--nodes", "2", "--nproc", "4",
                      "--set", "train.lr=0.5", "--sbatch=--partition=cpu")  # fmt: skip
    script = Path(written["script"])
    assert script == tmp_path / "run" / "slurm" / "train.sbatch"
    text = script.read_text()
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --partition=cpu\n" in text
    assert f"#SBATCH --output={tmp_path / 'run' / 'slurm'}/%j.out\n" in text
    # Stand-ins: a job on nodes n1 and n2 (n1 reached at 10.1.2.3), whose srun runs each
    # node's task in turn, and a dlrmflow that prints the arguments it got.
    shims = tmp_path / "bin"
    shims.mkdir()
    node = 'echo "NodeName=$3 Arch=x86_64"; echo "   NodeAddr=10.1.2.3 NodeHostName=h"'
    _stand_in(shims, "scontrol",
              f'if [ "$2" = hostnames ]; then printf "n1\\nn2\\n"; else {node}; fi\n')  # fmt: skip
    _stand_in(shims, "srun", 'while [[ "$1" == --* ]]; do shift; done\n'
              'for node in 0 1; do SLURM_NODEID=$node "$@"; done\n')  # fmt: skip
    _stand_in(shims, "dlrmflow", 'printf "%s|" "$@"; echo\n')
    env = {**os.environ, "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "4321"}  # fmt: skip
    ran = subprocess.run(["bash", script], capture_output=True, text=True, env=env, timeout=60)
    assert ran.returncode == 0, ran.stderr
    common = (f"train|--config|{config}|--set|train.lr=0.5|--nproc|4|--nnodes|2|"
              "--rdzv-endpoint|10.1.2.3:24321|--node-rank|")  # fmt: skip
    assert ran.stdout.splitlines() == [common + "0|", common + "1|"]


def test_submit_prints_the_job_id_and_a_refusal_is_sbatchs_words_in_one_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run")}))
    shims = tmp_path / "bin"
    shims.mkdir()
    path = f"{shims}{os.pathsep}{os.environ['PATH']}"
    _stand_in(shims, "sbatch", 'echo "$@" > "$(dirname "$0")/args"; echo "4321;cluster"\n')
    submitted = _launch("--config", str(config), "--submit", env={**os.environ, "PATH": path})
    assert submitted["job_id"] == 4321
    assert (shims / "args").read_text().split() == ["--parsable", submitted["script"]]
    _stand_in(shims, "sbatch", 'echo "sbatch: error: invalid partition specified: gpu" >&2\n'
              "exit 1\n")  # fmt: skip
    refused = subprocess.run(
        [BIN / "dlrmflow", "launch", "slurm", "--config", str(config), "--submit"],
        capture_output=True, text=True, env={**os.environ, "PATH": path}, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert "invalid partition specified: gpu" in refused.stderr
    assert str(tmp_path / "run" / "slurm" / "train.sbatch") in refused.stderr


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (("--nodes", "0"), "nodes and nproc must be at least 1, got 0, 1"),
        (("--sbatch=partition",), "sbatch option 'partition': give it as --name=value"),
        (("--port", "70000"), "port must be in 1..65535, got 70000"),
    ],
)
def test_a_bad_option_is_refused_in_one_line_and_nothing_written(tmp_path, option, message):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run")}))
    done = subprocess.run(
        [BIN / "dlrmflow", "launch", "slurm", "--config", str(config), *option],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and done.stderr == f"error: {message}\n"
    assert not (tmp_path / "run" / "slurm").exists()


def test_a_bad_configuration_is_refused_before_any_script_is_written(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "train": {"lr": -1}}))
    done = subprocess.run(
        [BIN / "dlrmflow", "launch", "slurm", "--config", str(config), "--nodes", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "train.lr" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.serial
@pytest.mark.skipif(slurm_unavailable() is not None, reason=str(slurm_unavailable()))
def test_a_two_node_job_trains_stops_in_one_line_and_resumes_bitwise(tiny_dataset, tmp_path):
    """Two emulated nodes of one rank each; 12 steps an epoch, a checkpoint every 20."""

    def config(name: str) -> Path:
        # One thread a rank: the two "nodes" share this host's cores.
        run = tiny_run_config(
            tiny_dataset, tmp_path / name, epochs=20, checkpoint_every=20, threads=1
        )
        data = run.model_dump()
        data["distributed"]["sharding"] = "row_wise"  # one plan on one host or two
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    alone = subprocess.run(
        [BIN / "dlrmflow", "train", "--config", str(config("alone")), "--nproc", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-3000:]
    run_dir = tmp_path / "slurm-run"
    with slurm_cluster(tmp_path / "cluster", nodes=2) as cluster:
        # The job sees dlrmflow on PATH, as a user's activated environment gives it.
        env = {**cluster.env, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
        script = Path(_launch("--config", str(config("slurm-run")), "--nodes", "2",
                              "--nproc", "1", env=env)["script"])  # fmt: skip
        job = cluster.submit(script, env=env)
        checkpoints = run_dir / "checkpoints"
        deadline = time.monotonic() + 300
        while not (checkpoints.exists() and any(checkpoints.glob("step_*"))):
            assert cluster.state(job) in ("PENDING", "RUNNING"), cluster.state(job)
            assert time.monotonic() < deadline, "no checkpoint in 300 s"
            time.sleep(0.2)
        cluster.cancel(job)
        assert cluster.wait(job, timeout=120) == "CANCELLED"
        output = (script.parent / f"{job}.out").read_text()
        stopped = [line for line in output.splitlines() if "stopped by SIGTERM" in line]
        assert len(stopped) == 2 and "Traceback" not in output, output[-3000:]
        deadline = time.monotonic() + 30
        while job_processes(run_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert described(job_processes(run_dir)) == []
        with run_dir_lock(str(run_dir), "test"):
            pass  # unlocked: the next job may start
        again = cluster.submit(script, env=env)
        assert cluster.wait(again, timeout=600) == "COMPLETED", (
            script.parent / f"{again}.out"
        ).read_text()[-3000:]
        assert "Warning" not in (script.parent / f"{again}.out").read_text()
    result = json.loads((run_dir / "train_result.json").read_text())
    assert result["resumed_from_step"] is not None and result["world_size"] == 2
    same_weights(run_dir, tmp_path / "alone")
