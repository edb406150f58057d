"""Click-prediction metrics: AUC, log loss, normalized entropy (also after recalibration)
and calibration.

AUC comes from torchmetrics (exact, no threshold histogram) rather than being written here.
It is imported when a metric is first computed: torchmetrics brings matplotlib and sympy
with it (a noticeable part of every rank's start-up), which a run that never scores skips.

A dataset that declares a weight column (``FeatureSchema.weight``) is scored with every
row counting by its weight, as it counted in the training loss: an integer weight ``k``
scores as ``k`` copies of the row would. torchmetrics' AUROC takes no per-row weights, so
the weighted AUC is computed here, from the same definition (the chance that a positive
outranks a negative, ties counting one half), with each pair weighted by its rows' weights.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

_EPS = 1e-7

# The metrics that a weighted evaluation weights (listed under "weighted" in its result).
WEIGHTED_METRICS = ("auc", "logloss", "ne", "ne_recalibrated", "calibration", "positive_rate")


def log_loss(
    probs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> float:
    """Mean binary cross-entropy of probabilities, clipped away from 0 and 1; with
    ``weights``, the weighted mean (sum of weight x loss over the sum of weights)."""
    p = probs.double().clamp(_EPS, 1 - _EPS)
    y = labels.double()
    losses = -(y * p.log() + (1 - y) * (1 - p).log())
    if weights is None:
        return float(losses.mean())
    w = weights.double()
    return float((w * losses).sum() / w.sum())


def binary_entropy(rate: float) -> float:
    """Entropy (nats) of a Bernoulli with this rate: the log loss of always predicting it."""
    r = min(max(rate, _EPS), 1 - _EPS)
    return -(r * math.log(r) + (1 - r) * math.log(1 - r))


def intercept_shift(
    probs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> float:
    """The one shift of the logit that makes the mean prediction of these rows their
    positive rate (weighted where ``weights``): the maximum-likelihood intercept of a
    logistic regression whose offset is the model's logit. Found by bisection, to below
    1e-13, in float64: the mean prediction rises with the shift."""
    return _bisected_shift(*_logit_and_rate(probs, labels, weights))


def _logit_and_rate(
    probs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(each row's logit, float64, from probabilities clipped away from 0 and 1; each
    row's weight, 1 without ``weights``; the rows' positive rate, weighted)."""
    p = probs.double().clamp(_EPS, 1 - _EPS)
    y = labels.double()
    w = torch.ones_like(y) if weights is None else weights.double()
    return (p / (1 - p)).log(), w, float((w * y).sum() / w.sum())


def _bisected_shift(logit: torch.Tensor, w: torch.Tensor, rate: float) -> float:
    low, high = -40.0, 40.0
    for _ in range(50):  # halves an 80-wide bracket to below 1e-13
        mid = 0.5 * (low + high)
        if float((w * torch.sigmoid(logit + mid)).sum() / w.sum()) < rate:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def recalibrated_ne(
    probs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> float:
    """NE after the one shift of the logit that makes the mean prediction the positive rate
    of these rows (``intercept_shift``): what miscalibration does not count, so that a
    model's ranking and sharpness are judged apart from its calibration (TorchRec's NE
    with recalibration fixes the shift beforehand instead). The shift is fitted on the rows
    scored, so it is a diagnosis, not a deployable correction (``train.run.recalibration``
    fits one on other rows)."""
    logit, w, rate = _logit_and_rate(probs, labels, weights)
    shifted = torch.sigmoid(logit + _bisected_shift(logit, w, rate))
    return log_loss(shifted, labels.double(), weights) / binary_entropy(rate)


def weighted_auc(probs: torch.Tensor, clicks: torch.Tensor, weights: torch.Tensor) -> float:
    """The AUC with each (positive, negative) pair counted by the product of its weights:
    the weighted share of pairs the positive outranks, tied pairs counting one half.

    Exact (no threshold histogram): rows are grouped by distinct prediction, and each
    positive weight is matched with the negative weight below its prediction and half the
    negative weight at it. ``clicks`` are booleans.
    """
    p = probs.double().numpy()
    c = clicks.bool().numpy()
    w = weights.double().numpy()
    levels, level_of_row = np.unique(p, return_inverse=True)
    positive = np.bincount(level_of_row, weights=np.where(c, w, 0.0), minlength=len(levels))
    negative = np.bincount(level_of_row, weights=np.where(c, 0.0, w), minlength=len(levels))
    total_positive, total_negative = float(positive.sum()), float(negative.sum())
    if total_positive <= 0 or total_negative <= 0:
        raise ValueError("AUC needs positive and negative labels of non-zero weight")
    below = np.cumsum(negative) - negative
    ranked = float((positive * (below + 0.5 * negative)).sum())
    return ranked / (total_positive * total_negative)


def click_metrics(
    probs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> dict[str, Any]:
    """AUC, log loss, NE (log loss over the entropy of the positive rate), NE after the
    intercept shift that calibrates the predictions on these rows (``recalibrated_ne``),
    calibration.

    Calibration is mean prediction over positive rate: 1.0 is perfect, above 1 over-predicts.
    With ``weights`` (one per row, from the dataset's weight column) every metric but
    ``rows`` is weighted: calibration is then sum(w * p) / sum(w * y), and the result
    names the weighted metrics under ``"weighted"`` and adds ``"weight_sum"``.
    """
    if probs.numel() == 0:
        raise ValueError("no predictions to evaluate")
    if weights is not None:
        return _weighted_click_metrics(probs, labels, weights)
    labels = labels.float()
    positive_rate = float(labels.mean())
    if positive_rate in (0.0, 1.0):
        raise ValueError("AUC needs both positive and negative labels")
    from torchmetrics.functional.classification import binary_auroc

    loss = log_loss(probs, labels)
    return {
        # Soft labels (floats in [0, 1]) count as clicks from 0.5 up in the AUC alone; the
        # log loss and calibration take them as they are.
        # float64 predictions (a recalibration's) as they are: float32 could tie some.
        "auc": float(binary_auroc(_auc_dtype(probs), (labels >= 0.5).long())),
        "logloss": loss,
        "ne": loss / binary_entropy(positive_rate),
        "ne_recalibrated": recalibrated_ne(probs, labels),
        "calibration": float(probs.double().mean()) / positive_rate,
        "positive_rate": positive_rate,
        "rows": int(labels.numel()),
    }


def _auc_dtype(probs: torch.Tensor) -> torch.Tensor:
    return probs if probs.dtype == torch.float64 else probs.float()


def _weighted_click_metrics(
    probs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> dict[str, Any]:
    """``click_metrics`` with every row counted by its weight."""
    labels = labels.float()
    w = weights.double()
    weight_sum = float(w.sum())
    if not weight_sum > 0:
        raise ValueError("the weights of the evaluated rows sum to 0: nothing to evaluate")
    positive_rate = float((w * labels.double()).sum()) / weight_sum
    if positive_rate <= 0.0 or positive_rate >= 1.0:
        raise ValueError("AUC needs both positive and negative labels of non-zero weight")
    loss = log_loss(probs, labels, weights)
    return {
        # Soft labels count as clicks from 0.5 up in the AUC alone, as unweighted.
        "auc": weighted_auc(probs, labels >= 0.5, weights),
        "logloss": loss,
        "ne": loss / binary_entropy(positive_rate),
        "ne_recalibrated": recalibrated_ne(probs, labels, weights),
        "calibration": float((w * probs.double()).sum()) / weight_sum / positive_rate,
        "positive_rate": positive_rate,
        "rows": int(labels.numel()),
        "weight_sum": weight_sum,
        "weighted": list(WEIGHTED_METRICS),
    }
