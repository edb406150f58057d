"""String IDs, alone or in lists, read as the dictionaries Parquet stores them in: the
same batches, fewer strings decoded and hashed, and drift still checked against what each
file declares."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrmflow.features.batch import Batch
from dlrmflow.features.ids import HashIds
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.loader import make_loader
from dlrmflow.ingest.reader import ParquetBatchDataset
from dlrmflow.ingest.splits import list_splits
from dlrmflow.schema import DenseFeature
from tests.features.test_transform import assert_batches_equal

ROWS = 600  # a row group


def table(seed: int, users: int) -> pa.Table:
    """A row group of logs: ``users`` distinct user strings (some null), a list of tags, a
    list of recent item strings drawn from as many (some lists null)."""
    rng = np.random.default_rng(seed)
    user = [None if v == 0 else f"user-{v}" for v in rng.integers(0, users, ROWS)]
    tags = [list(rng.integers(0, 50, rng.integers(0, 4))) for _ in range(ROWS)]
    recent = [
        None if rng.random() < 0.1 else [f"item-{v}" for v in rng.integers(0, users, size)]
        for size in rng.integers(0, 5, ROWS)
    ]
    return pa.table(
        {
            "click": pa.array(rng.integers(0, 2, ROWS), pa.int8()),
            "price": pa.array(rng.random(ROWS) * 10, pa.float32()),
            "user": pa.array(user, pa.string()),
            "item": pa.array([f"item-{v}" for v in rng.integers(0, 40, ROWS)], pa.string()),
            "tags": pa.array(tags, pa.list_(pa.int64())),
            "recent": pa.array(recent, pa.list_(pa.string())),
        }
    )


def write(path: str, tables: list[pa.Table], **options) -> str:
    with pq.ParquetWriter(path, tables[0].schema, **options) as writer:
        for t in tables:
            writer.write_table(t)
    return path


SPEC = FeatureSpec(
    dense=("price",),
    sparse=(
        SparseFeature("user", 64, 4),
        SparseFeature("item", 64, 4),
        SparseFeature("tags", 97, 4),
        SparseFeature("recent", 64, 4),
    ),
    label="click",
    dense_transforms=(DenseFeature(column="price", transform="log"),),
)


class Seen:
    """The transform, recording the types of ``user`` and ``recent`` in every table it
    validates."""

    def __init__(self, transform: BatchTransform, dictionaries: bool = True) -> None:
        self.transform = transform
        self.types: list[pa.DataType] = []
        self.list_types: list[pa.DataType] = []
        if dictionaries:
            self.dictionary_columns = transform.dictionary_columns

    def validate(self, t: pa.Table) -> None:
        self.types.append(t.schema.field("user").type)
        self.list_types.append(t.schema.field("recent").type)
        self.transform.validate(t)

    def __call__(self, t: pa.Table) -> Batch:
        return self.transform(t)

    def window_writer(self, order, dest=None):
        return self.transform.window_writer(order, dest)


def batches(paths: list[str], transform: Seen, shuffle: bool = True) -> list[Batch]:
    dataset = ParquetBatchDataset(
        list_splits(paths),
        SPEC.columns,
        128,
        shuffle=shuffle,
        shuffle_window=2,
        validate=transform.validate,
        transform=transform,
    )
    with make_loader(dataset, num_workers=1, threads=2) as loader:
        return list(loader)


def read_both(paths: list[str]) -> tuple[Seen, list[Batch], list[Batch]]:
    transform = BatchTransform(SPEC, HashIds.from_spec(SPEC, seed=2))
    seen, plain = Seen(transform), Seen(transform, dictionaries=False)
    with_dictionaries, without = batches(paths, seen), batches(paths, plain)
    assert plain.types and all(t == pa.string() for t in plain.types)
    assert all(t == pa.list_(pa.string()) for t in plain.list_types)
    return seen, with_dictionaries, without


def assert_all_equal(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert_batches_equal(x, y)


def test_dictionary_encoded_strings_are_read_as_dictionaries_to_the_same_batches(tmp_path):
    paths = [
        write(str(tmp_path / f"part-{i}.parquet"), [table(3 * i + j, 30) for j in range(3)])
        for i in range(2)
    ]
    seen, with_dictionaries, without = read_both(paths)
    assert seen.types and all(pa.types.is_dictionary(t) for t in seen.types)
    assert all(pa.types.is_dictionary(t.value_type) for t in seen.list_types)
    assert_all_equal(with_dictionaries, without)


def test_a_column_whose_dictionary_is_as_large_as_its_rows_is_read_plain_after(tmp_path):
    """Unique strings: Arrow would build a dictionary the size of the column each time."""
    path = write(str(tmp_path / "part.parquet"), [table(j, 10**9) for j in range(4)])
    seen, with_dictionaries, without = read_both([path])
    assert pa.types.is_dictionary(seen.types[0])
    assert pa.string() in seen.types[1:]
    assert pa.types.is_dictionary(seen.list_types[0].value_type)
    assert pa.list_(pa.string()) in seen.list_types[1:]
    assert_all_equal(with_dictionaries, without)


def test_strings_the_writer_left_plain_give_the_same_batches(tmp_path):
    path = write(
        str(tmp_path / "part.parquet"), [table(j, 30) for j in range(3)], use_dictionary=False
    )
    _, with_dictionaries, without = read_both([path])
    assert_all_equal(with_dictionaries, without)


def test_the_compiled_path_reads_strings_plain(tmp_path):
    """One-hot string IDs and Criteo's dense transform: hashed straight into place."""
    spec = FeatureSpec(dense=("price",), sparse=(SparseFeature("user", 64, 4),), label="click")
    transform = BatchTransform(spec, HashIds.from_spec(spec))
    assert transform.dictionary_columns(table(0, 30).schema) == []
    assert BatchTransform(SPEC, HashIds.from_spec(SPEC)).dictionary_columns(
        table(0, 30).schema
    ) == ["user", "item", "recent"]


def test_drift_is_what_the_files_declare(tmp_path):
    """A string column read as a dictionary is still a string column to the drift check:
    another type in a later file is named as the file holds it."""
    first = write(str(tmp_path / "a.parquet"), [table(0, 30)])
    later = table(1, 30)
    ints = later.set_column(2, "user", pa.array(np.arange(ROWS), pa.int64()))
    second = write(str(tmp_path / "b.parquet"), [ints])
    transform = Seen(BatchTransform(SPEC, HashIds.from_spec(SPEC)))
    message = r"b\.parquet, row group 0: column user is int64, but .*a\.parquet, row group 0 "
    with pytest.raises(DataError, match=message + r"has string \(schema drift\)"):
        batches([first, second], transform, shuffle=False)


def test_drift_of_a_list_of_strings_is_what_the_files_declare(tmp_path):
    first = write(str(tmp_path / "a.parquet"), [table(0, 30)])
    later = table(1, 30)
    ints = later.set_column(5, "recent", pa.array([[1, 2]] * ROWS, pa.list_(pa.int64())))
    second = write(str(tmp_path / "b.parquet"), [ints])
    transform = Seen(BatchTransform(SPEC, HashIds.from_spec(SPEC)))
    message = r"b\.parquet, row group 0: column recent is list<element: int64>, but "
    with pytest.raises(DataError, match=message + r".*has list<element: string> \(schema drift"):
        batches([first, second], transform, shuffle=False)


def test_a_file_that_declares_a_dictionary_still_differs_from_one_of_strings(tmp_path):
    first = write(str(tmp_path / "a.parquet"), [table(0, 30)])
    later = table(1, 30)
    encoded = later.set_column(2, "user", later.column("user").dictionary_encode())
    second = write(str(tmp_path / "b.parquet"), [encoded])
    transform = Seen(BatchTransform(SPEC, HashIds.from_spec(SPEC)))
    with pytest.raises(DataError, match=r"b\.parquet, row group 0: column user is dictionary"):
        batches([first, second], transform, shuffle=False)
