"""Reader servers in processes of their own, started together and stopped on exit.

Tests kill a server's process to see trainers fail over, benchmarks give servers cores of
their own, and a run starts its reader servers beside its ranks; all three start them here,
forked from a ``forkserver`` that imported the modules once.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dlrmflow.ingest.service.protocol import Endpoint
from dlrmflow.ingest.service.server import FlightBatchServer, serve

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
