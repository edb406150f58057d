"""``data.drift``: synthetic days whose click model and IDs move from day to day, so that a
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


def test_day_zero_is_the_iid_day_zero_and_later_days_bring_new_ids(tmp_path: Path) -> None:
    iid, drifting = tmp_path / "iid", tmp_path / "drift"
    _generate(iid)
    _generate(drifting, drift=0.3)
    [iid_day0] = (iid / "day=0").glob("*.parquet")
    [drift_day0] = (drifting / "day=0").glob("*.parquet")
    assert drift_day0.name != iid_day0.name  # another dataset, another name
    assert drift_day0.read_bytes() == iid_day0.read_bytes()

    def unseen(url: Path, day: int) -> float:
        seen, today = _ids(url, 0), _ids(url, day)
        return len(today - seen) / len(today)

    # IDs of day 3 never seen on day 0: the Zipf tail alone in i.i.d. days, many more with
    # drift, and more the further from day 0.
    assert unseen(drifting, 3) > unseen(drifting, 1) > unseen(iid, 1)
    assert unseen(drifting, 3) > unseen(iid, 3) + 0.1
    manifest = read_manifest(str(drifting))
    assert manifest.generator["drift"] == 0.3
    assert manifest.cardinalities == read_manifest(str(iid)).cardinalities  # tables keep size
    assert all(0.5 < f.bayes_auc < 1 for f in manifest.files)


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
    # its effects have moved since, and the ranks new IDs took over keep old IDs' effects.
    stale = synthetic._sample_rows(day0, np.random.default_rng(0), 20_000, False).logit
    new = synthetic._numbers(truth.sparse[2], np.arange(truth.sparse[2].cardinality))
    assert new.max() >= truth.sparse[2].cardinality  # IDs beyond day 0's numbers exist
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
