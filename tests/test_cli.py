"""The ``dlrmflow`` command as a user runs it (in-process through typer's runner)."""

import json

import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from dlrmflow.cli import app, main
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.train.run.checkpoint import load_checkpoint

runner = CliRunner()


def test_every_command_has_help():
    for args in (
        [],
        ["generate"],
        ["convert"],
        ["train"],
        ["line"],
        ["evaluate"],
        ["demo"],
        ["config"],
        ["bench"],
        ["bench", "ingest"],
        ["bench", "kernels"],
        ["bench", "train"],
        ["bench", "readers"],
        ["bench", "ingest-days"],
        ["bench", "precision"],
        ["deploy"],
        ["bench", "report"],
        ["plan"],
        ["export"],
        ["readers", "serve"],
        ["serve"],
        ["stats"],
    ):
        result = runner.invoke(app, [*args, "--help"])
        assert result.exit_code == 0, result.output
        assert "Usage" in result.output


def test_generate_train_evaluate(tmp_path):
    data = str(tmp_path / "data")
    result = runner.invoke(
        app,
        [
            "generate",
            "--out", data,
            "--days", "2",
            "--rows-per-day", "3000",
            "--seed", "3",
            "--set", "data.row_group_size=1000",
            "--set", "data.cardinality_scale=0.0005",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["rows"] == 6000 and info["test_day"] == 1
    day0 = read_manifest(data).day_paths(data, [0])[0]
    assert pq.ParquetFile(day0).metadata.num_row_groups == 3

    run_dir = str(tmp_path / "run")
    sets = ["--set", "train.batch_size=500", "--set", "train.num_workers=0"]
    result = runner.invoke(app, ["train", "--run-dir", run_dir, "--data", data, *sets])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["steps"] == 6

    result = runner.invoke(app, ["evaluate", "--run-dir", run_dir])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["rows"] == 3000

    # The whole model in one safetensors file, by parameter name, with its config.
    out = tmp_path / "model.safetensors"
    result = runner.invoke(app, ["export", "--run-dir", run_dir, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["step"] == 6
    with safe_open(str(out), framework="pt") as f:
        names = set(f.keys())
        assert json.loads(f.metadata()["spec"])["sparse"][2]["name"] == "C3"
        c3 = f.get_tensor("embeddings.C3")
    assert {f"embeddings.C{i}" for i in range(1, 27)} <= names
    assert "dense_arch.top.0.weight" in names
    trained = load_checkpoint(run_dir).model.embeddings.table("C3")
    assert torch.equal(c3, trained)


def test_config_errors_are_one_line_and_name_the_key(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["dlrmflow", "config", "--set", "train.batchsize=3"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "train.batchsize: unknown key" in err
    assert "Traceback" not in err


def test_missing_dataset_is_a_clear_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(
        "sys.argv",
        ["dlrmflow", "train", "--data", str(tmp_path / "nope"), "--run-dir", str(tmp_path)],
    )
    try:
        main()
    except SystemExit as e:
        assert e.code == 1
    assert "no manifest" in capsys.readouterr().err


def test_convert_the_real_sample_then_train_on_it(criteo_sample, tmp_path):
    out = str(tmp_path / "criteo")
    days = [tmp_path / "day0.tsv", tmp_path / "day1.tsv"]
    for day in days:
        day.write_bytes(criteo_sample.read_bytes())
    result = runner.invoke(
        app, ["convert", "--input", str(days[0]), "--input", str(days[1]), "--out", out]
    )
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info == {
        "url": out, "rows": 400, "days": 2, "bad_lines": 0, "written_days": [0, 1],
        "quarantine": None,
    }  # fmt: skip
    run_dir = str(tmp_path / "run")
    sets = ["--set", "train.batch_size=64", "--set", "features.max_rows_per_table=500"]
    result = runner.invoke(app, ["train", "--run-dir", run_dir, "--data", out, *sets])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["rows"] == 200


def test_convert_over_the_bad_line_threshold_fails_naming_the_file(
    criteo_sample, tmp_path, capsys, monkeypatch
):
    bad = tmp_path / "day0.tsv"
    bad.write_text(criteo_sample.read_text() + "1\tnot-a-number\n")
    monkeypatch.setattr(
        "sys.argv", ["dlrmflow", "convert", "--input", str(bad), "--out", str(tmp_path / "o")]
    )
    try:
        main()
    except SystemExit as e:
        assert e.code == 1
    err = capsys.readouterr().err
    assert "day0.tsv" in err and "quarantine" in err


def test_plan_prints_each_ranks_shards_and_uses_the_datasets_stats(tmp_path, capsys, monkeypatch):
    """``dlrmflow plan``: a block per rank by default, the plan as JSON with --json; with
    the dataset's stats.json and tables on SSD, each SSD shard's expected cache hit rate."""
    from dlrmflow.train.model.plan import ShardingPlan

    data = str(tmp_path / "data")
    sets = ["--set", "data.row_group_size=1000", "--set", "data.cardinality_scale=0.0005"]
    result = runner.invoke(
        app, ["generate", "--out", data, "--days", "2", "--rows-per-day", "2000", *sets]
    )
    assert result.exit_code == 0, result.output
    plan_args = ["plan", "--set", f"data.url={data}", "--world-size", "2"]

    result = runner.invoke(app, plan_args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("26 tables on 2 ranks (1 host of 2): ")
    assert lines[1].startswith("statistics: defaults")
    assert [line.split(":")[0] for line in lines if line.startswith("rank ")] == [
        "rank 0",
        "rank 1",
    ]
    result = runner.invoke(app, [*plan_args, "--json"])
    assert result.exit_code == 0, result.output
    plan = ShardingPlan.from_dict(json.loads(result.output))
    plan.validate()
    assert plan.estimates["statistics"] == "defaults"

    assert runner.invoke(app, ["stats", "--data", data]).exit_code == 0
    tiered = [*plan_args, "--device-memory", "2e6", "--ssd-memory", "1e9"]
    result = runner.invoke(app, [*tiered, "--cache-load-factor", "0.05"])
    assert result.exit_code == 0, result.output
    assert f"statistics: {data}/stats.json" in result.output
    shards = [line.split() for line in result.output.splitlines() if line.startswith("  C")]
    on_ssd = [words for words in shards if words[4] == "ssd"]
    assert on_ssd
    result = runner.invoke(app, [*tiered, "--cache-load-factor", "0.05", "--json"])
    estimates = json.loads(result.output)["estimates"]
    assert estimates["statistics"] == f"{data}/stats.json"
    for words in on_ssd:
        rate = estimates["tables"][words[0]]["cache_hit_rate"]
        assert words[-1] == f"{rate:.1%}" and rate > 0.05  # skewed IDs: above the cache's share

    monkeypatch.setattr("sys.argv", ["dlrmflow", *tiered, "--cache-load-factor", "2"])
    with pytest.raises(SystemExit):
        main()
    err = capsys.readouterr().err
    assert err == "error: cache_load_factor must be in [0, 1], got 2.0\n"


def test_generate_one_day_more_writes_only_that_day(tmp_path):
    data = str(tmp_path / "data")
    base = ["generate", "--out", data, "--rows-per-day", "1000", "--drift", "0.1"]
    small = ["--set", "data.row_group_size=500", "--set", "data.cardinality_scale=0.0005"]
    first = runner.invoke(app, [*base, "--days", "2", *small])
    assert first.exit_code == 0, first.output
    assert json.loads(first.output)["written_days"] == [0, 1]
    more = runner.invoke(app, [*base, "--days", "3", *small])
    assert more.exit_code == 0, more.output
    info = json.loads(more.output)
    assert (info["written_days"], info["test_day"], info["rows"]) == ([2], 2, 3000)
    again = runner.invoke(app, [*base, "--days", "3", *small])
    assert json.loads(again.output)["written_days"] == []
    assert read_manifest(data).generator["drift"] == 0.1
