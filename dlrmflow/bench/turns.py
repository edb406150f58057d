"""The benchmarks' way of timing a comparison: its cases take turns, best of N rounds.

Within each round every case runs once, in a fixed order, so that a slow spell of a shared
machine (a noisy neighbour, a frequency drop) hits every side of a ratio alike rather than
whichever case happened to run during it. Each case keeps its best run, the one least
disturbed by anything but itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


def best_of_turns(
    cases: Mapping[K, Callable[[], R]],
    rounds: int,
    *,
    key: Callable[[R], float],
    lowest: bool = False,
    warmup_rounds: int = 0,
) -> dict[K, R]:
    """Each case's best result over ``rounds`` rounds in which the cases take turns.

    ``key`` gives a result's figure: the highest wins (a rate), or the lowest with
    ``lowest`` (a time). ``warmup_rounds`` untimed rounds run first, in the same order,
    so that both sides start with warm caches, allocator and thread pools.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be positive, got {rounds}")
    for _ in range(warmup_rounds):
        for run in cases.values():
            run()
    best: dict[K, R] = {}
    for _ in range(rounds):
        for case, run in cases.items():
            result = run()
            if case not in best or _better(key(result), key(best[case]), lowest):
                best[case] = result
    return best


def _better(figure: float, than: float, lowest: bool) -> bool:
    return figure < than if lowest else figure > than
