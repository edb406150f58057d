"""The suite runs from a fresh clone with nothing beside it: its data is in the repository."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_criteo_sample_is_tracked_inside_the_repository(criteo_sample: Path) -> None:
    assert criteo_sample.is_relative_to(ROOT)
    assert len(criteo_sample.read_text().splitlines()) == 200
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(
        ["git", "ls-files", "--error-unmatch", str(criteo_sample.relative_to(ROOT))],
        cwd=ROOT,
        capture_output=True,
    )
    assert tracked.returncode == 0, "the sample must be committed, not only present"


def test_no_test_reaches_outside_the_repository() -> None:
    # A folder beside the checkout (the shared data folder, an environment variable
    # pointing at one) is absent from a fresh clone.
    outside = re.compile(r"parents\[[2-9]\]|[\"']\.\./|DLRMFLOW_SHARED|/work/|/shared/")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path.name != Path(__file__).name
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if outside.search(line)
    ]
    assert not offenders
