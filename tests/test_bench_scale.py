"""``dlrmflow bench scale``'s own failure path: a stage that fails names itself and its
error in one line.

The benchmark's full run (``make bench-scale``, ~20 minutes) is what the docs record; its
pieces are tested where they live: tiers under a budget, their checkpoints and evaluation
(tests/train/model/test_sharded_tiers.py), memory bounds (tests/train/model/test_tiered_memory.py),
and the rendering of its record (tests/test_docs.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dlrmflow.bench.scale import StageFailed, _stage


def test_a_failing_stage_names_itself_and_its_error_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-run"
    command = [sys.executable, "-m", "dlrmflow", "evaluate", "--run-dir", str(missing)]
    with pytest.raises(StageFailed) as failed:
        _stage(command, tmp_path / "evaluate.log")
    message = str(failed.value)
    assert message.startswith("bench scale: evaluate exited 1: error: ")
    assert str(missing) in message and "\n" not in message


def test_a_stage_reports_its_time_and_its_own_peak_memory(tmp_path: Path) -> None:
    # A child that touches 200 MB: its own peak, not the parent's (a full pytest run holds
    # more, which wait4's ru_maxrss would have reported).
    code = "import time; x = bytearray(200_000_000); x[::4096] = b'1' * 48829; time.sleep(0.5)"
    stage = _stage([sys.executable, "-c", code], tmp_path / "child.log")
    assert stage["seconds"] > 0
    assert 200_000_000 < stage["peak_rss_bytes"] < 400_000_000


def test_plan_figures_count_each_ranks_bytes_tiers_and_row_map() -> None:
    from dlrmflow.bench.scale import _plan_figures

    def shard(rank, rows, cols, tier):
        return {"rank": rank, "row_start": rows[0], "row_end": rows[1], "col_start": cols[0],
                "col_end": cols[1], "tier": tier}  # fmt: skip

    plan = {
        "tables": [
            {"shards": [shard(0, (0, 10), (0, 4), "device")]},
            {"shards": [shard(0, (0, 6), (0, 2), "ssd"), shard(1, (0, 6), (2, 4), "ssd")]},
        ]
    }
    figures = _plan_figures(plan, 2)
    # Rows x (columns + the row-wise Adagrad state) x 4 bytes.
    assert figures["table_bytes_per_rank"] == [4 * 10 * 5 + 4 * 6 * 3, 4 * 6 * 3]
    assert figures["table_bytes"] == sum(figures["table_bytes_per_rank"])
    assert figures["rows_by_tier"] == {"device": 10, "ssd": 12}
    assert figures["row_map_bytes_per_rank"] == [24, 24]
