"""MovieLens-100k as a team's logs (``dlrmflow bench movielens``): prepared by week from the
recbole wheel's package data, registered under its schema; skipped where the wheel is absent."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from dlrmflow.bench.movielens import (
    SCHEMA,
    movielens_files,
    movielens_section,
    popularity_auc,
    prepare_movielens,
)
from dlrmflow.ingest.register import register_dataset

SOURCE = movielens_files()
pytestmark = pytest.mark.skipif(
    SOURCE is None,
    reason="MovieLens-100k comes from the recbole wheel (pip install --no-deps recbole)",
)


def test_movielens_by_week_registers_as_a_teams_logs(tmp_path):
    assert SOURCE is not None
    weeks = prepare_movielens(SOURCE, tmp_path / "data")
    assert weeks == 31  # 1997-09-20 to 1998-04-22
    manifest = register_dataset(str(tmp_path / "data"), SCHEMA)
    assert manifest.rows == 100_000 and manifest.days == weeks
    assert manifest.positive_rate == pytest.approx(0.55375)  # ratings of 4 or 5
    assert manifest.cardinalities["user_id"] in range(900, 990)  # 943 users, estimated
    assert manifest.cardinalities["genres"] in range(17, 22)  # 19 genres with "unknown"
    first = pq.read_table(tmp_path / "data" / "day=0").to_pylist()[0]
    assert set(first) == {c for c in SCHEMA.columns}
    assert isinstance(first["genres"], list) and first["click"] in (0, 1)
    baseline = popularity_auc(tmp_path / "data", weeks)
    assert len(baseline) == weeks - 1 and all(0.55 < a < 0.85 for a in baseline if a)


def test_the_section_says_when_it_did_not_run():
    assert "Not run: no wheel" in movielens_section({"skipped": "no wheel"})
