"""A model line over a team's own Parquet on an object store (moto's S3 server,
tests/s3_server.py): it reads its days from the bucket, and a day partition uploaded later
is registered there and trained as the next version. The line itself stays on local disk."""

from __future__ import annotations

from pathlib import Path

import fsspec

from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.register import register_dataset
from dlrmflow.train.line.line import history, train_line
from tests.conftest import tiny_run_config
from tests.ingest.own_data import SCHEMA, write_own_days

ROWS = 300


def test_a_line_reads_its_days_from_s3_and_trains_a_day_uploaded_later(
    s3_bucket: str, tmp_path: Path
) -> None:
    local = tmp_path / "data"
    write_own_days(local, days=4, rows=ROWS)
    url = f"{s3_bucket}/own"
    fs, root = fsspec.core.url_to_fs(url)
    for day in range(3):
        fs.put(f"{local}/day={day}/", f"{root}/day={day}", recursive=True)
    register_dataset(url, SCHEMA)

    config = tiny_run_config(url, tmp_path / "unused", batch_size=100)
    trained = train_line(tmp_path / "line", config).made
    assert [(v.number, v.day, v.rows) for v in trained] == [
        (0, 0, ROWS),
        (1, 1, 2 * ROWS),
        (2, 2, 3 * ROWS),
    ]
    assert [r["day"] for r in history(tmp_path / "line")] == [1, 2]

    fs.put(f"{local}/day=3/", f"{root}/day=3", recursive=True)  # the next day lands
    [fourth] = train_line(tmp_path / "line").made
    assert (fourth.number, fourth.day, fourth.rows) == (3, 3, 4 * ROWS)
    assert {f.day for f in read_manifest(url).files} == {0, 1, 2, 3}
    assert train_line(tmp_path / "line").made == []
