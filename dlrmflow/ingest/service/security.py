"""What a reader server and a trainer trust each other by: TLS and a shared secret.

Trust (``ReaderSecurity``, from ``distributed.reader_security``). The batches are a team's
logs, so a server can serve over TLS (Flight's ``grpc+tls``; trainers check its certificate
against their roots) and require a shared secret: every call carries it as a bearer token
that a Flight middleware (``SecretCheck``) compares in constant time, before any handler
runs. The secret comes from a file the configuration names or from
``DLRMFLOW_READER_SECRET``, never from a command line (``ps`` shows those) nor the
configuration itself (written to ``config.json``). A server listens on a non-loopback
address only with both, unless told ``insecure``. A refused secret is not a failure of the
endpoint: every endpoint shares the secret, so the pass raises ``ReaderRefusedError`` at
once, naming the endpoint.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow.flight as flight

from dlrmflow.errors import DlrmflowError
from dlrmflow.ingest.service.protocol import Endpoint

logger = logging.getLogger(__name__)


class ReaderSecurityError(DlrmflowError, ValueError):
    """Reader security settings that cannot be used; the message names the key or address."""


class ReaderRefusedError(DlrmflowError, PermissionError):
    """A reader server refused the trainer's secret; the message names the endpoint."""


# The shared secret's variable: the environment, unlike a command line, is not shown by ps.
SECRET_ENV = "DLRMFLOW_READER_SECRET"
_AUTH_HEADER = "authorization"  # gRPC metadata keys are lower case
_BEARER = b"Bearer "


class ReaderSecuritySettings(Protocol):
    """What ``ReaderSecurity.load`` reads: the configuration's
    ``distributed.reader_security`` (the ingest stage imports no configuration)."""

    tls: bool
    cert_file: str | None
    key_file: str | None
    ca_file: str | None
    secret_file: str | None


def _read_setting(key: str, path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ReaderSecurityError(
            f"distributed.reader_security.{key}: cannot read {path}: {e.strerror or e}"
        ) from None


def _secret(config: ReaderSecuritySettings, environ: Mapping[str, str]) -> bytes | None:
    """The shared secret from ``secret_file`` or the environment (never both: which one
    wins would be a guess), without the whitespace a file ends in."""
    from_env = environ.get(SECRET_ENV)
    if config.secret_file is not None and from_env is not None:
        raise ReaderSecurityError(
            f"distributed.reader_security.secret_file and {SECRET_ENV} both give the reader "
            "secret; give one"
        )
    if config.secret_file is not None:
        where = f"distributed.reader_security.secret_file {config.secret_file}"
        raw = _read_setting("secret_file", config.secret_file)
    elif from_env is not None:
        where, raw = SECRET_ENV, from_env.encode("utf-8", "surrogateescape")
    else:
        return None
    secret = raw.strip()
    # It travels in a gRPC header: printable ASCII only.
    if not secret or not all(0x20 <= b < 0x7F for b in secret):
        raise ReaderSecurityError(
            f"{where}: the reader secret must be one line of printable ASCII characters"
        )
    return secret


@dataclass(frozen=True)
class ReaderSecurity:
    """What a reader server or trainer trusts the other by: TLS (PEM bytes) and the shared
    secret. Loaded once, where servers are started or a trainer reads, and handed down as
    an object: a process forked from a ``forkserver`` would see its environment as it was
    when that server started. ``repr`` shows no key nor secret."""

    tls: bool = False
    cert_chain: bytes | None = field(default=None, repr=False)
    private_key: bytes | None = field(default=None, repr=False)
    root_certs: bytes | None = field(default=None, repr=False)
    secret: bytes | None = field(default=None, repr=False)

    @classmethod
    def load(
        cls,
        config: ReaderSecuritySettings,
        *,
        serving: bool,
        environ: Mapping[str, str] | None = None,
    ) -> ReaderSecurity:
        """The settings of ``config`` (``distributed.reader_security``) with their files
        read and the secret from ``secret_file`` or ``DLRMFLOW_READER_SECRET`` (in
        ``environ``, default ``os.environ``); ``serving``: for a server, which needs its
        certificate and key, else for a trainer, which needs only the roots."""
        secret = _secret(config, os.environ if environ is None else environ)
        if not config.tls:
            return cls(secret=secret)
        if not serving:
            roots = None if config.ca_file is None else _read_setting("ca_file", config.ca_file)
            return cls(tls=True, root_certs=roots, secret=secret)
        missing = [k for k in ("cert_file", "key_file") if getattr(config, k) is None]
        if missing:
            raise ReaderSecurityError(
                f"distributed.reader_security.tls: a reader server over TLS needs "
                f"{' and '.join('distributed.reader_security.' + k for k in missing)}"
            )
        assert config.cert_file is not None and config.key_file is not None
        return cls(
            tls=True,
            cert_chain=_read_setting("cert_file", config.cert_file),
            private_key=_read_setting("key_file", config.key_file),
            secret=secret,
        )

    def connect(self, endpoint: Endpoint) -> flight.FlightClient:
        """A client of ``endpoint`` that checks its certificate against ``root_certs``."""
        if self.tls != endpoint.tls:  # a programming error: endpoints come from here
            raise ValueError(f"reader {endpoint}: TLS is {endpoint.tls}, security's {self.tls}")
        return flight.connect(endpoint.location, tls_root_certs=self.root_certs)

    def call_options(self, timeout_s: float | None = None) -> flight.FlightCallOptions:
        """Options for every call: the secret as a bearer token, and ``timeout_s``."""
        headers = [] if self.secret is None else [(_AUTH_HEADER.encode(), _BEARER + self.secret)]
        return flight.FlightCallOptions(timeout=timeout_s, headers=headers)

    def check_exposure(self, listen: Endpoint, *, insecure: bool) -> None:
        """Refuse to serve an address other hosts can reach without TLS and a secret, unless
        ``insecure``: anyone reaching the port could read the data, or pose as the server."""
        if listen.loopback or (self.tls and self.secret is not None):
            return
        lacking = " and ".join(
            what
            for what, given in (
                ("TLS (distributed.reader_security.tls, cert_file, key_file)", self.tls),
                (
                    f"a secret (distributed.reader_security.secret_file or {SECRET_ENV})",
                    self.secret,
                ),
            )
            if not given
        )
        if not insecure:
            raise ReaderSecurityError(
                f"reader server on {listen}: an address other hosts can reach needs {lacking}; "
                "listen on 127.0.0.1, or give --insecure to serve it so anyway"
            )
        logger.warning("reader server on %s without %s (--insecure)", listen, lacking)


class SecretCheck(flight.ServerMiddlewareFactory):
    """Refuses every call whose bearer token is not the secret, before its handler runs."""

    def __init__(self, secret: bytes) -> None:
        super().__init__()
        self._expected = _BEARER + secret

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[Any]]) -> None:
        given = headers.get(_AUTH_HEADER, [])
        if not given:
            raise flight.FlightUnauthenticatedError("no reader secret given")
        token = given[0] if isinstance(given[0], bytes) else given[0].encode("utf-8", "replace")
        if len(given) != 1 or not hmac.compare_digest(token, self._expected):
            raise flight.FlightUnauthenticatedError("wrong reader secret")
        return None
