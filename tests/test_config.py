import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dlrmflow.config import (
    RESERVED_ENV,
    ConfigError,
    RunConfig,
    Source,
    apply_overrides,
    env_key,
    given_keys,
    load_config,
    resolve_config,
)


def test_defaults_are_valid_and_demo_sized():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    # The default demo must train on at least 1M rows: every day but the last.
    assert (cfg.data.days - 1) * cfg.data.rows_per_day >= 1_000_000


@pytest.mark.parametrize("suffix", [".yaml", ".json", ".toml"])
def test_file_then_overrides(tmp_path, suffix):
    path = tmp_path / f"run{suffix}"
    if suffix == ".yaml":
        path.write_text("train:\n  lr: 0.3\n  batch_size: 64\nmodel:\n  arch: dcnv2\n")
    elif suffix == ".json":
        path.write_text(
            json.dumps({"train": {"lr": 0.3, "batch_size": 64}, "model": {"arch": "dcnv2"}})
        )
    else:
        path.write_text('[train]\nlr = 0.3\nbatch_size = 64\n[model]\narch = "dcnv2"\n')
    cfg = load_config(path, ["train.batch_size=128", "model.top_mlp=[8, 4]"])
    assert cfg.train.lr == 0.3
    assert cfg.train.batch_size == 128
    assert cfg.model.arch == "dcnv2"
    assert cfg.model.top_mlp == [8, 4]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.lrr=1", "train.lrr: unknown key"),
        ("nosuch.key=1", "nosuch: unknown key"),
        ("train.lr=-1", "train.lr: Input should be greater than 0"),
        ("train.optimizer=adamw", "train.optimizer"),
        ("model.embedding_dim=8", "bottom_mlp must end in embedding_dim=8"),
        ("train.lr", "expected KEY=VALUE"),
        # Non-finite numbers, booleans for numbers and empty MLPs never reach training.
        ("train.lr=inf", "train.lr: Input should be a finite number"),
        ("train.lr=.inf", "train.lr: Input should be a finite number"),
        ("train.embedding_lr=.nan", "train.embedding_lr"),
        ("distributed.timeout_s=1e999", "distributed.timeout_s: Input should be a finite"),
        ("train.lr=0", "train.lr: Input should be greater than 0"),
        ("train.batch_size=true", "train.batch_size: .*not a boolean"),
        ("train.lr=false", "train.lr: .*not a boolean"),
        ("train.batch_size=2.5", "train.batch_size: .*integer"),
        ("model.top_mlp=[]", "model.top_mlp: List should have at least 1 item"),
        ("model.bottom_mlp=[]", "model.bottom_mlp: List should have at least 1 item"),
        ("model.top_mlp=[true]", "model.top_mlp.0: .*not a boolean"),
        ("model.top_mlp=[0]", "model.top_mlp.0: Input should be greater than or equal to 1"),
    ],
)
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        load_config(None, [override])


def test_numbers_written_as_text_still_read_as_numbers():
    # YAML reads 1e-3 (no dot) as a string; it is still the number a user meant.
    assert load_config(None, ["train.lr=1e-3"]).train.lr == 0.001


def test_bad_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.ini"
    bad.write_text("x")
    with pytest.raises(ConfigError, match="bad.ini: unknown config format"):
        load_config(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [1,\n")
    with pytest.raises(ConfigError, match="broken.yaml: cannot parse"):
        load_config(broken)


def test_apply_overrides_revalidates():
    cfg = apply_overrides(load_config(), {"train.lr": 0.5, "data.days": None})
    assert cfg.train.lr == 0.5
    assert cfg.data.days == load_config().data.days
    with pytest.raises(ConfigError, match="data.days"):
        apply_overrides(cfg, {"data.days": 1})


# Configuration from the environment: DLRMFLOW_SECTION__KEY=value.


def test_environment_variables_set_keys(monkeypatch):
    monkeypatch.setenv("DLRMFLOW_TRAIN__LR", "0.1")
    monkeypatch.setenv("DLRMFLOW_RUN_DIR", "runs/x")
    monkeypatch.setenv("DLRMFLOW_MODEL__TOP_MLP", "[64,32]")
    monkeypatch.setenv("DLRMFLOW_DISTRIBUTED__READERS", "[a:1, b:2]")
    monkeypatch.setenv("DLRMFLOW_TRAIN__MAX_STEPS", "~")
    cfg = load_config()
    assert cfg.train.lr == 0.1
    assert cfg.run_dir == "runs/x"
    assert cfg.model.top_mlp == [64, 32]
    assert cfg.distributed.readers == ["a:1", "b:2"]
    assert cfg.train.max_steps is None
    # A mapping instead of os.environ, or none at all.
    assert load_config(env={"DLRMFLOW_TRAIN__BATCH_SIZE": "7"}).train.batch_size == 7
    assert load_config(env=False).train.lr == RunConfig().train.lr


def test_precedence_file_environment_set_flag(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 0.3\n  batch_size: 64\n  epochs: 3\n  seed: 5\n")
    env = {
        "DLRMFLOW_TRAIN__BATCH_SIZE": "128",
        "DLRMFLOW_TRAIN__EPOCHS": "4",
        "DLRMFLOW_TRAIN__SEED": "6",
    }
    resolved = resolve_config(
        path, ["train.epochs=5", "train.seed=7"], {"train.seed": 8, "run_dir": None}, env=env
    )
    cfg = resolved.config
    assert (cfg.train.lr, cfg.train.batch_size, cfg.train.epochs, cfg.train.seed) == (
        0.3,
        128,
        5,
        8,
    )
    assert {key: str(source) for key, source in resolved.sources.items()} == {
        "train.batch_size": "environment DLRMFLOW_TRAIN__BATCH_SIZE",
        "train.epochs": "--set",
        "train.lr": f"file {path}",
        "train.seed": "flag",
    }
    # A whole section from the environment replaces the file's; its keys still win.
    env = {"DLRMFLOW_TRAIN": "{lr: 0.2, epochs: 2}", "DLRMFLOW_TRAIN__EPOCHS": "9"}
    resolved = resolve_config(path, env=env)
    assert (resolved.config.train.lr, resolved.config.train.epochs) == (0.2, 9)
    assert resolved.config.train.batch_size == RunConfig().train.batch_size
    assert {key: str(source) for key, source in resolved.sources.items()} == {
        "train.lr": "environment DLRMFLOW_TRAIN",
        "train.epochs": "environment DLRMFLOW_TRAIN__EPOCHS",
    }


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        (
            "DLRMFLOW_TRAIN__LR",
            "-1",
            "environment variable DLRMFLOW_TRAIN__LR: train.lr: Input should be greater than 0 "
            "(got -1)",
        ),
        ("DLRMFLOW_TRAIN__BATCH_SIZE", "true", "DLRMFLOW_TRAIN__BATCH_SIZE: train.batch_size: "),
        ("DLRMFLOW_MODEL__TOP_MLP", "[0]", "DLRMFLOW_MODEL__TOP_MLP: model.top_mlp.0: "),
        ("DLRMFLOW_TRAIN__LR", "[1,", "environment variable DLRMFLOW_TRAIN__LR: cannot parse"),
        ("DLRMFLOW_TRAIN", "0.1", "DLRMFLOW_TRAIN: train: Input should be a valid dictionary"),
    ],
)
def test_bad_environment_values_name_the_variable_and_key(name, value, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(env={name: value})


def test_bad_environment_value_is_one_line_from_the_cli(capsys, monkeypatch):
    from dlrmflow.cli import main

    monkeypatch.setenv("DLRMFLOW_TRAIN__LR", "-1")
    monkeypatch.setattr("sys.argv", ["dlrmflow", "config"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err == (
        "error: invalid configuration: environment variable DLRMFLOW_TRAIN__LR: train.lr: "
        "Input should be greater than 0 (got -1)\n"
    )


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("DLRMFLOW_TRAIN__LRR", "train.lrr"),
        ("DLRMFLOW_NOSUCH__KEY", "nosuch.key"),
        ("DLRMFLOW_RUN_DIR__X", "run_dir.x"),
        ("DLRMFLOW_TRAIN__LR__X", "train.lr.x"),
        ("DLRMFLOW_TRAIN__", "train."),
    ],
)
def test_unknown_environment_variables_are_errors(name, key):
    # Even when --set gives the key it meant: a typo never goes unnoticed.
    with pytest.raises(ConfigError, match=re.escape(f"{name}: {key}: unknown key")):
        load_config(None, ["train.lr=0.1"], env={name: "1"})


def test_reserved_and_other_variables_are_not_configuration():
    env = {name: "1" for name in RESERVED_ENV}
    env["TRAIN__LR"] = "-1"  # not ours
    assert load_config(env=env) == RunConfig()


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        # One underscore where the separator is two: the key it meant is suggested.
        (
            "DLRMFLOW_TRAIN_LR",
            "DLRMFLOW_TRAIN_LR: train_lr: unknown key; did you mean DLRMFLOW_TRAIN__LR?",
        ),
        ("DLRMFLOW_RUNDIR", "DLRMFLOW_RUNDIR: rundir: unknown key; did you mean DLRMFLOW_RUN_DIR?"),
        ("DLRMFLOW_FOO", "DLRMFLOW_FOO: foo: unknown key"),
        ("DLRMFLOW_", "DLRMFLOW_: : unknown key"),
    ],
)
def test_every_other_dlrmflow_variable_is_an_error(name, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(env={name: "0.3"})


def test_a_misspelt_variable_is_one_line_from_the_cli(tmp_path):
    env = {**os.environ, "DLRMFLOW_TRAIN_LR": "0.3"}
    done = subprocess.run(
        [sys.executable, "-m", "dlrmflow", "config"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr == (
        "error: invalid configuration: environment variable DLRMFLOW_TRAIN_LR: train_lr: "
        "unknown key; did you mean DLRMFLOW_TRAIN__LR?\n"
    )


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        (
            "dup.yaml",
            "train:\n  lr: 0.1\nmodel:\n  embedding_dim: 8\ntrain:\n  epochs: 2\n",
            "dup.yaml: cannot parse: line 5: key 'train' given twice (first on line 1)",
        ),
        (
            "dup_key.yaml",
            "train:\n  lr: 0.1\n  lr: 0.2\n",
            "dup_key.yaml: cannot parse: line 3: key 'lr' given twice (first on line 2)",
        ),
        (
            "dup.json",
            '{"train": {"lr": 0.1}, "train": {"epochs": 2}}',
            "dup.json: cannot parse: key 'train' given twice in one object",
        ),
        ("dup.toml", "[train]\nlr = 0.1\n[train]\nepochs = 2\n", "dup.toml: cannot parse"),
    ],
)
def test_a_key_given_twice_in_a_file_is_an_error(tmp_path, name, text, needle):
    # YAML and JSON parsers keep the last value silently: half of the file would be lost.
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(path, env=False)


def test_every_dlrmflow_variable_the_code_reads_is_reserved():
    # A variable with another purpose, read anywhere in the package, must never be taken
    # for configuration (nor be an "unknown key" error).
    root = Path(__file__).resolve().parents[1] / "dlrmflow"
    literal = re.compile(r"[\"'](DLRMFLOW_[A-Z0-9_]+)[\"']")
    used = {m for path in root.rglob("*.py") for m in literal.findall(path.read_text())}
    assert "DLRMFLOW_DEBUG" in used and "DLRMFLOW_HELD_RUN_DIRS" in used
    assert used <= RESERVED_ENV
    assert all(env_key(name) is None for name in used)


def test_config_command_shows_where_values_came_from(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from dlrmflow.cli import app

    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 0.3\n  epochs: 2\n")
    env = {"DLRMFLOW_TRAIN__EPOCHS": "3", "DLRMFLOW_TRAIN__SEED": "4"}
    result = CliRunner().invoke(
        app, ["config", "--config", str(path), "--set", "train.seed=5"], env=env
    )
    assert result.exit_code == 0, result.output
    # Still plain YAML: the sources are comments.
    printed = yaml.safe_load(result.output)
    assert printed == resolve_config(path, ["train.seed=5"], env=env).config.model_dump()
    assert (printed["train"]["lr"], printed["train"]["epochs"], printed["train"]["seed"]) == (
        0.3,
        3,
        5,
    )
    sources = result.output[result.output.index("# sources:") :].splitlines()
    assert sources == [
        "# sources:",
        "#   train.epochs: environment DLRMFLOW_TRAIN__EPOCHS",
        f"#   train.lr: file {path}",
        "#   train.seed: --set",
    ]
    plain = CliRunner().invoke(app, ["config"], env={})
    assert plain.output.rstrip().endswith("# sources: all defaults")


def test_a_rank_resolves_the_configuration_its_parent_did(tmp_path, monkeypatch):
    # The parent's --set overrides the environment; the ranks inherit that environment and
    # read the parent's resolved config.json: applying the environment again would undo
    # the --set on every rank.
    monkeypatch.setenv("DLRMFLOW_TRAIN__LR", "0.1")
    monkeypatch.setenv("DLRMFLOW_TRAIN__BATCH_SIZE", "64")
    parent = resolve_config(None, ["train.lr=0.2"], {"distributed.nproc": 2}).config
    assert (parent.train.lr, parent.train.batch_size) == (0.2, 64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(parent.model_dump(), indent=1))  # as the launcher writes it
    assert load_config(path, env=False) == parent
    assert load_config(path).train.lr == 0.1  # what a rank reading the environment got

    # And the rank's entry point reads it that way when launched (--resolved), while a
    # rank started by hand with torchrun resolves the environment as the CLI does.
    import dlrmflow.train.__main__ as rank
    from dlrmflow.train.launch.job import launch_command

    assert "--resolved" in launch_command(path, 2, None)

    class Result:
        def to_dict(self) -> dict:
            return {}

    seen = []

    def fake_train(config, progress):
        seen.append(config)
        return Result()

    monkeypatch.setattr(rank, "tune_allocator", lambda: None)
    monkeypatch.setattr(rank, "train", fake_train)
    assert rank.main(["--config", str(path), "--resolved"]) == 0
    assert seen == [parent]
    assert rank.main(["--config", str(path)]) == 0
    assert seen[-1].train.lr == 0.1


def test_given_keys_name_what_a_file_and_set_set_before_any_validation(tmp_path, monkeypatch):
    monkeypatch.setenv("DLRMFLOW_TRAIN__LR", "0.5")  # the environment is not given
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  embedding_dim: 8\neval:\n  max_rows: 10\n")
    given = given_keys(path, ["eval.max_rows=20", "train.lrr=1"])
    assert given == {
        "model.embedding_dim": Source("file", str(path)),  # invalid with the default MLPs
        "eval.max_rows": Source("set", "eval.max_rows=20"),
        "train.lrr": Source("set", "train.lrr=1"),  # unknown: not checked here
    }
    assert given_keys() == {}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        given_keys(None, ["eval.max_rows"])
