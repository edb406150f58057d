"""The sharding planner: which rank holds which rows and columns of every table, and where.

A plan is chosen with a cost model, as in the papers (Mudigere et al. 2021, section 4.2):
every shard costs its rank some seconds per training step, and the step lasts as long as
the busiest rank, so the planner minimises the largest per-rank load and reports the
max/mean ratio.

One module per job, split as TorchRec's planner is, each importing only those above it
in this list:

- ``types``: the inputs (``TableSpec``, ``Topology``, ``OptimizerState``), ``PlanningError``
  and the working records of shards and options.
- ``estimators``: the cost model (lookup, all-to-all and allreduce bytes, memory per tier,
  cache hit rates), a plan's estimates, and ``evaluate_plan`` for any plan.
- ``proposers``: data-parallel or not, and each table's sharding type and pieces.
- ``placement``: shards onto ranks and tiers, largest first (LPT).
- ``tiering``: the memory tier of each table before placement, promotion after it.
- ``refine``: moves and swaps off the busiest rank.
- ``planners``: ``plan_sharding``, the steps in order (the algorithm is in its docstring).
- ``jobs``: the plan a training job runs (``plan_for_config``, ``plan_for_job``,
  ``plan_for_dataset``), from the configuration, the feature spec and the dataset's
  ``stats.json``.
- ``presets`` (``paper_12t``, ``plan_preset``) and ``report`` (``format_plan``, the printed
  plan) stand apart: inputs to planning and its output as text.

The plan itself is plain data in ``dlrmflow.train.model.plan``. This package re-exports its
public API, so callers may import from ``dlrmflow.train.planner`` or from the module.
"""

from __future__ import annotations

from dlrmflow.train.planner.estimators import evaluate_plan
from dlrmflow.train.planner.jobs import (
    CACHE_SHARE,
    DISK_BYTES,
    cpu_topology,
    load_plan_stats,
    plan_for_config,
    plan_for_dataset,
    plan_for_job,
    tables_from_spec,
)
from dlrmflow.train.planner.planners import plan_sharding
from dlrmflow.train.planner.presets import PAPER_BATCH_SIZE, PRESETS, paper_12t, plan_preset
from dlrmflow.train.planner.report import format_plan
from dlrmflow.train.planner.types import (
    ADAM_STATE,
    OPTIMIZER_STATES,
    ROW_WISE_ADAGRAD_STATE,
    SGD_STATE,
    OptimizerState,
    PlanningError,
    TableSpec,
    Topology,
)

__all__ = [
    "ADAM_STATE",
    "CACHE_SHARE",
    "DISK_BYTES",
    "OPTIMIZER_STATES",
    "PAPER_BATCH_SIZE",
    "PRESETS",
    "ROW_WISE_ADAGRAD_STATE",
    "SGD_STATE",
    "OptimizerState",
    "PlanningError",
    "TableSpec",
    "Topology",
    "cpu_topology",
    "evaluate_plan",
    "format_plan",
    "load_plan_stats",
    "paper_12t",
    "plan_for_config",
    "plan_for_dataset",
    "plan_for_job",
    "plan_preset",
    "plan_sharding",
    "tables_from_spec",
]
