"""``train_line`` is the one driver of a line, whoever runs its steps: it lands what
arrived, then runs a day step for each new day in day order (through ``through``, at most
``max_days``), and reports what it did. A step runner here records the calls and trains
nothing, so only the sequence around the steps is under test (the ``line`` command's and
the recurring flow's tests run it with the real steps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrmflow.config import DataConfig
from dlrmflow.ingest.register import register_dataset
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.line.line import Line, LineError, LineSteps, Version, train_line
from tests.conftest import TINY_DATA, tiny_run_config
from tests.ingest.own_data import SCHEMA, write_own_dataset
from tests.ingest.test_registered_days import land_day


class Recorded(LineSteps):
    """Lands as the plain steps do, records each call, and trains nothing: the day step
    returns a version that is never written, so the line's days stay new."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def land(self, line: Line) -> list[int]:
        self.calls.append("land")
        return super().land(line)

    def day(self, line: Line, day: int) -> Version:
        self.calls.append(f"day {day}")
        return Version(day, day, None, [day], 0, 0, 0.0, "", [], None)


def test_the_driver_lands_then_runs_each_new_day_in_order(tmp_path: Path) -> None:
    data = write_own_dataset(tmp_path / "data", days=2, rows=100, partition="dt")
    register_dataset(str(data), SCHEMA)
    line = tmp_path / "line"
    steps = Recorded()
    config = tiny_run_config(str(data), tmp_path / "unused")
    run = train_line(line, config, max_days=1, steps=steps)
    assert steps.calls == ["land", "day 0"]
    assert ([v.day for v in run.made], run.left, run.landed) == ([0], [1], [])
    assert (run.dir, run.judged, run.plot) == (line, [], None)
    assert run.config.run_dir == str(line / "run")  # the line's own run directory

    land_day(data, "dt=2026-11-03", seed=5, rows=100)
    steps = Recorded()
    run = train_line(line, steps=steps, through=1)
    assert steps.calls == ["land", "day 0", "day 1"]  # the landed day 2 waits: --through
    assert (run.landed, run.left) == ([2], [])


def test_a_line_that_lands_nothing_skips_the_land_step(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    generate_dataset(DataConfig(url=data, **{**TINY_DATA, "days": 2, "rows_per_day": 100}))
    steps = Recorded()
    run = train_line(tmp_path / "line", tiny_run_config(data, tmp_path / "x"), steps=steps)
    assert steps.calls == ["day 0", "day 1"] and run.left == [] and run.landed == []


def test_max_days_below_one_is_refused_before_the_line_starts(tmp_path: Path) -> None:
    config = tiny_run_config(str(tmp_path / "data"), tmp_path / "x")
    with pytest.raises(LineError, match=r"^max_days must be >= 1 \(got 0\)$"):
        train_line(tmp_path / "line", config, max_days=0)
    assert not (tmp_path / "line").exists()
