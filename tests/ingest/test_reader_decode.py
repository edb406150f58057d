"""Decoding a split: only the requested columns, one schema across files (nullability
aside), and a file, row group and column named when a row group cannot be used."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.splits import Split, list_splits
from tests.ingest.test_reader import COLUMNS, _read, _row_group, _row_ids, _write_dataset


@pytest.fixture
def splits(tmp_path) -> list[Split]:
    return list_splits(_write_dataset(str(tmp_path)))


def test_only_requested_columns_are_read(splits):
    tables: list[pa.Table] = []
    batch = _read(splits, validate=tables.append)[0]
    assert batch.schema.names == COLUMNS
    assert tables[0].column_names == COLUMNS
    assert batch.column("x").null_count > 0  # nulls survive the shuffle


def test_missing_column_names_file_row_group_and_column(tmp_path):
    path = str(tmp_path / "drift.parquet")
    pq.write_table(_row_group(0, 10).drop_columns(["x"]), path)
    with pytest.raises(DataError, match=rf"{path}, row group 0: missing column x \(schema drift\)"):
        _read(list_splits([path]))


def test_column_type_drift_names_the_column(tmp_path):
    good, bad = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    pq.write_table(_row_group(0, 10), good)
    table = _row_group(10, 10)
    pq.write_table(table.set_column(1, "x", table.column("x").cast(pa.int64())), bad)
    with pytest.raises(DataError, match=rf"{bad}, row group 0: column x is int64"):
        _read(list_splits([good, bad]), shuffle=False)


def test_files_that_differ_only_in_nullability_share_a_window(tmp_path):
    strict, loose = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    table = _row_group(0, 10)
    schema = table.schema.set(0, table.schema.field("row_id").with_nullable(False))
    pq.write_table(table.cast(schema), strict)
    pq.write_table(_row_group(10, 10), loose)
    batches = _read(list_splits([strict, loose]), shuffle=False, batch_size=15)
    assert np.array_equal(_row_ids(batches), np.arange(20))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_corrupt_row_group_names_file_and_row_group(tmp_path, splits, num_workers):
    path = tmp_path / "part-0.parquet"
    data = bytearray(path.read_bytes())
    data[4:68] = b"\xff" * 64  # the first page header of row group 0; the footer is intact
    path.write_bytes(bytes(data))
    # With reader threads the error crosses to the consumer with its type and message.
    with pytest.raises(DataError, match=f"^{path}, row group 0: cannot decode"):
        _read(splits, num_workers, shuffle=False)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_validate_errors_are_wrapped_with_file_and_row_group(tmp_path, splits, num_workers):
    def validate(table: pa.Table) -> None:
        if table.num_rows == 250:
            raise ValueError("label out of range")

    # Raised as the reader thread raised it: its message alone (not torchdata's "Caught
    # DataError in _populate_queue" and a traceback), its cause kept.
    message = f"{tmp_path}/part-0.parquet, row group 1: label out of range"
    with pytest.raises(DataError) as raised:
        _read(splits, num_workers, validate=validate)
    assert str(raised.value) == message
    assert isinstance(raised.value.__cause__, ValueError)
