"""Click-prediction metrics: AUC, log loss, normalized entropy and calibration.

AUC comes from torchmetrics (exact, no threshold histogram) rather than being written here.
It is imported when a metric is first computed: torchmetrics brings matplotlib and sympy
with it (0.8 s of every rank's start-up, measured), which a run that never scores skips.
"""

from __future__ import annotations

import math

import torch

_EPS = 1e-7


def log_loss(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of probabilities, clipped away from 0 and 1."""
    p = probs.double().clamp(_EPS, 1 - _EPS)
    y = labels.double()
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def binary_entropy(rate: float) -> float:
    """Entropy (nats) of a Bernoulli with this rate: the log loss of always predicting it."""
    r = min(max(rate, _EPS), 1 - _EPS)
    return -(r * math.log(r) + (1 - r) * math.log(1 - r))


def click_metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """AUC, log loss, NE (log loss over the entropy of the positive rate), calibration.

    Calibration is mean prediction over positive rate: 1.0 is perfect, above 1 over-predicts.
    """
    if probs.numel() == 0:
        raise ValueError("no predictions to evaluate")
    labels = labels.float()
    positive_rate = float(labels.mean())
    if positive_rate in (0.0, 1.0):
        raise ValueError("AUC needs both positive and negative labels")
    from torchmetrics.functional.classification import binary_auroc

    loss = log_loss(probs, labels)
    return {
        # Soft labels (floats in [0, 1]) count as clicks from 0.5 up in the AUC alone; the
        # log loss and calibration take them as they are.
        "auc": float(binary_auroc(probs.float(), (labels >= 0.5).long())),
        "logloss": loss,
        "ne": loss / binary_entropy(positive_rate),
        "calibration": float(probs.double().mean()) / positive_rate,
        "positive_rate": positive_rate,
        "rows": int(labels.numel()),
    }
