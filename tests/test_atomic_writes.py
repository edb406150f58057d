"""Safe outputs: written beside the destination and renamed, only over a regular file; a
full disk fails in one line naming the step or file and leaves earlier outputs usable."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrmflow.atomic_writes import OutputError, write_atomic
from dlrmflow.train.run.checkpoint import list_checkpoints, load_checkpoint
from dlrmflow.train.run.export import export_model
from dlrmflow.train.run.trainer import train
from tests.conftest import small_tmpfs, tiny_run_config


@pytest.fixture(scope="module")
def trained(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train(tiny_run_config(tiny_dataset, run_dir, max_steps=2))
    return run_dir


@pytest.fixture
def disk_for_one_checkpoint(tmp_path: Path) -> Iterator[Path]:
    # The tiny model's checkpoint takes ~2.3 MB: one fits, a second beside it does not.
    with small_tmpfs(tmp_path / "disk", "3500k") as disk:
        yield disk


def _no_temporaries(folder: Path) -> bool:
    return not [p for p in folder.rglob("*") if p.name.startswith(".") and "tmp" in p.name]


def test_export_refuses_special_files_and_writes_through_symlinks(trained: Path, tmp_path):
    folder = tmp_path / "a folder"
    folder.mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target in (folder, Path("/dev/null"), fifo):
        with pytest.raises(OutputError, match="refusing to replace it with a file"):
            export_model(trained, target)
    device_link = tmp_path / "to_null"
    device_link.symlink_to("/dev/null")
    with pytest.raises(OutputError, match=r"a link to /dev/null\) is a character device"):
        export_model(trained, device_link)
    assert device_link.is_symlink() and folder.is_dir() and fifo.exists()

    real = tmp_path / "models" / "model.safetensors"
    real.parent.mkdir()
    real.write_bytes(b"the previous model")
    link = tmp_path / "current.safetensors"
    link.symlink_to(real)
    result = export_model(trained, link)
    assert link.is_symlink() and os.readlink(link) == str(real)  # the link stays
    assert real.stat().st_size == result["bytes"] > 1000  # its target was replaced
    assert _no_temporaries(tmp_path)


def test_export_on_a_full_disk_fails_in_one_line_and_keeps_the_old_file(
    trained: Path, tmp_path: Path
) -> None:
    with small_tmpfs(tmp_path / "disk", "1m") as disk:  # the model takes ~1.9 MB
        out = disk / "model.safetensors"
        out.write_bytes(b"the previous model")
        with pytest.raises(OutputError, match=r"model.safetensors: .*No space left on device"):
            export_model(trained, out)
        assert out.read_bytes() == b"the previous model"
        assert _no_temporaries(disk)
        done = subprocess.run(
            [sys.executable, "-m", "dlrmflow", "export", "--run-dir", str(trained)]
            + ["--out", str(out)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 1 and "No space left on device" in done.stderr
        assert done.stderr.strip().splitlines() == [done.stderr.strip()]
        assert out.read_bytes() == b"the previous model"


def test_a_checkpoint_on_a_full_disk_fails_in_one_line_and_keeps_the_previous_one(
    tiny_dataset: str, disk_for_one_checkpoint: Path
) -> None:
    run_dir = disk_for_one_checkpoint / "run"
    first = tiny_run_config(tiny_dataset, run_dir, max_steps=1, checkpoint_every=1)
    train(first)
    sets = {
        "model.embedding_dim": 8,
        "model.bottom_mlp": "[16,8]",
        "model.top_mlp": "[32]",
        "train.batch_size": 512,
        "train.num_workers": 0,
        "train.log_every": 5,
        "train.checkpoint_every": 1,
        "train.max_steps": 3,
    }
    args = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    done = subprocess.run(
        [sys.executable, "-m", "dlrmflow", "train", "--data", tiny_dataset]
        + ["--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    line = done.stderr.strip()
    assert line.splitlines() == [line] and "Traceback" not in line
    assert "checkpoint of step 2" in line and "No space left on device" in line
    assert [c.step for c in list_checkpoints(run_dir)] == [1]
    assert not list((run_dir / "checkpoints").glob(".partial*"))
    assert load_checkpoint(run_dir).step == 1  # still verified and loadable


def test_write_atomic_keeps_the_old_file_when_the_writer_fails(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    out.write_text("old")

    def broken(path: Path) -> None:
        path.write_text("half")
        raise RuntimeError("writer crashed")

    with pytest.raises(RuntimeError, match="writer crashed"):
        write_atomic(out, broken)
    assert out.read_text() == "old" and _no_temporaries(tmp_path)
    write_atomic(out, "new")
    assert out.read_text() == "new"


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_outputs_honour_the_umask(tmp_path: Path, umask: int) -> None:
    # mkstemp's temporary is 0600 whatever the umask; renamed into place, an output would
    # be unreadable by the other users and workers of a shared file system.
    previous = os.umask(umask)
    try:
        written = write_atomic(tmp_path / "out.json", "{}\n")
    finally:
        os.umask(previous)
    assert os.stat(written).st_mode & 0o777 == 0o666 & ~umask


def test_generated_dataset_is_readable_by_others_under_umask_022(tmp_path: Path) -> None:
    out = tmp_path / "data"
    done = subprocess.run(
        [sys.executable, "-m", "dlrmflow", "generate", "--out", str(out), "--days", "2"]
        + ["--rows-per-day", "64"],
        capture_output=True,
        text=True,
        preexec_fn=lambda: os.umask(0o022),
    )
    assert done.returncode == 0, done.stderr
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) >= 3  # two day files and the manifest
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {oct(0o644)}


@pytest.mark.parametrize("fmt", ["torch-export", "safetensors"])
def test_an_export_onto_a_full_disk_fails_in_one_line_and_leaves_nothing(
    trained: Path, tmp_path: Path, fmt: str
) -> None:
    # Nothing at the destination before: the disk's free space is all the writer had (the
    # torch-export's C++ writer used to abort the process, safetensors to print a traceback).
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        out = disk / "model.out"
        done = subprocess.run(
            [sys.executable, "-m", "dlrmflow", "export", "--run-dir", str(trained)]
            + ["--out", str(out), "--format", fmt],
            capture_output=True,
            text=True,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1, done.stderr[-2000:]
        assert len(lines) == 1 and lines[0].startswith(f"error: {out}: could not be written")
        assert "No space left on device" in lines[0] and "KiB free" in lines[0]
        assert list(disk.iterdir()) == []
