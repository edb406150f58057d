import math

import pytest
import torch

from dlrmflow.train.run.metrics import binary_entropy, click_metrics, log_loss


def test_auc_matches_pair_counting():
    probs = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.7, 0.2])
    labels = torch.tensor([0, 0, 1, 1, 0, 1])
    pos = probs[labels == 1]
    neg = probs[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).float().mean().item()
    assert click_metrics(probs, labels)["auc"] == pytest.approx(pairs)


def test_constant_prediction_at_base_rate_has_ne_one_and_calibration_one():
    labels = torch.tensor([1, 0, 0, 0] * 25)
    probs = torch.full((100,), 0.25)
    m = click_metrics(probs, labels)
    assert m["ne"] == pytest.approx(1.0)
    assert m["calibration"] == pytest.approx(1.0)
    assert m["logloss"] == pytest.approx(binary_entropy(0.25))
    assert m["positive_rate"] == 0.25 and m["rows"] == 100


def test_log_loss_is_clipped_and_exact():
    assert log_loss(torch.tensor([0.9]), torch.tensor([1.0])) == pytest.approx(-math.log(0.9))
    assert math.isfinite(log_loss(torch.tensor([0.0]), torch.tensor([1.0])))


def test_degenerate_inputs_fail_clearly():
    with pytest.raises(ValueError, match="no predictions"):
        click_metrics(torch.tensor([]), torch.tensor([]))
    with pytest.raises(ValueError, match="both positive and negative"):
        click_metrics(torch.tensor([0.2, 0.3]), torch.tensor([1, 1]))


def test_reliability_bins_hold_equal_rows_and_show_where_a_model_is_off():
    """Labels drawn at half the predicted rate: every bin observes half its prediction,
    so the table shows the over-prediction bin by bin."""
    from dlrmflow.train.run.reliability import calibration_error, reliability_table

    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(150_000, generator=generator) * 0.6
    labels = (torch.rand(150_000, generator=generator) < probs / 2).long()
    table = reliability_table(probs, labels, bins=15)
    assert [b["bin"] for b in table] == list(range(15))
    assert all(b["rows"] == 10_000 for b in table)
    assert all(a["high"] <= b["low"] for a, b in zip(table, table[1:], strict=False))
    for b in table:
        assert b["low"] <= b["predicted"] <= b["high"]
        assert b["observed"] == pytest.approx(b["predicted"] / 2, abs=0.012)
    assert calibration_error(table) == pytest.approx(float(probs.mean()) / 2, abs=0.003)
    honest = (torch.rand(150_000, generator=generator) < probs).long()
    assert calibration_error(reliability_table(probs, honest)) < 0.01
    # Fewer rows than bins: no empty bin.
    assert [b["rows"] for b in reliability_table(probs[:3], labels[:3], bins=15)] == [1, 1, 1]


def test_soft_labels_count_as_clicks_from_one_half_in_the_auc_alone():
    probs = torch.tensor([0.9, 0.2, 0.6, 0.3, 0.7])
    soft = torch.tensor([0.8, 0.1, 0.5, 0.4, 0.2])
    got = click_metrics(probs, soft)
    hard = click_metrics(probs, torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0]))
    assert got["auc"] == hard["auc"]
    assert got["logloss"] == log_loss(probs, soft) != hard["logloss"]
    assert got["positive_rate"] == pytest.approx(float(soft.mean()))
