"""Reader servers built from a run config: the reader service composed with the features.

A server fits the feature spec and ID mapping from the config and data as ``fit_features``
does, runs the local reader with the ``BatchTransform`` on its share of the row groups
(``ParquetStreams``) and sends each ``Batch`` in the wire format of
``dlrmflow.features.wire``; trainers read them with ``make_train_loader``. The service
itself, and how streams are divided and fail over, is ``dlrmflow.ingest.service``. Its
TLS and secret come from ``distributed.reader_security`` (and ``DLRMFLOW_READER_SECRET``).
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
from dlrmflow.ingest.service.processes import ReaderProcess, server_processes
from dlrmflow.ingest.service.protocol import Endpoint
from dlrmflow.ingest.service.security import ReaderSecurity
from dlrmflow.ingest.service.server import FlightBatchServer, serve
from dlrmflow.ingest.service.streams import ParquetStreams
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
    benchmark passes one with an artificial cost. ``security``: its TLS and secret (none:
    loaded from ``distributed.reader_security`` and the environment); an address other
    hosts reach needs both unless ``insecure``. ``shutdown()`` ends every open stream at
    its next batch (clients fail over) and waits for them.
    """

    def __init__(
        self,
        config: RunConfig,
        listen: str,
        workers: int,
        *,
        transform: TransformFactory = BatchTransform,
        security: ReaderSecurity | None = None,
        insecure: bool = False,
    ) -> None:
        _end_with_parent()
        # Bad settings fail before the features are fitted, which may take minutes.
        if workers < 1:
            raise ValueError(f"workers must be positive, got {workers}")
        if security is None:
            security = ReaderSecurity.load(config.distributed.reader_security, serving=True)
        endpoint = Endpoint.parse(listen, tls=security.tls)
        security.check_exposure(endpoint, insecure=insecure)
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
        super().__init__(
            endpoint,
            streams,
            features=features_digest(spec, ids),
            security=security,
            insecure=insecure,
        )


def serve_readers(
    config: RunConfig,
    listen: str,
    workers: int,
    *,
    transform: TransformFactory = BatchTransform,
    ready: Callable[[Endpoint], None] | None = None,
    insecure: bool = False,
) -> None:
    """Serve ``config.data.url``'s batches on ``listen`` (``HOST:PORT``) until SIGINT/SIGTERM.

    ``ready`` is called with the bound endpoint once the server listens (with port 0, that
    is how to learn the port). Call it from the main thread: it installs the signal
    handlers (see ``dlrmflow.ingest.service.server.serve``). ``insecure``: serve an address other
    hosts reach without TLS and a secret.
    """
    server = ReaderServer(config, listen, workers, transform=transform, insecure=insecure)

    def started(endpoint: Endpoint) -> None:
        logger.info(
            "dlrmflow readers: serving %s on %s with %d preprocessing slot(s)",
            server.root,
            endpoint.location,
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
    end), then SIGKILL if it has not ended within 5 seconds. The security settings are
    loaded here, so that they are checked once and the secret is this process's
    environment's (the processes fork from a server started earlier).
    """
    security = ReaderSecurity.load(config.distributed.reader_security, serving=True)
    security.check_exposure(Endpoint.parse(f"{host}:0", tls=security.tls), insecure=False)
    make_server = partial(
        ReaderServer, config, workers=workers, transform=transform, security=security
    )
    with server_processes(make_server, count, host=host, preload=[__name__]) as servers:
        yield servers
