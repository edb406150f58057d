"""A registered dataset grows a day partition at a time: a new partition is its next day,
read alone; a late partition, a registered day's folder or files changed, are refused in
one line naming them, with nothing written. And its days, which its files' footers do not
record, reach the reader from the manifest: a run in day order reads a day a pass."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.reader import ParquetBatchDataset
from dlrmflow.ingest.register import register_dataset
from dlrmflow.ingest.registered_days import (
    RegisteredDayChanged,
    is_registered,
    register_new_days,
)
from dlrmflow.ingest.splits import list_splits
from tests.ingest.own_data import SCHEMA, own_day, write_own_dataset

ROWS = 200


def land_day(data: Path, name: str, seed: int, rows: int = ROWS) -> Path:
    """A day partition ``name`` lands under ``data``: two Parquet files and ``_SUCCESS``."""
    folder = data / name
    folder.mkdir()
    table, _ = own_day(np.random.default_rng(seed), rows)
    half = rows // 2
    pq.write_table(table.slice(0, half), folder / "part-0.parquet", row_group_size=50)
    pq.write_table(table.slice(half), folder / "part-1.parquet", row_group_size=50)
    (folder / "_SUCCESS").write_text("")
    return folder


@pytest.fixture
def registered(tmp_path: Path) -> Path:
    data = write_own_dataset(tmp_path / "data", days=3, rows=ROWS, partition="dt")
    register_dataset(str(data), SCHEMA)
    return data


def _written(data: Path) -> tuple[int, int]:
    return (data / "manifest.json").stat().st_mtime_ns, (data / "stats.json").stat().st_mtime_ns


def test_a_new_partition_is_the_next_day_and_only_it_is_read(registered: Path) -> None:
    data = registered
    assert is_registered(str(data)) and not is_registered(str(data / "nothing"))
    before, written = read_manifest(str(data)), _written(data)
    assert register_new_days(str(data)).new_days == []  # nothing new: nothing written
    assert _written(data) == written

    land_day(data, "dt=2026-11-04", seed=9)
    read: list[int] = []
    grown = register_new_days(str(data), progress=read.append)
    assert grown.new_days == [3] and grown.manifest.days == 4
    assert read == [ROWS // 2, ROWS // 2]  # the new day's two files, no other
    assert grown.manifest.files[: len(before.files)] == before.files
    assert [f.path for f in grown.manifest.files if f.day == 3] == [
        "dt=2026-11-04/part-0.parquet",
        "dt=2026-11-04/part-1.parquet",
    ]
    assert grown.manifest.features == before.features


@pytest.mark.parametrize("late", ["dt=2026-10-31", "dt=2026-11-02", "dt=2026-11-04"])
def test_a_late_partition_is_refused_naming_it(tmp_path: Path, late: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for seed, name in enumerate(["dt=2026-11-01", "dt=2026-11-03", "dt=2026-11-05"]):
        land_day(data, name, seed)
    register_dataset(str(data), SCHEMA)
    before, written = read_manifest(str(data)), _written(data)
    land_day(data, late, seed=9)
    with pytest.raises(RegisteredDayChanged) as e:
        register_new_days(str(data))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{data / late}: landed after dt=2026-11-05 (day 2) was registered")
    assert message.endswith("land its rows in a partition that sorts after dt=2026-11-05")
    assert _written(data) == written and read_manifest(str(data)) == before


def test_a_registered_day_that_changed_is_refused_naming_the_file(registered: Path) -> None:
    data = registered
    written = _written(data)
    land_day(data, "dt=2026-11-04", seed=9)  # a new day too: nothing of it is registered
    part = data / "dt=2026-11-02" / "part-0.parquet"
    saved = part.read_bytes()

    table = pq.read_table(part)
    pq.write_table(table, part, row_group_size=20)  # the same rows, rewritten
    with pytest.raises(RegisteredDayChanged, match=f"^{part}: rewritten since it was registered"):
        register_new_days(str(data))
    part.write_bytes(saved)

    extra = data / "dt=2026-11-02" / "part-2.parquet"
    pq.write_table(table, extra)
    with pytest.raises(RegisteredDayChanged, match=f"^{extra}: a new file in dt=2026-11-02"):
        register_new_days(str(data))
    extra.unlink()

    part.unlink()
    with pytest.raises(RegisteredDayChanged, match=f"^{part}: gone from dt=2026-11-02"):
        register_new_days(str(data))
    part.write_bytes(saved)

    shutil.move(data / "dt=2026-11-01", data.parent / "away")
    with pytest.raises(RegisteredDayChanged, match=f"^{data / 'dt=2026-11-01'}: gone, but"):
        register_new_days(str(data))
    shutil.move(data.parent / "away", data / "dt=2026-11-01")
    assert _written(data) == written
    assert register_new_days(str(data)).new_days == [3]  # restored: the new day goes in


def test_registered_days_reach_the_reader_from_the_manifest(tmp_path: Path) -> None:
    """``day=N`` folders not numbered from 0, and ``dt=`` ones: the manifest's days."""
    for partition in ("day", "dt"):
        data = write_own_dataset(tmp_path / partition, days=3, rows=ROWS, partition=partition)
        if partition == "day":
            for day in (2, 1, 0):
                (data / f"day={day}").rename(data / f"day={day + 20}")
        manifest = register_dataset(str(data), SCHEMA)
        url = str(data)
        splits = list_splits(manifest.day_paths(url), manifest.path_days(url))
        dataset = ParquetBatchDataset(splits, ["click"], 64, by_day=True)
        assert dataset.days == [0, 1, 2]
        for epoch in range(3):
            read, day = dataset.pass_of(epoch)
            assert day == epoch
            assert sum(s.num_rows for s in read) == ROWS  # the day's rows, no other
            assert {s.path for s in read} == {
                f"{url}/{f.path}" for f in manifest.files if f.day == epoch
            }
        if partition == "dt":
            with pytest.raises(ValueError, match="no day in its footer, its path"):
                ParquetBatchDataset(
                    list_splits(manifest.day_paths(url)), ["click"], 64, by_day=True
                )
