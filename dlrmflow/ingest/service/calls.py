"""A client's calls to a reader server, each wait bounded by a deadline.

A server that hangs without dying (stopped, wedged, its host gone without a reset) answers
nothing and closes nothing, and Flight's calls would wait for it for good: a ``do_get``
returns only once the server has sent the stream's first message, and a stream's
``read_chunk`` has no deadline of its own. So a ``do_get`` runs in a thread of its own
(``Opening``) that the caller stops waiting for, and each wait for a next batch is armed
on one process-wide timer thread (``DEADLINES``) that cancels the call when it runs out.
Either way the caller sees ``NoAnswer``, and the client counts the endpoint as failed.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow.flight as flight

from dlrmflow.ingest.service.protocol import Endpoint
from dlrmflow.ingest.service.security import ReaderSecurity


class NoAnswer(Exception):
    """A call that a reader server left unanswered past the deadline: the server hangs."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"did not answer within {timeout_s:g} s")


class Abandoned(Exception):
    """The stream was closed while it waited for a server: the pass ends, nothing failed."""


class Deadlines:
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


DEADLINES = Deadlines()


@dataclass
class OpenCall:
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


def _do_get(endpoint: Endpoint, ticket: flight.Ticket, security: ReaderSecurity) -> OpenCall:
    """``ticket``'s stream from ``endpoint``, once the server has accepted it."""
    client = security.connect(endpoint)
    try:
        # No deadline: it would bound the whole pass (``Deadlines`` bounds each message).
        reader = client.do_get(ticket, security.call_options())
        reader.schema  # noqa: B018 -- waits until the server has accepted the stream
    except BaseException:
        client.close()
        raise
    return OpenCall(client, reader)


class Opening:
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
        self._outcome: OpenCall | Exception | None = None
        self._given_up = False  # no one takes the call any more: the thread closes it
        self._abandoned = False
        threading.Thread(
            target=self._run,
            args=(endpoint, ticket, security),
            name=f"dlrmflow-open-{endpoint}",
            daemon=True,
        ).start()

    def _run(self, endpoint: Endpoint, ticket: flight.Ticket, security: ReaderSecurity) -> None:
        outcome: OpenCall | Exception
        try:
            outcome = _do_get(endpoint, ticket, security)
        except Exception as e:
            outcome = e
        with self._lock:
            late = self._given_up
            self._outcome = outcome
        self._settled.set()
        if late and isinstance(outcome, OpenCall):
            outcome.close()

    def result(self, timeout_s: float) -> OpenCall:
        """The call once the server has accepted it, else its error; ``NoAnswer`` after
        ``timeout_s``; ``Abandoned`` when ``abandon`` came first."""
        self._settled.wait(timeout_s)
        with self._lock:
            outcome, abandoned = self._outcome, self._abandoned
            self._given_up = outcome is None
        if abandoned:
            if isinstance(outcome, OpenCall):
                outcome.close()
            raise Abandoned
        if outcome is None:
            raise NoAnswer(timeout_s)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def abandon(self) -> None:
        """End the wait in ``result`` now (the stream was closed)."""
        with self._lock:
            self._abandoned = True
        self._settled.set()
