"""``train.order: days``: each training day once, in day order, so that a run whose window
grows by a day continues where it ended: trained a day at a time, its weights are bitwise
those of one run over all the days."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlrmflow.config import ConfigError, DataConfig, RunConfig, load_config
from dlrmflow.ingest.synthetic import generate_dataset
from dlrmflow.train.launch.job import launch_training
from dlrmflow.train.run.checkpoint import load_checkpoint
from dlrmflow.train.run.resume import IncompatibleCheckpoint
from dlrmflow.train.run.trainer import train
from tests.conftest import TINY_DATA, tiny_run_config

DAYS = {**TINY_DATA, "days": 4, "rows_per_day": 2500, "row_group_size": 500}


@pytest.fixture(scope="module")
def four_days(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("days") / "data")
    generate_dataset(DataConfig(url=url, **DAYS))
    return url


def _config(data: str, run_dir: Path, window: str, nproc: int = 1, **train_keys) -> RunConfig:
    config = tiny_run_config(data, run_dir, order="days", batch_size=400 // nproc, **train_keys)
    config.data.train_days = window
    config.distributed.nproc = nproc
    return config


def _weights(run_dir: str) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir).model.state_dict()


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("on_disk", [False, True], ids=["in-memory", "shard-on-disk"])
def test_a_day_at_a_time_is_bitwise_one_run_over_the_days(
    four_days: str, tmp_path: Path, on_disk: bool
) -> None:
    extra = {"embedding_memory_bytes": 200_000} if on_disk else {}
    whole = train(_config(four_days, tmp_path / "whole", "0-2", **extra))
    steps = []
    for last in range(3):  # a schedule: the same run directory, one day more each time
        result = train(_config(four_days, tmp_path / "daily", f"0-{last}", **extra))
        steps.append(result.trained_steps)
    # 2500 rows a day in batches of 400: 7 steps a day, the last one partial.
    assert steps == [7, 7, 7] and whole.steps == 21
    assert bool(whole.embedding_cache) == on_disk  # the tables did live on disk
    assert result.final_loss == whole.final_loss
    _assert_same(_weights(str(tmp_path / "daily")), _weights(str(tmp_path / "whole")))
    again = train(_config(four_days, tmp_path / "daily", "0-2", **extra))
    assert again.trained_steps == 0  # the schedule firing twice trains nothing


def test_two_ranks_a_day_at_a_time_equal_one_run(four_days: str, tmp_path: Path) -> None:
    whole = launch_training(_config(four_days, tmp_path / "whole", "0-1", nproc=2))
    for last in range(2):
        daily = launch_training(_config(four_days, tmp_path / "daily", f"0-{last}", nproc=2))
    assert (daily.steps, daily.final_loss) == (whole.steps, whole.final_loss)
    _assert_same(_weights(str(tmp_path / "daily")), _weights(str(tmp_path / "whole")))


def test_what_breaks_the_day_order_is_refused(four_days: str, tmp_path: Path) -> None:
    train(_config(four_days, tmp_path / "run", "0-1"))
    # Days in another order than the run read them, or one left out, are another run.
    with pytest.raises(IncompatibleCheckpoint, match="'days 0-1' -> 'days 1-2'"):
        train(_config(four_days, tmp_path / "run", "1-2"))
    shuffled = _config(four_days, tmp_path / "run", "0-2")
    shuffled.train.order = "shuffled"
    with pytest.raises(IncompatibleCheckpoint, match="train.order 'days' -> 'shuffled'"):
        train(shuffled)
    with pytest.raises(ConfigError, match="train.order=days reads each training day once"):
        load_config(None, ["train.order=days", "train.epochs=2"])
    with pytest.raises(ConfigError, match="train.order=days: .* leave distributed.readers empty"):
        load_config(None, ["train.order=days", "distributed.readers=[reader1:8815]"])


def test_a_vocabulary_run_keeps_the_vocabulary_it_started_with(
    four_days: str, tmp_path: Path
) -> None:
    # Refitted on the grown window, the vocabulary would move the IDs the run trained on
    # to other rows; kept, the IDs first seen on later days share the OOV row (so, unlike
    # hashed IDs, daily runs are not one run over all days: that one counts every day).
    first = _config(four_days, tmp_path / "run", "0")
    first.features.ids = "vocab"
    train(first)
    vocab = (tmp_path / "run" / "vocab.npz").read_bytes()
    grown = _config(four_days, tmp_path / "run", "0-1")
    grown.features.ids = "vocab"
    assert train(grown).trained_steps == 7
    assert (tmp_path / "run" / "vocab.npz").read_bytes() == vocab
    fresh = _config(four_days, tmp_path / "fresh", "0-1")
    fresh.features.ids = "vocab"
    train(fresh)
    assert (tmp_path / "fresh" / "vocab.npz").read_bytes() != vocab  # counted on both days
