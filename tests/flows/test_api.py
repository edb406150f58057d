"""A Prefect API that does not answer is one line for every command that runs flows, named
by its URL, and exit 1; never Prefect's chain of client tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dlrmflow.flows.api import PrefectServerError, unreachable_api
from tests.prefect_server import free_port


@pytest.fixture
def nowhere() -> str:
    """An API URL on a local port nothing listens on: connections are refused at once."""
    return f"http://127.0.0.1:{free_port()}/api"


@pytest.mark.parametrize(
    "command",
    [
        ["serve", "--interval", "3600"],
        ["demo", "--quick"],
    ],
    ids=["serve", "demo"],
)
def test_an_unreachable_api_is_one_line(tmp_path: Path, nowhere: str, command: list[str]) -> None:
    env = {**os.environ, "PREFECT_API_URL": nowhere, "PREFECT_HOME": str(tmp_path / "home")}
    if command[0] == "demo":
        command = [*command, "--run-dir", str(tmp_path / "run")]
    done = subprocess.run(
        [sys.executable, "-m", "dlrmflow", *command],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert lines == [
        f"error: Prefect API at {nowhere} does not answer ([Errno 111] Connection refused): "
        "start the server (prefect server start) or unset PREFECT_API_URL to run on a local API"
    ], done.stderr
    assert not (tmp_path / "run").exists()  # the check comes before any work


def test_the_failure_is_recognised_wherever_prefect_raises_it(nowhere: str):
    # Prefect's client raises its own RuntimeError from httpx's error from httpcore's.
    # (Prefect reads its settings once, at import: they are changed through its own API.)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    try:
        try:
            try:
                raise ConnectionRefusedError(111, "Connection refused")
            except OSError as e:
                raise httpx.ConnectError("All connection attempts failed") from e
        except httpx.ConnectError as e:
            raise RuntimeError(f"Failed to reach API at {nowhere}/") from e
    except RuntimeError as e:
        error = e
    with temporary_settings(updates={PREFECT_API_URL: nowhere}):
        found = unreachable_api(error)
        assert unreachable_api(RuntimeError("something else")) is None
    assert isinstance(found, PrefectServerError)
    assert str(found).startswith(f"Prefect API at {nowhere} does not answer ([Errno 111]")
