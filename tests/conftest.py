"""Shared fixtures: a tiny synthetic dataset and Prefect isolated from the user's home."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

# Prefect must never touch ~/.prefect or the network from the tests; set before any import.
os.environ.setdefault(
    "PREFECT_HOME", str(Path(__file__).resolve().parents[1] / ".venv" / "prefect")
)

from dlrmflow.config import DataConfig, RunConfig, build_config  # noqa: E402
from dlrmflow.ingest.synthetic import generate_dataset  # noqa: E402

# The session's Prefect server (``prefect_server``, ``prefect_api``) and S3 server
# (``s3_server``, ``s3_bucket``), for any test.
pytest_plugins = ["tests.prefect_server", "tests.s3_server"]

# Data kept in the repository for the tests (see its README).
TEST_DATA = Path(__file__).resolve().parent / "data"

TINY_DATA = {
    "days": 3,
    "rows_per_day": 6000,
    "row_group_size": 2000,
    "cardinality_scale": 0.0005,
    "max_cardinality": 2000,
    "seed": 7,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` run where torch sees a CUDA device and are skipped, saying so,
    elsewhere (``make gpu-check`` runs them on a GPU machine)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none (make gpu-check runs it)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def criteo_sample() -> Path:
    """200 real Criteo lines, kept in the repository (tests/data) so a fresh clone tests."""
    path = TEST_DATA / "criteo_sample_200.tsv"
    assert path.is_file(), f"{path} is missing from the repository"
    return path


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Three days of 6000 synthetic rows (the last day held out), generated once."""
    url = str(tmp_path_factory.mktemp("tiny") / "data")
    generate_dataset(DataConfig(url=url, **TINY_DATA))
    return url


def tiny_run_config(data_url: str, run_dir: Path, **train: object) -> RunConfig:
    """A small model and short training on the tiny dataset."""
    return build_config(
        {
            "run_dir": str(run_dir),
            "data": {"url": data_url, **TINY_DATA},
            "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [32]},
            "train": {"batch_size": 512, "log_every": 5, "num_workers": 0, **train},
            "eval": {"batch_size": 4096},
        }
    )


def same_weights(a: Path, b: Path) -> None:
    """The checkpoints at ``a`` and ``b`` (a checkpoint or a run directory's newest) hold
    bitwise the same model."""
    import torch

    from dlrmflow.train.run.checkpoint import load_checkpoint

    got, want = load_checkpoint(a).model.state_dict(), load_checkpoint(b).model.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


@contextlib.contextmanager
def small_tmpfs(directory: Path, size: str = "8m") -> Iterator[Path]:
    """``directory`` on a tmpfs of ``size`` (a disk that fills), unmounted afterwards;
    skips the test where mounting is not allowed (not root, no tmpfs)."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)]
    done = subprocess.run(mount, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: str):
    """``dlrmflow ARGS`` in this process, as a user runs it: (exit code, stdout, stderr's
    non-empty lines)."""
    from dlrmflow.cli import main

    monkeypatch.setattr("sys.argv", ["dlrmflow", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.strip()]
