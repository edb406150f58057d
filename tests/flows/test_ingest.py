"""The ingest flow: its cache keys, the cache skip on a real server, the statistics artifact."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from prefect.states import Failed

from dlrmflow.config import DataConfig, build_config
from dlrmflow.flows.artifacts import STATS_KEY
from dlrmflow.flows.ingest import (
    convert_cache_key,
    generate_cache_key,
    ingest_flow,
    stats_cache_key,
)
from dlrmflow.flows.policies import retry_unless_bad_input
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.synthetic import generate_dataset
from tests.flows.records import run_records

SMALL = {"days": 2, "rows_per_day": 800, "row_group_size": 400, "cardinality_scale": 0.0005}


def test_generate_cache_key_follows_every_generation_parameter():
    base = DataConfig(url="/data/a", **SMALL)
    key = generate_cache_key(None, {"data": base})
    assert key == generate_cache_key(None, {"data": DataConfig(url="/data/a", **SMALL)})
    for change in ({"seed": 1}, {"rows_per_day": 801}, {"url": "/data/b"}, {"multi_hot": True}):
        assert generate_cache_key(None, {"data": base.model_copy(update=change)}) != key


def test_convert_cache_key_follows_the_day_raw_file_fingerprint_and_options(tmp_path):
    raw = tmp_path / "day0.tsv"
    raw.write_text("0\t1\n")
    params = {
        "raw": str(raw),
        "day": 0,
        "out": str(tmp_path / "out"),
        "row_group_size": 100,
        "max_bad_fraction": 0.001,
    }
    key = convert_cache_key(None, params)
    assert convert_cache_key(None, dict(params)) == key

    stat = raw.stat()
    os.utime(raw, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    touched = convert_cache_key(None, params)
    assert touched != key

    raw.write_text("0\t1\t2\n")  # new size; keep the touched mtime so only the size differs
    os.utime(raw, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert convert_cache_key(None, params) not in (key, touched)

    for change in ({"row_group_size": 101}, {"day": 1}, {"max_bad_fraction": 0.01}):
        assert convert_cache_key(None, {**params, **change}) != convert_cache_key(None, params)
    with pytest.raises(FileNotFoundError, match="nope.tsv: input file not found"):
        convert_cache_key(None, {**params, "raw": str(tmp_path / "nope.tsv")})


def test_stats_cache_key_follows_the_day_file(tmp_path):
    url = str(tmp_path / "data")
    manifest = generate_dataset(DataConfig(url=url, **SMALL))
    day = tmp_path / "data" / manifest.files[1].path
    params = {"path": str(day), "multi_hot": False}
    key = stats_cache_key(None, params)
    assert stats_cache_key(None, dict(params)) == key
    assert stats_cache_key(None, {**params, "multi_hot": True}) != key
    other = {**params, "path": str(tmp_path / "data" / manifest.files[0].path)}
    assert stats_cache_key(None, other) != key
    stat = day.stat()
    os.utime(day, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert stats_cache_key(None, params) != key


def test_retries_skip_bad_data_and_configuration():
    assert not retry_unless_bad_input(None, None, Failed(data=ValueError("bad row group")))
    assert not retry_unless_bad_input(None, None, Failed(data=FileNotFoundError("no manifest")))
    assert retry_unless_bad_input(None, None, Failed(data=OSError("connection reset")))
    assert retry_unless_bad_input(None, None, Failed(data=RuntimeError("worker died")))


def _states(records, *names):
    return [sorted(t.state_name for t in records.tasks(name)) for name in names]


def test_generate_is_skipped_while_parameters_and_output_are_unchanged(prefect_api, tmp_path):
    url = tmp_path / "data"
    config = build_config({"data": {"url": str(url), **SMALL}})

    first = ingest_flow(config, return_state=True)
    records = run_records(first.state_details.flow_run_id)
    assert _states(records, "generate", "stats") == [["Completed"], ["Completed"] * 2]
    table = json.loads(records.artifact(STATS_KEY).data)
    assert table[0] == {**table[0], "column": "label", "rows": 1600}
    assert [row["column"] for row in table[1:3]] == ["I1", "I2"]
    written = {p: p.stat().st_mtime_ns for p in url.rglob("*.parquet")}

    second = ingest_flow(config, return_state=True)
    records = run_records(second.state_details.flow_run_id)
    assert _states(records, "generate", "stats") == [["Cached"], ["Cached"] * 2]
    assert {p: p.stat().st_mtime_ns for p in url.rglob("*.parquet")} == written
    assert second.result() == first.result()
    records.artifact(STATS_KEY)  # published on every run, cached or not

    (url / "manifest.json").unlink()  # the output is gone: the cache no longer stands for it
    third = ingest_flow(config, return_state=True)
    records = run_records(third.state_details.flow_run_id)
    assert _states(records, "generate", "stats")[0] == ["Completed"]
    assert (url / "manifest.json").is_file()

    # Another configuration generated there since: the cached result describes other data.
    generate_dataset(config.data.model_copy(update={"seed": 5}))
    fourth = ingest_flow(config, return_state=True)
    records = run_records(fourth.state_details.flow_run_id)
    assert _states(records, "generate")[0] == ["Completed"]
    assert {p: p.stat().st_size for p in url.rglob("*.parquet")}.keys() == written.keys()


def test_convert_is_skipped_until_a_raw_file_changes(prefect_api, criteo_sample, tmp_path):
    raw = [str(tmp_path / f"day{d}.tsv") for d in range(2)]
    for path in raw:
        shutil.copy(criteo_sample, path)
    config = build_config({"data": {"url": str(tmp_path / "criteo"), "row_group_size": 64}})

    first = ingest_flow(config, raw, return_state=True)
    records = run_records(first.state_details.flow_run_id)
    assert _states(records, "convert", "stats", "manifest") == [
        ["Completed"] * 2,
        ["Completed"] * 2,
        ["Completed"],
    ]
    summary = first.result()
    assert summary["rows"] == 400 and summary["bad_lines"] == 0
    assert summary["bayes_auc"] is None and summary["source"] == "criteo"

    second = ingest_flow(config, raw, return_state=True)
    records = run_records(second.state_details.flow_run_id)
    assert _states(records, "convert", "stats") == [["Cached"] * 2, ["Cached"] * 2]
    assert second.result() == summary

    stat = os.stat(raw[1])
    os.utime(raw[1], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    third = ingest_flow(config, raw, return_state=True)
    records = run_records(third.state_details.flow_run_id)
    assert _states(records, "convert") == [["Cached", "Completed"]]

    day0 = tmp_path / "criteo" / read_manifest(str(tmp_path / "criteo")).files[0].path
    day0.unlink()  # output gone: refresh
    fourth = ingest_flow(config, raw, return_state=True)
    records = run_records(fourth.state_details.flow_run_id)
    assert _states(records, "convert") == [["Cached", "Completed"]]
    assert day0.is_file()
