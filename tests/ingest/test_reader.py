"""The Parquet reader: exactly-once splits, deterministic bounded shuffle, resume, bad data."""

from __future__ import annotations

import itertools

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrmflow.config import DataConfig, FeaturesConfig, ModelConfig
from dlrmflow.features.ids import HashIds
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.loader import make_loader
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.reader import ParquetBatchDataset
from dlrmflow.ingest.splits import Split, assign_splits, list_splits
from dlrmflow.ingest.synthetic import generate_dataset

# Rows per row group of each file: uneven on purpose so that batches span row groups,
# windows and files.
ROW_GROUPS = [[100, 250, 130, 170], [210, 120, 180, 140], [160, 200, 110, 230]]
TOTAL_ROWS = sum(map(sum, ROW_GROUPS))
COLUMNS = ["row_id", "x"]


def _row_group(first_id: int, rows: int) -> pa.Table:
    ids = np.arange(first_id, first_id + rows, dtype=np.int64)
    return pa.table(
        {
            "row_id": ids,
            "x": pa.array((ids % 1000).astype(np.int32), mask=ids % 7 == 0),
            "unused": pa.array(ids.astype(np.float64)),
            # Few distinct values per row group, and different ones in each.
            "tag": pa.array([f"t{i // 50}" for i in ids]),
        }
    )


def _write_dataset(root: str) -> list[str]:
    """Files of ``ROW_GROUPS`` with ``row_id`` numbering every row in file/row-group order."""
    paths, first_id = [], 0
    for i, sizes in enumerate(ROW_GROUPS):
        path = f"{root}/part-{i}.parquet"
        with fsspec.open(path, "wb") as f, pq.ParquetWriter(f, _row_group(0, 1).schema) as w:
            for rows in sizes:
                w.write_table(_row_group(first_id, rows))
                first_id += rows
        paths.append(path)
    return paths


@pytest.fixture
def splits(tmp_path) -> list[Split]:
    return list_splits(_write_dataset(str(tmp_path)))


class Rows:
    """A minimal ``Block``: named numpy columns, what a feature transform might return."""

    def __init__(self, columns: dict[str, np.ndarray]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(self.columns["row_id"])

    def take(self, indices: np.ndarray) -> Rows:
        return Rows({name: values[indices] for name, values in self.columns.items()})

    @classmethod
    def concat(cls, blocks: list[Rows]) -> Rows:
        return cls({name: np.concatenate([b.columns[name] for b in blocks]) for name in COLUMNS})


def to_rows(table: pa.Table) -> Rows:
    x = table.column("x").fill_null(-1).to_numpy()
    return Rows({"row_id": table.column("row_id").to_numpy(), "x": x})


def _ids(batch) -> np.ndarray:
    if isinstance(batch, Rows):
        return batch.columns["row_id"]
    return batch.column("row_id").to_numpy()


def _row_ids(batches) -> np.ndarray:
    return np.concatenate([_ids(b) for b in batches])


def _dataset(splits, epoch: int = 0, **kwargs) -> ParquetBatchDataset:
    kwargs.setdefault("batch_size", 64)
    dataset = ParquetBatchDataset(splits, COLUMNS, **kwargs)
    dataset.set_epoch(epoch)
    return dataset


def _read(splits, num_workers: int = 0, threads: int | None = None, **kwargs) -> list:
    return list(make_loader(_dataset(splits, **kwargs), num_workers=num_workers, threads=threads))


def test_every_row_once_across_ranks_and_workers(splits):
    seen, sizes = [], []
    for rank in range(2):
        batches = _read(splits, 2, rank=rank, world_size=2, seed=3, epoch=1, transform=to_rows)
        # The transform's blocks come through untouched.
        assert all(isinstance(b, Rows) for b in batches)
        seen += [_ids(b) for b in batches]
        sizes += [len(b) for b in batches]
    ids = np.concatenate(seen)
    assert len(ids) == TOTAL_ROWS
    assert np.array_equal(np.sort(ids), np.arange(TOTAL_ROWS))
    # Only each of the 4 readers' last batch may be partial.
    assert sum(size != 64 for size in sizes) <= 4


@pytest.mark.parametrize("num_workers", [0, 2])
def test_order_is_deterministic_per_seed_and_epoch(splits, num_workers):
    def run(epoch: int, seed: int = 5) -> np.ndarray:
        return _row_ids(_read(splits, num_workers, seed=seed, epoch=epoch))

    first = run(0)
    assert np.array_equal(first, run(0))
    assert not np.array_equal(first, run(1))
    assert not np.array_equal(first, run(0, seed=6))
    assert np.array_equal(np.sort(run(1)), np.arange(TOTAL_ROWS))


def test_two_workers_take_turns(splits):
    batches = _read(splits, 2, seed=4, batch_size=100)
    first = {
        int(i)
        for s in assign_splits(
            splits, rank=0, world_size=1, worker=0, num_workers=2, seed=4, epoch=0
        )
        for i in _split_ids(s, splits)
    }
    owner = [0 if _ids(b)[0] in first else 1 for b in batches]
    # Strict alternation until one reader runs out, then the other's remaining batches.
    n = min(owner.count(0), owner.count(1))
    assert n > 3
    assert owner[: 2 * n] == [0, 1] * n
    assert len(set(owner[2 * n :])) <= 1


def test_shuffle_window_permutes_rows_within_window(splits):
    window = 3
    batches = _read(splits, seed=1, shuffle_window=window, batch_size=100)
    assert all(b.num_rows == 100 for b in batches[:-1]) and batches[-1].num_rows > 0
    order = assign_splits(splits, rank=0, world_size=1, worker=0, num_workers=1, seed=1, epoch=0)
    window_rows = sum(s.num_rows for s in order[:window])
    head = _row_ids(batches)[:window_rows]
    # The first window holds exactly the rows of its splits, permuted across them.
    expected = np.concatenate([_split_ids(s, splits) for s in order[:window]])
    assert np.array_equal(np.sort(head), np.sort(expected))
    assert not np.array_equal(head, expected)
    assert len({_split_of(i) for i in head[:100]}) > 1
    # Rows are dealt to batches at random; a batch keeps them in the window's file order.
    position = {int(r): p for p, r in enumerate(expected)}
    inside = batches[: window_rows // 100]
    assert len(inside) > 3
    for batch in inside:
        where = [position[int(r)] for r in _ids(batch)]
        assert where == sorted(where) and where[-1] - where[0] > 100


def _split_ids(split: Split, splits: list[Split]) -> np.ndarray:
    first = sum(s.num_rows for s in splits[: splits.index(split)])
    return np.arange(first, first + split.num_rows)


def _split_of(row_id: int) -> int:
    return int(np.searchsorted(np.cumsum(sum(ROW_GROUPS, [])), row_id, side="right"))


def test_no_shuffle_keeps_file_order_and_drop_last(splits):
    batches = _read(splits, shuffle=False, batch_size=128)
    assert np.array_equal(_row_ids(batches), np.arange(TOTAL_ROWS))
    assert batches[-1].num_rows == TOTAL_ROWS % 128 > 0
    dropped = _read(splits, shuffle=False, batch_size=128, drop_last=True)
    assert len(dropped) == TOTAL_ROWS // 128
    assert all(b.num_rows == 128 for b in dropped)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_transform_blocks_give_the_same_rows_in_the_same_order(splits, num_workers):
    kwargs = dict(seed=9, batch_size=70, shuffle_window=3)
    tables = _read(splits, num_workers, **kwargs)
    blocks = _read(splits, num_workers, transform=to_rows, **kwargs)
    assert [len(b) for b in blocks] == [len(t) for t in tables]
    for block, table in zip(blocks, tables, strict=True):
        assert np.array_equal(block.columns["row_id"], table.column("row_id").to_numpy())
        assert np.array_equal(block.columns["x"], table.column("x").fill_null(-1).to_numpy())


@pytest.mark.parametrize(("num_workers", "threads"), [(0, 1), (0, 3), (2, 1), (2, 2)])
def test_preparation_threads_change_nothing_but_speed(splits, num_workers, threads):
    kwargs = dict(seed=5, batch_size=70, shuffle_window=2)
    expected = _row_ids(_read(splits, num_workers, threads=1, **kwargs))
    assert np.array_equal(_row_ids(_read(splits, num_workers, threads=threads, **kwargs)), expected)
    blocks = _read(splits, num_workers, threads=threads, transform=to_rows, **kwargs)
    assert np.array_equal(np.concatenate([b.columns["row_id"] for b in blocks]), expected)


def test_transform_runs_once_per_row_group(splits):
    seen: list[int] = []

    def transform(table: pa.Table) -> Rows:
        seen.append(table.num_rows)
        return to_rows(table)

    _read(splits, transform=transform, batch_size=32)
    assert sorted(seen) == sorted(sum(ROW_GROUPS, []))


def test_transform_must_keep_every_row(splits):
    with pytest.raises(ValueError, match=r"row group \d: transform returned 1 rows for \d+"):
        _read(splits, transform=lambda table: to_rows(table).take(np.array([0])))


def _loader(splits, num_workers: int, epoch: int = 2, **kwargs):
    dataset = _dataset(splits, epoch=epoch, **kwargs)
    return make_loader(dataset, num_workers=num_workers, prefetch_factor=2)


@pytest.mark.parametrize(
    ("num_workers", "shuffle", "transform"),
    [(0, True, None), (2, True, None), (0, False, None), (2, True, to_rows)],
)
def test_resume_mid_epoch_continues_exactly(splits, num_workers, shuffle, transform):
    kwargs = dict(seed=11, batch_size=48, shuffle_window=2, shuffle=shuffle, transform=transform)
    full = list(_loader(splits, num_workers, **kwargs))
    interrupted = _loader(splits, num_workers, **kwargs)
    k = 17
    head = list(itertools.islice(interrupted, k))
    state = interrupted.state_dict()
    del interrupted
    resumed = _loader(splits, num_workers, **kwargs)
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert len(head) + len(tail) == len(full)
    for a, b in zip(head + tail, full, strict=True):
        assert np.array_equal(_ids(a), _ids(b))


def test_resume_rereads_only_the_current_window_of_its_epoch(splits):
    def loader(epoch: int, decoded: list | None = None):
        validate = None if decoded is None else decoded.append
        return _loader(splits, 0, epoch, batch_size=50, shuffle_window=2, validate=validate)

    full = list(loader(0))
    interrupted = loader(0)
    it = iter(interrupted)
    for _ in range(20):  # 1000 of 2000 rows: mid-epoch, windows hold ~350
        next(it)
    state = interrupted.state_dict()

    decoded: list[pa.Table] = []
    resumed = loader(9, decoded)  # a loaded state keeps its own epoch
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert all(a.equals(b) for a, b in zip(rest, full[20:], strict=True))
    # Only the window holding row 1000 and those after it are decoded again.
    order = assign_splits(splits, rank=0, world_size=1, worker=0, num_workers=1, seed=0, epoch=0)
    window_ends = np.cumsum([sum(s.num_rows for s in order[i : i + 2]) for i in range(0, 12, 2)])
    current = int(np.searchsorted(window_ends, 1000, side="right"))
    assert 0 < current < 5
    assert len(decoded) == 12 - 2 * current


def test_state_after_the_last_batch_restores_to_a_fresh_pass(splits):
    finished = _loader(splits, 2, epoch=0)
    first = list(finished)
    resumed = _loader(splits, 2, epoch=1)
    resumed.load_state_dict(finished.state_dict())
    again = list(resumed)
    assert np.array_equal(_row_ids(again), _row_ids(_loader(splits, 2, epoch=1)))
    assert not np.array_equal(_row_ids(again), _row_ids(first))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_from_another_layout_is_refused(splits, num_workers):
    loader = _loader(splits, num_workers, seed=1)
    next(iter(loader))
    other = _loader(splits, num_workers, seed=2)
    other.load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="layout"):
        iter(other)


def test_state_between_two_batches_is_refused(splits):
    loader = _loader(splits, 0, seed=1, batch_size=48)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()

    def shift(d: dict) -> None:  # one row past the reader's position
        for key, value in d.items():
            if key == "offset":
                d[key] = value + 1
            elif isinstance(value, dict):
                shift(value)

    shift(state)
    other = _loader(splits, 0, seed=1, batch_size=48)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="not at a batch boundary"):
        iter(other)


@pytest.mark.parametrize(
    ("saved", "loaded", "message"),
    [(2, 3, "another num_workers"), (2, 0, "num_workers > 0"), (0, 2, "num_workers=0")],
)
def test_state_from_another_worker_count_is_refused(splits, saved, loaded, message):
    loader = _loader(splits, saved)
    next(iter(loader))
    other = _loader(splits, loaded)
    other.load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match=message):
        iter(other)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_transform_errors_name_file_and_row_group(tmp_path, splits, num_workers):
    def transform(table: pa.Table) -> Rows:
        if table.num_rows == 180:
            raise KeyError("C3")
        return to_rows(table)

    where = f"{tmp_path}/part-1.parquet, row group 2"
    with pytest.raises(DataError, match=f"^{where}: transform failed: KeyError: 'C3'$"):
        _read(splits, num_workers, transform=transform)


def test_memory_filesystem():
    paths = _write_dataset("memory://reader-test")
    try:
        batches = _read(list_splits(paths), seed=2)
        assert np.array_equal(np.sort(_row_ids(batches)), np.arange(TOTAL_ROWS))
    finally:
        fsspec.filesystem("memory").rm("/reader-test", recursive=True)


@pytest.fixture(scope="module")
def criteo_like(tmp_path_factory):
    """Synthetic Criteo-layout days in uneven row groups, and the hashed transform."""
    url = str(tmp_path_factory.mktemp("criteo") / "data")
    generate_dataset(DataConfig(url=url, days=3, rows_per_day=1500, row_group_size=333))
    manifest = read_manifest(url)
    spec = FeatureSpec.for_dataset(manifest, FeaturesConfig(), ModelConfig())
    return list_splits(manifest.day_paths(url)), spec, BatchTransform(spec, HashIds.from_spec(spec))


@pytest.mark.parametrize(("num_workers", "threads"), [(0, 1), (2, 2)])
def test_compiled_window_batches_are_the_transform_of_the_plain_batches(
    criteo_like, num_workers, threads
):
    # The reader's compiled path (each row group written straight to its shuffled place)
    # must give, batch for batch, what transforming the plain Arrow batches gives.
    splits, spec, transform = criteo_like
    kwargs = dict(seed=3, shuffle_window=3, validate=transform.validate)

    def loader(**more):
        dataset = ParquetBatchDataset(splits, spec.columns, 256, **kwargs, **more)
        return make_loader(dataset, num_workers=num_workers, threads=threads)

    plain = list(loader())
    compiled = list(loader(transform=transform))
    assert [len(b) for b in compiled] == [b.num_rows for b in plain]
    for got, rows in zip(compiled, plain, strict=True):
        expected = transform(rows)
        assert torch.equal(got.dense, expected.dense)
        assert torch.equal(got.labels, expected.labels)
        assert torch.equal(got.sparse.one_hot_rows, expected.sparse.one_hot_rows)
    # Resumed mid-epoch, the compiled path continues with the same batches.
    interrupted = loader(transform=transform)
    head = list(itertools.islice(interrupted, 7))
    resumed = loader(transform=transform)
    resumed.load_state_dict(interrupted.state_dict())
    for got, expected in zip(head + list(resumed), compiled, strict=True):
        assert torch.equal(got.sparse.one_hot_rows, expected.sparse.one_hot_rows)
        assert torch.equal(got.dense, expected.dense)
