"""The trainer's side of the reader service: one rank's batches from reader servers.

``RemoteBatchSource`` is the remote twin of ``ParquetBatchDataset``: its ``loader`` builds
the local loader's node graph with a ``RemoteSplitReader`` (one Flight stream) in place of
each ``SplitReader``, so batches, order and states are the local ones.

Failure. When a stream's endpoint dies (connection lost, refused, or shutting down), the
client re-requests that stream from the next endpoint in the list (``w + 1 mod S``, ...),
starting from the state of the last batch it received: no row is lost or repeated. A server
that hangs without dying (stopped, wedged, its host gone without a reset) is treated alike
once one call to it waits past the deadline (``timeout_s``, see ``calls``): a request not
answered, or a next batch not sent. The call is cancelled, not waited for. An endpoint that
failed is not tried again in that pass. When none is left the pass fails with
``ReaderUnavailableError`` naming every endpoint and its error. Bad data (``DataError``) or
a refused request (``ValueError``: mismatched features, a state of another layout) are not
failures of the endpoint and raise at once, naming the endpoint, file, row group and column;
nor is a refused secret (``ReaderRefusedError``).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight
from torchdata.nodes import BaseNode

from dlrmflow.errors import DlrmflowError
from dlrmflow.ingest.loader import ReaderLoader, ReaderPrefetcher, RoundRobin
from dlrmflow.ingest.reader import ParquetBatchDataset, pass_steps
from dlrmflow.ingest.service.calls import DEADLINES, Abandoned, NoAnswer, OpenCall, Opening
from dlrmflow.ingest.service.protocol import (
    SPLITS_ACTION,
    STATE_ACTION,
    Endpoint,
    StreamRequest,
    read_marked,
)
from dlrmflow.ingest.service.security import SECRET_ENV, ReaderRefusedError, ReaderSecurity
from dlrmflow.ingest.splits import Split

logger = logging.getLogger(__name__)


class ReaderUnavailableError(DlrmflowError, RuntimeError):
    """No reader endpoint could serve a stream; the message names each one and its error."""


# What a call to an endpoint raises when the endpoint (not the request) is at fault.
_ENDPOINT_ERRORS = (flight.FlightError, pa.ArrowException, OSError, NoAnswer)


def _gist(error: Exception) -> str:
    """An error's message without gRPC's debug context, which repeats it at length."""
    message = str(error).split("\n")[0]
    for noise in (". Detail:", ". gRPC client debug context:"):
        message = message.split(noise)[0]
    return message


class _Stream:
    """One pass of one reader, served by one endpoint at a time.

    ``state`` is the ``SplitReader`` state after the last batch received (the server's own
    state, so a local loader can resume from it). ``next`` is called by one thread at a
    time; ``close`` may come from another, and then ends the pass without failing over.
    Every wait for a server ends by the source's ``timeout_s``: past it, the endpoint has
    failed (``NoAnswer``).
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
        self._open_call: OpenCall | None = None
        self._opening: Opening | None = None  # while a do_get waits for its first message
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
                except Abandoned:
                    break
                continue  # closed meanwhile? then the call is cancelled below
            token = DEADLINES.arm(self._source.timeout_s, call.expire)
            try:
                chunk = call.reader.read_chunk()
            except (flight.FlightError, pa.ArrowException, OSError) as e:
                if self._closed:
                    break
                self._raise_if_marked(e)
                self._open_call = None
                call.client.close()
                self._fail(NoAnswer(self._source.timeout_s) if call.expired else e)
                continue
            finally:
                DEADLINES.disarm(token)
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
                raise NoAnswer(self._source.timeout_s) from e
        return json.loads(results[0].body.to_pybytes())

    def _open(self, endpoint: Endpoint, state: dict[str, Any]) -> OpenCall:
        """A ``do_get`` of this reader's batches from ``state`` on, accepted by the server."""
        request = self._request.model_copy(update={"state": state})
        opening = Opening(endpoint, flight.Ticket(request.encode()), self._source.security)
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
        marked = read_marked(error)
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
            if any(isinstance(why, NoAnswer) for why in self._failed.values()):
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
    if isinstance(error, NoAnswer):
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
