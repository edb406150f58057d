"""``check_dataset``: a dataset held to its manifest before work starts; the held-out day."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest

from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.manifest import Manifest, check_dataset, read_manifest


@pytest.fixture
def data(tiny_dataset: str, tmp_path: Path) -> Path:
    """A copy of the tiny dataset (days 0, 1 and test day 2; 6000 rows each) to break."""
    root = tmp_path / "data"
    shutil.copytree(tiny_dataset, root)
    return root


def day_file(root: Path, day: int) -> Path:
    """Day ``day``'s file, as the manifest lists it."""
    files = json.loads((root / "manifest.json").read_text())["files"]
    return root / next(f["path"] for f in files if f["day"] == day)


def edit_manifest(root: Path, edit: Callable[[dict], None]) -> Manifest:
    path = root / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    return read_manifest(str(root))


def set_rows(root: Path, rows: dict[int, int]) -> Manifest:
    """The manifest with these days' row counts, its total kept consistent, and no
    identity recorded for those days (as in a manifest written before identities were)."""

    def edit(manifest: dict) -> None:
        for f in manifest["files"]:
            if f["day"] in rows:
                f["rows"] = rows[f["day"]]
                f.pop("digest", None)
                f.pop("bytes", None)
        manifest["rows"] = sum(f["rows"] for f in manifest["files"])

    return edit_manifest(root, edit)


def write_empty(root: Path, day: int) -> None:
    """Day ``day``'s file as a valid Parquet file with the dataset's schema and no rows."""
    path = day_file(root, day)
    pq.write_table(pq.read_schema(path).empty_table(), path)


def check(root: Path, manifest: Manifest | None = None) -> list[str]:
    return check_dataset(str(root), manifest or read_manifest(str(root)))


def test_a_sound_dataset_passes(data: Path) -> None:
    manifest = read_manifest(str(data))
    assert check_dataset(str(data), manifest) == []
    assert manifest.train_days() == [0, 1]
    assert manifest.day_paths(str(data), manifest.train_days()) == [
        str(day_file(data, 0)), str(day_file(data, 1)),
    ]  # fmt: skip


def test_only_footers_are_read(data: Path) -> None:
    """Data pages wrecked, footer intact: the check passes, so it never read the data."""
    path = day_file(data, 1)
    raw = bytearray(path.read_bytes())
    footer = int.from_bytes(raw[-8:-4], "little") + 8
    raw[4 : len(raw) - footer] = bytes(len(raw) - footer - 4)
    path.write_bytes(bytes(raw))
    with pytest.raises(Exception):  # noqa: B017 - the data really is unreadable
        pq.read_table(path)

    assert check(data) == []


def test_missing_file(data: Path) -> None:
    day_file(data, 1).unlink()
    with pytest.raises(DataError, match=rf"day 1: {day_file(data, 1)}: missing$"):
        check(data)


def test_missing_test_day_file(data: Path) -> None:
    day_file(data, 2).unlink()
    with pytest.raises(DataError, match=rf"day 2: {day_file(data, 2)}: missing$"):
        check(data)


@pytest.mark.parametrize("rows", [0, 1000])
def test_file_row_count_differs_from_the_manifest(data: Path, rows: int) -> None:
    path = day_file(data, 0)
    pq.write_table(pq.read_table(path).slice(0, rows), path)
    with pytest.raises(
        DataError, match=rf"day 0: {path}: has {rows} rows, the manifest says 6000$"
    ):
        check(data)


def test_file_that_is_not_parquet(data: Path) -> None:
    day_file(data, 1).write_bytes(b"day,rows\n1,6000\n")
    with pytest.raises(DataError, match=rf"day 1: {day_file(data, 1)}: not a readable Parquet"):
        check(data)


def test_several_problems_are_named_together(data: Path) -> None:
    day_file(data, 0).unlink()
    day_file(data, 1).write_bytes(b"junk")
    with pytest.raises(DataError) as info:
        check(data)
    message = str(info.value)
    assert message.startswith(f"{data / 'manifest.json'}: day 0: {day_file(data, 0)}: missing; ")
    assert f"day 1: {day_file(data, 1)}: not a readable Parquet file" in message
    assert "\n" not in message


@pytest.mark.parametrize("test_day", [3, -1, 7])
def test_test_day_not_one_of_the_days(data: Path, test_day: int) -> None:
    manifest = edit_manifest(data, lambda m: m.update(test_day=test_day))
    with pytest.raises(
        DataError, match=rf"test day {test_day}: not one of the manifest's days \(0-2\)"
    ):
        check(data, manifest)
    # Training would otherwise take every day, the one meant to be held out included.
    with pytest.raises(DataError, match=f"test day {test_day}: no file in the manifest"):
        manifest.train_days()


def test_test_day_without_a_file(data: Path) -> None:
    """Day 2 is the test day, but the manifest lists no file for it."""

    def drop_test_file(m: dict) -> None:
        m["files"] = [f for f in m["files"] if f["day"] != 2]
        m["rows"] = 12000

    manifest = edit_manifest(data, drop_test_file)
    with pytest.raises(DataError, match=r"manifest.json: test day 2: no file$"):
        check(data, manifest)
    with pytest.raises(DataError, match="test day 2: no file in the manifest"):
        manifest.train_days()
    # Evaluation asks for the test day's files: an error now, not an empty list.
    with pytest.raises(DataError, match="day 2: no file in the manifest"):
        manifest.day_paths(str(data), [manifest.test_day])


def test_test_day_file_listed_under_a_training_day(data: Path) -> None:
    def relabel(m: dict) -> None:
        m["files"][1]["path"] = m["files"][2]["path"]

    manifest = edit_manifest(data, relabel)
    with pytest.raises(DataError, match=r"day=2/part-[0-9a-f]+\.parquet: listed 2 times"):
        check(data, manifest)
    with pytest.raises(DataError, match=r"listed under day 1 and under the held-out day 2"):
        manifest.day_paths(str(data), manifest.train_days())
    assert manifest.day_paths(str(data), [2]) == [str(day_file(data, 2))]


def test_no_training_day(data: Path) -> None:
    def only_test_day(m: dict) -> None:
        m["files"] = [f for f in m["files"] if f["day"] == 2]
        m.update(days=3, rows=6000)

    manifest = edit_manifest(data, only_test_day)
    with pytest.raises(DataError) as info:
        check(data, manifest)
    assert str(info.value) == (
        f"{data / 'manifest.json'}: day 0, 1: no file; no training day: no file outside test day 2"
    )

    # Day 2's file alone, as day 0 of a one-day dataset.
    test_file = {**read_manifest(str(data)).files[0].model_dump(), "day": 0}
    manifest = edit_manifest(data, lambda m: m.update(days=1, test_day=0, files=[test_file]))
    with pytest.raises(DataError, match="no training day: no file outside test day 0$"):
        check(data, manifest)
    assert manifest.train_days() == []
    # Evaluation needs the test day alone.
    assert check_dataset(str(data), manifest, training=False) == []


def test_evaluation_checks_the_test_day_but_not_training_days(data: Path) -> None:
    write_empty(data, 0)
    write_empty(data, 1)
    manifest = set_rows(data, {0: 0, 1: 0})
    assert check_dataset(str(data), manifest, training=False) == []
    write_empty(data, 2)
    with pytest.raises(DataError, match=r"day 2: .*: has 0 rows, the manifest says 6000$"):
        check_dataset(str(data), manifest, training=False)
    manifest = set_rows(data, {2: 0})
    with pytest.raises(DataError, match="test day 2 has no rows"):
        check_dataset(str(data), manifest, training=False)
    day_file(data, 2).unlink()
    with pytest.raises(DataError, match=r"day 2: .*: missing$"):
        check_dataset(str(data), manifest, training=False)


def test_evaluation_needs_no_training_file(data: Path) -> None:
    day_file(data, 0).unlink()
    day_file(data, 1).write_bytes(b"junk")
    manifest = read_manifest(str(data))
    assert check_dataset(str(data), manifest, training=False) == []
    with pytest.raises(DataError, match="day 0: .*: missing; day 1: .*: not a readable Parquet"):
        check_dataset(str(data), manifest)


def test_day_outside_the_manifest_days(data: Path) -> None:
    manifest = edit_manifest(data, lambda m: m["files"][0].update(day=5))
    with pytest.raises(DataError, match=r"day 5: outside the manifest's 3 days; day 0: no file"):
        check(data, manifest)


def test_manifest_rows_differ_from_its_files(data: Path) -> None:
    manifest = edit_manifest(data, lambda m: m.update(rows=17000))
    with pytest.raises(DataError, match=r"rows=17000, but its files hold 18000 rows$"):
        check(data, manifest)


def test_an_empty_training_day_is_a_warning(data: Path) -> None:
    write_empty(data, 1)
    manifest = set_rows(data, {1: 0})

    assert check(data, manifest) == [
        f"day 1 has no rows ({day_file(data, 1)}); training on the other days"
    ]
    assert manifest.train_days() == [0, 1]


def test_every_training_day_empty_is_an_error(data: Path) -> None:
    write_empty(data, 0)
    write_empty(data, 1)
    manifest = set_rows(data, {0: 0, 1: 0})
    with pytest.raises(DataError, match=r"manifest.json: every training day \(0, 1\) has no rows$"):
        check(data, manifest)


def test_an_empty_test_day_is_an_error(data: Path) -> None:
    write_empty(data, 2)
    manifest = set_rows(data, {2: 0})
    with pytest.raises(
        DataError,
        match=rf"test day 2 has no rows \({day_file(data, 2)}\); there is nothing to evaluate on$",
    ):
        check(data, manifest)


@pytest.fixture
def memory_copy(tiny_dataset: str) -> Iterator[str]:
    url = f"memory://manifest-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    fs.put(tiny_dataset, url, recursive=True)
    try:
        yield url
    finally:
        fs.rm(url, recursive=True)


def test_any_fsspec_url(memory_copy: str) -> None:
    manifest = read_manifest(memory_copy)
    assert check_dataset(memory_copy, manifest) == []
    fsspec.filesystem("memory").rm(f"{memory_copy}/{manifest.files[0].path}")
    with pytest.raises(DataError, match=r"day 0: memory://.*/day=0/part-\w+\.parquet: missing"):
        check_dataset(memory_copy, manifest)
