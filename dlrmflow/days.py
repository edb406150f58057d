"""Day windows: which days of a dataset a run trains on (``data.train_days``) and which it
is scored on (``data.eval_days``).

A window is written as a list of days (``[0, 1, 5]``) or as text: comma-separated terms,
each a day (``5``), a range of days with both ends included (``0-22``), or a form relative
to the days the dataset has when the run starts: ``all``, ``first N``, ``last N`` (``last``
alone is the last day) and ``all_but_last N`` (``all_but_last``: every day but the last).
Relative forms let one configuration follow a dataset that grows by a day at a time.
``data.eval_days: none`` holds no day out: every day may be trained on (a model line
scores each version on the next day instead).

The syntax is checked with the configuration (``parse_window``); the days themselves only
against a dataset's manifest (``select_days``), where a day it does not have, a window
that selects nothing, or a day both trained and evaluated on is one line naming the key
and the day. Unset, the windows are what they always were: the dataset's test day (its
last) is evaluated on and every other day trained on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from dlrmflow.errors import DlrmflowError

TRAIN_KEY = "data.train_days"
EVAL_KEY = "data.eval_days"
RELATIVE = ("all", "first", "last", "all_but_last")
_TERM = re.compile(r"(\d+)(?:\s*-\s*(\d+))?|(all_but_last|first|last|all)(?:\s+(\d+))?")

Window = str | list[int] | None


class WindowError(DlrmflowError, ValueError):
    """A window that is not one, or selects days the dataset does not have."""


@dataclass(frozen=True)
class _Term:
    kind: str  # "days" (first..last, inclusive) or one of RELATIVE
    first: int = 0
    last: int = 0


NONE = "none"  # data.eval_days: no day held out


def parse_window(value: str | Sequence[int]) -> list[_Term]:
    """The terms of a window, or a ``WindowError`` saying what a window looks like."""
    if value == NONE:
        return []
    if not isinstance(value, str):
        days = list(value)
        if not days:
            raise WindowError("an empty list selects no day")
        for day in days:
            if isinstance(day, bool) or not isinstance(day, int) or day < 0:
                raise WindowError(f"{day!r} is not a day (days are numbers from 0)")
        return [_Term("days", day, day) for day in days]
    terms = []
    for text in value.split(","):
        match = _TERM.fullmatch(text.strip())
        if match is None:
            raise WindowError(
                f"{text.strip()!r} is not a day window: write days (5), ranges (0-22), or "
                "all, first N, last N, all_but_last N, joined by commas"
            )
        start, end, relative, count = match.groups()
        if relative is None:
            first, last = int(start), int(end if end is not None else start)
            if last < first:
                raise WindowError(f"{text.strip()!r}: a range runs from its lower day up")
            terms.append(_Term("days", first, last))
        elif relative == "all":
            if count is not None:
                raise WindowError(f"{text.strip()!r}: 'all' takes no count")
            terms.append(_Term("all"))
        else:
            n = 1 if count is None else int(count)
            if n < 1 and relative != "all_but_last":
                raise WindowError(f"{text.strip()!r}: the count must be at least 1")
            terms.append(_Term(relative, n, n))
    return terms


def select_days(value: str | Sequence[int], available: Sequence[int], key: str) -> list[int]:
    """The days of ``available`` (a dataset's days) that window ``value`` selects, in
    ascending order; a ``WindowError`` naming ``key`` for a day the dataset does not have,
    or for a window that selects none."""
    try:
        terms = parse_window(value)
    except WindowError as e:
        raise WindowError(f"{key}: {e}") from None
    days = sorted(set(available))
    chosen: set[int] = set()
    for term in terms:
        if term.kind == "days":
            wanted = range(term.first, term.last + 1)
            missing = [d for d in wanted if d not in days]
            if missing:
                raise WindowError(
                    f"{key}: day {missing[0]}: not in the dataset (its days: {describe(days)})"
                )
            chosen.update(wanted)
        elif term.kind == "all":
            chosen.update(days)
        elif term.kind == "first":
            chosen.update(days[: term.first])
        elif term.kind == "last":
            chosen.update(days[-term.first :])
        else:  # all_but_last
            chosen.update(days[: len(days) - term.first])
    if not chosen:
        raise WindowError(
            f"{key}: {value!r} selects no day of the dataset (its days: {describe(days)})"
        )
    return sorted(chosen)


def held_out_days(
    evaluate: Window,
    available: Sequence[int],
    test_day: int,
    trained: Sequence[int] | None = None,
) -> list[int]:
    """The days window ``evaluate`` selects (by default the manifest's ``test_day``); a
    day among ``trained`` (those a model trained on) is a ``WindowError``: its score
    would say nothing of unseen data."""
    if evaluate == NONE:
        return []
    if evaluate is None:
        if test_day not in available:
            raise WindowError(
                f"{EVAL_KEY}: the dataset's test day {test_day} has no file, so no day is held "
                "out; choose the days to evaluate on"
            )
        days = [test_day]
    else:
        days = select_days(evaluate, available, EVAL_KEY)
    seen = sorted(set(days) & set(trained or ()))
    if seen:
        raise WindowError(
            f"{EVAL_KEY}: day {seen[0]}: the model trained on it; score it on days it has not seen"
        )
    return days


def windows(
    train: Window, evaluate: Window, available: Sequence[int], test_day: int
) -> tuple[list[int], list[int]]:
    """``(train days, eval days)`` of a dataset with days ``available`` and its manifest's
    ``test_day``: each window selected, the eval window defaulting to the test day and the
    train window to every other day. A day in both is a ``WindowError``."""
    eval_days = held_out_days(evaluate, available, test_day)
    if train is None:
        train_days = sorted(set(available) - set(eval_days))
        if not train_days:
            raise WindowError(f"{TRAIN_KEY}: every day of the dataset is held out to evaluate on")
    else:
        train_days = select_days(train, available, TRAIN_KEY)
    both = sorted(set(train_days) & set(eval_days))
    if both:
        raise WindowError(
            f"{TRAIN_KEY}: day {both[0]} is also in {EVAL_KEY}; a held-out day is never trained on"
        )
    return train_days, eval_days


def window_text(value: str | Sequence[int]) -> str:
    """A window as text (a list of days joined by commas), for a command line."""
    return value if isinstance(value, str) else ",".join(str(day) for day in value)


def describe(days: Sequence[int]) -> str:
    """Days as ranges: ``0-3, 5``."""
    parts: list[str] = []
    ordered = sorted(set(days))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(parts) if parts else "none"
