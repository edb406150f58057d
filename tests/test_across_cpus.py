"""No test pins one CPU's bits: the tests that compare with values computed on another
machine (marked ``recorded``) pass under another CPU's code paths (``OTHER_CPU``), so one
that compared bitwise would fail here, on the machine it was written on, not only on the
next one CI runs on. ``make test-across-cpus`` runs the whole suite so."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.across_cpus import OTHER_CPU

ROOT = Path(__file__).resolve().parents[1]

# A float32 product and a bfloat16 one, each as bits: what the settings must change.
_PRODUCTS = """
import hashlib, torch
torch.manual_seed(0)
a, b = torch.randn(256, 333), torch.randn(333, 129)
for x, y in ((a, b), (a.bfloat16(), b.bfloat16())):
    print(hashlib.sha256((x @ y).float().numpy().tobytes()).hexdigest())
"""


def _products(env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _PRODUCTS],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.split()


def test_another_cpus_code_paths_round_products_differently_here():
    """Otherwise the check below proves nothing on this machine: say so, do not pass."""
    here, other = _products({}), _products(OTHER_CPU)
    if here == other:
        pytest.skip(
            "MKL_CBWR=COMPATIBLE and ONEDNN_MAX_CPU_ISA=AVX2 round this CPU's products as it "
            "does itself: the check of the recorded tests cannot tell pinned bits here"
        )
    assert here[0] != other[0] or here[1] != other[1]


def test_tests_comparing_with_another_machines_values_pass_under_another_cpus_rounding():
    listed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--collect-only",
            "-m",
            "recorded",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    marked = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", listed.stdout)
    assert marked and int(marked.group(1)) >= 5, listed.stdout[-2000:]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "recorded", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env={**os.environ, **OTHER_CPU},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{marked.group(1)} passed" in done.stdout, done.stdout[-2000:]


def test_make_runs_the_whole_suite_under_the_same_settings():
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("test-across-cpus:") :].split("\n\n")[0]
    for key, value in OTHER_CPU.items():
        assert f'{key}="{value}"' in target or f"{key}={value}" in target, key
