"""A model line: a version a day as days arrive, each validated on its day before training
on it, ending bitwise where one run over the same days ends."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrmflow.config import DataConfig, RunConfig
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.line.line import LineError, history, train_line, verdicts, versions
from dlrmflow.train.run.checkpoint import list_checkpoints, read_checkpoint
from dlrmflow.train.run.trainer import train
from tests.conftest import TINY_DATA, run_cli, same_weights, tiny_run_config

DAYS = {**TINY_DATA, "rows_per_day": 2500, "row_group_size": 500, "drift": 0.2}


def _grow(url: Path, days: int) -> str:
    generate_dataset(DataConfig(url=str(url), **{**DAYS, "days": days}))
    return str(url)


def _config(data: str, run_dir: Path) -> RunConfig:
    # A dense rate above the default's: a version learns from a day's 6 steps.
    return tiny_run_config(data, run_dir, batch_size=400, lr=0.01)


def test_a_line_grows_a_version_a_day_as_one_run_over_the_days(tmp_path: Path) -> None:
    data = _grow(tmp_path / "data", 2)
    line = tmp_path / "line"
    first = train_line(line, _config(data, tmp_path / "ignored")).made
    assert [(v.number, v.day, v.parent) for v in first] == [(0, 0, None), (1, 1, 0)]
    assert first[0].validation is None  # no model before the first day
    assert first[1].validation["day"] == 1 and 0.5 < first[1].validation["auc"] < 1

    assert train_line(line).made == []  # no new day: nothing trained, nothing written
    _grow(tmp_path / "data", 3)  # the next day lands
    [third] = train_line(line).made
    assert (third.number, third.day, third.parent, third.days) == (2, 2, 1, [0, 1, 2])
    assert [r["day"] for r in history(line)] == [1, 2]
    assert (line / "history.png").is_file()
    # The Zipf tail (and churn, where there is some) brings IDs new to the line each day.
    unseen = [r["unseen_ids"] for r in history(line)]
    assert all(0.02 < share < 0.6 for share in unseen), unseen
    # Whose fault a miscalibration is: the day's rate against the days trained on, the NE
    # miscalibration does not count, and the day before's Bayes model's calibration.
    manifest = read_manifest(data)
    rates = {f.day: f.positive_rate for f in manifest.files}
    for record in history(line):
        trained = range(record["day"])
        before = sum(rates[d] for d in trained) / len(trained)  # days of equal rows
        assert record["base_rate_ratio"] == pytest.approx(rates[record["day"]] / before)
        assert record["ne_recalibrated"] <= record["ne"] + 1e-12
        reference = manifest.files[record["day"]].reference_calibration
        assert record["reference_calibration"] == reference and 0.5 < reference < 2
    assert sorted(p.name for p in (line / "ids").iterdir()) == [f"day={d}.npz" for d in range(3)]

    # One run over days 0-2 in day order ends where the line's versions end.
    whole = _config(data, tmp_path / "whole")
    whole.train.order, whole.data.train_days, whole.data.eval_days = "days", "0-2", "none"
    train(whole)
    # Versions 0 and 1 were recalibrated on days 1 and 2 before the line trained on those
    # days, and version 2 ends bitwise where one run does: the shift never reaches training.
    assert [v.recalibration["day"] for v in versions(line)[:2]] == [1, 2]
    assert versions(line)[2].recalibration is None
    same_weights(line / "versions" / "0002" / "checkpoint", tmp_path / "whole")
    recorded = json.loads((line / "versions" / "0002" / "version.json").read_text())
    assert recorded["days"] == [0, 1, 2] and len(recorded["day_digests"]) == 3
    # Each version keeps its own checkpoint, whatever the run directory pruned.
    for number, days in ((0, [0]), (1, [0, 1])):
        kept = read_checkpoint(line / "versions" / f"{number:04d}" / "checkpoint").manifest
        assert kept["train_days"] == days
    assert [v.number for v in versions(line)] == [0, 1, 2]


def test_a_line_refuses_another_configuration_and_trains_through_at_most(tmp_path: Path) -> None:
    data = _grow(tmp_path / "data", 2)
    line = tmp_path / "line"
    train_line(line, _config(data, tmp_path / "x"), through=0)
    other = _config(data, tmp_path / "x")
    other.train.lr = 0.5
    with pytest.raises(LineError, match="train.lr 0.01 -> 0.5"):
        train_line(line, other)
    # What is not the run's identity is this call's, not silently the first call's.
    machinery = _config(data, tmp_path / "x")
    machinery.train.log_every = 2
    [second] = train_line(line, machinery).made
    logged = (line / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(r)["step"] for r in logged if '"loss"' in r]
    assert second.steps == 14 and 8 in steps  # day 1's steps 8-14, logged every 2
    # --through is "at most": past the dataset's days or below the trained ones, no error.
    assert train_line(line, through=7).made == [] and train_line(line, through=0).made == []
    with pytest.raises(LineError, match="--through -1: days are numbered from 0"):
        train_line(line, through=-1)
    with pytest.raises(LineError, match="no config.json"):
        train_line(tmp_path / "new")


def test_a_line_refuses_other_data_before_it_scores_or_records_anything(
    tmp_path: Path,
) -> None:
    data = _grow(tmp_path / "data", 2)
    line = tmp_path / "line"
    train_line(line, _config(data, tmp_path / "x"))
    before = history(line)
    generate_dataset(DataConfig(url=data, **{**DAYS, "days": 3, "seed": 8}))  # another dataset
    with pytest.raises(LineError, match="day 0: its files are not the ones version 0001"):
        train_line(line)
    assert history(line) == before  # nothing scored on the foreign data was kept
    assert not (line / "versions" / "0001" / "gate.json").exists()

    # Records an earlier call made from data since replaced are made again, never kept.
    stale = {**before[0], "day": 2, "auc": 0.1, "day_digest": "another day 2"}
    (line / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*before, stale]))
    _grow(tmp_path / "data", 3)  # the line's data restored, with a day more
    [third] = train_line(line).made
    fresh = tmp_path / "fresh"
    train_line(fresh, _config(data, tmp_path / "y"))
    assert history(line) == history(fresh) and third == versions(fresh)[-1]
    assert verdicts(line) == verdicts(fresh)


def test_the_line_command_starts_continues_and_says_when_nothing_is_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    data = _grow(tmp_path / "data", 2)
    line = str(tmp_path / "line")
    sizes = [
        "--set", "train.batch_size=400", "--set", "train.num_workers=0",
        "--set", "model.embedding_dim=8", "--set", "model.bottom_mlp=[16, 8]",
    ]  # fmt: skip
    code, out, err = run_cli(monkeypatch, capsys, "line", "--line", line, "--data", data, *sizes)
    assert code == 0, err
    assert [v["day"] for v in json.loads(out)["trained"]] == [0, 1]
    code, out, err = run_cli(monkeypatch, capsys, "line", "--line", line)
    assert code == 0 and json.loads(out)["trained"] == [] and "no new day" in err[-1]
    code, out, err = run_cli(monkeypatch, capsys, "line", "--line", line, "--set", "train.lr=1")
    assert code == 1 and len(err) == 1, err
    assert err[0].endswith(
        "another configuration: train.lr 0.002 -> 1.0; start another line for it"
    )


def test_a_line_refuses_a_run_length_it_cannot_honour_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    data = _grow(tmp_path / "data", 3)
    line = tmp_path / "line"
    for key, value in (("train.max_steps", "5"), ("train.epochs", "2")):
        args = ["line", "--line", str(line), "--data", data, "--set", f"{key}={value}"]
        code, _, err = run_cli(monkeypatch, capsys, *args, "--through", "2")
        assert code == 1 and len(err) == 1, err
        assert f"{key}={value}: a line trains each new day whole" in err[0]
        assert not (line / "config.json").exists()  # not started: a corrected call starts it


def test_a_broken_line_fails_in_one_line_naming_the_file_and_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    data = _grow(tmp_path / "data", 2)
    line = tmp_path / "line"
    sizes = [
        "--set", "train.batch_size=400", "--set", "train.num_workers=0",
        "--set", "model.embedding_dim=8", "--set", "model.bottom_mlp=[16, 8]",
        "--set", "gate.calibration_min=0.01", "--set", "gate.calibration_max=100",
    ]  # fmt: skip

    def cli(*args: str) -> tuple[int, str, list[str]]:
        return run_cli(monkeypatch, capsys, "line", "--line", str(line), *args)

    def fails(message: str, *args: str) -> None:
        code, _, err = cli(*args)
        assert code == 1 and len(err) == 1 and message in err[0], err

    # A first call that failed leaves nothing a corrected call must match.
    fails(str(tmp_path / "typo"), "--data", str(tmp_path / "typo"), *sizes)
    code, _, err = cli("--data", data, *sizes)
    assert code == 0, err
    records = history(line)

    recorded = (line / "config.json").read_text()
    (line / "config.json").write_text("")
    fails("config.json: unreadable (Expecting value: line 1 column 1")
    (tmp_path / "line.json").write_text(recorded)  # given again, it is rewritten
    assert cli("--config", str(tmp_path / "line.json"))[0] == 0
    assert json.loads((line / "config.json").read_text()) == json.loads(recorded)

    (line / "history.jsonl").write_text('{"day": 1, "auc"\n')
    fails("history.jsonl: line 1 is not a validation record")
    (line / "history.jsonl").unlink()  # the trained days' records are the versions'
    assert cli()[0] == 0 and history(line) == records

    current = line / "models" / "current"
    for target in ("0007", "x"):  # dangling, not a version
        current.unlink()
        current.symlink_to(target)
        fails(f"current: points at '{target}', which is not a published version")
    current.unlink()
    current.write_text("0000\n")
    fails("current: is not a symbolic link to the champion's models/NNNN")
    current.unlink()
    fails(f"current: is missing, but version 0000 was published; the champion is the newest "
          f"published version: ln -sfn 0000 {current}")  # fmt: skip
    current.symlink_to("0000")

    shutil.rmtree(line / "run")  # continued from the newest version's checkpoint
    _grow(tmp_path / "data", 3)
    code, out, err = cli()
    assert code == 0, err
    assert [v["days"] for v in json.loads(out)["trained"]] == [[0, 1, 2]]
    assert [r["day"] for r in history(line)] == [1, 2]


def test_a_line_killed_anywhere_resumes_to_where_the_whole_line_ends(tmp_path: Path) -> None:
    data = _grow(tmp_path / "data", 3)
    config = _config(data, tmp_path / "x")
    config.train.checkpoint_every = 2
    whole = tmp_path / "whole"
    train_line(whole, config)
    steps = versions(whole)[-1].steps
    # A different kill point on each run of the suite, printed and replayable:
    # DLRMFLOW_TEST_SEED=<seed> pytest -k line_killed
    seed = int(os.environ.get("DLRMFLOW_TEST_SEED", random.SystemRandom().randrange(10**6)))
    kill_after = random.Random(seed).choice(range(2, steps, 2))
    print(f"kill point: after step {kill_after} (DLRMFLOW_TEST_SEED={seed})")

    killed = tmp_path / "killed"
    (tmp_path / "line.json").write_text(config.model_dump_json())
    command = [Path(sys.executable).parent / "dlrmflow", "line", "--line", str(killed),
               "--config", str(tmp_path / "line.json")]  # fmt: skip
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job.poll() is None:
        done = (
            [c.step for c in list_checkpoints(killed / "run")] if (killed / "run").is_dir() else []
        )
        if done and max(done) >= kill_after:
            break
        time.sleep(0.01)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    assert job.returncode == -signal.SIGKILL, "the line finished before it could be killed"

    train_line(killed)  # its recorded configuration; resumes where the kill left it
    assert versions(killed) == versions(whole), f"DLRMFLOW_TEST_SEED={seed}"
    assert history(killed) == history(whole)
    for version in versions(whole):
        kept = Path("versions") / version.name / "checkpoint"
        same_weights(killed / kept, whole / kept)
