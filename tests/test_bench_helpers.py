"""What the benchmarks share: turn-taking rounds, the thread budget, spawned jobs; and what
their tests share: a report section and the rows of its tables, a plot's checks."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dlrmflow.bench import machine
from dlrmflow.bench.spawn import run_spawned_job
from dlrmflow.bench.turns import best_of_turns
from dlrmflow.runtime.glibc_malloc import tune_allocator


def test_cases_take_turns_and_keep_their_best():
    calls = []
    figures = {"a": iter([3, 9, 1]), "b": iter([5, 2, 8])}

    def case(name):
        def run():
            calls.append(name)
            return next(figures[name])

        return run

    best = best_of_turns({"a": case("a"), "b": case("b")}, 3, key=float)
    assert calls == ["a", "b"] * 3  # in turn within each round, not one case's runs in a row
    assert best == {"a": 9, "b": 8}


def test_lowest_and_warmup_rounds():
    runs = {"t": iter([0.1, 5.0, 2.0, 3.0])}
    best = best_of_turns({"t": lambda: next(runs["t"])}, 3, key=float, lowest=True, warmup_rounds=1)
    assert best == {"t": 2.0}  # 0.1 was the untimed warm-up
    with pytest.raises(ValueError):
        best_of_turns({"t": lambda: 1.0}, 0, key=float)


@pytest.mark.parametrize(
    ("cores", "worlds", "budget"),
    [(2, (1, 2), 2), (3, (1, 2), 2), (16, (1, 2), 16), (1, (1, 2), 2), (6, (1, 2, 4), 4)],
)
def test_thread_budget_splits_evenly_over_every_world_size(monkeypatch, cores, worlds, budget):
    monkeypatch.setattr(machine, "available_cores", lambda: cores)
    assert machine.thread_budget(worlds) == budget


def _report(rank: int, world: int, offset: int) -> tuple[int, int, int]:
    return rank, world, offset + torch.get_num_threads()


def test_spawned_job_returns_every_ranks_result_and_settings():
    ranks = run_spawned_job(_report, 2, 100, threads=1)
    assert [r.result for r in ranks] == [(0, 2, 101), (1, 2, 101)]
    expected = tune_allocator()  # what the parent gets; every rank applied the same
    for rank, r in enumerate(ranks):
        assert r.settings() == {"rank": rank, "torch_threads": 1, "malloc_mmap_threshold": expected}


def table_rows(markdown: str) -> list[list[str]]:
    """The cells of every body row of the markdown tables in ``markdown``: a header row (one
    that a ``|---|`` line follows) and that line are left out."""
    lines = markdown.splitlines()
    return [
        line.removeprefix("| ").removesuffix(" |").split(" | ")
        for line, following in zip(lines, [*lines[1:], ""], strict=True)
        if line.startswith("| ") and not following.startswith("|---")
    ]


def report_section(render: Callable[[dict], str], record: dict) -> str:
    """``render``'s section of ``record`` as report.md has it, checked to be the same when
    rendered from the record as report.json holds it (as docs/benchmarks.md is)."""
    section = render(record)
    assert render(json.loads(json.dumps(record))) == section
    return section


def check_plot(path: Path) -> None:
    """``path`` is a PNG that reads back as an image large enough to show its plot."""
    import matplotlib.image  # here: the ranks this file spawns import it, and need no plots

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    height, width, _ = matplotlib.image.imread(path).shape
    assert height > 200 and width > 300, path
