"""The reader server: a Flight server that streams record batches, and ``serve`` to run it.

``FlightBatchServer`` answers a ticket (``StreamRequest``) with the stream its
``StreamFactory`` opens for it (``streams.ParquetStreams`` for a Parquet dataset), each
batch sent with the stream's cursor after it, and the two actions a client asks before a
pass (the state a stream starts in, the row groups of its files). It checks each request
against its own features first, and sends bad data and bad requests marked
(``protocol.marked_errors``) so that clients do not fail over on them. ``serve`` runs a
server until SIGINT or SIGTERM; on shutdown open streams end at their next batch, so their
trainers fail over at once.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.flight as flight

from dlrmflow.ingest.service.protocol import (
    SPLITS_ACTION,
    STATE_ACTION,
    Endpoint,
    StreamRequest,
    marked_errors,
    refuse,
)
from dlrmflow.ingest.service.security import ReaderSecurity, ReaderSecurityError, SecretCheck

_EMPTY_SCHEMA = pa.schema([("labels", pa.float32())])  # a stream with no batch at all


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
            else {"secret": SecretCheck(security.secret)},
        )
        self.endpoint = Endpoint(listen.host, self.port, security.tls)

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> Iterator:
        """``reader-state``: the state a ticket's stream starts in, checked against its layout;
        ``reader-splits``: the row groups of the ticket's files (``Split`` fields, paths as
        the ticket names them)."""
        if action.type not in (STATE_ACTION, SPLITS_ACTION):
            raise refuse("ValueError", f"unknown action {action.type!r}")
        with marked_errors():
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
        with marked_errors():
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
        with marked_errors():
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
