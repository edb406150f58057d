"""A team's own Parquet on an object store: registered, checked, trained at two ranks,
evaluated and scored where it lies, on a real S3 server (moto's, tests/s3_server.py),
through fsspec's s3fs and botocore's standard settings. Runs and scores stay on local disk."""

from __future__ import annotations

import os
import subprocess
import sys

import fsspec
import pyarrow.parquet as pq
import pytest

from dlrmflow.config import apply_overrides, build_config
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.manifest import check_dataset, read_manifest
from dlrmflow.ingest.register import register_dataset
from dlrmflow.score.score import score_dataset
from dlrmflow.train.launch.job import launch_training
from dlrmflow.train.run.evaluate import evaluate
from tests.ingest.own_data import SCHEMA, SCHEMA_YAML, write_own_days

DAYS, ROWS = 3, 2000


@pytest.fixture(scope="module")
def own_s3(s3_bucket: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The own-data dataset written locally, uploaded to ``s3://BUCKET/own`` and
    registered there."""
    local = tmp_path_factory.mktemp("own-s3") / "data"
    write_own_days(local, days=DAYS, rows=ROWS)
    url = f"{s3_bucket}/own"
    fs, path = fsspec.core.url_to_fs(url)
    fs.put(f"{local}/", path, recursive=True)
    register_dataset(url, SCHEMA)
    return url


def test_own_data_on_s3_registers_trains_at_two_ranks_evaluates_and_scores(own_s3, tmp_path):
    fs, path = fsspec.core.url_to_fs(own_s3)
    assert fs.isfile(f"{path}/manifest.json") and fs.isfile(f"{path}/stats.json")
    manifest = read_manifest(own_s3)
    assert manifest.rows == DAYS * ROWS and manifest.test_day == DAYS - 1
    assert check_dataset(own_s3, manifest) == []

    config = build_config(
        {
            "run_dir": str(tmp_path / "run"),
            "data": {"url": own_s3},
            "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]},
            "train": {"batch_size": 256, "num_workers": 0, "log_every": 20, "epochs": 1},
        }
    )
    config = apply_overrides(config, {"distributed.nproc": 2})
    result = launch_training(config)
    assert result is not None and result.rows == (DAYS - 1) * ROWS
    metrics = evaluate(tmp_path / "run")
    assert metrics["auc"] > 0.6

    scored = score_dataset(
        str(tmp_path / "run"), own_s3, str(tmp_path / "scores"), days=str(DAYS - 1)
    )
    assert scored["rows"] == ROWS
    assert pq.read_table(tmp_path / "scores").num_rows == ROWS


def test_a_rewritten_object_on_s3_is_caught_naming_it(own_s3, tmp_path):
    manifest = read_manifest(own_s3)
    fs, path = fsspec.core.url_to_fs(own_s3)
    victim = manifest.files[0].path
    original = fs.cat_file(f"{path}/{victim}")
    local = tmp_path / "part.parquet"
    table = pq.read_table(f"{path}/{victim}", filesystem=fs)
    # The same rows in other row groups: a rewrite the row count alone would not show.
    pq.write_table(table, local, row_group_size=300)
    fs.put_file(str(local), f"{path}/{victim}")
    try:
        with pytest.raises(DataError, match=rf"{own_s3}/{victim}: rewritten or replaced"):
            check_dataset(own_s3, manifest)
    finally:
        fs.pipe_file(f"{path}/{victim}", original)
    assert check_dataset(own_s3, manifest) == []


def test_missing_credentials_fail_in_one_line(tmp_path):
    """botocore's own failures (here: no credentials anywhere) are one line and exit 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {
        "HOME": str(tmp_path),  # no ~/.aws
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
    }
    schema = tmp_path / "schema.yaml"
    schema.write_text(SCHEMA_YAML)
    done = subprocess.run(
        [sys.executable, "-m", "dlrmflow", "register", "--data", "s3://bucket/own",
         "--schema", str(schema)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: object store: Unable to locate credentials (set AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
    ]
