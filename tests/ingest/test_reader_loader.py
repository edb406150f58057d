"""The loader graph: preparation threads per reader, readers taking turns (resumable),
every thread stopped on close, and a failing consumer that exits 1, not 134."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading

import numpy as np
import pytest
from torchdata.nodes import IterableWrapper

from dlrmflow.ingest import loader as loader_module
from dlrmflow.ingest.loader import RoundRobin, make_loader, reader_threads
from dlrmflow.ingest.splits import Split, list_splits
from tests.ingest.test_reader import TOTAL_ROWS, _dataset, _row_ids, _write_dataset


@pytest.fixture
def splits(tmp_path) -> list[Split]:
    return list_splits(_write_dataset(str(tmp_path)))


def test_reader_threads_use_two_per_reader_where_the_cores_allow(monkeypatch):
    monkeypatch.setattr(loader_module, "_cores", lambda: 2)
    assert [reader_threads(n) for n in (0, 1, 2, 3)] == [2, 2, 1, 1]
    monkeypatch.setattr(loader_module, "_cores", lambda: 16)
    assert [reader_threads(n) for n in (1, 8, 16)] == [2, 2, 1]
    with pytest.raises(ValueError, match="threads must be positive"):
        make_loader(_dataset([]), threads=0)


def test_round_robin_drops_sources_that_run_out_and_resumes():
    def node() -> RoundRobin:
        return RoundRobin([IterableWrapper(r) for r in (range(5), range(10, 12), range(20, 23))])

    assert list(node()) == [0, 10, 20, 1, 11, 21, 2, 22, 3, 4]
    for k in range(10):
        interrupted = node()
        head = list(itertools.islice(interrupted, k))
        resumed = node()
        resumed.reset(interrupted.state_dict())
        assert head + list(resumed) == [0, 10, 20, 1, 11, 21, 2, 22, 3, 4]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_closing_the_loader_stops_every_reader_thread(splits, num_workers):
    before = set(threading.enumerate())
    loader = make_loader(_dataset(splits, batch_size=16), num_workers=num_workers, threads=2)
    next(iter(loader))
    started = set(threading.enumerate()) - before
    assert started  # preparation threads, and a prefetch thread per reader
    loader.close()
    assert not [t.name for t in started if t.is_alive()]
    # A closed loader reads a whole pass again.
    assert np.array_equal(np.sort(_row_ids(loader)), np.arange(TOTAL_ROWS))
    loader.close()


# Readers at work when the interpreter exits after an error: a reader thread that is inside
# a torch call then (here: joining a batch across windows), or an Arrow IO thread freeing a
# Python buffer, used to abort the process (exit 134) once in a few runs.
_EXIT_WHILE_READING = """
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dlrmflow.ingest.loader import make_loader
from dlrmflow.ingest.reader import ParquetBatchDataset
from dlrmflow.ingest.splits import list_splits

path = sys.argv[1]
pq.write_table(pa.table({"x": np.arange(2000, dtype=np.float32)}), path, row_group_size=10)


class Rows:
    def __init__(self, t):
        self.t = t

    def __len__(self):
        return len(self.t)

    def take(self, indices):
        return Rows(self.t[torch.from_numpy(indices)])

    @classmethod
    def concat(cls, blocks):
        for _ in range(100):
            torch.zeros(20000)
        return Rows(torch.cat([b.t for b in blocks]))


dataset = ParquetBatchDataset(
    list_splits([path]),
    ["x"],
    batch_size=7,  # every window of one 10-row row group leaves rows for the next batch
    shuffle_window=1,
    transform=lambda table: Rows(torch.tensor(table.column("x").to_numpy())),
)
batches = iter(make_loader(dataset, num_workers=2, prefetch_factor=1000))
next(batches)
raise ValueError("the consumer failed")
"""


def test_an_error_while_readers_work_exits_1_not_134(tmp_path):
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _EXIT_WHILE_READING, str(tmp_path / f"{i}.parquet")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    for run in runs:
        _, err = run.communicate(timeout=120)
        assert run.returncode == 1, err[-2000:]
        assert err.rstrip().endswith("ValueError: the consumer failed"), err[-2000:]
