"""A model's recalibration: one shift of its logit, fitted on rows it did not train on.

A model line's version is validated on the day after its last, which no version has
trained on. A ``share`` of the day's rows fits the shift that makes the version's mean
prediction their click rate (the intercept of a logistic regression with the version's
logit as offset, the one parameter He et al. 2014 and TorchRec's recalibrated metrics
correct); the rest of the day judges it: calibration and NE before and after, on the same
rows, and the AUC, which a shift of every logit cannot change (it keeps their order).

Which rows fit it (``FIT_ROWS``), by each row's place in the day's order (its files as the
manifest lists them, each file's row groups in order):

* ``spread`` (the default): rows spread evenly over the day, those whose place times the
  golden ratio has the smallest fractional parts (a low-discrepancy sequence: every
  stretch of the day gives close to its share). The fit and the judged rows come from the
  same hours, so the judged calibration says what the shift does on the day, whatever
  the day's order.
* ``first``: the day's first rows, its first hours for logs written in time order, as
  a version recalibrated on one day's start serves its rest. Where a "day" is long and
  its start unlike the rest (MovieLens's weeks: their first quarter is a few users'
  sessions), the shift fits the start only.

The shift travels with the version's checkpoint (``recalibration.json`` in its directory,
beside the files its manifest lists, so a checkpoint's integrity check never sees it):
every reader of that checkpoint (``evaluate``, ``score``, both exports) loads the model
with the shift folded into the bias of its last layer, so the exported program applies
it without knowing of it. Training never reads it: a run resumes from its own
checkpoints, whose directories never hold one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.train.run.metrics import click_metrics, intercept_shift

RECALIBRATION_FILE = "recalibration.json"
FIT_ROWS = ("spread", "first")  # which of the day's rows fit the shift (see above)
# The fractional part of a row's place times this spreads the rows that fit: 1 / phi.
_GOLDEN = 0.6180339887498949
# What the judged rows' metrics record, before and after the shift.
JUDGED = ("auc", "calibration", "ne", "logloss")


@dataclass(frozen=True)
class Recalibration:
    """A shift of the logit, the day and rows it was fitted on, and what it did to the
    day's other rows (``before`` and ``after``: ``JUDGED`` metrics of the judged rows)."""

    shift: float
    day: int
    fit_rows: int  # how many of the day's rows fitted it
    judged_rows: int  # the day's other rows
    before: dict[str, float]
    after: dict[str, float]
    rows: str = "first"  # which rows fitted it (FIT_ROWS; records before spread: first)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_recalibration(
    probs: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    day_rows: torch.Tensor,
    day: int,
    share: float,
    rows: str = "spread",
) -> Recalibration:
    """Fit the shift on ``share`` of the scored rows, chosen by ``rows`` (``FIT_ROWS``)
    from their day-rows (``day_rows``: each scored row's index in its day), and judge it
    on the others.

    At least one row is fitted on and one judged. A ``ValueError`` says why a day gives no
    recalibration: a day of one row cannot be split; rows to fit of one class have no
    finite shift (the mean prediction cannot reach a click rate of 0 or 1), and rows to
    judge of one class no AUC."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"the share of rows to fit on must lie in (0, 1), got {share}")
    check_fit_rows(rows)
    total = int(day_rows.numel())
    if total < 2:
        raise ValueError(f"day {day}: {total} row(s) cannot be split into rows to fit and judge")
    cut = min(max(1, round(share * total)), total - 1)
    # Ranked by place in the day, or by the place's golden-ratio fraction: ``cut`` rows.
    rank = day_rows if rows == "first" else torch.frac(day_rows.double() * _GOLDEN)
    fit = torch.zeros(total, dtype=torch.bool, device=day_rows.device)
    fit[torch.argsort(rank, stable=True)[:cut]] = True
    judged = ~fit

    def part(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return probs[mask], labels[mask], None if weights is None else weights[mask]

    fit_probs, fit_labels, fit_weights = part(fit)
    clicked = fit_labels >= 0.5
    if fit_weights is not None:
        counted = fit_weights > 0
        clicked, unclicked = clicked & counted, ~clicked & counted
    else:
        unclicked = ~clicked
    if not bool(clicked.any()) or not bool(unclicked.any()):
        which = f"its first {cut} rows" if rows == "first" else f"the {cut} rows to fit on"
        raise ValueError(f"day {day}: {which} are all of one class: no shift fits")
    shift = intercept_shift(fit_probs, fit_labels, fit_weights)
    p, y, w = part(judged)
    before, after = click_metrics(p, y, w), click_metrics(shifted(p, shift), y, w)
    return Recalibration(
        shift=shift,
        day=day,
        fit_rows=cut,
        judged_rows=int(judged.sum()),
        before={k: before[k] for k in JUDGED},
        after={k: after[k] for k in JUDGED},
        rows=rows,
    )


def check_fit_rows(rows: str) -> None:
    """Refuse, in one line, a choice of rows to fit on that is not one of ``FIT_ROWS``."""
    if rows not in FIT_ROWS:
        raise ValueError(f"rows to fit a recalibration on: {rows!r} is not one of {FIT_ROWS}")


def shifted(probs: torch.Tensor, shift: float) -> torch.Tensor:
    """``probs`` with ``shift`` added to their logit, in float64: distinct predictions stay
    distinct and in order (float32 would merge a few neighbours, which moves the AUC in
    its last bits: a tie counts one half)."""
    p = probs.double().clamp(1e-12, 1 - 1e-12)
    return torch.sigmoid((p / (1 - p)).log() + shift)


def write_recalibration(checkpoint: Path, recalibration: Recalibration) -> None:
    """Give the checkpoint at ``checkpoint`` (a version's directory of it) the shift."""
    text = json.dumps(recalibration.to_dict(), indent=1) + "\n"
    write_atomic(Path(checkpoint) / RECALIBRATION_FILE, text)


def read_recalibration(checkpoint: Path) -> Recalibration | None:
    """The shift a checkpoint carries, None when it carries none."""
    path = Path(checkpoint) / RECALIBRATION_FILE
    if not path.is_file():
        return None
    return Recalibration(**json.loads(path.read_text()))


def apply_recalibration(checkpoint: Path, dense_arch: nn.Module) -> Recalibration | None:
    """Fold the shift the checkpoint at ``checkpoint`` carries (if any) into ``dense_arch``,
    the model just loaded from it: how every reader of a checkpoint loads it. The shift,
    or None."""
    recalibration = read_recalibration(checkpoint)
    if recalibration is not None:
        fold_into_bias(dense_arch, recalibration.shift)
    return recalibration


def drop_recalibration(checkpoint: Path) -> None:
    """Take the shift off a checkpoint (before it is fitted again, on raw predictions)."""
    (Path(checkpoint) / RECALIBRATION_FILE).unlink(missing_ok=True)


def fold_into_bias(dense_arch: nn.Module, shift: float) -> None:
    """Add ``shift`` to the bias of the last linear layer of ``dense_arch``, whose single
    output is the logit: every prediction's logit moves by ``shift``."""
    last = [m for m in dense_arch.modules() if isinstance(m, nn.Linear)][-1]
    if last.out_features != 1 or last.bias is None:
        raise ValueError("the model's last linear layer does not give the logit: cannot shift it")
    with torch.no_grad():
        last.bias += shift
