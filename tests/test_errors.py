"""Bad data found by a reader thread, alone or on one rank of two, as the user sees it: one
``error:`` line naming the file, row group and column (and the rank), and exit code 1."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from dlrmflow.ingest.manifest import MANIFEST_NAME, read_manifest
from dlrmflow.ingest.splits import Split, assign_splits, list_splits
from tests.conftest import tiny_run_config

BAD_COLUMN = "I5"


@pytest.fixture(scope="module")
def corrupt(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> Split:
    """The tiny dataset with float ``I5`` columns and one +inf in the first row group that
    rank 1 of two reads (so rank 0's share is clean); returns that split."""
    root = tmp_path_factory.mktemp("corrupt") / "data"
    shutil.copytree(tiny_dataset, root)
    manifest = read_manifest(str(root))
    train = tiny_run_config(str(root), root.parent / "run").train
    splits = list_splits(manifest.day_paths(str(root), manifest.train_days()))
    bad = assign_splits(
        splits,
        rank=1,
        world_size=2,
        worker=0,
        num_workers=1,
        seed=train.seed,
        epoch=0,
        shuffle=train.shuffle,
    )[0]
    for path in manifest.day_paths(str(root)):
        _float_column(path, bad.row_group if path == bad.path else None)
    listing = json.loads((root / MANIFEST_NAME).read_text())
    for field in listing["schema"]:
        if field["name"] == BAD_COLUMN:
            field["type"] = "float"
    for day_file in listing["files"]:  # rewritten: no identity recorded for them
        day_file.pop("digest", None)
        day_file.pop("bytes", None)
    (root / MANIFEST_NAME).write_text(json.dumps(listing, indent=2))
    return bad


def _float_column(path: str, infinite_in: int | None) -> None:
    """Rewrite ``path`` with ``BAD_COLUMN`` as float32, the same row groups, and an
    infinity in row group ``infinite_in``."""
    source = pq.ParquetFile(path)
    groups = []
    for i in range(source.num_row_groups):
        table = source.read_row_group(i)
        column = table.column(BAD_COLUMN).combine_chunks().cast(pa.float32())
        if i == infinite_in:
            values = column.to_numpy(zero_copy_only=False).copy()
            values[3] = np.inf
            column = pa.array(values, mask=pc.is_null(column).to_numpy(zero_copy_only=False))
        index = table.schema.get_field_index(BAD_COLUMN)
        groups.append(table.set_column(index, pa.field(BAD_COLUMN, pa.float32()), column))
    with pq.ParquetWriter(path, groups[0].schema) as writer:
        for table in groups:
            writer.write_table(table, row_group_size=table.num_rows)


def _start_train(data: str, run_dir: Path, *flags: str, **train: object) -> subprocess.Popen:
    """``dlrmflow train`` on ``data`` with the tests' small model, as a user runs it."""
    config = tiny_run_config(data, run_dir, **train)
    config_file = run_dir.parent / f"{run_dir.name}.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump()))
    return subprocess.Popen(
        [sys.executable, "-m", "dlrmflow", "train", "--config", str(config_file), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def assert_one_error_line(proc: subprocess.Popen, pattern: str) -> str:
    """The command exited 1 and its error is its one ``error:`` line, the last of stderr."""
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and re.fullmatch(pattern, lines[-1]), err[-3000:]
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]], err[-3000:]
    assert "Traceback" not in err and "_populate_queue" not in err, err[-3000:]
    return lines[-1]


def test_bad_data_in_reader_threads_is_one_line_and_exit_1(corrupt: Split, tmp_path: Path):
    data = str(Path(corrupt.path).parents[1])
    where = rf"{re.escape(corrupt.path)}, row group {corrupt.row_group}: column {BAD_COLUMN}: "
    # One and two reader threads, at once (test_reader.py repeats the exit-134 path).
    runs = [
        _start_train(data, tmp_path / f"run-{workers}", num_workers=workers) for workers in (1, 2)
    ]
    for run in runs:
        assert_one_error_line(run, rf"error: {where}.*infinite.*")


def test_bad_data_on_one_of_two_ranks_names_that_rank_and_its_error(corrupt: Split, tmp_path: Path):
    data = str(Path(corrupt.path).parents[1])
    job = _start_train(data, tmp_path / "run", "--nproc", "2", num_workers=1, max_steps=20)
    where = rf"{re.escape(corrupt.path)}, row group {corrupt.row_group}: column {BAD_COLUMN}: "
    # Rank 0 loses its connection to rank 1 when rank 1 exits: a consequence, not the cause.
    line = assert_one_error_line(
        job, rf"error: training with 2 ranks failed: rank 1: DataError: {where}.*infinite.*"
    )
    assert "rank 0" not in line and "onnection" not in line
