"""`dlrmflow readers serve` feeding `train`: the same weights as reading locally."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from dlrmflow.train.launch.job import free_port
from dlrmflow.train.run.checkpoint import load_checkpoint
from dlrmflow.train.run.trainer import train
from tests.conftest import tiny_run_config


def test_training_from_a_reader_server_equals_local_reading(tiny_dataset: str, tmp_path: Path):
    local = tiny_run_config(tiny_dataset, tmp_path / "local", max_steps=6)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(local.model_dump()))
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "dlrmflow", "readers", "serve", "--config", str(config_file)]
        + ["--listen", f"127.0.0.1:{port}", "--workers", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        for line in server.stdout:
            if "serving" in line:
                break
            assert time.monotonic() < deadline, "the reader server never came up"
        remote = local.model_copy(deep=True)
        remote.run_dir = str(tmp_path / "remote")
        remote.distributed.readers = [f"127.0.0.1:{port}"]
        remote_result = train(remote)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    local_result = train(local)
    assert remote_result.rows == local_result.rows
    got = load_checkpoint(tmp_path / "remote").model.state_dict()
    want = load_checkpoint(tmp_path / "local").model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
