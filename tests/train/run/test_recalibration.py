"""A recalibration: one shift of the logit, fitted on a share of a day's rows (spread over
it, or its first) and judged on the rest; carried by a checkpoint to every reader
(evaluate, score, both exports), folded into the model's last bias, so that it moves
calibration and never the AUC."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from dlrmflow.config import RunConfig
from dlrmflow.days import WindowError
from dlrmflow.score.score import score_dataset
from dlrmflow.train.launch.job import launch_evaluation
from dlrmflow.train.run.checkpoint import find_checkpoint, load_checkpoint
from dlrmflow.train.run.evaluate import evaluate, keyed_loader
from dlrmflow.train.run.export import export_model
from dlrmflow.train.run.metrics import intercept_shift
from dlrmflow.train.run.rank import DistEnv
from dlrmflow.train.run.recalibration import (
    Recalibration,
    fit_recalibration,
    shifted,
    write_recalibration,
)
from dlrmflow.train.run.trainer import train
from tests.conftest import tiny_run_config

N = 40_000
OFFSET = 0.6  # the labels' logit is the model's plus this: it under-predicts


def _miscalibrated(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(predictions, labels, each row's index in its day, in a scrambled scored order)."""
    gen = torch.Generator().manual_seed(seed)
    logit = torch.randn(N, generator=gen)
    labels = (torch.rand(N, generator=gen) < torch.sigmoid(logit + OFFSET)).float()
    return torch.sigmoid(logit), labels, torch.randperm(N, generator=gen)


def _spread(rows: torch.Tensor, count: int) -> torch.Tensor:
    """Whether each row is among the ``count`` whose place in the day times 1 / phi has the
    smallest fractional part: the rows a spread recalibration fits."""
    fraction = torch.frac(rows.double() * ((5**0.5 - 1) / 2))
    chosen = torch.zeros(len(rows), dtype=torch.bool)
    chosen[torch.argsort(fraction)[:count]] = True
    return chosen


def test_the_shift_is_fitted_on_the_first_rows_and_judged_on_the_rest() -> None:
    probs, labels, rows = _miscalibrated()
    fitted = fit_recalibration(probs, labels, None, rows, day=3, share=0.25, rows="first")
    assert (fitted.day, fitted.fit_rows, fitted.judged_rows) == (3, 10_000, 30_000)
    assert fitted.rows == "first"
    first = rows < 10_000
    # On its own rows the shift makes the mean prediction the click rate.
    mean = shifted(probs[first], fitted.shift).double().mean()
    assert float(mean / labels[first].double().mean()) == pytest.approx(1.0, abs=1e-6)
    # The intercept's standard error on 10,000 rows is about 0.025: 4 of them.
    assert abs(fitted.shift - OFFSET) < 0.1
    assert fitted.before["calibration"] < 0.9
    assert fitted.after["calibration"] == pytest.approx(1.0, abs=0.03)
    assert fitted.after["ne"] < fitted.before["ne"]
    assert fitted.after["auc"] == fitted.before["auc"]
    # The judged rows' labels play no part in the fit; a fitted row's label does.
    flipped = labels.clone()
    flipped[~first] = 1 - flipped[~first]
    assert fit_recalibration(probs, flipped, None, rows, 3, 0.25, "first").shift == fitted.shift
    changed = labels.clone()
    one = int(first.nonzero()[0])
    changed[one] = 1 - changed[one]
    assert fit_recalibration(probs, changed, None, rows, 3, 0.25, "first").shift != fitted.shift


def test_a_spread_shift_is_fitted_on_rows_from_every_stretch_of_the_day() -> None:
    """The day's first half clicks less than its second: a shift fitted on its first
    quarter misses the rest, one fitted on a quarter spread over the day calibrates it."""
    probs, labels, rows = _miscalibrated(2)
    gen = torch.Generator().manual_seed(5)
    labels = torch.where(rows < N // 2, labels * (torch.rand(N, generator=gen) < 0.6), labels)
    fitted = fit_recalibration(probs, labels, None, rows, 3, 0.25)
    assert (fitted.rows, fitted.fit_rows, fitted.judged_rows) == ("spread", 10_000, 30_000)
    chosen = _spread(rows, 10_000)
    # Every tenth of the day gives close to a quarter of its rows.
    for tenth in range(10):
        part = (rows >= tenth * N // 10) & (rows < (tenth + 1) * N // 10)
        assert float(chosen[part].double().mean()) == pytest.approx(0.25, abs=0.01)
    assert intercept_shift(probs[chosen], labels[chosen]) == pytest.approx(fitted.shift, abs=1e-12)
    first = fit_recalibration(probs, labels, None, rows, 3, 0.25, "first")
    assert abs(fitted.after["calibration"] - 1) < 0.03 < abs(first.after["calibration"] - 1)
    assert fitted.after["auc"] == fitted.before["auc"]
    with pytest.raises(ValueError, match="'middle' is not one of"):
        fit_recalibration(probs, labels, None, rows, 3, 0.25, "middle")


def test_weights_count_in_the_fit_and_a_day_that_gives_no_shift_is_refused() -> None:
    probs, labels, rows = _miscalibrated(1)
    plain = fit_recalibration(probs, labels, None, rows, 3, 0.5)
    doubled = fit_recalibration(probs, labels, torch.full((N,), 2.0), rows, 3, 0.5)
    assert doubled.shift == pytest.approx(plain.shift, abs=1e-12)  # uniform weights: the same
    weights = torch.where(labels > 0, 3.0, 1.0)  # clicks count thrice: a larger shift
    assert fit_recalibration(probs, labels, weights, rows, 3, 0.5).shift > plain.shift + 0.5
    with pytest.raises(ValueError, match="share of rows to fit on"):
        fit_recalibration(probs, labels, None, rows, 3, 1.0)
    with pytest.raises(ValueError, match="day 3: 1 row"):
        fit_recalibration(probs[:1], labels[:1], None, torch.zeros(1, dtype=torch.long), 3, 0.5)
    # No click among the rows to fit: no finite shift makes the mean prediction 0.
    none_first = torch.where(rows < N // 2, 0.0, labels)
    with pytest.raises(ValueError, match="day 3: its first 20000 rows are all of one class"):
        fit_recalibration(probs, none_first, None, rows, 3, 0.5, "first")
    none_spread = torch.where(_spread(rows, N // 2), 0.0, labels)
    with pytest.raises(ValueError, match="day 3: the 20000 rows to fit on are all of one"):
        fit_recalibration(probs, none_spread, None, rows, 3, 0.5)
    # Nor where the clicks there weigh nothing.
    with pytest.raises(ValueError, match="all of one class"):
        fit_recalibration(probs, labels, torch.where(labels > 0, 0.0, 1.0), rows, 3, 0.5)


@pytest.fixture(scope="module")
def trained(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    cfg = tiny_run_config(tiny_dataset, tmp_path_factory.mktemp("recal") / "run", max_steps=4)
    train(cfg)
    return cfg


def _version(trained: RunConfig, where: Path) -> Path:
    """A copy of the run's checkpoint, as a line keeps a version's."""
    target = where / "checkpoint"
    shutil.copytree(find_checkpoint(trained.run_dir).path, target)
    return target


def test_evaluation_fits_on_the_days_rows_at_any_rank_count(trained, tmp_path) -> None:
    checkpoint = _version(trained, tmp_path)
    alone = evaluate(trained.run_dir, checkpoint=checkpoint, eval_days=[2], recalibrate=0.25)
    fitted = alone["recalibration_fitted"]
    assert (fitted["day"], fitted["fit_rows"], fitted["judged_rows"]) == (2, 1500, 4500)
    assert fitted["rows"] == "spread"
    assert "recalibration" not in alone  # the checkpoint carries none yet
    first_alone = evaluate(
        trained.run_dir,
        checkpoint=checkpoint,
        eval_days=[2],
        recalibrate=0.25,
        recalibrate_rows="first",
    )["recalibration_fitted"]
    # The same rows' predictions from `score`, keyed by their day-row: the shifts are theirs.
    out = tmp_path / "scores"
    score_dataset(str(checkpoint), trained.data.url, out, days="2")
    table = pq.read_table(out).sort_by("row")
    rows = torch.tensor(table.column("row").to_numpy())
    probs = torch.tensor(table.column("prediction").to_numpy())
    labels = torch.tensor(table.column("label").to_numpy()).float()
    spread = _spread(rows, 1500)
    assert intercept_shift(probs[spread], labels[spread]) == pytest.approx(
        fitted["shift"], abs=1e-9
    )
    first = rows < 1500
    shift = intercept_shift(probs[first], labels[first])
    assert shift == pytest.approx(first_alone["shift"], abs=1e-9)
    assert abs(shift - fitted["shift"]) > 1e-6  # other rows, another shift
    # Two ranks read the day otherwise (each a share, in other batches): the same rows fit.
    jobs = launch_evaluation(
        trained.run_dir,
        2,
        checkpoint=str(checkpoint),
        eval_days=[2],
        recalibrate=0.25,
        recalibrate_rows="first",
    )
    assert jobs["recalibration_fitted"]["fit_rows"] == 1500
    assert jobs["recalibration_fitted"]["rows"] == "first"
    assert jobs["recalibration_fitted"]["shift"] == pytest.approx(first_alone["shift"], abs=1e-6)
    # A choice of rows that is none of them is refused before scoring, not recorded as a
    # day that gave no recalibration.
    with pytest.raises(ValueError, match="'middle' is not one of"):
        evaluate(trained.run_dir, eval_days=[2], recalibrate=0.25, recalibrate_rows="middle")
    # A recalibration is a day's: a window of two is refused in one line naming the key.
    with pytest.raises(WindowError, match="data.eval_days: a recalibration is fitted on one day"):
        keyed_loader(trained, None, None, DistEnv.from_env(), trained.data.url, None, [1, 2])


def test_a_checkpoint_with_a_shift_is_read_with_it_everywhere(trained, tmp_path) -> None:
    checkpoint = _version(trained, tmp_path)
    raw = evaluate(trained.run_dir, checkpoint=checkpoint, eval_days=[2], recalibrate=0.25)
    fitted = Recalibration(**raw["recalibration_fitted"])
    write_recalibration(checkpoint, fitted)
    applied = evaluate(trained.run_dir, checkpoint=checkpoint, eval_days=[2])
    assert applied["recalibration"] == {"shift": fitted.shift, "day": 2}
    # The ranking is the model's: a float32 logit plus a shift keeps every order, and only
    # merges a few neighbours within a rounding (a tie counts one half).
    assert applied["auc"] == pytest.approx(raw["auc"], abs=1e-6)
    assert applied["calibration"] != raw["calibration"]
    # The shift sits in the last bias: the export's, and the model score loads.
    bias = "dense_arch.top.2.bias"  # top_mlp [32], then the logit
    plain = load_checkpoint(trained.run_dir).model.state_dict()[bias]
    exported = tmp_path / "model.safetensors"
    export_model(checkpoint, exported)
    torch.testing.assert_close(load_file(exported)[bias], plain + fitted.shift, rtol=0, atol=1e-6)
    out = tmp_path / "scores"
    score_dataset(str(checkpoint), trained.data.url, out, days="2")
    got = pq.read_table(out).sort_by("row").column("prediction").to_numpy()
    score_dataset(trained.run_dir, trained.data.url, tmp_path / "raw", days="2")
    before = pq.read_table(tmp_path / "raw").sort_by("row").column("prediction").to_numpy()
    want = shifted(torch.tensor(before), fitted.shift).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
