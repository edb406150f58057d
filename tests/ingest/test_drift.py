"""``data.drift``: synthetic days whose click model moves from day to day, so that a
model trained on earlier days goes stale; without it the days stay i.i.d. as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from dlrmflow.config import DataConfig
from dlrmflow.ingest import synthetic
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.synthetic import generate_dataset
from tests.conftest import TINY_DATA

SMALL = {**TINY_DATA, "rows_per_day": 4000, "row_group_size": 2000, "days": 4}
COLUMN = "C3"  # one of the larger tables at this scale


def _generate(url: Path, **changes: object) -> DataConfig:
    config = DataConfig(url=str(url), **{**SMALL, **changes})
    generate_dataset(config)
    return config


def _ids(url: Path, day: int) -> set[int]:
    [path] = (url / f"day={day}").glob("*.parquet")
    return set(pq.read_table(path, columns=[COLUMN]).column(0).drop_null().to_pylist())


def test_day_zero_is_the_iid_day_zero_and_drift_moves_effects_not_ids(tmp_path: Path) -> None:
    iid, drifting = tmp_path / "iid", tmp_path / "drift"
    _generate(iid)
    _generate(drifting, drift=0.3)
    [iid_day0] = (iid / "day=0").glob("*.parquet")
    [drift_day0] = (drifting / "day=0").glob("*.parquet")
    assert drift_day0.name != iid_day0.name  # another dataset, another name
    assert drift_day0.read_bytes() == iid_day0.read_bytes()
    # The same IDs are drawn as on i.i.d. days (churn, not drift, brings new ones).
    for day in (1, 3):
        assert _ids(drifting, day) == _ids(iid, day)
    manifest = read_manifest(str(drifting))
    assert manifest.generator["drift"] == 0.3
    assert manifest.cardinalities == read_manifest(str(iid)).cardinalities  # tables keep size
    assert all(0.5 < f.bayes_auc < 1 for f in manifest.files)


def test_the_click_rate_walks_a_few_percent_a_day_and_the_reference_is_recorded(
    tmp_path: Path,
) -> None:
    """Each day's bias is set to the day's rate, so the effects' drift no longer drags it;
    the rate walks ``base_rate_step`` (0.03 in log-odds by default) a day."""
    _generate(tmp_path / "d", drift=0.3, rows_per_day=20_000, row_group_size=10_000)
    files = read_manifest(str(tmp_path / "d")).files
    assert files[0].target_rate == 0.25 and files[0].reference_calibration is None
    for before, day in zip(files, files[1:], strict=False):
        assert abs(day.positive_rate / day.target_rate - 1) < 0.05  # 20,000 rows' noise
        assert abs(day.target_rate / before.target_rate - 1) < 0.1
        # The day before's Bayes model is off by the rate's move and the effects' step:
        # recorded, and near 1 at this drift rather than off by half.
        assert 0.75 < day.reference_calibration < 1.3
    iid = DataConfig(url="unused", **SMALL)
    assert synthetic.base_rate_step(iid) == 0 and not synthetic.steers_rate(iid)


def test_a_weekly_cycle_moves_the_rate_with_the_day_of_the_week(tmp_path: Path) -> None:
    config = DataConfig(url="unused", **{**SMALL, "drift": 0.1, "base_rate_step": 0.0,
                                         "weekly": 0.4})  # fmt: skip
    rates = [synthetic.target_rate(config, day) for day in range(15)]
    assert rates[0] == pytest.approx(0.25)
    assert rates[7] == pytest.approx(rates[0]) and rates[8] == pytest.approx(rates[1])
    assert max(rates) > 0.3 and min(rates) < 0.2  # log-odds +-0.4 around 0.25


def test_the_click_model_of_day_zero_goes_stale(tmp_path: Path) -> None:
    config = DataConfig(url=str(tmp_path), **{**SMALL, "drift": 0.3})
    day0 = synthetic._ground_truth(config)
    truth = day0
    for day in range(1, 4):
        truth = synthetic._drifted(truth, config, day)
    rows = synthetic._sample_rows(truth, np.random.default_rng(0), 20_000, False)
    labels = np.random.default_rng(1).random(20_000) < synthetic.sigmoid(rows.logit + truth.bias)

    def auc(logit: np.ndarray) -> float:
        return float(binary_auroc(torch.from_numpy(logit), torch.from_numpy(labels.astype(int))))

    # The same rows (the same draws of ranks and counts) scored by day 0's click model:
    # its effects have moved since.
    stale = synthetic._sample_rows(day0, np.random.default_rng(0), 20_000, False).logit
    assert auc(rows.logit) > auc(stale) + 0.02


def test_a_drifting_dataset_grows_by_a_day_as_it_generates_whole(tmp_path: Path) -> None:
    grown, whole = tmp_path / "grown", tmp_path / "whole"
    _generate(grown, drift=0.2, days=3)
    _generate(grown, drift=0.2, days=4)
    _generate(whole, drift=0.2, days=4)
    assert read_manifest(str(grown)) == read_manifest(str(whole))


@pytest.mark.parametrize("bad", ["-0.1", "1.5"])
def test_drift_is_a_share_between_0_and_1(bad: str) -> None:
    from dlrmflow.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="data.drift"):
        load_config(None, [f"data.drift={bad}"])
