import math

import pytest
import torch

from dlrmflow.train.run.metrics import WEIGHTED_METRICS, binary_entropy, click_metrics, log_loss


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


def test_recalibrated_ne_forgives_a_shifted_intercept_and_nothing_else():
    """A well calibrated model's predictions, then the same predictions with the logit
    shifted by 1: NE worsens, the recalibrated NE is the calibrated model's, the AUC is
    the same; a constant prediction stays at NE 1 either way."""
    generator = torch.Generator().manual_seed(0)
    logit = torch.randn(20_000, generator=generator, dtype=torch.float64)
    labels = torch.rand(20_000, generator=generator, dtype=torch.float64) < torch.sigmoid(logit)
    calibrated = click_metrics(torch.sigmoid(logit), labels)
    shifted = click_metrics(torch.sigmoid(logit + 1.0), labels)
    assert shifted["ne"] > calibrated["ne"] + 0.05 and shifted["calibration"] > 1.3
    assert shifted["ne_recalibrated"] == pytest.approx(calibrated["ne_recalibrated"], rel=1e-9)
    # Already calibrated: recalibrating changes NE by the sample's own miscalibration only.
    assert calibrated["ne_recalibrated"] == pytest.approx(calibrated["ne"], abs=1e-3)
    assert calibrated["ne_recalibrated"] <= calibrated["ne"]
    # A monotone shift: the same ranking, up to the float32 rounding of the probabilities.
    assert shifted["auc"] == pytest.approx(calibrated["auc"], abs=1e-6)
    constant = click_metrics(torch.full((100,), 0.6), torch.tensor([1, 0, 0, 0] * 25))
    assert constant["ne"] > 1.2 and constant["ne_recalibrated"] == pytest.approx(1.0)


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
    from dlrmflow.train.run.calibration import calibration_error, reliability_table

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


def _weighted_case(n: int = 400, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Predictions with many ties (two decimals), labels, and integer weights 0-3."""
    generator = torch.Generator().manual_seed(seed)
    probs = (torch.rand(n, generator=generator) * 98 + 1).round() / 100
    labels = (torch.rand(n, generator=generator) < probs).float()
    weights = torch.randint(0, 4, (n,), generator=generator).float()
    return probs, labels, weights


def test_integer_weights_score_as_that_many_copies_of_each_row():
    """A row of weight k counts as k copies of it (0: as if absent), in every metric."""
    probs, labels, weights = _weighted_case()
    got = click_metrics(probs, labels, weights)
    copies = weights.long()
    want = click_metrics(probs.repeat_interleave(copies), labels.repeat_interleave(copies))
    assert got["logloss"] == pytest.approx(want["logloss"], rel=1e-12, abs=0)
    # The copies' AUC (torchmetrics') and positive rate (which NE and calibration divide
    # by) are float32s; the weighted ones float64s.
    for name in ("auc", "ne", "ne_recalibrated", "calibration", "positive_rate"):
        assert got[name] == pytest.approx(want[name], rel=1e-6, abs=0), name
    assert got["rows"] == 400 and got["weight_sum"] == float(weights.sum())
    assert got["weighted"] == list(WEIGHTED_METRICS)  # every metric but the row count
    plain = click_metrics(probs, labels)
    assert "weighted" not in plain and "weight_sum" not in plain
    assert abs(plain["auc"] - got["auc"]) > 1e-3  # the weights do change the AUC here


def test_weighted_auc_and_calibration_match_their_definitions():
    """Fractional weights and ties: the AUC by counting every (positive, negative) pair
    with the product of their weights (ties one half); calibration sum(w p) / sum(w y)."""
    probs, labels, _ = _weighted_case(120, seed=1)
    weights = torch.rand(120, generator=torch.Generator().manual_seed(2)) * 3
    p, y, w = probs.double(), labels.bool(), weights.double()
    pair = w[y][:, None] * w[~y][None, :]
    above = (p[y][:, None] > p[~y][None, :]).double()
    tied = (p[y][:, None] == p[~y][None, :]).double()
    assert tied.sum() > 0
    auc = float((pair * (above + 0.5 * tied)).sum() / pair.sum())
    got = click_metrics(probs, labels, weights)
    assert got["auc"] == pytest.approx(auc, rel=1e-12)
    calibration = float((w * p).sum() / (w * labels.double()).sum())
    assert got["calibration"] == pytest.approx(calibration, rel=1e-12)
    assert got["logloss"] == pytest.approx(log_loss(probs, labels, weights), rel=0)
    losses = -(labels.double() * p.log() + (1 - labels.double()) * (1 - p).log())
    assert got["logloss"] == pytest.approx(float((w * losses).sum() / w.sum()), rel=1e-12)


def test_weights_that_leave_nothing_to_score_fail_clearly():
    probs, labels = torch.tensor([0.2, 0.7, 0.4]), torch.tensor([0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="weights of the evaluated rows sum to 0"):
        click_metrics(probs, labels, torch.zeros(3))
    with pytest.raises(ValueError, match="positive and negative labels of non-zero weight"):
        click_metrics(probs, labels, torch.tensor([0.0, 1.0, 2.0]))


def test_a_weighted_reliability_table_weights_each_bin():
    """Equal rows per bin as unweighted, with each bin's means and the calibration error
    weighted; unweighted tables are as they were."""
    from dlrmflow.train.run.calibration import calibration_error, reliability_table

    probs, labels, weights = _weighted_case(300, seed=3)
    table = reliability_table(probs, labels, bins=3, weights=weights)
    plain = reliability_table(probs, labels, bins=3)
    assert [b["rows"] for b in table] == [b["rows"] for b in plain] == [100, 100, 100]
    assert all("weight" not in b for b in plain)
    order = torch.argsort(probs.double(), stable=True)
    p, y, w = probs.double()[order], labels.double()[order], weights.double()[order]
    bins = zip(p.split(100), y.split(100), w.split(100), strict=True)
    for b, (pb, yb, wb) in zip(table, bins, strict=True):
        assert b["weight"] == float(wb.sum())
        assert b["predicted"] == pytest.approx(float((wb * pb).sum() / wb.sum()), rel=1e-12)
        assert b["observed"] == pytest.approx(float((wb * yb).sum() / wb.sum()), rel=1e-12)
    error = sum(b["weight"] * abs(b["predicted"] - b["observed"]) for b in table)
    assert calibration_error(table) == pytest.approx(error / float(weights.sum()), rel=1e-12)
    assert calibration_error(table) != calibration_error(plain)
