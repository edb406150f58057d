"""The reader service: reader servers stream a dataset's batches to trainers over Arrow Flight.

Preprocessing can outgrow the CPUs beside an accelerator; reader servers move it to hosts
of their own that scale apart from the trainers. A server runs the local reader unchanged
(``ParquetBatchDataset``, ``SplitReader``, with the caller's ``validate`` and ``transform``)
and sends each batch as one Arrow record batch (``ParquetStreams``, with the caller's
``encode``); the client hands each one to the caller's ``decode``. This module knows record
batches only: what a batch holds, and which digest of its features a server and a client
must share, is the caller's (``dlrmflow.train.launch.reader_servers`` and
``dlrmflow.train.run.data`` compose it with the feature transform).

How the work is divided (the rule). The local loader of a rank runs ``num_workers``
readers (one, read in the training loop, when it is 0); reader ``w`` reads a fixed share of
the rank's splits, and the loader takes one batch from each reader in turn. Remotely, each
of those readers becomes one Flight stream (``do_get``), and the client takes batches from
the streams in the same turn, with the same ``torchdata`` nodes. Stream ``w`` goes to
endpoint ``w mod S`` of the ``S`` endpoints. So the batches, their order and the
``state_dict`` are those of the local loader for any number of servers; to use ``S``
servers at once, set ``num_workers`` to ``S`` or a multiple of it (a server serves several
streams; its ``workers`` bounds how many row groups it preprocesses at once).

The ticket (JSON, ``StreamRequest``) names the rank, world size, reader ``w`` of
``num_workers``, epoch, seed, batch size and shuffle settings, the files (relative to the
dataset root, which each server resolves under its own), a digest of the client's features
(a server whose own digest differs refuses), and the ``SplitReader`` state to start from.
Each record batch carries the reader's state after it as Flight metadata, so the client
always knows the exact position of the next row. Flight's streaming is the back-pressure: a
server reads ahead a few windows and what gRPC buffers, never an epoch.

Failure. When a stream's endpoint dies (connection lost, refused, or shutting down), the
client re-requests that stream from the next endpoint in the list (``w + 1 mod S``, ...),
starting from the state of the last batch it received: no row is lost or repeated. A server
that hangs without dying (stopped, wedged, its host gone without a reset) is treated alike
once one call to it waits past the deadline (``timeout_s``): a request not answered, or a
next batch not sent. The call is cancelled, not waited for. An endpoint that failed is not
tried again in that pass. When none is left the pass fails with ``ReaderUnavailableError``
naming every endpoint and its error. Bad data (``DataError``) or
a refused request (``ValueError``: mismatched features, a state of another layout) are not
failures of the endpoint and raise at once, naming the endpoint, file, row group and column.

Trust (``ReaderSecurity``, from ``distributed.reader_security``). The batches are a team's
logs, so a server can serve over TLS (Flight's ``grpc+tls``; trainers check its certificate
against their roots) and require a shared secret: every call carries it as a bearer token
that a Flight middleware compares in constant time, before any handler runs. The secret
comes from a file the configuration names or from ``DLRMFLOW_READER_SECRET``, never from a
command line (``ps`` shows those) nor the configuration itself (written to ``config.json``).
A server listens on a non-loopback address only with both, unless told ``insecure``. A
refused secret is not a failure of the endpoint: every endpoint shares the secret, so the
pass raises ``ReaderRefusedError`` at once, naming the endpoint.
"""

from __future__ import annotations

import hmac
import ipaddress
import itertools
import json
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torchdata.nodes import BaseNode

from dlrmflow.errors import DlrmflowError
from dlrmflow.ingest.manifest import Manifest, join_url
from dlrmflow.ingest.reader import (
    Block,
    DataError,
    ParquetBatchDataset,
    ReaderLoader,
    ReaderPrefetcher,
    RoundRobin,
    Split,
    SplitReader,
    list_splits,
    pass_steps,
)

logger = logging.getLogger(__name__)

STATE_ACTION = "reader-state"
# The row groups a ticket's files hold, as the server lists them: the trainer counts a pass's
# steps from them exactly as local readers would cut it (``reader.pass_steps``).
SPLITS_ACTION = "reader-splits"
# Stands for the Flight errors a server sends on purpose: the client raises them as these
# types instead of failing over, since another endpoint would refuse the same request.
_MARKED = {"DataError": DataError, "ValueError": ValueError}
_EMPTY_SCHEMA = pa.schema([("labels", pa.float32())])  # a stream with no batch at all


class ReaderUnavailableError(DlrmflowError, RuntimeError):
    """No reader endpoint could serve a stream; the message names each one and its error."""


class ReaderSecurityError(DlrmflowError, ValueError):
    """Reader security settings that cannot be used; the message names the key or address."""


class ReaderRefusedError(DlrmflowError, PermissionError):
    """A reader server refused the trainer's secret; the message names the endpoint."""


# The shared secret's variable: the environment, unlike a command line, is not shown by ps.
SECRET_ENV = "DLRMFLOW_READER_SECRET"
_AUTH_HEADER = "authorization"  # gRPC metadata keys are lower case
_BEARER = b"Bearer "


@dataclass(frozen=True)
class Endpoint:
    """A reader server's ``HOST:PORT`` (``[v6addr]:PORT`` for IPv6); ``tls``: reached over
    ``grpc+tls``."""

    host: str
    port: int
    tls: bool = False

    @classmethod
    def parse(cls, text: str, *, tls: bool = False) -> Endpoint:
        host, sep, port = text.strip().rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"reader endpoint {text!r}: expected HOST:PORT, e.g. 10.0.0.5:8815")
        return cls(host, int(port), tls)

    @property
    def location(self) -> str:
        scheme = "grpc+tls" if self.tls else "grpc"
        return f"{scheme}://{self}"

    @property
    def loopback(self) -> bool:
        """Whether only this host can reach the address (a name other than localhost is
        taken as reachable from outside: what it resolves to may change)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


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


class StreamRequest(BaseModel):
    """A Flight ticket: one reader's batches of one rank, from ``state`` (or the epoch start)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    files: tuple[str, ...] = Field(min_length=1, description="relative to the dataset root")
    features: str = Field(description="digest of the client's features, the server's to match")
    batch_size: int = Field(ge=1)
    seed: int = Field(ge=0)
    shuffle: bool
    shuffle_window: int = Field(ge=1)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    worker: int = Field(ge=0)
    num_workers: int = Field(ge=1)
    epoch: int = Field(ge=0)
    state: dict[str, Any] | None = None

    def encode(self) -> bytes:
        return self.model_dump_json().encode()


# --- server ------------------------------------------------------------------------------


class BatchStream(Protocol):
    """One stream's record batches, from a position that its state names exactly."""

    def __next__(self) -> pa.RecordBatch:
        """The next record batch; ``StopIteration`` at the end of the pass."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands: a request with this state goes on from here."""
        ...

    def cursor(self) -> dict[str, Any]:
        """The entries of ``state_dict()`` that batches move: sent after each batch."""
        ...


class StreamFactory(Protocol):
    """What a server serves; ``endpoint`` is the server's, for messages."""

    def __call__(self, request: StreamRequest, endpoint: Endpoint) -> BatchStream:
        """The request's stream, reset to its state (checked) or to the start of its epoch."""
        ...

    def splits(self, request: StreamRequest, endpoint: Endpoint) -> list[list[Any]]:
        """The row groups of the request's files, as ``Split`` fields."""
        ...


class _SecretCheck(flight.ServerMiddlewareFactory):
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


def _refuse(kind: str, message: str) -> flight.FlightServerError:
    return flight.FlightServerError(
        message, extra_info=json.dumps({"type": kind, "message": message}).encode()
    )


@contextmanager
def _marked_errors() -> Iterator[None]:
    """Send bad data and bad requests as marked errors, so that clients do not fail over."""
    try:
        yield
    except DataError as e:
        raise _refuse("DataError", str(e)) from e
    except ValidationError as e:
        raise _refuse("ValueError", f"bad request: {e}") from e
    except (ValueError, KeyError) as e:
        raise _refuse("ValueError", str(e)) from e


class FlightBatchServer(flight.FlightServerBase):
    """A Flight server of record batches: ``do_get`` streams ``open_stream(request)``.

    It listens as soon as it is built (``listen`` with port 0 picks a free port, see
    ``endpoint``); ``serve`` blocks until a signal. ``features`` is the digest of what its
    streams hold; a request for another refuses. ``security``: TLS with its certificate,
    and the secret every call must carry (none: plain gRPC, open to any caller, refused on
    an address other hosts reach unless ``insecure``). ``shutdown()`` ends every open
    stream at its next batch (clients fail over) and waits for them.
    """

    def __init__(
        self,
        listen: Endpoint,
        open_stream: StreamFactory,
        *,
        features: str,
        security: ReaderSecurity | None = None,
        insecure: bool = False,
    ) -> None:
        security = ReaderSecurity() if security is None else security
        listen = Endpoint(listen.host, listen.port, security.tls)
        security.check_exposure(listen, insecure=insecure)
        if security.tls and (security.cert_chain is None or security.private_key is None):
            raise ReaderSecurityError(
                f"reader server on {listen}: TLS needs distributed.reader_security.cert_file "
                "and key_file"
            )
        self.features = features
        self._open_stream = open_stream
        self._closing = threading.Event()
        super().__init__(
            listen.location,
            tls_certificates=(
                [flight.CertKeyPair(security.cert_chain, security.private_key)]
                if security.tls
                else None
            ),
            middleware=None
            if security.secret is None
            else {"secret": _SecretCheck(security.secret)},
        )
        self.endpoint = Endpoint(listen.host, self.port, security.tls)

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> Iterator:
        """``reader-state``: the state a ticket's stream starts in, checked against its layout;
        ``reader-splits``: the row groups of the ticket's files (``Split`` fields, paths as
        the ticket names them)."""
        if action.type not in (STATE_ACTION, SPLITS_ACTION):
            raise _refuse("ValueError", f"unknown action {action.type!r}")
        with _marked_errors():
            request = StreamRequest.model_validate_json(action.body.to_pybytes())
            if action.type == SPLITS_ACTION:
                self._check(request)
                splits = getattr(self._open_stream, "splits", None)
                if splits is None:
                    raise ValueError(f"reader {self.endpoint} does not list its splits")
                answer: Any = splits(request, self.endpoint)
            else:
                answer = self._open(request).state_dict()
        return iter([json.dumps(answer).encode()])

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> Any:
        with _marked_errors():
            request = StreamRequest.model_validate_json(ticket.ticket)
            stream = self._open(request)
            # The schema must precede the first batch, and it may depend on the data (for
            # ``Batch``es, whether the sparse part is one-hot): the first batch decides it.
            head = next(stream, None)
        schema = _EMPTY_SCHEMA if head is None else head.schema
        return flight.GeneratorStream(schema, self._stream(stream, head))

    def _stream(
        self, stream: BatchStream, data: pa.RecordBatch | None
    ) -> Iterator[tuple[pa.RecordBatch, bytes]]:
        """``data`` then the stream's other batches, each with the stream's cursor after it."""
        with _marked_errors():
            while data is not None:
                if self._closing.is_set():
                    raise flight.FlightUnavailableError(f"reader {self.endpoint} is shutting down")
                yield data, json.dumps(stream.cursor()).encode()
                data = next(stream, None)

    def _open(self, request: StreamRequest) -> BatchStream:
        self._check(request)
        return self._open_stream(request, self.endpoint)

    def _check(self, request: StreamRequest) -> None:
        if request.features != self.features:
            raise ValueError(
                f"reader {self.endpoint}: its feature spec or ID mapping differs from the "
                "trainer's; start it with the trainer's config (features section) and data"
            )
        if request.worker >= request.num_workers or request.rank >= request.world_size:
            raise ValueError(
                f"reader {request.worker} of {request.num_workers} on rank "
                f"{request.rank} of {request.world_size} does not exist"
            )

    def shutdown(self) -> None:
        if self._closing.is_set():
            return  # Flight's shutdown must run once
        self._closing.set()
        super().shutdown()


class _Throttled:
    """``fn`` run under one of the server's preprocessing slots, so that however many
    streams are open, at most ``workers`` row groups are validated or transformed at once."""

    def __init__(self, fn: Callable[[pa.Table], Any], slots: threading.Semaphore) -> None:
        self._fn = fn
        self._slots = slots

    def __call__(self, table: pa.Table) -> Any:
        with self._slots:
            return self._fn(table)


class _ThrottledTransform(_Throttled):
    """A transform with a window writer (``BatchTransform``), throttled alike: each row
    group a writer takes, and each window it finishes, holds a slot. The reader then builds
    windows as it does locally, each row group written to its shuffled place."""

    def window_writer(self, order: np.ndarray, dest: np.ndarray | None = None) -> _ThrottledWriter:
        return _ThrottledWriter(self._fn.window_writer(order, dest), self._slots)  # type: ignore[attr-defined]


class _ThrottledWriter:
    def __init__(self, writer: Any, slots: threading.Semaphore) -> None:
        self._writer = writer
        self._slots = slots

    def add(self, table: pa.Table) -> None:
        with self._slots:
            self._writer.add(table)

    def finish(self) -> Any:
        with self._slots:
            return self._writer.finish()


class _SplitStream:
    """A ``SplitReader``'s batches, encoded, as a ``BatchStream`` with the reader's state."""

    def __init__(self, reader: SplitReader, encode: Callable[[Any], pa.RecordBatch] | None):
        self._reader = reader
        self._encode = encode

    def __iter__(self) -> _SplitStream:
        return self

    def __next__(self) -> pa.RecordBatch:
        batch = next(self._reader)
        return batch if self._encode is None else self._encode(batch)

    def state_dict(self) -> dict[str, Any]:
        return self._reader.state_dict()

    def cursor(self) -> dict[str, Any]:
        state = self._reader.state_dict()
        return {key: state[key] for key in ("epoch", "window", "offset")}


class ParquetStreams:
    """The streams of one Parquet dataset (a ``StreamFactory``): each request's splits read
    by a ``SplitReader`` exactly as the local loader reads them.

    ``manifest`` lists the files the dataset at ``root`` holds; requests name files
    relative to ``root``. ``columns``, ``validate`` and ``transform`` are those of
    ``ParquetBatchDataset``, run under ``workers`` preprocessing slots that every stream
    shares. ``encode`` turns a batch into a record batch (none: the batches are record
    batches already, as without a transform).
    """

    def __init__(
        self,
        root: str,
        manifest: Manifest,
        columns: Sequence[str],
        *,
        workers: int,
        validate: Callable[[pa.Table], None] | None = None,
        transform: Callable[[pa.Table], Block] | None = None,
        encode: Callable[[Any], pa.RecordBatch] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be positive, got {workers}")
        self.root = root
        self.workers = workers
        self._files = {f.path for f in manifest.files}
        self._columns = list(columns)
        slots = threading.BoundedSemaphore(workers)
        self._validate = None if validate is None else _Throttled(validate, slots)
        self._transform: _Throttled | None = None
        if transform is not None:
            throttled = _ThrottledTransform if hasattr(transform, "window_writer") else _Throttled
            self._transform = throttled(transform, slots)
        self._encode = encode
        self._splits: dict[tuple[str, ...], list[Split]] = {}
        self._lock = threading.Lock()

    def __call__(self, request: StreamRequest, endpoint: Endpoint) -> BatchStream:
        """The request's reader, reset to its state (checked) or to the start of its epoch."""
        dataset = ParquetBatchDataset(
            self._list_splits(request.files, endpoint),
            self._columns,
            request.batch_size,
            rank=request.rank,
            world_size=request.world_size,
            seed=request.seed,
            shuffle=request.shuffle,
            shuffle_window=request.shuffle_window,
            validate=self._validate,
            transform=self._transform,
        )
        dataset.set_epoch(request.epoch)
        reader = SplitReader(dataset, request.worker, request.num_workers)
        reader.reset(request.state)
        return _SplitStream(reader, self._encode)

    def splits(self, request: StreamRequest, endpoint: Endpoint) -> list[list[Any]]:
        """The request's row groups as ``Split`` fields, each path relative to ``root`` as
        the request names it (what the trainer needs to count a pass's steps)."""
        prefix = {join_url(self.root, f): f for f in request.files}
        return [
            [prefix[s.path], s.row_group, s.num_rows, s.day, s.digest]
            for s in self._list_splits(request.files, endpoint)
        ]

    def _list_splits(self, files: tuple[str, ...], endpoint: Endpoint) -> list[Split]:
        with self._lock:
            if files not in self._splits:
                unknown = [f for f in files if f not in self._files]
                if unknown:
                    raise ValueError(
                        f"reader {endpoint}: {', '.join(unknown)} not in the manifest "
                        f"of its dataset {self.root}"
                    )
                self._splits[files] = list_splits([join_url(self.root, f) for f in files])
            return self._splits[files]


def serve(server: FlightBatchServer, ready: Callable[[Endpoint], None] | None = None) -> None:
    """Serve with ``server`` until SIGINT/SIGTERM, then shut it down.

    ``ready`` is called with the bound endpoint once the signal handlers are in place (with
    port 0, that is how to learn the port). Call it from the main thread: it installs the
    signal handlers. On a signal, open streams end at their next batch, so their trainers
    fail over at once (or stop with a clear error) instead of the server waiting for their
    passes to finish.
    """
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        if ready is not None:
            ready(server.endpoint)
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.shutdown()


ServerFactory = Callable[[str], FlightBatchServer]  # ``HOST:PORT`` -> a listening server


def _serve_in_child(make_server: ServerFactory, listen: str, conn: Any) -> None:
    def ready(endpoint: Endpoint) -> None:
        conn.send(endpoint)
        conn.close()

    try:
        serve(make_server(listen), ready)
    except Exception as e:
        if not conn.closed:
            conn.send(f"{type(e).__name__}: {e}")
        raise


@dataclass
class ReaderProcess:
    """A reader server in a process of its own (tests kill it; benchmarks get its cores)."""

    process: multiprocessing.process.BaseProcess
    endpoint: Endpoint


@contextmanager
def server_processes(
    make_server: ServerFactory,
    count: int,
    *,
    host: str = "127.0.0.1",
    preload: Sequence[str] = (),
) -> Iterator[list[ReaderProcess]]:
    """Start ``count`` processes serving ``make_server(f"{host}:0")`` at once; stop them on exit.

    ``make_server`` must be picklable; ``preload`` names the modules it needs, imported
    once by the process the servers fork from. On exit each process gets SIGTERM (its open
    streams end, see ``serve``), then SIGKILL if it has not ended within 5 seconds.
    """
    # Children fork from a server process that imported the modules once: a reader then
    # starts without a new interpreter importing torch (seconds), and no child is forked
    # from a process that holds threads (this one's gRPC and reader threads).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*preload, __name__])
    started: list[tuple[multiprocessing.process.BaseProcess, Any]] = []
    try:
        for _ in range(count):
            parent, child = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=_serve_in_child,
                args=(make_server, f"{host}:0", child),
                daemon=True,
                name="dlrmflow-reader",
            )
            process.start()
            child.close()
            started.append((process, parent))
        servers = []
        for process, parent in started:
            try:
                reply = parent.recv()
            except EOFError:
                reply = f"exited with code {process.exitcode}"
            if not isinstance(reply, Endpoint):
                raise RuntimeError(f"reader server process did not start: {reply}")
            servers.append(ReaderProcess(process, reply))
        yield servers
    finally:
        for process, parent in started:
            parent.close()
            if process.is_alive():
                process.terminate()
        for process, _ in started:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()


# --- client ------------------------------------------------------------------------------


def _marked(error: Exception) -> tuple[type[Exception], str] | None:
    """The type and message of an error the server sent on purpose, else None."""
    if not isinstance(error, flight.FlightServerError) or not error.extra_info:
        return None
    try:
        info = json.loads(error.extra_info)
        return _MARKED[info["type"]], info["message"]
    except (ValueError, KeyError, TypeError):
        return None


def _gist(error: Exception) -> str:
    """An error's message without gRPC's debug context, which repeats it at length."""
    message = str(error).split("\n")[0]
    for noise in (". Detail:", ". gRPC client debug context:"):
        message = message.split(noise)[0]
    return message


class _NoAnswer(Exception):
    """A call that a reader server left unanswered past the deadline: the server hangs."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"did not answer within {timeout_s:g} s")


class _Abandoned(Exception):
    """The stream was closed while it waited for a server: the pass ends, nothing failed."""


# What a call to an endpoint raises when the endpoint (not the request) is at fault.
_ENDPOINT_ERRORS = (flight.FlightError, pa.ArrowException, OSError, _NoAnswer)


class _Deadlines:
    """Runs a call's ``expire`` once the call outlives its deadline, unless it ended first.

    One thread serves every stream of the process, started on first use: a timer thread per
    batch would cost more than receiving the batch. A stream arms one call at a time, so
    the thread scans a handful of entries.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, Callable[[], None]]] = {}
        self._tokens = itertools.count()
        self._wake_at = math.inf  # when the thread looks next (inf: when notified)
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, expire: Callable[[], None]) -> int:
        """Call ``expire`` in ``seconds`` unless ``disarm`` gets the returned token first."""
        deadline = time.monotonic() + seconds
        with self._cond:
            token = next(self._tokens)
            self._armed[token] = (deadline, expire)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="dlrmflow-reader-deadlines", daemon=True
                )
                self._thread.start()
            elif deadline < self._wake_at:
                self._cond.notify()
        return token

    def disarm(self, token: int) -> None:
        with self._cond:
            self._armed.pop(token, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [token for token, (deadline, _) in self._armed.items() if deadline <= now]
                expired = [self._armed.pop(token)[1] for token in due]
                self._wake_at = min((d for d, _ in self._armed.values()), default=math.inf)
                if not expired:
                    self._cond.wait(None if self._wake_at == math.inf else self._wake_at - now)
                    continue
            for expire in expired:
                expire()


_DEADLINES = _Deadlines()


@dataclass
class _OpenCall:
    """A ``do_get`` under way. The client is kept beside its reader: the call needs the
    client's channel while it lasts. ``expired``: the deadline cancelled it, so its error
    means that the server hung, whatever gRPC calls it."""

    client: flight.FlightClient
    reader: flight.FlightStreamReader
    expired: bool = False

    def expire(self) -> None:
        self.expired = True
        self.reader.cancel()  # ends a read_chunk waiting in another thread at once

    def close(self) -> None:
        self.reader.cancel()
        self.client.close()


def _do_get(endpoint: Endpoint, ticket: flight.Ticket, security: ReaderSecurity) -> _OpenCall:
    """``ticket``'s stream from ``endpoint``, once the server has accepted it."""
    client = security.connect(endpoint)
    try:
        # No deadline: it would bound the whole pass (``_Deadlines`` bounds each message).
        reader = client.do_get(ticket, security.call_options())
        reader.schema  # noqa: B018 -- waits until the server has accepted the stream
    except BaseException:
        client.close()
        raise
    return _OpenCall(client, reader)


class _Opening:
    """A ``do_get`` run in a thread of its own, so that waiting for it can end.

    Flight's ``do_get`` returns once the server has sent the stream's first message and
    nothing interrupts it (closing its client does not): a stopped server would hold the
    reader thread for good. So the caller waits for this thread up to the deadline, and a
    call that the server answers after the caller gave up is cancelled then. The thread is
    a daemon, not a pool's worker: one still waiting on a stopped server must not hold up
    the interpreter's exit, where a pool's workers are joined.
    """

    def __init__(self, endpoint: Endpoint, ticket: flight.Ticket, security: ReaderSecurity) -> None:
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self._outcome: _OpenCall | Exception | None = None
        self._given_up = False  # no one takes the call any more: the thread closes it
        self._abandoned = False
        threading.Thread(
            target=self._run,
            args=(endpoint, ticket, security),
            name=f"dlrmflow-open-{endpoint}",
            daemon=True,
        ).start()

    def _run(self, endpoint: Endpoint, ticket: flight.Ticket, security: ReaderSecurity) -> None:
        outcome: _OpenCall | Exception
        try:
            outcome = _do_get(endpoint, ticket, security)
        except Exception as e:
            outcome = e
        with self._lock:
            late = self._given_up
            self._outcome = outcome
        self._settled.set()
        if late and isinstance(outcome, _OpenCall):
            outcome.close()

    def result(self, timeout_s: float) -> _OpenCall:
        """The call once the server has accepted it, else its error; ``_NoAnswer`` after
        ``timeout_s``; ``_Abandoned`` when ``abandon`` came first."""
        self._settled.wait(timeout_s)
        with self._lock:
            outcome, abandoned = self._outcome, self._abandoned
            self._given_up = outcome is None
        if abandoned:
            if isinstance(outcome, _OpenCall):
                outcome.close()
            raise _Abandoned
        if outcome is None:
            raise _NoAnswer(timeout_s)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def abandon(self) -> None:
        """End the wait in ``result`` now (the stream was closed)."""
        with self._lock:
            self._abandoned = True
        self._settled.set()


class _Stream:
    """One pass of one reader, served by one endpoint at a time.

    ``state`` is the ``SplitReader`` state after the last batch received (the server's own
    state, so a local loader can resume from it). ``next`` is called by one thread at a
    time; ``close`` may come from another, and then ends the pass without failing over.
    Every wait for a server ends by the source's ``timeout_s``: past it, the endpoint has
    failed (``_NoAnswer``).
    """

    def __init__(
        self,
        source: RemoteBatchSource,
        request: StreamRequest,
        endpoints: list[Endpoint],
    ) -> None:
        self._source = source
        self._request = request
        self._endpoints = endpoints  # in the order this stream tries them
        self._at = 0  # index of the endpoint in use
        self._failed: dict[Endpoint, Exception] = {}
        self._state = request.state
        self._open_call: _OpenCall | None = None
        self._opening: _Opening | None = None  # while a do_get waits for its first message
        self._closed = False

    @property
    def state(self) -> dict[str, Any]:
        if self._state is None:
            # Asked of a server rather than computed here: the state (its layout above all)
            # is the reader's business, and this way it is exactly the local one.
            self._state = self._call(self._start_state)
        return dict(self._state)

    def next(self) -> pa.RecordBatch:
        while not self._closed:
            call = self._open_call
            if call is None:
                try:
                    # The state first: asking for it may fail over too, which must not
                    # happen inside the open call below.
                    self._open_call = self._call(partial(self._open, state=self.state))
                except _Abandoned:
                    break
                continue  # closed meanwhile? then the call is cancelled below
            token = _DEADLINES.arm(self._source.timeout_s, call.expire)
            try:
                chunk = call.reader.read_chunk()
            except (flight.FlightError, pa.ArrowException, OSError) as e:
                if self._closed:
                    break
                self._raise_if_marked(e)
                self._open_call = None
                call.client.close()
                self._fail(_NoAnswer(self._source.timeout_s) if call.expired else e)
                continue
            finally:
                _DEADLINES.disarm(token)
            cursor = json.loads(chunk.app_metadata.to_pybytes())
            self._state = {**self.state, **cursor}
            return chunk.data
        self._cancel()
        raise StopIteration  # closed: the pass was abandoned

    def close(self) -> None:
        self._closed = True
        opening = self._opening
        if opening is not None:
            opening.abandon()
        self._cancel()

    def _cancel(self) -> None:
        # Tells the server at once; otherwise it would hold the stream (and its shutdown)
        # until this object is collected.
        call = self._open_call
        if call is not None:
            call.reader.cancel()

    def splits(self) -> list[Split]:
        """The row groups of the request's files, as a server lists them (failing over)."""
        fields = self._call(partial(self._action, SPLITS_ACTION))
        return [Split(*f) for f in fields]

    def _start_state(self, endpoint: Endpoint) -> dict[str, Any]:
        return self._action(STATE_ACTION, endpoint)

    def _action(self, kind: str, endpoint: Endpoint) -> Any:
        # A unary call: gRPC's own deadline bounds it (do_get's would bound the whole pass).
        security = self._source.security
        options = security.call_options(self._source.timeout_s)
        with security.connect(endpoint) as client:
            action = flight.Action(kind, self._request.encode())
            try:
                results = list(client.do_action(action, options))
            except flight.FlightTimedOutError as e:
                raise _NoAnswer(self._source.timeout_s) from e
        return json.loads(results[0].body.to_pybytes())

    def _open(self, endpoint: Endpoint, state: dict[str, Any]) -> _OpenCall:
        """A ``do_get`` of this reader's batches from ``state`` on, accepted by the server."""
        request = self._request.model_copy(update={"state": state})
        opening = _Opening(endpoint, flight.Ticket(request.encode()), self._source.security)
        self._opening = opening
        if self._closed:  # closed before ``close`` could see this opening
            opening.abandon()
        try:
            return opening.result(self._source.timeout_s)
        finally:
            self._opening = None

    def _call(self, fn: Callable[[Endpoint], Any]) -> Any:
        """``fn(endpoint)`` on the endpoint in use, failing over while endpoints are left."""
        while True:
            endpoint = self._endpoints[self._at]
            try:
                return fn(endpoint)
            except _ENDPOINT_ERRORS as e:
                self._raise_if_marked(e)
                self._fail(e)

    def _raise_if_marked(self, error: Exception) -> None:
        endpoint = self._endpoints[self._at]
        if isinstance(error, flight.FlightUnauthenticatedError):
            # Every endpoint shares the secret: failing over would only be refused again.
            given = "refused this trainer's secret"
            if self._source.security.secret is None:
                given = "requires a secret and this trainer has none"
            raise ReaderRefusedError(
                f"reader {endpoint} {given}: give the servers' secret in "
                f"distributed.reader_security.secret_file or {SECRET_ENV}"
            ) from error
        marked = _marked(error)
        if marked is not None:
            kind, message = marked
            raise kind(f"reader {endpoint}: {message}") from error

    def _fail(self, error: Exception) -> None:
        """Record the endpoint in use as failed and move to the next one left, or raise."""
        failed = self._endpoints[self._at]
        self._failed[failed] = error
        left = [i for i, e in enumerate(self._endpoints) if e not in self._failed]
        r = self._request
        where = f"rank {r.rank} reader {r.worker} of {r.num_workers}"
        if not left:
            tried = "; ".join(f"{e}: {_why(why)}" for e, why in self._failed.items())
            start = f"state {self._state}" if self._state else f"the start of epoch {r.epoch}"
            hints = ""
            if any(isinstance(why, _NoAnswer) for why in self._failed.values()):
                hints = " A server only slow to answer needs a longer distributed.reader_timeout_s."
            if any(isinstance(why, flight.FlightUnavailableError) for why in self._failed.values()):
                # A server over TLS drops a plain-text client at once (and the reverse).
                over = "TLS" if self._source.security.tls else "plain gRPC"
                hints += (
                    " A server up but over the other protocol looks down too: this trainer "
                    f"connects over {over} (distributed.reader_security.tls)."
                )
            raise ReaderUnavailableError(
                f"{where}: no reader endpoint left to serve its splits from {start}. "
                f"Tried {tried}. Reader w is served by endpoint w mod S of the "
                "S in distributed.readers and fails over to the next ones in order; start "
                "the servers again (the state resumes exactly) or clear distributed.readers "
                f"to read locally.{hints}"
            ) from error
        self._at = next((i for i in left if i > self._at), left[0])
        self._source._record_failover()
        logger.warning(
            "%s: reader %s failed (%s); resuming from %s on %s",
            where,
            failed,
            _why(error),
            self._state,
            self._endpoints[self._at],
        )


def _why(error: Exception) -> str:
    """What went wrong with an endpoint, in a few words for one line."""
    if isinstance(error, _NoAnswer):
        return str(error)
    return f"{type(error).__name__}: {_gist(error)}"


class RemoteSplitReader(BaseNode[Any]):
    """``SplitReader``'s counterpart whose batches come from a reader server, decoded.

    Its states are ``SplitReader`` states, so local and remote loaders resume each other's.
    """

    def __init__(self, source: RemoteBatchSource, worker: int, num_workers: int) -> None:
        super().__init__()
        self.source = source
        self.worker = worker
        self.num_workers = num_workers
        self._stream: _Stream | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        # A new stream rather than a rewound one: a prefetch thread of the previous pass
        # may still be reading, and closing its stream ends it without a failover.
        if self._stream is not None:
            self._stream.close()
        self._stream = self.source.open_stream(self.worker, self.num_workers, initial_state)

    def next(self) -> Any:
        assert self._stream is not None  # BaseNode resets before the first next()
        data = self._stream.next()
        decode = self.source.decode
        # Decoded here, in the reader's prefetch thread, not in the consumer's.
        return data if decode is None else decode(data)

    def get_state(self) -> dict[str, Any]:
        assert self._stream is not None
        return self._stream.state

    def close(self) -> None:
        """End the stream; a thread waiting for its next batch gets StopIteration."""
        if self._stream is not None:
            self._stream.close()


class RemoteBatchSource:
    """One rank's batches from reader servers: the remote twin of ``ParquetBatchDataset``.

    ``loader(num_workers)`` builds the same node graph as ``make_loader`` with
    ``RemoteSplitReader`` in place of ``SplitReader``. ``files`` are relative to the
    servers' dataset root; ``features`` is the digest the servers must match. ``decode``
    turns each record batch into the batch the loader gives (none: the record batch).
    ``timeout_s`` is how long a server may take to answer a request or send a stream's
    next batch before it counts as hung and the stream fails over: longer than a server
    takes to start a stream (list the files' row groups, preprocess a window) when busy.
    ``security``: TLS and its roots, and the secret every call carries (none: plain gRPC).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        files: Sequence[str],
        features: str,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_window: int = 4,
        rank: int = 0,
        world_size: int = 1,
        decode: Callable[[pa.RecordBatch], Any] | None = None,
        timeout_s: float = 30.0,
        security: ReaderSecurity | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("RemoteBatchSource needs at least one reader endpoint")
        if not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        self.security = ReaderSecurity() if security is None else security
        self.endpoints = [Endpoint.parse(e, tls=self.security.tls) for e in endpoints]
        duplicates = {str(e) for e in self.endpoints if self.endpoints.count(e) > 1}
        if duplicates:
            raise ValueError(f"distributed.readers lists {', '.join(sorted(duplicates))} twice")
        if rank >= world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self._template = StreamRequest(
            files=tuple(files),
            features=features,
            batch_size=batch_size,
            seed=seed,
            shuffle=shuffle,
            shuffle_window=shuffle_window,
            rank=rank,
            world_size=world_size,
            worker=0,
            num_workers=1,
            epoch=0,
        )
        self.decode = decode
        self.timeout_s = timeout_s
        self.epoch = 0
        self._failovers = 0
        self._lock = threading.Lock()
        self._streams: weakref.WeakSet[_Stream] = weakref.WeakSet()
        self._splits: list[Split] | None = None

    @property
    def failovers(self) -> int:
        return self._failovers

    def _record_failover(self) -> None:
        with self._lock:
            self._failovers += 1

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next fresh pass reads (a loaded state keeps its own)."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        self.epoch = epoch

    def open_stream(self, worker: int, num_workers: int, state: dict[str, Any] | None) -> _Stream:
        """Reader ``worker``'s pass from ``state`` (or the start of ``epoch``), not yet sent."""
        request = self._template.model_copy(
            update={
                "worker": worker,
                "num_workers": num_workers,
                "epoch": self.epoch,
                "state": state,
            }
        )
        first = worker % len(self.endpoints)
        stream = _Stream(self, request, self.endpoints[first:] + self.endpoints[:first])
        self._streams.add(stream)
        return stream

    def pass_steps(self, epoch: int, num_workers: int) -> int:
        """The steps the job takes over pass ``epoch`` (``reader.pass_steps``), counted from
        the row groups a server lists for these files, so exactly as local readers cut it."""
        if self._splits is None:
            stream = self.open_stream(0, 1, None)
            try:
                self._splits = stream.splits()
            finally:
                stream.close()
        r = self._template
        dataset = ParquetBatchDataset(
            self._splits,
            ["-"],  # counting reads no column
            r.batch_size,
            rank=r.rank,
            world_size=r.world_size,
            seed=r.seed,
            shuffle=r.shuffle,
            shuffle_window=r.shuffle_window,
        )
        return pass_steps(dataset, epoch, num_workers)

    def loader(self, num_workers: int, prefetch_factor: int = 4) -> ReaderLoader:
        """Batches as ``make_loader(dataset, num_workers, prefetch_factor)`` gives them."""
        if num_workers < 0:
            raise ValueError(f"num_workers must be non-negative, got {num_workers}")
        idle = self.endpoints[max(num_workers, 1) :]
        if idle:
            logger.warning(
                "%d reader stream(s) for %d endpoints: %s only stand by for failover; set "
                "train.num_workers to a multiple of the endpoint count to use them all",
                max(num_workers, 1),
                len(self.endpoints),
                ", ".join(map(str, idle)),
            )
        if num_workers == 0:
            return ReaderLoader(RemoteSplitReader(self, 0, 1))
        readers = [
            ReaderPrefetcher(RemoteSplitReader(self, worker, num_workers), prefetch_factor)
            for worker in range(num_workers)
        ]
        return ReaderLoader(RoundRobin(readers))

    def close(self) -> None:
        """End every open stream (the servers stop reading for them at once)."""
        for stream in list(self._streams):
            stream.close()
