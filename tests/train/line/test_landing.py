"""A line fed by a landing folder: each landed file, once converted, is its day for good,
whatever becomes of the file (archived, touched); a file that would renumber the days, a
changed converted file and an empty one are refused in one line naming the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dlrmflow.ingest.criteo.landing import LandingError
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.train.line.line import history, train_line, versions
from tests.conftest import run_cli, tiny_run_config

LINES_A_DAY = 40


def _land(landing: Path, sample: Path, name: str, part: int) -> Path:
    """``name`` lands: the sample's ``part``-th 40 lines."""
    lines = sample.read_text().splitlines(keepends=True)
    landing.mkdir(exist_ok=True)
    path = landing / name
    path.write_text("".join(lines[part * LINES_A_DAY : (part + 1) * LINES_A_DAY]))
    return path


def _start(tmp_path: Path, landing: Path) -> Path:
    """The line's configuration, as a file for ``dlrmflow line --config``."""
    config = tiny_run_config(str(tmp_path / "data"), tmp_path / "unused", batch_size=16)
    config.data.landing = str(landing)
    path = tmp_path / "line.json"
    path.write_text(config.model_dump_json())
    return path


def _day_files(data: Path) -> dict[str, tuple[int, int]]:
    """Each day file's (inode, modification time): the same only if never rewritten."""
    return {
        str(p.relative_to(data)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(data.glob("day=*/*.parquet"))
    }


def test_a_late_file_is_refused_naming_it_and_never_renumbers_the_days(
    tmp_path: Path, criteo_sample: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    landing, line, data = tmp_path / "landing", tmp_path / "line", tmp_path / "data"
    for part, name in enumerate(["day_0.tsv", "day_1.tsv", "day_3.tsv"]):
        _land(landing, criteo_sample, name, part)
    start = ["line", "--line", str(line), "--config", str(_start(tmp_path, landing))]
    code, out, err = run_cli(monkeypatch, capsys, *start)
    assert code == 0, err
    assert [v["day"] for v in json.loads(out)["trained"]] == [0, 1, 2]
    files, records = _day_files(data), history(line)

    late = _land(landing, criteo_sample, "day_2.tsv", 3)
    code, out, err = run_cli(monkeypatch, capsys, "line", "--line", str(line))
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: {late}: landed after day_3.tsv (day 2) was converted")
    assert err[0].endswith("rename it to sort after day_3.tsv to make it day 3")
    assert _day_files(data) == files and history(line) == records  # nothing scored, nothing moved
    assert [v.day for v in versions(line)] == [0, 1, 2]

    late.rename(landing / "day_4.tsv")  # taken as the next day, as the message says
    [fourth] = train_line(line).made
    assert (fourth.day, fourth.days) == (3, [0, 1, 2, 3])
    assert [r["day"] for r in history(line)] == [1, 2, 3]
    assert {k: files[k] for k in files} == {k: _day_files(data)[k] for k in files}


def test_archived_or_touched_files_keep_their_days_and_the_next_day_trains(
    tmp_path: Path, criteo_sample: Path
) -> None:
    landing, line, data = tmp_path / "landing", tmp_path / "line", tmp_path / "data"
    for part in range(2):
        _land(landing, criteo_sample, f"day_{part}.tsv", part)
    config = tiny_run_config(str(data), tmp_path / "unused", batch_size=16)
    config.data.landing = str(landing)
    train_line(line, config)
    files = _day_files(data)

    (landing / "day_0.tsv").unlink()  # archived once converted
    os.utime(landing / "day_1.tsv", ns=(1, 1))  # touched: the same bytes
    _land(landing, criteo_sample, "day_2.tsv", 2)
    [third] = train_line(line).made
    assert (third.day, third.days) == (2, [0, 1, 2])
    assert {k: _day_files(data)[k] for k in files} == files  # days 0-1 never rewritten
    landed = read_manifest(str(data)).generator["landed"]
    assert [Path(r["url"]).name for r in landed] == ["day_0.tsv", "day_1.tsv", "day_2.tsv"]

    for path in landing.iterdir():  # every landed file archived: no new day, no error
        path.unlink()
    assert train_line(line).made == []


def test_a_changed_or_empty_landed_file_is_refused_and_the_line_goes_on(
    tmp_path: Path, criteo_sample: Path
) -> None:
    landing, line, data = tmp_path / "landing", tmp_path / "line", tmp_path / "data"
    first = _land(landing, criteo_sample, "day_0.tsv", 0)
    config = tiny_run_config(str(data), tmp_path / "unused", batch_size=16)
    config.data.landing = str(landing)
    train_line(line, config)
    manifest = read_manifest(str(data))

    saved = first.read_bytes()
    first.write_bytes(saved + saved)
    with pytest.raises(LandingError, match="day_0.tsv: its bytes changed since it was converted"):
        train_line(line)
    first.write_bytes(saved)  # put back as it was

    empty = landing / "day_1.tsv"
    empty.write_bytes(b"")
    with pytest.raises(LandingError, match="day_1.tsv: an empty file is not a day"):
        train_line(line)
    assert read_manifest(str(data)).files == manifest.files
    empty.unlink()
    _land(landing, criteo_sample, "day_2.tsv", 1)
    [second] = train_line(line).made
    assert (second.day, [r["day"] for r in history(line)]) == (1, [1])
