"""Reader servers built from a run config: the reader service composed with the features.

A server fits the feature spec and ID mapping from the config and data as ``fit_features``
does, runs the local reader with the ``BatchTransform`` on its share of the row groups
(``ParquetStreams``) and sends each ``Batch`` in the wire format of
``dlrmflow.features.wire``; trainers read them with ``make_train_loader``. The service
itself, and how streams are divided and fail over, is ``dlrmflow.ingest.service``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from multiprocessing.connection import wait

from dlrmflow.config import RunConfig
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.features.transform import BatchTransform
from dlrmflow.features.wire import encode_batch, features_digest
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.service import (
    Endpoint,
    FlightBatchServer,
    ParquetStreams,
    ReaderProcess,
    serve,
    server_processes,
)
from dlrmflow.train.run.data import IdMapper, fit_features

logger = logging.getLogger(__name__)

TransformFactory = Callable[[FeatureSpec, IdMapper], BatchTransform]


def _end_with_parent(grace_s: float = 5.0) -> None:
    """In a process started for a run (``reader_processes``): SIGTERM to itself once the
    run's process is gone, even killed by SIGKILL (SIGKILL ``grace_s`` later). Not a
    parent-death signal: the process it forks from (``forkserver``) outlives the run for as
    long as its children live; the parent's sentinel is the run's own."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)  # open streams end (``serve``)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="dlrmflow-parent-watch", daemon=True).start()


class ReaderServer(FlightBatchServer):
    """A Flight server of the batches of ``config.data.url``, fitted as the trainers are.

    It listens as soon as it is built (``listen`` ``HOST:0`` picks a free port, see
    ``endpoint``). ``workers`` is how many row groups it preprocesses at once (size it to
    its cores). ``transform`` builds the batch transform from the spec and IDs; the readers
    benchmark passes one with an artificial cost. ``shutdown()`` ends every open stream at
    its next batch (clients fail over) and waits for them.
    """

    def __init__(
        self,
        config: RunConfig,
        listen: str,
        workers: int,
        *,
        transform: TransformFactory = BatchTransform,
    ) -> None:
        _end_with_parent()
        # Bad settings fail before the features are fitted, which may take minutes.
        if workers < 1:
            raise ValueError(f"workers must be positive, got {workers}")
        endpoint = Endpoint.parse(listen)
        self.root = config.data.url
        manifest = read_manifest(self.root)
        spec, ids = fit_features(config, manifest)
        batch_transform = transform(spec, ids)
        streams = ParquetStreams(
            self.root,
            manifest,
            spec.columns,
            workers=workers,
            validate=batch_transform.validate,
            transform=batch_transform,
            encode=encode_batch,
        )
        super().__init__(endpoint, streams, features=features_digest(spec, ids))


def serve_readers(
    config: RunConfig,
    listen: str,
    workers: int,
    *,
    transform: TransformFactory = BatchTransform,
    ready: Callable[[Endpoint], None] | None = None,
) -> None:
    """Serve ``config.data.url``'s batches on ``listen`` (``HOST:PORT``) until SIGINT/SIGTERM.

    ``ready`` is called with the bound endpoint once the server listens (with port 0, that
    is how to learn the port). Call it from the main thread: it installs the signal
    handlers (see ``dlrmflow.ingest.service.serve``).
    """
    server = ReaderServer(config, listen, workers, transform=transform)

    def started(endpoint: Endpoint) -> None:
        logger.info(
            "dlrmflow readers: serving %s on %s with %d preprocessing slot(s)",
            server.root,
            endpoint,
            workers,
        )
        if ready is not None:
            ready(endpoint)

    serve(server, started)


@contextmanager
def reader_processes(
    config: RunConfig,
    count: int,
    workers: int,
    *,
    transform: TransformFactory = BatchTransform,
    host: str = "127.0.0.1",
) -> Iterator[list[ReaderProcess]]:
    """Start ``count`` ``ReaderServer`` processes on free ports at once; stop them on exit.

    ``transform`` must be picklable. On exit each process gets SIGTERM (its open streams
    end), then SIGKILL if it has not ended within 5 seconds.
    """
    make_server = partial(ReaderServer, config, workers=workers, transform=transform)
    with server_processes(make_server, count, host=host, preload=[__name__]) as servers:
        yield servers
