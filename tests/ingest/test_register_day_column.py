"""Registering Parquet whose days are in a column (the schema's ``day_column``), not in
folders: each file's day from its footer's statistics (or the column, without them), days
numbered in order, a file of two days refused in one line, a later day registered alone."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from zoneinfo import ZoneInfo

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.manifest import check_dataset, read_manifest
from dlrmflow.ingest.reader import ParquetBatchDataset
from dlrmflow.ingest.register import register_dataset
from dlrmflow.ingest.registered_days import RegisteredDayChanged, register_new_days
from dlrmflow.ingest.splits import list_splits
from tests.conftest import run_cli
from tests.ingest.own_data import SCHEMA, SCHEMA_YAML, own_day

ROWS = 200
FIRST = dt.date(2026, 11, 1)


def _schema(column: str = "seen"):
    return SCHEMA.model_copy(update={"day_column": column})


def write_file(path: Path, days: list, kind: pa.DataType, seed: int, **options) -> pa.Table:
    """A file of ``ROWS`` own-data rows whose ``seen`` column holds ``days`` in turn."""
    table, _ = own_day(np.random.default_rng(seed), ROWS)
    seen = pa.array([days[i * len(days) // ROWS] for i in range(ROWS)], kind)
    table = table.append_column("seen", seen)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=50, **options)
    return table


def _date(offset: int) -> dt.date:
    return FIRST + dt.timedelta(days=offset)


def test_a_flat_folder_with_a_date_column_registers_each_file_under_its_day(tmp_path):
    data = tmp_path / "flat"
    # Names that do not sort as the days do; day 1 in two files, one in a folder of its own.
    files = {"c.parquet": 0, "a.parquet": 1, "more/b.parquet": 1, "0.parquet": 3}
    for seed, (name, offset) in enumerate(files.items()):
        write_file(data / name, [_date(offset)], pa.date32(), seed)
    (data / "_SUCCESS").write_text("")
    (data / ".hidden").mkdir()
    (data / ".hidden" / "x.parquet").write_text("not data")
    manifest = register_dataset(str(data), _schema())
    # Days in date order, numbered consecutively (the missing 2026-11-03 takes no number).
    assert {f.path: f.day for f in manifest.files} == {
        "c.parquet": 0,
        "a.parquet": 1,
        "more/b.parquet": 1,
        "0.parquet": 2,
    }
    assert manifest.generator == {
        "partitions": ["seen=2026-11-01", "seen=2026-11-02", "seen=2026-11-04"]
    }
    assert (manifest.days, manifest.test_day, manifest.rows) == (3, 2, 4 * ROWS)
    check_dataset(str(data), manifest)
    # The reader takes each file's day from the manifest: a pass a day.
    url = str(data)
    splits = list_splits(manifest.day_paths(url), manifest.path_days(url))
    dataset = ParquetBatchDataset(splits, ["click"], 64, by_day=True)
    assert dataset.days == [0, 1, 2]
    read, day = dataset.pass_of(1)
    assert day == 1 and {s.path for s in read} == {f"{url}/a.parquet", f"{url}/more/b.parquet"}


@pytest.mark.parametrize("statistics", [True, False], ids=["footer", "no-statistics"])
def test_a_timestamps_day_is_its_date_in_its_time_zone(tmp_path, statistics):
    data = tmp_path / "ts"
    zone = "America/New_York"
    kind = pa.timestamp("ms", tz=zone)
    for offset in range(3):
        # 20:00 to 23:30 in New York: the next day in UTC, this day where the data is.
        evening = dt.datetime.combine(_date(offset), dt.time(20), tzinfo=ZoneInfo(zone))
        stamps = [evening + dt.timedelta(minutes=30 * i) for i in range(8)]
        assert {s.astimezone(dt.UTC).date() for s in stamps} == {_date(offset + 1)}
        write_file(
            data / f"part-{offset}.parquet", stamps, kind, offset, write_statistics=statistics
        )
    manifest = register_dataset(str(data), _schema())
    assert manifest.generator["partitions"] == [f"seen={_date(i)}" for i in range(3)]
    assert [f.day for f in manifest.files] == [0, 1, 2]


def test_integer_days_are_numbered_in_order(tmp_path):
    data = tmp_path / "ints"
    for seed, day in enumerate([20261105, 20261101, 20261103]):
        write_file(data / f"{seed}.parquet", [day], pa.int32(), seed)
    manifest = register_dataset(str(data), _schema())
    assert manifest.generator["partitions"] == ["seen=20261101", "seen=20261103", "seen=20261105"]
    assert {f.path: f.day for f in manifest.files} == {
        "1.parquet": 0,
        "2.parquet": 1,
        "0.parquet": 2,
    }


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (
            lambda p: write_file(p, [_date(0), _date(1)], pa.date32(), 0),
            r"bad.parquet: column seen: rows of 2026-11-01 and of 2026-11-02, but a file must "
            r"hold one day: partition the data by day",
        ),
        (  # without statistics the column is read: the same finding
            lambda p: write_file(p, [_date(1), _date(0)], pa.date32(), 0, write_statistics=False),
            r"bad.parquet: column seen: rows of 2026-11-01 and of 2026-11-02, but",
        ),
        (
            lambda p: write_file(p, [None, _date(0)], pa.date32(), 0),
            r"bad.parquet, row group 0, column seen: 50 rows with no day \(null\)",
        ),
        (
            lambda p: write_file(p, ["2026-11-01"], pa.string(), 0),
            r"bad.parquet: column seen: type string cannot be a day column",
        ),
        (
            lambda p: write_file(p, [20261101], pa.int64(), 0),
            r"bad.parquet: column seen: type int64, but .*good.parquet has date32\[day\]",
        ),
        (
            lambda p: pq.write_table(
                pq.read_table(p.parent / "good.parquet").drop_columns("seen"), p
            ),
            r"bad.parquet: column seen: missing \(the schema's day_column\)",
        ),
    ],
    ids=["two-days", "two-days-no-statistics", "null-day", "string", "type-changes", "missing"],
)
def test_a_file_that_gives_no_one_day_fails_in_one_line(tmp_path, write, message):
    data = tmp_path / "data"
    write_file(data / "good.parquet", [_date(0)], pa.date32(), 1)
    write_file(data / "later.parquet", [_date(2)], pa.date32(), 2)
    write(data / "x-bad.parquet")
    with pytest.raises(DataError, match=message) as e:
        register_dataset(str(data), _schema())
    assert "\n" not in str(e.value)
    assert not (data / "manifest.json").exists()


def test_a_later_file_is_registered_alone_as_the_next_day(tmp_path):
    data = tmp_path / "data"
    for offset in range(3):
        write_file(data / f"{offset}.parquet", [_date(offset)], pa.date32(), offset)
    register_dataset(str(data), _schema())
    before = read_manifest(str(data))
    assert register_new_days(str(data)).new_days == []

    write_file(data / "2026" / "new.parquet", [_date(5)], pa.date32(), 5)
    read: list[int] = []
    grown = register_new_days(str(data), progress=read.append)
    assert grown.new_days == [3] and read == [ROWS]  # only the new file's labels were read
    assert grown.manifest.files[:3] == before.files
    assert grown.manifest.files[3].path == "2026/new.parquet"
    assert grown.manifest.generator["partitions"][3] == "seen=2026-11-06"

    late = data / "late.parquet"
    write_file(late, [_date(4)], pa.date32(), 4)
    with pytest.raises(RegisteredDayChanged) as e:
        register_new_days(str(data))
    assert str(e.value).startswith(
        f"{late} (seen=2026-11-05): landed after seen=2026-11-06 (day 3) was registered but "
        "sorts before it"
    )
    assert str(e.value).endswith("or give its rows a day after seen=2026-11-06")
    late.unlink()

    again = data / "again.parquet"
    write_file(again, [_date(1)], pa.date32(), 9)
    with pytest.raises(RegisteredDayChanged, match=f"^{again}: a new file of seen=2026-11-02, reg"):
        register_new_days(str(data))
    again.unlink()

    rewritten = data / "1.parquet"
    saved = rewritten.read_bytes()
    write_file(rewritten, [_date(1)], pa.date32(), 7)
    with pytest.raises(RegisteredDayChanged, match=f"^{rewritten}: rewritten since it was reg"):
        register_new_days(str(data))
    rewritten.unlink()
    with pytest.raises(RegisteredDayChanged, match=f"^{rewritten}: gone, but it was registered"):
        register_new_days(str(data))
    rewritten.write_bytes(saved)
    assert register_new_days(str(data)).new_days == []


@pytest.mark.parametrize(
    ("kind", "hint"),
    [
        (
            pa.timestamp("ms", "UTC"),
            "a column of each row's day (seen (timestamp[ms, tz=UTC]) in the data)",
        ),
        (pa.int32(), "a date, timestamp or integer column of each row's day"),
    ],
    ids=["timestamp-seen", "none-seen"],
)
def test_a_flat_folder_without_a_day_column_suggests_one(tmp_path, kind, hint):
    data = tmp_path / "flat"
    when = dt.datetime(2026, 11, 1, 12) if pa.types.is_timestamp(kind) else 20261101
    write_file(data / "a.parquet", [when], kind, 0)
    with pytest.raises(DataError) as e:
        register_dataset(str(data), SCHEMA)
    assert str(e.value) == (
        f"{data}: no day partitions; expected day=N/ or dt=YYYY-MM-DD/ folders of Parquet, or "
        f"the schema's day_column naming {hint}"
    )


def test_register_from_the_command_line_with_a_day_column(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    for offset in range(2):
        write_file(data / f"{offset}.parquet", [_date(offset)], pa.date32(), offset)
    schema = tmp_path / "schema.yaml"
    schema.write_text(SCHEMA_YAML + "day_column: seen\n")
    code, printed, err = run_cli(
        monkeypatch, capsys, "register", "--data", str(data), "--schema", str(schema)
    )
    assert code == 0, err
    assert '"seen=2026-11-02"' in printed
    write_file(data / "2.parquet", [_date(2), _date(3)], pa.date32(), 2)
    (data / "manifest.json").unlink()
    code, _, err = run_cli(
        monkeypatch, capsys, "register", "--data", str(data), "--schema", str(schema)
    )
    assert code == 1 and len(err) == 1
    assert "2.parquet: column seen: rows of 2026-11-03 and of 2026-11-04" in err[0]


def test_a_day_column_on_s3_registers_and_grows_where_the_files_lie(s3_bucket, tmp_path):
    local = tmp_path / "data"
    for offset in range(2):
        write_file(local / "logs" / f"{offset}.parquet", [_date(offset)], pa.date32(), offset)
    url = f"{s3_bucket}/flat"
    fs, path = fsspec.core.url_to_fs(url)
    fs.put(f"{local}/", path, recursive=True)
    manifest = register_dataset(url, _schema())
    assert {f.path: f.day for f in manifest.files} == {"logs/0.parquet": 0, "logs/1.parquet": 1}
    check_dataset(url, manifest)
    write_file(local / "2.parquet", [_date(2)], pa.date32(), 2)
    fs.put(str(local / "2.parquet"), f"{path}/2.parquet")
    grown = register_new_days(url)
    assert grown.new_days == [2] and grown.manifest.files[-1].path == "2.parquet"
