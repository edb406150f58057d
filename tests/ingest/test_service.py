"""The reader service on its own: Arrow record batches, no features, the local reader's exactly.

The service with the feature transform, failover and its errors: tests/train/launch/test_readers.py;
servers that hang (stopped processes), with training: tests/train/launch/test_reader_hang.py.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pyarrow as pa
import pytest

from dlrmflow.ingest.loader import make_loader
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.reader import ParquetBatchDataset
from dlrmflow.ingest.service.client import RemoteBatchSource
from dlrmflow.ingest.service.protocol import Endpoint
from dlrmflow.ingest.service.server import BatchStream, FlightBatchServer
from dlrmflow.ingest.service.streams import ParquetStreams
from dlrmflow.ingest.splits import list_splits

COLUMNS = ["label", "I1", "C1"]
READ = {"batch_size": 700, "seed": 3, "shuffle_window": 1}


@pytest.fixture
def server(tiny_dataset: str) -> Iterator[FlightBatchServer]:
    streams = ParquetStreams(tiny_dataset, read_manifest(tiny_dataset), COLUMNS, workers=1)
    server = FlightBatchServer(Endpoint.parse("127.0.0.1:0"), streams, features="plain")
    try:
        yield server
    finally:
        server.shutdown()


def test_streams_are_the_local_readers_record_batches_and_resume_them(tiny_dataset, server):
    manifest = read_manifest(tiny_dataset)
    paths = manifest.day_paths(tiny_dataset, manifest.train_days())
    files = [p.removeprefix(tiny_dataset.rstrip("/") + "/") for p in paths]
    local = make_loader(ParquetBatchDataset(list_splits(paths), COLUMNS, **READ), num_workers=2)
    whole = list(local)
    remote = RemoteBatchSource([str(server.endpoint)], files, "plain", **READ)
    with remote.loader(2) as loader:
        head = [b for _, b in zip(range(5), loader, strict=False)]
        state = loader.state_dict()
    local.load_state_dict(state)  # a remote state resumes a local reader
    tail = list(local)
    assert len(head) == 5 and len(tail) > 0
    for got, want in zip(head + tail, whole, strict=True):
        assert isinstance(got, pa.RecordBatch) and got.equals(want)
    with pytest.raises(ValueError, match=r"reader 127\.0\.0\.1:\d+: .*differs"):
        list(RemoteBatchSource([str(server.endpoint)], files, "other", **READ).loader(0))


T = TypeVar("T")


def within(seconds: float, fn: Callable[[], T]) -> T:
    """``fn()``, failing the test if it takes more than ``seconds``.

    Run in a daemon thread: a reader that hangs (what the hang tests guard against) then
    fails the test instead of stalling the suite, and the test's teardown (opening the
    gate, killing a stopped server) frees the thread.
    """
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as e:  # re-raised in the test's thread
            outcome.append((False, e))

    thread = threading.Thread(target=run, name="bounded-test-call", daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds:g} s: a hung reader was missed"
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


class WedgedStream:
    """A stream that sends ``after`` batches, then waits for ``gate`` before each next one:
    a server whose handler is stuck while its process and connection are fine."""

    def __init__(self, stream: BatchStream, after: int, gate: threading.Event) -> None:
        self._stream = stream
        self._left = after
        self._gate = gate

    def __next__(self) -> pa.RecordBatch:
        if self._left == 0:
            self._gate.wait()
        self._left = max(self._left - 1, 0)
        return next(self._stream)

    def state_dict(self) -> dict[str, Any]:
        return self._stream.state_dict()

    def cursor(self) -> dict[str, Any]:
        return self._stream.cursor()


@pytest.mark.parametrize("after", [0, 3], ids=["before-its-first-batch", "mid-stream"])
def test_server_that_stops_answering_hands_its_stream_on_within_the_deadline(
    tiny_dataset, caplog, after
):
    timeout_s = 1.0
    manifest = read_manifest(tiny_dataset)
    streams = ParquetStreams(tiny_dataset, manifest, COLUMNS, workers=1)
    gate = threading.Event()
    wedged = FlightBatchServer(
        Endpoint.parse("127.0.0.1:0"),
        lambda request, endpoint: WedgedStream(streams(request, endpoint), after, gate),
        features="plain",
    )
    backup = FlightBatchServer(Endpoint.parse("127.0.0.1:0"), streams, features="plain")
    paths = manifest.day_paths(tiny_dataset, manifest.train_days())
    files = [p.removeprefix(tiny_dataset.rstrip("/") + "/") for p in paths]
    endpoints = [str(wedged.endpoint), str(backup.endpoint)]
    remote = RemoteBatchSource(endpoints, files, "plain", timeout_s=timeout_s, **READ)

    def read() -> list[pa.RecordBatch]:
        with remote.loader(2) as loader:
            return list(loader)

    try:
        start = time.monotonic()
        got = within(timeout_s + 20, read)
        seconds = time.monotonic() - start
    finally:
        gate.set()  # the wedged handler ends (its call was cancelled), so shutdown does
        wedged.shutdown()
        backup.shutdown()
    want = list(make_loader(ParquetBatchDataset(list_splits(paths), COLUMNS, **READ), 2))
    assert len(got) == len(want) > after
    assert all(a.equals(b) for a, b in zip(got, want, strict=True))
    assert remote.failovers == 1 and seconds >= timeout_s
    message = f"reader {wedged.endpoint} failed (did not answer within 1 s); resuming from"
    assert message in caplog.text and f"on {backup.endpoint}" in caplog.text


def test_deadline_must_be_positive_and_finite(tiny_dataset):
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
            RemoteBatchSource(["127.0.0.1:1"], ["day.parquet"], "plain", timeout_s=bad, **READ)
