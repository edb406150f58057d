"""``data.churn``: synthetic days whose ID space turns over, IDs born at random popularity
ranks, older ones pushed down and the least popular dropped for good; without it the
days are as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dlrmflow.config import ConfigError, DataConfig, load_config
from dlrmflow.ingest import synthetic
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.synthetic_logs import generate_logs_dataset
from tests.ingest.test_drift import SMALL, _generate, _ids


def test_churn_brings_ids_never_seen_and_drops_old_ones(tmp_path: Path) -> None:
    still, churning = tmp_path / "still", tmp_path / "churn"
    _generate(still)
    _generate(churning, churn=0.3)
    [still_day0] = (still / "day=0").glob("*.parquet")
    [churn_day0] = (churning / "day=0").glob("*.parquet")
    assert churn_day0.name != still_day0.name  # another dataset, another name
    assert churn_day0.read_bytes() == still_day0.read_bytes()

    def unseen(url: Path, day: int) -> float:
        seen, today = _ids(url, 0), _ids(url, day)
        return len(today - seen) / len(today)

    def gone(url: Path, day: int) -> float:
        first, today = _ids(url, 0), _ids(url, day)
        return len(first - today) / len(first)

    # New IDs each day, more the further from day 0; day 0's IDs disappear as they go.
    assert unseen(churning, 3) > unseen(churning, 1) > unseen(still, 1) + 0.05
    assert gone(churning, 3) > gone(still, 3) + 0.1
    manifest = read_manifest(str(churning))
    assert manifest.generator["churn"] == 0.3 and "churn" not in read_manifest(str(still)).generator
    assert manifest.cardinalities == read_manifest(str(still)).cardinalities  # live IDs a day
    assert all(0.5 < f.bayes_auc < 1 for f in manifest.files)


def test_a_day_of_churn_inserts_newcomers_pushes_older_ids_down_and_drops_the_last() -> None:
    config = DataConfig(url="unused", **{**SMALL, "churn": 0.25})
    before = synthetic._ground_truth(config)
    after = synthetic._churned(before, config, 1)
    for old, new in zip(before.sparse, after.sparse, strict=True):
        n = old.cardinality
        born = round(0.25 * n)
        numbers = synthetic._numbers(new, np.arange(n))
        fresh = numbers >= n  # day 0's numbers are its ranks 0..n-1
        assert fresh.sum() == born and len(set(numbers)) == n
        # The survivors are day 0's first n - born ranks, in their order, each one rank
        # lower for every newcomer above it; each keeps its effect.
        survivors = numbers[~fresh]
        assert np.array_equal(survivors, np.arange(n - born))
        assert (np.flatnonzero(~fresh) >= survivors).all()
        assert np.array_equal(new.effect[~fresh], old.effect[: n - born])
        assert np.array_equal(new.latent[:, ~fresh], old.latent[:, : n - born])


def test_a_churning_dataset_grows_by_a_day_as_it_generates_whole(tmp_path: Path) -> None:
    grown, whole = tmp_path / "grown", tmp_path / "whole"
    _generate(grown, churn=0.2, drift=0.1, days=3)
    _generate(grown, churn=0.2, drift=0.1, days=4)
    _generate(whole, churn=0.2, drift=0.1, days=4)
    assert read_manifest(str(grown)) == read_manifest(str(whole))


@pytest.mark.parametrize("bad", ["-0.1", "1", "1.5"])
def test_churn_is_a_share_below_1(bad: str) -> None:
    with pytest.raises(ConfigError, match="data.churn"):
        load_config(None, [f"data.churn={bad}"])


def test_the_logs_shape_refuses_churn_in_one_line(tmp_path: Path) -> None:
    config = DataConfig(url=str(tmp_path / "logs"), days=2, rows_per_day=100, churn=0.1)
    with pytest.raises(ConfigError, match=r"^data\.churn: the logs shape has no churn"):
        generate_logs_dataset(config)
