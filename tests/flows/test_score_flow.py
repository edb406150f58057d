"""The ``score`` flow writes what ``dlrmflow score`` writes, retries what a retry can fix
(finishing from the parts already written), never bad input, and publishes its summary."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import dlrmflow.flows.score as score_module
import dlrmflow.score.worker as worker
from dlrmflow.days import WindowError
from dlrmflow.flows.score import PROGRESS_KEY, SCORES_KEY, score_flow
from dlrmflow.train.run.trainer import train
from tests.conftest import run_cli, tiny_run_config
from tests.flows.records import run_records

# Run-specific fields; everything else the flow returns is what the command prints.
VARYING = ("out", "manifest", "seconds")


def _sorted(out: Path):
    return pq.read_table(out).sort_by([("day", "ascending"), ("row", "ascending")])


@pytest.fixture(scope="module")
def run_dir(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    cfg = tiny_run_config(tiny_dataset, tmp_path_factory.mktemp("score") / "run", max_steps=2)
    train(cfg)
    return cfg.run_dir


def test_the_flow_writes_what_the_command_writes_and_a_retry_finishes_it(
    prefect_api: str,
    run_dir: str,
    tiny_dataset: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    by_cli = tmp_path / "cli"
    code, printed, err = run_cli(
        monkeypatch, capsys, "score", "--model", run_dir, "--data", tiny_dataset,
        "--out", str(by_cli), "--days", "1-2", "--batch-size", "1000",
    )  # fmt: skip
    assert code == 0, err
    cli = json.loads(printed)

    # The first attempt stops after its first part, as a lost worker would.
    real = worker.share_batches
    calls: list[int] = []

    def lost_in_the_second_part(share, *args, **kwargs):
        calls.append(share.day)
        if len(calls) == 2:
            raise OSError("simulated: the mount went away")
        yield from real(share, *args, **kwargs)

    monkeypatch.setattr(worker, "share_batches", lost_in_the_second_part)
    fast_retry = score_module.score_task.with_options(retry_delay_seconds=0)
    monkeypatch.setattr(score_module, "score_task", fast_retry)
    by_flow = tmp_path / "flow"
    state = score_flow(
        run_dir, tiny_dataset, str(by_flow), days="1-2", batch_size=1000, return_state=True
    )
    result = state.result()
    assert calls == [1, 2, 2]  # the retry kept day 1's part and scored day 2 only
    assert (result["parts_kept"], result["rows_scored"]) == (1, 6000)
    drop = (*VARYING, "parts_kept", "rows_scored")
    assert {k: v for k, v in result.items() if k not in drop} == {
        k: v for k, v in cli.items() if k not in drop
    }
    assert _sorted(by_flow).equals(_sorted(by_cli))

    records = run_records(state.state_details.flow_run_id)
    (task_run,) = records.tasks("score")
    assert task_run.state_name == "Completed" and task_run.run_count == 2
    assert float(records.artifact(PROGRESS_KEY).data) == 100.0
    summary = {row["metric"]: row["value"] for row in json.loads(records.artifact(SCORES_KEY).data)}
    assert summary["rows"] == 12000 and summary["days"] == "1, 2"
    assert summary["model_step"] == 2


def test_bad_input_fails_without_running_or_retrying(
    prefect_api: str, run_dir: str, tiny_dataset: str, tmp_path: Path
) -> None:
    state = score_flow(run_dir, tiny_dataset, str(tmp_path / "out"), days="7", return_state=True)
    assert state.is_failed()
    with pytest.raises(WindowError, match="--days: day 7: not in the dataset"):
        state.result()
    state = score_flow(
        str(tmp_path / "no_run"), tiny_dataset, str(tmp_path / "o"), return_state=True
    )
    with pytest.raises(FileNotFoundError, match="no such model"):
        state.result()
    (task_run,) = run_records(state.state_details.flow_run_id).tasks("score")
    assert task_run.state_name == "Failed" and task_run.run_count == 1
