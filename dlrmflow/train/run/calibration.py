"""A click model's calibration: its reliability table (predicted against observed click
rate, by bin of prediction), the calibration error over it, and its plot
(``RUN_DIR/reliability.png``).

Calibration (the mean prediction over the click rate) can be 1.0 while the model
over-predicts its confident rows and under-predicts the rest; the table shows where. Its
bins hold equal numbers of rows, as click predictions crowd into a small part of [0, 1]
and equal-width bins would leave most of them empty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

RELIABILITY_FILE = "reliability.png"
BINS = 15


def reliability_table(
    probs: torch.Tensor,
    labels: torch.Tensor,
    bins: int = BINS,
    weights: torch.Tensor | None = None,
) -> list[dict[str, Any]]:
    """``bins`` bins of about equal rows, by increasing prediction: each one's rows, its
    predictions' range and mean, and its observed click rate.

    With ``weights`` (a dataset's weight column) the bins still hold equal rows, but their
    mean prediction and click rate are weighted, as the weighted calibration is, and each
    bin carries its ``weight`` (the sum of its rows' weights)."""
    order = torch.argsort(probs.double(), stable=True)
    p, y = probs.double()[order], labels.double()[order]
    w_bins = weights.double()[order].tensor_split(bins) if weights is not None else None
    table = []
    for number, (pb, yb) in enumerate(zip(p.tensor_split(bins), y.tensor_split(bins), strict=True)):
        if pb.numel() == 0:
            continue
        row: dict[str, Any] = {
            "bin": number,
            "rows": int(pb.numel()),
            "low": float(pb[0]),
            "high": float(pb[-1]),
            "predicted": float(pb.mean()),
            "observed": float(yb.mean()),
        }
        if w_bins is not None:
            wb = w_bins[number]
            weight = float(wb.sum())
            row["weight"] = weight
            # A bin whose rows all weigh 0 says nothing of calibration: its plain means.
            if weight > 0:
                row["predicted"] = float((wb * pb).sum()) / weight
                row["observed"] = float((wb * yb).sum()) / weight
        table.append(row)
    return table


def calibration_error(table: list[dict[str, Any]]) -> float:
    """The rows-weighted mean of |predicted - observed| over the bins (the expected
    calibration error of these bins); weight-weighted for a table with bin weights."""
    size = "weight" if all("weight" in b for b in table) else "rows"
    total = sum(b[size] for b in table)
    return sum(b[size] * abs(b["predicted"] - b["observed"]) for b in table) / total


def plot_reliability(table: list[dict[str, Any]], path: str | Path) -> Path:
    """Observed against predicted click rate per bin, beside the diagonal of a calibrated
    model, into a PNG (matplotlib's Agg canvas, no pyplot state)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(4.5, 4.5), layout="constrained")
    axes = figure.add_subplot()
    top = max(max(b["predicted"], b["observed"]) for b in table) * 1.05
    axes.plot([0, top], [0, top], color="grey", linestyle="--", label="calibrated")
    axes.plot(
        [b["predicted"] for b in table],
        [b["observed"] for b in table],
        marker="o",
        color="tab:blue",
        label=f"model ({len(table)} bins of equal rows)",
    )
    axes.set_xlabel("mean predicted click rate")
    axes.set_ylabel("observed click rate")
    axes.set_xlim(0, top)
    axes.set_ylim(0, top)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left")
    path = Path(path)
    figure.savefig(path, dpi=100, format="png")
    return path
