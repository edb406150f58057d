"""Models and topologies fixed for benchmarks and demonstrations: ``paper_12t``, the
paper-scale model ``dlrmflow plan --preset paper-12t`` plans (``plan_preset``).

Kept out of the planning steps: a preset is an input to them, chosen by name.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dlrmflow.train.model.plan import ShardingPlan
from dlrmflow.train.planner.planners import plan_sharding
from dlrmflow.train.planner.types import PlanningError, TableSpec, Topology

PAPER_BATCH_SIZE = 512  # per rank: 64K samples a step on 128 ranks


def paper_12t() -> tuple[list[TableSpec], Topology, int]:
    """A paper-scale model (Mudigere et al. 2021: 12T parameters on 128 GPUs of 16 ZionEX
    hosts), fixed by a seed so that benchmarks and tests see the same one.

    600 tables whose rows spread evenly on a log scale from 4K to 1.73G (a density of sizes
    proportional to 1/rows, Zipf-like: most tables are small, a few dozen hold most of the
    parameters), dims 64 to 256, Zipf-distributed pooling factors (most features one-hot,
    a few with bags of up to 200 IDs) and access frequencies from 10% to 100%: 12.05T
    float32 parameters, 48.2 TB. Per rank: 80 GB HBM (A100 80GB), 192 GB DRAM (1.5 TB per
    host of 8 GPUs) and 2 TB of NVMe: 10.2 TB of HBM and 24.6 TB of DRAM across the job,
    so the coldest ~20 TB live on SSD.
    """
    n = 600
    rng = np.random.default_rng(12)
    log_rows = np.linspace(np.log(4e3), np.log(1.73e9), n)
    rows = np.round(np.exp(log_rows)).astype(np.int64)[rng.permutation(n)]
    dims = rng.choice([64, 128, 192, 256], size=n, p=[0.3, 0.3, 0.2, 0.2])
    pooling = np.minimum(rng.zipf(1.6, size=n), 200)
    access = rng.uniform(0.1, 1.0, size=n)
    tables = [
        TableSpec(f"t{i:03d}", int(rows[i]), int(dims[i]), float(pooling[i]), float(access[i]))
        for i in range(n)
    ]
    topology = Topology(
        world_size=128, ranks_per_host=8, device_bytes=80e9, dram_bytes=192e9, ssd_bytes=2e12
    )
    return tables, topology, PAPER_BATCH_SIZE


# By the name ``dlrmflow plan --preset`` takes: the tables, topology and per-rank batch.
PRESETS: dict[str, Callable[[], tuple[list[TableSpec], Topology, int]]] = {
    "paper-12t": paper_12t,
}


def plan_preset(
    name: str,
    *,
    device_bytes: float | None = None,
    dram_bytes: float | None = None,
    ssd_bytes: float | None = None,
    cache_load_factor: float | None = None,
) -> ShardingPlan:
    """The plan of the preset ``name`` (a key of ``PRESETS``), on its own topology with the
    memory per tier given replacing its own (``Topology.with_memory``): what a model of that
    scale would need of other hardware, without a dataset or a configuration."""
    if name not in PRESETS:
        raise PlanningError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    tables, topology, batch_size = PRESETS[name]()
    topology = topology.with_memory(
        device_bytes=device_bytes,
        dram_bytes=dram_bytes,
        ssd_bytes=ssd_bytes,
        cache_load_factor=cache_load_factor,
    )
    return plan_sharding(tables, topology, batch_size)
