"""A dataset changes atomically and is held to its files' identities.

``generate`` and ``convert`` write new day files beside the old ones and switch the
manifest last; every day file's digest and size are in the manifest and its footer, checked
before training and on resume, and again by the reader at every file it opens. The
commands are run as a user runs them (``dlrmflow`` subprocesses) where that is what a user
would notice; each run is tiny.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dlrmflow.config import DataConfig
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.loader import make_loader
from dlrmflow.ingest.manifest import check_dataset, read_manifest
from dlrmflow.ingest.reader import ParquetBatchDataset
from dlrmflow.ingest.splits import list_splits
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.run.checkpoint import dataset_digest
from tests.ingest.digests import content_digest

DLRMFLOW = str(Path(sys.executable).parent / "dlrmflow")
SMALL = {"days": 3, "rows_per_day": 256, "row_group_size": 64, "cardinality_scale": 0.0005}
# A model small enough that a run's time is the interpreter's start.
TRAIN = [
    "--set", "train.batch_size=64",
    "--set", "train.num_workers=0",
    "--set", "model.embedding_dim=4",
    "--set", "model.bottom_mlp=[8,4]",
    "--set", "model.top_mlp=[8]",
    "--set", "features.max_rows_per_table=256",
]  # fmt: skip


def generate(url: Path, seed: int = 1, **overrides: int) -> None:
    generate_dataset(DataConfig(url=str(url), seed=seed, **{**SMALL, **overrides}))


def dlrmflow(*args: str, timeout: float = 120, **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [DLRMFLOW, *args], capture_output=True, text=True, timeout=timeout, **kwargs
    )


def train(
    data: Path, run_dir: Path, *sets: str, timeout: float = 120
) -> subprocess.CompletedProcess:
    return dlrmflow(
        "train", "--data", str(data), "--run-dir", str(run_dir), *TRAIN, *sets, timeout=timeout
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` by path, with the SHA-256 of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def listed_file(root: Path, day: int) -> Path:
    return Path(read_manifest(str(root)).day_paths(str(root), [day])[0])


def test_a_killed_generate_leaves_the_previous_dataset_and_the_next_one_cleans_up(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    generate(data)
    before = snapshot(data)
    digest = dataset_digest(read_manifest(str(data)))
    seen = {p.name: p.stat().st_mtime_ns for p in (data / "day=0").iterdir()}

    # A larger dataset from another seed, killed once its first day file is in place.
    rewrite = subprocess.Popen(
        [
            DLRMFLOW, "generate", "--out", str(data), "--days", "3", "--seed", "2",
            "--rows-per-day", "150000", "--set", "data.row_group_size=30000",
            "--set", "data.cardinality_scale=0.0005",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and rewrite.poll() is None:
            new = [
                p
                for p in (data / "day=0").iterdir()
                if p.suffix == ".parquet" and seen.get(p.name) != p.stat().st_mtime_ns
            ]
            if new:
                break
            time.sleep(0.005)
        assert new and rewrite.poll() is None, "the rewrite ended before it could be killed"
        rewrite.send_signal(signal.SIGKILL)
    finally:
        rewrite.kill()
        rewrite.wait()

    # The previous dataset, whole: same manifest, files and identity, and it checks out.
    current = snapshot(data)
    assert {k: v for k, v in current.items() if k in before} == before
    manifest = read_manifest(str(data))
    assert dataset_digest(manifest) == digest
    assert check_dataset(str(data), manifest) == []
    for f in manifest.files:
        assert content_digest(str(data / f.path)) == f.digest

    # The same seed again: the same files, the same manifest, nothing left of the rewrite.
    generate(data)
    assert snapshot(data) == before


def test_a_failed_generate_leaves_the_previous_dataset_and_removes_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dlrmflow.ingest.synthetic as synthetic

    data = tmp_path / "data"
    generate(data)
    before = snapshot(data)
    write_day = synthetic._write_day

    def fail_after_day_0(writer, truth, config, day, *rest):  # noqa: ANN001, ANN002, ANN202
        if day == 1:
            raise OSError(28, "No space left on device")
        return write_day(writer, truth, config, day, *rest)

    monkeypatch.setattr(synthetic, "_write_day", fail_after_day_0)
    with pytest.raises(OSError, match="No space left on device"):
        generate(data, seed=2)
    assert snapshot(data) == before


def test_train_fails_naming_the_day_when_its_dataset_is_rewritten_under_it(
    tmp_path: Path,
) -> None:
    data, run_dir = tmp_path / "data", tmp_path / "run"
    generate(data)
    job = subprocess.Popen(
        [
            DLRMFLOW, "train", "--data", str(data), "--run-dir", str(run_dir), *TRAIN,
            "--set", "train.epochs=100000", "--set", "train.log_every=1",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while job.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and metrics.stat().st_size > 0:
                break
            time.sleep(0.05)
        assert job.poll() is None, job.stderr.read() if job.stderr else ""
        generate(data, seed=2)  # training is under way: rewrite its dataset
        stdout, stderr = job.communicate(timeout=60)
    finally:
        job.kill()
        job.wait()
    result = subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)
    error = one_line_error(result)
    assert "day " in error and "the dataset was rewritten or removed while this job read it" in (
        error
    )
    assert "Traceback" not in error


def test_the_reader_fails_at_a_file_replaced_after_the_manifest_was_read(tmp_path: Path) -> None:
    data = tmp_path / "data"
    generate(data)
    manifest = read_manifest(str(data))
    day0, day1 = (str(data / f.path) for f in manifest.files[:2])

    def loader(paths: list[str]):  # noqa: ANN202
        dataset = ParquetBatchDataset(
            list_splits(paths), ["label"], 64, shuffle=False, shuffle_window=1
        )
        return make_loader(dataset, num_workers=0, threads=1)

    # Replaced between listing and the first read.
    batches = loader([day0])
    shutil.copyfile(day1, day0 + ".new")
    os.replace(day0 + ".new", day0)
    with pytest.raises(DataError, match=r"^day 0: .*day=0/part-\w+\.parquet: replaced while"):
        list(batches)
    batches.close()

    # Replaced after the reader opened it (its footer cached): the next open sees it.
    generate(data)
    batches = loader([day0])
    it = iter(batches)
    next(it)
    shutil.copyfile(day1, day0 + ".new")
    os.replace(day0 + ".new", day0)
    with pytest.raises(DataError, match=r"^day 0: .*: replaced while this job read the dataset"):
        list(it)
    batches.close()

    # A dataset rewritten from another seed: the listed files are gone.
    generate(data)
    batches = loader([day0, day1])
    it = iter(batches)
    next(it)
    generate(data, seed=2)
    with pytest.raises(DataError, match=r"^day [01]: .*: missing; the dataset was rewritten"):
        list(it)
    batches.close()


def test_a_day_file_replaced_by_one_of_the_same_rows_is_refused_on_resume(
    tmp_path: Path,
) -> None:
    data, run_dir = tmp_path / "data", tmp_path / "run"
    generate(data)
    first = train(data, run_dir)
    assert first.returncode == 0, first.stderr[-2000:]
    day0, day1 = listed_file(data, 0), listed_file(data, 1)
    shutil.copyfile(day1, day0)  # 256 rows, like the file it replaces
    error = one_line_error(train(data, run_dir))
    assert f"day 0: {day0}: replaced by another file: its footer's digest" in error


def test_a_fifo_in_place_of_a_day_file_is_an_error_not_a_hang(tmp_path: Path) -> None:
    data = tmp_path / "data"
    generate(data)
    day1 = listed_file(data, 1)
    day1.unlink()
    os.mkfifo(day1)
    error = one_line_error(train(data, tmp_path / "run", timeout=60))
    assert f"day 1: {day1}: is a FIFO, not a regular file" in error


def test_truncated_replaced_and_non_regular_day_files_are_named(tmp_path: Path) -> None:
    data = tmp_path / "data"
    generate(data)
    manifest = read_manifest(str(data))
    day0, day1, day2 = (listed_file(data, d) for d in range(3))
    size = day0.stat().st_size

    with day0.open("r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(DataError) as info:
        check_dataset(str(data), manifest)
    assert f"day 0: {day0}: not a readable Parquet file" in str(info.value)
    assert f"it has {size // 2} bytes, the manifest says {size} (truncated" in str(info.value)

    generate(data)  # the same dataset again, whole
    day1.unlink()
    day1.mkdir()
    with pytest.raises(DataError, match=rf"day 1: {day1}: is a directory, not a regular file"):
        check_dataset(str(data), manifest)
    day1.rmdir()

    generate(data)
    shutil.copyfile(day2, day1)  # the test day's rows as a training day: same row count
    with pytest.raises(DataError, match=rf"day 1: {day1}: replaced by another file"):
        check_dataset(str(data), manifest)


def test_manifests_without_identities_still_check_and_keep_their_digest(tmp_path: Path) -> None:
    data = tmp_path / "data"
    generate(data)
    path = data / "manifest.json"
    old = json.loads(path.read_text())
    for f in old["files"]:
        del f["digest"], f["bytes"]
    path.write_text(json.dumps(old))
    manifest = read_manifest(str(data))
    assert manifest.model_dump(mode="json", by_alias=True) == old  # the same digest as before
    assert check_dataset(str(data), manifest) == []
    listed = listed_file(data, 0)
    pq.write_table(pq.read_table(listed).slice(0, 64), listed)
    with pytest.raises(DataError, match=r"day 0: .*: has 64 rows, the manifest says 256$"):
        check_dataset(str(data), manifest)


def test_convert_on_a_full_disk_names_the_file_and_the_day(
    criteo_sample: Path, tmp_path: Path
) -> None:
    out = tmp_path / "criteo"
    raw = [tmp_path / f"day{d}.tsv" for d in range(2)]
    for path in raw:
        shutil.copy(criteo_sample, path)
    inputs = [arg for path in raw for arg in ("--input", str(path))]
    assert dlrmflow("convert", *inputs, "--out", str(out)).returncode == 0
    before = snapshot(out)
    for path in raw:  # new versions of the raw days (unchanged ones would be kept unread)
        os.utime(path, ns=(1, 1))

    def small_disk() -> None:  # files may not grow past 8 KiB: a write fails as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    result = dlrmflow("convert", *inputs, "--out", str(out), preexec_fn=small_disk)
    error = one_line_error(result)
    assert error.startswith(f"error: day 0: {out}/day=0/part-")
    assert error.endswith(f".parquet: could not be written: File too large (converting {raw[0]})\n")
    assert snapshot(out) == before  # the previous dataset, and nothing else


def test_statistics_of_other_files_go_when_the_manifest_switches(tmp_path: Path) -> None:
    # stats.json plans the tables; kept beside a regenerated dataset it would describe
    # files that are gone.
    from dlrmflow.ingest.manifest import STATS_NAME
    from dlrmflow.ingest.stats.results import write_stats
    from dlrmflow.ingest.stats.scan import dataset_stats

    data = tmp_path / "data"
    generate(data, seed=1)
    write_stats(str(data), dataset_stats(str(data)))
    generate(data, seed=1)  # the same files: the statistics still hold
    assert (data / STATS_NAME).is_file()
    generate(data, seed=2)
    assert not (data / STATS_NAME).exists()
