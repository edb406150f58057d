"""A real S3 server for the tests (a plugin of tests/conftest.py): moto's server mode on
127.0.0.1 and a free port, started once for the session when a test asks for it and always
stopped by its pid, also when a test fails, and by the kernel when pytest itself is killed.

Tests reach it the way a user reaches any S3 endpoint: through botocore's standard
settings in the environment (``AWS_ENDPOINT_URL``, the access keys and the region), which
s3fs, and so every ``s3://`` URL fsspec opens, picks up; processes a test starts (training
ranks) inherit them. Nothing leaves this machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.prefect_server import dies_with_this_process, free_port, stop_process_group

# moto answers in a few seconds here; a server not answering by then will not.
S3_START_TIMEOUT_S = 60


def _moto_command(port: int) -> list[str] | None:
    """How to start moto's server from this interpreter's environment, if it is installed."""
    script = Path(sys.executable).with_name("moto_server")
    if script.is_file():
        return [str(script), "-H", "127.0.0.1", "-p", str(port)]
    found = shutil.which("moto_server")
    return [found, "-H", "127.0.0.1", "-p", str(port)] if found else None


def _wait_up(url: str, proc: subprocess.Popen, log: Path) -> str | None:
    """None once the server answers; else why it did not (it exited, or never answered)."""
    deadline = time.monotonic() + S3_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"moto_server exited with {proc.returncode}: {log.read_text()[-500:]}"
        try:
            with urllib.request.urlopen(f"{url}/moto-api/", timeout=2):
                return None
        except urllib.error.HTTPError:
            return None  # it answered
        except OSError:
            time.sleep(0.2)
    return f"moto_server did not answer on {url} within {S3_START_TIMEOUT_S} s"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint URL (``http://127.0.0.1:PORT``) of moto's S3 server for this session;
    the test is skipped, with the reason, where moto is missing or cannot start."""
    port = free_port()
    command = _moto_command(port)
    if command is None:
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    log = tmp_path_factory.mktemp("s3-server") / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with log.open("w") as out:
        proc = subprocess.Popen(
            command,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=dies_with_this_process(),
        )
    try:
        url = f"http://127.0.0.1:{port}"
        failure = _wait_up(url, proc, log)
        if failure is not None:
            pytest.skip(f"no S3 server: {failure}")
        yield url
    finally:
        stop_process_group(proc, timeout=10)


@pytest.fixture(scope="module")
def s3_bucket(s3_server: str) -> Iterator[str]:
    """``s3://NAME``: a new bucket on the session's S3 server, with botocore's standard
    settings pointing at it for this module's tests (and the processes they start)."""
    import fsspec

    name = f"dlrmflow-{uuid.uuid4().hex[:12]}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", s3_server)
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask a cloud's metadata service
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
            env.delenv(key, raising=False)
        # A file system made under other settings would keep its endpoint: none is reused.
        s3 = fsspec.get_filesystem_class("s3")
        s3.clear_instance_cache()
        try:
            fsspec.filesystem("s3").call_s3("create_bucket", Bucket=name)
            yield f"s3://{name}"
        finally:
            s3.clear_instance_cache()
