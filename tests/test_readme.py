"""The README's configuration example and commands stay true to the code."""

import re
from pathlib import Path

import yaml

from dlrmflow.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_configuration_example_is_a_valid_config(tmp_path):
    example = re.search(r"```yaml\n(.*?)```", README, re.S).group(1)
    path = tmp_path / "run.yaml"
    path.write_text(example)
    cfg = load_config(path)
    assert cfg.run_dir == "runs/r1" and cfg.model.arch == "dlrm"


def test_ci_runs_the_readme_test_command():
    assert "make test" in README and "make demo" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_schema_example_is_a_valid_schema():
    """The "Your own data" example declares every operation, so each must parse."""
    from dlrmflow.schema import parse_schema

    block = next(
        b for b in re.findall(r"```yaml\n(.*?)```", README, re.S) if b.startswith("label:")
    )
    schema = parse_schema(yaml.safe_load(block), "README.md")
    assert schema.crosses[0].columns == ("user_id", "item_id")
    assert [d.transform for d in schema.dense] == ["log", "clip", "standardize", "bucketize"]
