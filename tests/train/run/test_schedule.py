"""Learning-rate schedules (``train.lr_schedule``): their shape, the rates every optimizer
trains at, and a resumed run continuing its schedule bitwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dlrmflow.config import ConfigError, LrScheduleConfig, load_config
from dlrmflow.train.launch.job import launch_training
from dlrmflow.train.run.checkpoint import list_checkpoints, load_checkpoint
from dlrmflow.train.run.schedule import LrSchedule
from dlrmflow.train.run.trainer import train
from tests.conftest import same_weights, tiny_run_config


def _schedule(horizons: tuple[int, ...] = (100,), **cfg: object) -> LrSchedule:
    """A schedule of constant rates from the pass's start unless ``cfg`` says otherwise."""
    return LrSchedule(
        LrScheduleConfig(**{"decay": "constant", "decay_start": 0.0, **cfg}), horizons
    )


def test_constant_is_one_after_a_linear_warm_up() -> None:
    s = _schedule(warmup_steps=4)
    assert [s.factor(step) for step in range(1, 7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert all(_schedule().factor(step) == 1.0 for step in range(1, 500))


def test_linear_decay_reaches_the_floor_at_the_passs_end() -> None:
    s = _schedule((10,), decay="linear", floor=0.1)
    shares = [s.factor(step, 0, 10) for step in range(1, 11)]
    assert shares[0] == 1.0
    assert shares == pytest.approx([1 - 0.9 * k / 10 for k in range(10)])
    assert s.factor(11, 0, 10) == pytest.approx(0.1) and s.factor(50, 0, 10) == pytest.approx(0.1)


def test_polynomial_decay_after_its_start_and_warm_up_multiply() -> None:
    s = _schedule((100,), decay="polynomial", decay_start=0.5, power=2.0, warmup_steps=10)
    assert s.factor(5, 0, 100) == 0.5  # warming up, not yet decaying
    assert s.factor(50, 0, 100) == 1.0  # the 49 steps before it are under half the pass
    assert s.factor(76, 0, 100) == pytest.approx((1 - 25 / 50) ** 2)
    assert s.factor(100, 0, 100) == pytest.approx((1 / 50) ** 2)


def test_each_pass_restarts_the_decay_over_its_own_steps() -> None:
    """Day order: day 1 (8 steps) began after step 10 of day 0."""
    s = _schedule((10, 8), decay="linear")
    assert s.horizon(0) == 10 and s.horizon(1) == 8
    assert s.factor(11, 10, 8) == 1.0
    assert s.factor(15, 10, 8) == pytest.approx(1 - 4 / 8)
    # A pass past the listed ones (a run continued by more epochs) spans the last's steps.
    assert s.horizon(2) == 8


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("train.lr_schedule.decay=cosine", "train.lr_schedule.decay"),
        ("train.lr_schedule.floor=1.5", "train.lr_schedule.floor"),
        ("train.lr_schedule.decay_start=1", "train.lr_schedule.decay_start"),
        ("train.lr_schedule.warmup_steps=-1", "train.lr_schedule.warmup_steps"),
        ("train.lr_schedule.decy=linear", "train.lr_schedule.decy"),
    ],
)
def test_a_bad_schedule_is_refused_naming_its_key(override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, [override])


def test_environment_variables_set_the_schedule() -> None:
    from dlrmflow.config import env_overrides

    found = env_overrides({"DLRMFLOW_TRAIN__LR_SCHEDULE__DECAY": "linear"})
    assert found == [("DLRMFLOW_TRAIN__LR_SCHEDULE__DECAY", "train.lr_schedule.decay", "linear")]
    with pytest.raises(ConfigError, match="DLRMFLOW_TRAIN__LR_SCHEDULE__DECAY"):
        env_overrides({"DLRMFLOW_TRAIN__LR_SCHEDULE__DECY": "linear"})


def _moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    """How far each weight of a state dict moved (the largest change of one value); the
    optimizer's state grows with the gradients whatever the rate."""
    return {k: float((after[k] - before[k]).abs().max()) for k in before if "sum_squares" not in k}


@pytest.fixture(scope="module")
def full_rates(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """The initial weights (after one step at ~1e-9 of the rates) and how far 5 steps at
    the full rates move each weight, one process."""
    root = tmp_path_factory.mktemp("rates")
    start = tiny_run_config(
        tiny_dataset, root / "start", max_steps=1, lr_schedule={"warmup_steps": 10**9}
    )
    train(start)
    full = tiny_run_config(tiny_dataset, root / "full", max_steps=5)
    train(full)
    first = load_checkpoint(root / "start").model.state_dict()
    moved = _moved(first, load_checkpoint(root / "full").model.state_dict())
    assert any("embedding" in k for k in moved) and all(m > 1e-3 for m in moved.values())
    return first, moved


@pytest.mark.parametrize("where", ["memory", "disk", "two ranks"])
def test_the_schedule_sets_the_dense_and_the_embedding_rates(
    tiny_dataset: str, tmp_path: Path, full_rates: tuple[dict, dict], where: str
) -> None:
    """Warming up over a billion steps, the first steps train at ~1e-9 of the rates: every
    weight, the embedding tables' (in memory, on disk or sharded over two ranks) and the
    output bias among them, moves by orders of magnitude less than at the full rates."""
    first, full = full_rates
    memory = {"embedding_memory_bytes": 100_000} if where == "disk" else {}
    cfg = tiny_run_config(
        tiny_dataset, tmp_path / "run", max_steps=5, lr_schedule={"warmup_steps": 10**9}, **memory
    )
    cfg.distributed.nproc = 2 if where == "two ranks" else 1
    result = launch_training(cfg)
    assert (result.kernels["tbe"] == "tiered") == (where == "disk")
    moved = _moved(first, load_checkpoint(tmp_path / "run").model.state_dict())
    assert moved.keys() == full.keys()
    for key, step in full.items():
        assert moved[key] < step * 1e-4, key


def test_a_resumed_run_continues_the_schedule_bitwise(tiny_dataset: str, tmp_path: Path) -> None:
    """A run with a warm-up and a polynomial decay over two epochs, killed after any of its
    checkpoints and resumed, ends with the uninterrupted run's weights and records."""
    schedule = {"warmup_steps": 5, "decay": "polynomial", "decay_start": 0.25, "floor": 0.05}
    whole = tiny_run_config(
        tiny_dataset, tmp_path / "whole", epochs=2, lr_schedule=schedule, log_every=1
    )
    train(whole)
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").open()]
    lrs = [r["lr"] for r in records]
    assert lrs[0] == pytest.approx(whole.train.lr / 5) and lrs[4] == pytest.approx(whole.train.lr)
    assert max(lrs) == pytest.approx(whole.train.lr) and min(lrs) < whole.train.lr * 0.2

    interrupted = whole.model_copy(deep=True)
    interrupted.run_dir = str(tmp_path / "interrupted")
    interrupted.train.checkpoint_every = 7
    interrupted.train.keep_checkpoints = 100
    train(interrupted)
    steps = [c.step for c in list_checkpoints(interrupted.run_dir)]
    assert steps[-1] == records[-1]["step"]
    for kill_after in steps[-3:-1]:  # mid-epoch and past the first epoch's end
        run_dir = tmp_path / f"killed_{kill_after}"
        shutil.copytree(interrupted.run_dir, run_dir)
        for c in list_checkpoints(run_dir):
            if c.step > kill_after:
                shutil.rmtree(c.path)
        (run_dir / "train_result.json").unlink()
        resumed = interrupted.model_copy(deep=True)
        resumed.run_dir = str(run_dir)
        result = train(resumed)
        assert result.resumed_from_step == kill_after
        same_weights(run_dir, Path(whole.run_dir))
        got = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        assert [(r["step"], r["lr"], r["loss"]) for r in got] == [
            (r["step"], r["lr"], r["loss"]) for r in records
        ]


def test_the_decay_spans_the_steps_the_readers_cut(tiny_dataset: str, tmp_path: Path) -> None:
    """Two ranks of two readers each: the 6 row groups of 2,000 rows deal 2, 2, 1 and 1 to
    the readers, so rank 0 reads 16 batches of 512 and rank 1 8, and the job steps 16 times
    (12,000 rows over a 1,024-row global batch would make 12). The linear decay to 0 spans
    all 16: its last step trains at 1/16 of the rate, not at none."""
    cfg = tiny_run_config(
        tiny_dataset, tmp_path / "run", num_workers=2, log_every=1,
        lr_schedule={"decay": "linear", "decay_start": 0.0},
    )  # fmt: skip
    cfg.distributed.nproc = 2
    result = launch_training(cfg)
    assert result.steps == 16
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["lr"] for r in records] == pytest.approx(
        [cfg.train.lr * (1 - k / 16) for k in range(16)]
    )


def _lrs(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["lr"]) for r in map(json.loads, (run_dir / "metrics.jsonl").open())]


def test_a_resumed_pass_keeps_the_steps_it_began_with(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The steps a pass's decay spans are fixed, and checkpointed, as the pass begins: a run
    resumed inside it continues its schedule even where they would now be counted
    otherwise (reader servers count them from the rows)."""
    schedule = {"decay": "linear", "decay_start": 0.0}
    whole = tiny_run_config(tiny_dataset, tmp_path / "whole", log_every=1, lr_schedule=schedule)
    train(whole)
    stopped = whole.model_copy(deep=True)
    stopped.run_dir, stopped.train.max_steps = str(tmp_path / "stopped"), 10
    train(stopped)
    monkeypatch.setattr(
        "dlrmflow.train.run.trainer.pass_steps_of_run", lambda *args, **kwargs: [99]
    )
    stopped.train.max_steps = None
    assert train(stopped).resumed_from_step == 10
    assert _lrs(tmp_path / "stopped") == _lrs(tmp_path / "whole")
    same_weights(tmp_path / "stopped", tmp_path / "whole")


def test_a_fine_tuning_that_reads_its_epoch_again_begins_a_pass(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Fine-tuned at another batch size from step 6 (of 24), the run reads the epoch from its
    start, so the decay begins again: its first step at the full rate, its last at 1/47 of
    it (12,000 rows in batches of 256 are 47 steps)."""
    schedule = {"decay": "linear", "decay_start": 0.0}
    first = tiny_run_config(tiny_dataset, tmp_path / "first", max_steps=6, lr_schedule=schedule)
    train(first)
    checkpoint = list_checkpoints(tmp_path / "first")[-1].path
    tuned = tiny_run_config(
        tiny_dataset, tmp_path / "tuned", batch_size=256, log_every=1,
        resume=str(checkpoint), lr_schedule=schedule,
    )  # fmt: skip
    result = train(tuned)
    assert result.resumed_from_step == 6 and result.steps == 6 + 47
    lrs = [lr for _, lr in _lrs(tmp_path / "tuned")]
    assert lrs == pytest.approx([tuned.train.lr * (1 - k / 47) for k in range(47)])
