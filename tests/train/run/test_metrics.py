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
