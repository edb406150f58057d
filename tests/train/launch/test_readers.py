"""Reader servers over Arrow Flight: the same batches as local readers, resumable, failing over."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from dlrmflow.bench.readers import CostlyTransform
from dlrmflow.config import DataConfig, RunConfig, apply_overrides
from dlrmflow.errors import DlrmflowError
from dlrmflow.features.batch import Batch
from dlrmflow.features.transform import BatchTransform
from dlrmflow.features.wire import decode_batch, encode_batch
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.service.client import ReaderUnavailableError
from dlrmflow.ingest.service.protocol import Endpoint
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.launch.job import free_port
from dlrmflow.train.launch.reader_servers import ReaderServer, reader_processes
from dlrmflow.train.run.data import TrainLoader, fit_features, make_train_loader
from tests.conftest import TINY_DATA, tiny_run_config

# One window per row group: three windows per reader at two readers, batches that span them.
TRAIN = {"num_workers": 2, "shuffle_window": 1}


@pytest.fixture
def config(tiny_dataset: str, tmp_path: Path) -> RunConfig:
    return tiny_run_config(tiny_dataset, tmp_path / "run", **TRAIN)


@pytest.fixture
def start_server() -> Iterator[Callable[..., ReaderServer]]:
    """Starts in-process servers on free ports; every one is shut down after the test."""
    servers: list[ReaderServer] = []

    def start(config: RunConfig, workers: int = 2, **kwargs: object) -> ReaderServer:
        server = ReaderServer(config, "127.0.0.1:0", workers, **kwargs)
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.shutdown()


def with_readers(config: RunConfig, *endpoints: object, **overrides: object) -> RunConfig:
    return apply_overrides(
        config, {"distributed.readers": [str(e) for e in endpoints], **overrides}
    )


def epoch(config: RunConfig, *, rank: int = 0, world_size: int = 1, n: int = 0) -> list[Batch]:
    """Epoch ``n`` of rank ``rank``, from the readers ``config`` names (local if none)."""
    manifest = read_manifest(config.data.url)
    spec, ids = fit_features(config, manifest)
    paths = manifest.day_paths(config.data.url, manifest.train_days())
    with make_train_loader(config, spec, ids, paths, rank=rank, world_size=world_size) as loader:
        loader.set_epoch(n)
        return list(loader)


def loader_for(config: RunConfig) -> TrainLoader:
    manifest = read_manifest(config.data.url)
    spec, ids = fit_features(config, manifest)
    return make_train_loader(
        config, spec, ids, manifest.day_paths(config.data.url, manifest.train_days())
    )


def assert_same_batches(expected: list[Batch], actual: list[Batch]) -> None:
    assert len(actual) == len(expected) > 0
    for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
        assert torch.equal(a.dense, b.dense), i
        assert torch.equal(a.labels, b.labels), i
        assert a.sparse.keys == b.sparse.keys
        if a.sparse.one_hot_rows is not None:  # and stays compact on the wire
            assert b.sparse.one_hot_rows is not None, i
            assert torch.equal(a.sparse.one_hot_rows, b.sparse.one_hot_rows), i
        assert torch.equal(a.sparse.values, b.sparse.values), i
        assert torch.equal(a.sparse.lengths, b.sparse.lengths), i


def row_matrix(batches: list[Batch]) -> np.ndarray:
    """One int32 row per sample (dense bits, label bits, IDs), sorted: a multiset of rows."""
    rows = np.concatenate(
        [
            np.hstack(
                [
                    b.dense.numpy().view(np.int32),
                    b.labels.numpy().view(np.int32)[:, None],
                    b.sparse.one_hot_rows.numpy(),
                ]
            )
            for b in batches
        ]
    )
    return rows[np.lexsort(rows.T[::-1])]


@pytest.mark.parametrize(("servers", "num_workers"), [(1, 2), (2, 2), (2, 3), (1, 0)])
def test_remote_batches_equal_local_ones(config, start_server, servers, num_workers):
    config = apply_overrides(config, {"train.num_workers": num_workers})
    endpoints = [start_server(config).endpoint for _ in range(servers)]
    local = epoch(config, n=1)
    assert_same_batches(local, epoch(with_readers(config, *endpoints), n=1))
    # Another epoch is another order: the epoch really travels in the ticket.
    assert not torch.equal(local[0].labels, epoch(config, n=0)[0].labels)


@pytest.fixture(scope="module")
def multi_hot_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("multi_hot") / "data")
    small = {**TINY_DATA, "days": 2, "rows_per_day": 1500, "row_group_size": 500}
    generate_dataset(DataConfig(url=url, multi_hot=True, **small))
    return url


def test_multi_hot_batches_travel_jagged(multi_hot_dataset, tmp_path, start_server):
    config = tiny_run_config(multi_hot_dataset, tmp_path / "run", **TRAIN)
    local = epoch(config)
    assert local[0].sparse.one_hot_rows is None
    assert int(local[0].sparse.lengths.max()) > 1  # real bags, not one-hot
    assert_same_batches(local, epoch(with_readers(config, start_server(config).endpoint)))


def test_every_row_once_across_ranks_and_two_servers(config, start_server):
    endpoints = [start_server(config).endpoint for _ in range(2)]
    remote = with_readers(config, *endpoints)
    served = [b for rank in range(2) for b in epoch(remote, rank=rank, world_size=2)]
    manifest = read_manifest(config.data.url)
    spec, ids = fit_features(config, manifest)
    transform = BatchTransform(spec, ids)
    every_row = [
        transform(pq.read_table(path, columns=spec.columns))
        for path in manifest.day_paths(config.data.url, manifest.train_days())
    ]
    assert sum(len(b) for b in served) == 2 * TINY_DATA["rows_per_day"]
    assert np.array_equal(row_matrix(served), row_matrix(every_row))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_servers_count_a_pass_as_the_local_readers_cut_it(config, start_server, num_workers):
    """At two ranks a rank's readers hold unequal shares of the row groups, so a pass is
    longer than its rows over the global batch: the servers list the row groups and the
    trainer counts the same steps as reading locally."""
    endpoints = [start_server(config).endpoint for _ in range(2)]
    config = apply_overrides(config, {"train.num_workers": num_workers})
    manifest = read_manifest(config.data.url)
    spec, ids = fit_features(config, manifest)
    paths = manifest.day_paths(config.data.url, manifest.train_days())
    counts = {}
    for where, cfg in (("local", config), ("remote", with_readers(config, *endpoints))):
        with make_train_loader(cfg, spec, ids, paths, rank=1, world_size=2) as loader:
            counts[where] = [loader.pass_steps(n, num_workers) for n in range(3)]
    assert counts["remote"] == counts["local"]
    if num_workers == 2:  # rank 0's two readers hold 2 row groups each, rank 1's one
        rows, global_batch = 2 * TINY_DATA["rows_per_day"], 2 * config.train.batch_size
        assert counts["local"][0] > -(-rows // global_batch)


@pytest.mark.parametrize(
    ("saved_by", "resumed_by"), [("remote", "remote"), ("local", "remote"), ("remote", "local")]
)
def test_resume_mid_epoch_equals_the_uninterrupted_tail(config, start_server, saved_by, resumed_by):
    endpoints = [start_server(config).endpoint for _ in range(2)]
    configs = {"local": config, "remote": with_readers(config, *endpoints)}
    whole = epoch(config, n=1)
    taken = 7  # mid-window on both readers
    with loader_for(configs[saved_by]) as first:
        first.set_epoch(1)
        head = [b for _, b in zip(range(taken), first, strict=False)]
        state = first.state_dict()
    with loader_for(configs[resumed_by]) as second:
        second.load_state_dict(state)
        tail = list(second)
    assert_same_batches(whole, head + tail)


def test_wait_seconds_counts_the_time_spent_waiting_for_batches(config, start_server):
    us_per_row = 50.0  # 12000 rows through one preprocessing slot: at least 0.6 s of CPU
    server = start_server(config, 1, transform=partial(CostlyTransform, us_per_row=us_per_row))
    with loader_for(with_readers(config, server.endpoint)) as loader:
        waits = []
        for _ in loader:
            waits.append(loader.wait_seconds)
    assert waits == sorted(waits)
    assert loader.wait_seconds >= 0.9 * 2 * TINY_DATA["rows_per_day"] * us_per_row * 1e-6


# Slow enough (0.3 s of CPU per row group) that the server is mid-stream when it dies.
SLOW = partial(CostlyTransform, us_per_row=150.0)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_stopped_server_fails_over_without_losing_or_repeating_a_row(config, start_server, how):
    backup = start_server(config)
    with reader_processes(config, 1, 1, transform=SLOW) as [doomed]:
        # Reader 0 is served by the first endpoint, reader 1 by the second.
        loader = loader_for(with_readers(config, doomed.endpoint, backup.endpoint))
        with loader:
            loader.set_epoch(1)
            batches = []
            for batch in loader:
                if not batches:
                    os.kill(doomed.process.pid, how)
                    doomed.process.join()
                batches.append(batch)
            assert loader.failovers >= 1
    assert_same_batches(epoch(config, n=1), batches)
    # SIGTERM is a clean stop (open streams end at their next batch), SIGKILL a crash.
    assert doomed.process.exitcode == (0 if how == signal.SIGTERM else -signal.SIGKILL)


def test_killed_server_without_another_endpoint_fails_naming_it(config):
    with reader_processes(config, 1, 1, transform=SLOW) as [doomed]:
        loader = loader_for(with_readers(config, doomed.endpoint))
        with loader:
            batches = iter(loader)
            next(batches)
            os.kill(doomed.process.pid, signal.SIGKILL)
            # From a reader thread, as raised there: one line, an expected failure.
            with pytest.raises(ReaderUnavailableError) as raised:
                list(batches)
    message = str(raised.value)
    assert message.startswith("rank 0 reader ") and "\n" not in message
    assert f"Tried {doomed.endpoint}: " in message
    assert isinstance(raised.value, DlrmflowError)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_unreachable_endpoint_fails_in_one_line_naming_it(config, num_workers):
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    unreachable = with_readers(config, endpoint, **{"train.num_workers": num_workers})
    with pytest.raises(ReaderUnavailableError) as raised:
        epoch(unreachable)
    message = str(raised.value)
    assert message.startswith(f"rank 0 reader 0 of {max(num_workers, 1)}: ")
    assert "from the start of epoch 0" in message and f"Tried {endpoint}: " in message
    assert "\n" not in message and "_populate_queue" not in message


def test_server_shutting_down_hands_its_streams_to_another(config, start_server):
    draining = start_server(config, 1, transform=SLOW)
    backup = start_server(config)
    with loader_for(with_readers(config, draining.endpoint, backup.endpoint)) as loader:
        batches = []
        for batch in loader:
            if not batches:
                stopping = threading.Thread(target=draining.shutdown)
                stopping.start()
            batches.append(batch)
        assert loader.failovers >= 1
    stopping.join(10)
    assert not stopping.is_alive()
    assert_same_batches(epoch(config), batches)


def test_bad_data_fails_naming_reader_file_row_group_and_column(
    tiny_dataset, tmp_path, start_server
):
    root = tmp_path / "data"
    shutil.copytree(tiny_dataset, root)
    config = tiny_run_config(str(root), tmp_path / "run", **TRAIN)
    path = read_manifest(str(root)).day_paths(str(root), [0])[0]
    table = pq.read_table(path)
    labels = table.column("label").to_numpy().copy()
    labels[2500] = 2  # row group 1
    table = table.set_column(table.schema.get_field_index("label"), "label", [labels])
    pq.write_table(table, path, row_group_size=TINY_DATA["row_group_size"])
    server = start_server(config)
    pattern = (
        rf"reader {re.escape(str(server.endpoint))}: {re.escape(path)}, row group 1: column label"
    )
    # Raised in a reader thread (num_workers 2), it reaches the caller as one line.
    with pytest.raises(DataError, match=f"^{pattern}: [^\n]+$"):
        epoch(with_readers(config, server.endpoint))


def test_server_fitted_differently_refuses_the_trainer(config, start_server):
    server = start_server(apply_overrides(config, {"features.hash_size_factor": 2.0}))
    with pytest.raises(ValueError, match=rf"reader {re.escape(str(server.endpoint))}: .*differs"):
        epoch(with_readers(config, server.endpoint))


def test_vocabulary_servers_fit_the_trainers_vocabulary(config, start_server):
    vocab = apply_overrides(config, {"features.ids": "vocab"})
    server = start_server(vocab)
    assert_same_batches(epoch(vocab), epoch(with_readers(vocab, server.endpoint)))
    rarer = start_server(apply_overrides(vocab, {"features.min_count": 3}))
    with pytest.raises(ValueError, match="differs"):
        epoch(with_readers(vocab, rarer.endpoint))


def test_state_of_another_layout_is_refused(config, start_server):
    server = start_server(config)
    with loader_for(config) as local:
        head = iter(local)
        next(head)
        state = local.state_dict()
    other = with_readers(config, server.endpoint, **{"train.shuffle_window": 2})
    with loader_for(other) as loader:
        loader.load_state_dict(state)
        with pytest.raises(ValueError, match="layout"):
            list(loader)


def test_endpoints_beyond_the_streams_stand_by(config, start_server, caplog):
    one_stream = apply_overrides(config, {"train.num_workers": 1})
    endpoints = [start_server(config).endpoint for _ in range(2)]
    assert_same_batches(epoch(one_stream), epoch(with_readers(one_stream, *endpoints)))
    assert f"{endpoints[1]} only stand by for failover" in caplog.text


def test_bad_reader_settings_are_named(config):
    with pytest.raises(ValueError, match="'localhost'"):
        loader_for(with_readers(config, "localhost"))
    with pytest.raises(ValueError, match="127.0.0.1:1 twice"):
        loader_for(with_readers(config, "127.0.0.1:1", "127.0.0.1:1"))
    manifest = read_manifest(config.data.url)
    spec, ids = fit_features(config, manifest)
    with pytest.raises(ValueError, match="/elsewhere/day.parquet does not"):
        make_train_loader(
            with_readers(config, "127.0.0.1:1"), spec, ids, ["/elsewhere/day.parquet"]
        )


def test_endpoints_parse_and_print_back():
    assert Endpoint.parse("10.0.0.5:8815") == Endpoint("10.0.0.5", 8815)
    v6 = Endpoint.parse("[::1]:9000")
    assert (v6.host, v6.port, v6.location, str(v6)) == (
        "::1",
        9000,
        "grpc://[::1]:9000",
        "[::1]:9000",
    )
    for bad in ("host", "host:", ":80", "host:http", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            Endpoint.parse(bad)


def test_wire_format_round_trips_both_sparse_forms(config, multi_hot_dataset):
    for url in (config.data.url, multi_hot_dataset):
        manifest = read_manifest(url)
        spec, ids = fit_features(apply_overrides(config, {"data.url": url}), manifest)
        table = pq.read_table(manifest.day_paths(url)[0], columns=spec.columns).slice(0, 300)
        batch = BatchTransform(spec, ids)(table).take(np.arange(299, -1, -3))
        assert_same_batches([batch], [decode_batch(encode_batch(batch))])
