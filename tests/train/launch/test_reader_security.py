"""Reader services over TLS with a shared secret (``distributed.reader_security``).

The certificates are made here, with the ``cryptography`` package: a CA of the test's own
and a server certificate it signs for 127.0.0.1 and localhost. A trainer with the secret
trains bitwise as one reading locally; one without it, or with another, is refused in one
line naming the endpoint; a plain-text client cannot reach a TLS server; an address other
hosts reach is served only with TLS and a secret, or with ``--insecure``; and the secret is
never on a command line nor in what a run writes down.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dlrmflow.config import ConfigError, ReaderSecurityConfig, load_config
from dlrmflow.ingest.loader import make_loader
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.reader import ParquetBatchDataset
from dlrmflow.ingest.service.client import ReaderUnavailableError, RemoteBatchSource
from dlrmflow.ingest.service.protocol import Endpoint
from dlrmflow.ingest.service.security import (
    SECRET_ENV,
    ReaderRefusedError,
    ReaderSecurity,
    ReaderSecurityError,
)
from dlrmflow.ingest.service.server import FlightBatchServer
from dlrmflow.ingest.service.streams import ParquetStreams
from dlrmflow.ingest.splits import list_splits
from dlrmflow.train.launch.job import free_port
from dlrmflow.train.run.trainer import train
from tests.conftest import same_weights, tiny_run_config

# It times waits and signals: run alone, after the rest of the suite (make test).
pytestmark = pytest.mark.serial

SECRET = "s3cret-reader-token-0123456789abcdef"
COLUMNS = ["label", "I1", "C1"]
READ = {"batch_size": 700, "seed": 3, "shuffle_window": 1}


@dataclass(frozen=True)
class Pki:
    """PEM files: the test's CA, a server certificate it signed and that certificate's key."""

    ca: Path
    cert: Path
    key: Path
    secret: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, signer: ec.EllipticCurvePrivateKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    where = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        _certificate("dlrmflow test CA", ca_key, "dlrmflow test CA", ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        _certificate("localhost", key, "dlrmflow test CA", ca_key)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = Pki(where / "ca.pem", where / "server.pem", where / "server.key", where / "secret")
    files.ca.write_bytes(ca.public_bytes(pem))
    files.cert.write_bytes(cert.public_bytes(pem))
    files.key.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    files.secret.write_text(SECRET + "\n")  # a file ends in a newline; the secret does not
    files.secret.chmod(0o600)
    return files


def _serving(pki: Pki, **overrides: object) -> ReaderSecurityConfig:
    return ReaderSecurityConfig(
        tls=True, cert_file=str(pki.cert), key_file=str(pki.key), **overrides
    )


def _trusting(pki: Pki, **overrides: object) -> ReaderSecurityConfig:
    return ReaderSecurityConfig(tls=True, ca_file=str(pki.ca), **overrides)


# --- the service on its own: record batches, in this process ------------------------------


@pytest.fixture
def tls_server(tiny_dataset: str, pki: Pki) -> Iterator[FlightBatchServer]:
    """A reader server over TLS that requires the secret, on all addresses (which TLS and
    the secret allow)."""
    security = ReaderSecurity.load(_serving(pki, secret_file=str(pki.secret)), serving=True)
    streams = ParquetStreams(tiny_dataset, read_manifest(tiny_dataset), COLUMNS, workers=1)
    server = FlightBatchServer(
        Endpoint.parse("0.0.0.0:0"), streams, features="plain", security=security
    )
    try:
        yield server
    finally:
        server.shutdown()


def _files(tiny_dataset: str) -> tuple[list[str], list[str]]:
    manifest = read_manifest(tiny_dataset)
    paths = manifest.day_paths(tiny_dataset, manifest.train_days())
    return paths, [p.removeprefix(tiny_dataset.rstrip("/") + "/") for p in paths]


def _source(server: FlightBatchServer, files: list[str], security: ReaderSecurity | None):
    where = f"127.0.0.1:{server.port}"
    return RemoteBatchSource([where], files, "plain", timeout_s=5, security=security, **READ)


def test_a_client_with_the_secret_reads_the_local_batches_over_tls(
    tiny_dataset: str, pki: Pki, tls_server: FlightBatchServer
) -> None:
    paths, files = _files(tiny_dataset)
    local = list(make_loader(ParquetBatchDataset(list_splits(paths), COLUMNS, **READ), 2))
    security = ReaderSecurity.load(_trusting(pki), serving=False, environ={SECRET_ENV: SECRET})
    remote = _source(tls_server, files, security)
    assert remote.endpoints[0].location == f"grpc+tls://127.0.0.1:{tls_server.port}"
    with remote.loader(2) as loader:
        got = list(loader)
    assert len(got) == len(local) > 0
    assert all(
        isinstance(g, pa.RecordBatch) and g.equals(w) for g, w in zip(got, local, strict=True)
    )
    assert remote.pass_steps(0, 2) == len(local)  # the 'reader-splits' action carries it too
    assert SECRET not in repr(security)


@pytest.mark.parametrize(
    ("secret", "says"),
    [
        (None, "requires a secret and this trainer has none"),
        ("another-secret", "refused this trainer's secret"),
    ],
)
def test_a_client_without_the_secret_or_with_another_is_refused_in_one_line(
    tiny_dataset: str, pki: Pki, tls_server: FlightBatchServer, secret: str | None, says: str
) -> None:
    _, files = _files(tiny_dataset)
    environ = {} if secret is None else {SECRET_ENV: secret}
    security = ReaderSecurity.load(_trusting(pki), serving=False, environ=environ)
    began = time.monotonic()
    # Refused at once, not failed over to the end: every endpoint shares the secret. Each
    # call is checked: the state and splits actions as the stream itself.
    endpoint = re.escape(f"reader 127.0.0.1:{tls_server.port}")
    pattern = rf"^{endpoint} {re.escape(says)}: .*secret_file or {SECRET_ENV}$"
    with pytest.raises(ReaderRefusedError, match=pattern) as refused:
        list(_source(tls_server, files, security).loader(2))
    assert "\n" not in str(refused.value)
    with pytest.raises(ReaderRefusedError, match=pattern):
        _source(tls_server, files, security).pass_steps(0, 1)
    assert time.monotonic() - began < 5  # the deadline (5 s) was never waited for


def test_a_plain_text_client_cannot_reach_a_tls_server(
    tiny_dataset: str, tls_server: FlightBatchServer
) -> None:
    _, files = _files(tiny_dataset)
    plain = ReaderSecurity.load(ReaderSecurityConfig(), serving=False, environ={SECRET_ENV: SECRET})
    began = time.monotonic()
    with pytest.raises(
        ReaderUnavailableError, match=r"connects over plain gRPC \(distributed"
    ) as failed:
        list(_source(tls_server, files, plain).loader(0))
    assert time.monotonic() - began < 5
    assert f"127.0.0.1:{tls_server.port}" in str(failed.value)
    assert "\n" not in str(failed.value)
    # Nor a TLS client that does not trust the test's CA (the system's roots).
    untrusting = ReaderSecurity.load(
        ReaderSecurityConfig(tls=True), serving=False, environ={SECRET_ENV: SECRET}
    )
    with pytest.raises(ReaderUnavailableError, match="connects over TLS"):
        list(_source(tls_server, files, untrusting).loader(0))


def test_a_reachable_address_needs_tls_and_a_secret_unless_insecure(
    tiny_dataset: str, pki: Pki
) -> None:
    streams = ParquetStreams(tiny_dataset, read_manifest(tiny_dataset), COLUMNS, workers=1)
    secret_only = ReaderSecurity.load(
        ReaderSecurityConfig(), serving=True, environ={SECRET_ENV: SECRET}
    )
    tls_only = ReaderSecurity.load(_serving(pki), serving=True, environ={})
    for security, lacking in [
        (None, "TLS .* and a secret"),
        (secret_only, r"needs TLS \(distributed"),
        (tls_only, r"needs a secret \(distributed"),
    ]:
        for listen in ("0.0.0.0:0", "[::]:0", "10.0.0.5:0", "reader-host:0"):
            with pytest.raises(ReaderSecurityError, match=f"^reader server on .*{lacking}"):
                FlightBatchServer(
                    Endpoint.parse(listen), streams, features="plain", security=security
                )
    for listen in ("127.0.0.1:0", "localhost:0", "[::1]:0"):
        assert Endpoint.parse(listen).loopback
    open_server = FlightBatchServer(
        Endpoint.parse("0.0.0.0:0"), streams, features="plain", insecure=True
    )
    open_server.shutdown()


def test_the_secret_comes_from_one_file_or_the_environment_and_never_into_the_config(
    pki: Pki, tmp_path: Path
) -> None:
    with_file = _trusting(pki, secret_file=str(pki.secret))
    assert ReaderSecurity.load(with_file, serving=False, environ={}).secret == SECRET.encode()
    with pytest.raises(ReaderSecurityError, match=f"secret_file and {SECRET_ENV} both"):
        ReaderSecurity.load(with_file, serving=False, environ={SECRET_ENV: SECRET})
    missing = ReaderSecurityConfig(secret_file=str(tmp_path / "nope"))
    with pytest.raises(ReaderSecurityError, match=r"secret_file: cannot read .*nope"):
        ReaderSecurity.load(missing, serving=True, environ={})
    (tmp_path / "two-lines").write_text("a\nb\n")
    two = ReaderSecurityConfig(secret_file=str(tmp_path / "two-lines"))
    with pytest.raises(ReaderSecurityError, match="one line of printable ASCII"):
        ReaderSecurity.load(two, serving=True, environ={})
    with pytest.raises(ReaderSecurityError, match="needs distributed.reader_security.key_file"):
        ReaderSecurity.load(
            ReaderSecurityConfig(tls=True, cert_file=str(pki.cert)), serving=True, environ={}
        )
    with pytest.raises(ConfigError, match="cert_file given but tls is false"):
        load_config(None, [f"distributed.reader_security.cert_file={pki.cert}"], env={})
    # The variable is the secret, not a configuration key; what a run writes down (its
    # config.json is this dump) holds the secret file's path only.
    config = load_config(
        None,
        ["distributed.reader_security.tls=true", f"distributed.reader_security.ca_file={pki.ca}"],
        env={SECRET_ENV: SECRET, "DLRMFLOW_DISTRIBUTED__READER_SECURITY__SECRET_FILE": "/s"},
    )
    assert config.distributed.reader_security.secret_file == "/s"
    assert SECRET not in json.dumps(config.model_dump())


# --- the commands: `dlrmflow readers serve` and `dlrmflow train` ----------------------------


def _start_readers(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dlrmflow", "readers", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )


def _wait_serving(server: subprocess.Popen) -> str:
    deadline = time.monotonic() + 120
    for line in server.stdout:
        if "serving" in line:
            return line
        assert time.monotonic() < deadline, "the reader server never came up"
    pytest.fail(f"the reader server ended: exit {server.wait()}")


def _stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=30)


def _argv(pid: int) -> str:
    """What ``ps`` shows of a process: its command line."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _env_without_secret() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != SECRET_ENV}


def test_a_reachable_address_is_refused_at_the_command_line_unless_insecure(
    tiny_dataset: str, tmp_path: Path
) -> None:
    config_file = tmp_path / "run.yaml"
    config = tiny_run_config(tiny_dataset, tmp_path / "run")
    config_file.write_text(yaml.safe_dump(config.model_dump()))
    refused = subprocess.run(
        [sys.executable, "-m", "dlrmflow", "readers", "serve", "-c", str(config_file)]
        + ["--listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env_without_secret(),
    )
    assert refused.returncode == 1
    assert re.fullmatch(
        r"error: reader server on 0\.0\.0\.0:0: an address other hosts can reach needs TLS "
        r".* and a secret .*--insecure to serve it so anyway\n",
        refused.stderr,
    ), refused.stderr
    server = _start_readers(["-c", str(config_file), "--listen", "0.0.0.0:0", "--insecure"])
    try:
        assert "grpc://0.0.0.0:" in _wait_serving(server)
    finally:
        _stop(server)
    helped = subprocess.run(
        [sys.executable, "-m", "dlrmflow", "readers", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert "[default: 127.0.0.1:8815]" in helped.stdout and "--insecure" in helped.stdout


def test_training_over_tls_with_the_secret_equals_local_reading_and_a_wrong_one_is_refused(
    tiny_dataset: str, pki: Pki, tmp_path: Path
) -> None:
    local = tiny_run_config(tiny_dataset, tmp_path / "local", max_steps=6)
    serving = local.model_copy(deep=True)
    serving.distributed.reader_security = _serving(pki, secret_file=str(pki.secret))
    serving_file = tmp_path / "serving.yaml"
    serving_file.write_text(yaml.safe_dump(serving.model_dump()))
    port = free_port()
    server = _start_readers(
        ["-c", str(serving_file), "--listen", f"0.0.0.0:{port}", "--workers", "1"],
        env=_env_without_secret(),
    )
    try:
        assert f"grpc+tls://0.0.0.0:{port}" in _wait_serving(server)
        remote = local.model_copy(deep=True)
        remote.run_dir = str(tmp_path / "remote")
        remote.distributed.readers = [f"127.0.0.1:{port}"]
        remote.distributed.reader_security = _trusting(pki)
        remote_file = tmp_path / "remote.yaml"
        remote_file.write_text(yaml.safe_dump(remote.model_dump()))

        def trainer(secret: str, run_dir: Path) -> subprocess.CompletedProcess:
            command = [sys.executable, "-m", "dlrmflow", "train", "-c", str(remote_file)]
            proc = subprocess.Popen(
                [*command, "--run-dir", str(run_dir)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, SECRET_ENV: secret},
            )
            assert secret not in _argv(proc.pid)
            out, err = proc.communicate(timeout=300)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

        wrong = trainer("not-the-secret", tmp_path / "wrong")
        trained = trainer(SECRET, tmp_path / "remote")
        assert SECRET not in _argv(server.pid)
    finally:
        _stop(server)
    assert wrong.returncode == 1, wrong.stderr
    errors = [line for line in wrong.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: reader 127.0.0.1:{port} refused this trainer's secret: give the servers' "
        f"secret in distributed.reader_security.secret_file or {SECRET_ENV}"
    ], wrong.stderr
    assert "Traceback" not in wrong.stderr
    assert trained.returncode == 0, trained.stderr[-3000:]
    local_result = train(local)
    assert json.loads(trained.stdout)["rows"] == local_result.rows
    same_weights(tmp_path / "remote", tmp_path / "local")
    # Nothing the run wrote down (its checkpoints carry the configuration) holds the secret.
    written = [p for p in (tmp_path / "remote").rglob("*") if p.is_file()]
    assert written and not [p for p in written if SECRET.encode() in p.read_bytes()]
