import json

import pytest

from dlrmflow.config import ConfigError, RunConfig, apply_overrides, load_config


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
