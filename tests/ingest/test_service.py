"""The reader service on its own: Arrow record batches, no features, the local reader's exactly.

The service with the feature transform, failover and its errors: tests/train/test_readers.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pytest

from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.reader import ParquetBatchDataset, list_splits, make_loader
from dlrmflow.ingest.service import Endpoint, FlightBatchServer, ParquetStreams, RemoteBatchSource

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
