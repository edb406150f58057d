"""The plan as text: ``format_plan``, what ``dlrmflow plan`` prints (``--json`` prints the
plan's own dictionary instead).

Printing reads only a plan and its estimates, never the cost model, so that a plan saved
or edited by hand prints too.
"""

from __future__ import annotations

from dlrmflow.train.model.plan import SHARDING_TYPES, TIERS, ShardingPlan
from dlrmflow.train.planner.types import _format_bytes


def _span(start: int, end: int, size: int) -> str:
    """A shard's row or column range, ``all`` when it is the whole table's."""
    return "all" if (start, end) == (0, size) else f"{start}:{end}"


def _hit_text(hit: float | None, tier: str, cache_load_factor: float | None) -> str:
    """A shard's expected cache hit rate: ``-`` in device memory (or unknown), ``no cache``
    in a slower tier of a topology without caches."""
    if tier == "device" or hit is None:
        return "-"
    return f"{hit:.1%}" if cache_load_factor else "no cache"


def format_plan(plan: ShardingPlan, max_shards: int = 12) -> str:
    """A plain-text report, one block per rank: its estimated load, memory per tier (device
    memory includes caches) and shard count, then its shards, heaviest first: table,
    sharding, rows and columns held, tier, memory, estimated load, and for a shard in DRAM or
    on SSD the hit rate expected of its cache. Past ``max_shards`` a rank's lightest shards
    are summed up in one line. A plan without estimates (edited by hand) prints ``-`` for
    them; ``--json`` carries every shard."""
    est = plan.estimates
    kinds = {k: sum(t.sharding == k for t in plan.tables) for k in SHARDING_TYPES}
    hosts = plan.world_size // plan.ranks_per_host
    lines = [
        f"{len(plan.tables)} tables on {plan.world_size} ranks ({hosts} host"
        f"{'s' if hosts > 1 else ''} of {plan.ranks_per_host}): "
        + ", ".join(f"{n} {k}" for k, n in kinds.items() if n)
    ]
    if "statistics" in est:
        source = est["statistics"]
        lines.append(
            "statistics: "
            + (
                "defaults (no stats.json: one-hot, always accessed, uniform access)"
                if source == "defaults"
                else source
            )
        )
    if est.get("cache_load_factor"):
        lines.append(
            f"cache: {est['cache_load_factor']:.0%} of the rows of each DRAM or SSD shard, "
            "in device memory"
        )
    per_table = est.get("tables", {})
    loads = est.get("load_seconds")
    memory = est.get("memory_bytes", {})
    header = (
        f"  {'table':<20} {'sharding':<15} {'rows':>21} {'cols':>9}  {'tier':<6} "
        f"{'memory':>9} {'load ms':>10} {'cache hit':>9}"
    )
    for r in range(plan.world_size):
        shards = []
        for t in plan.tables:
            numbers = per_table.get(t.name)
            for j, s in enumerate(t.shards):
                if s.rank != r:
                    continue
                load = numbers["load_seconds"][j] if numbers else None
                mem = numbers["memory_bytes"][j] if numbers else None
                hit = numbers["cache_hit_rate"] if numbers else None
                shards.append((t, s, load, mem, hit))
        if per_table:  # (a plan saved before per-shard estimates keeps its table order)
            shards.sort(key=lambda x: -x[2])
        load_text = f"{loads[r] * 1e3:.4g} ms" if loads else "-"
        mem_text = ", ".join(
            f"{tier} {_format_bytes(memory[tier][r]) if tier in memory else '-'}" for tier in TIERS
        )
        lines += ["", f"rank {r}: load {load_text}; {mem_text}; {len(shards)} shards", header]
        for t, s, load, mem, hit in shards[:max_shards]:
            rows, cols = _span(s.row_start, s.row_end, t.rows), _span(s.col_start, s.col_end, t.dim)
            lines.append(
                f"  {t.name:<20} {t.sharding:<15} {rows:>21} {cols:>9}  {s.tier:<6} "
                f"{_format_bytes(mem) if mem is not None else '-':>9} "
                f"{f'{load * 1e3:.4g}' if load is not None else '-':>10} "
                f"{_hit_text(hit, s.tier, est.get('cache_load_factor')):>9}"
            )
        rest = shards[max_shards:]
        if rest:
            summed = ""
            if per_table:
                rest_load = sum(x[2] for x in rest) * 1e3
                rest_mem = _format_bytes(sum(x[3] for x in rest))
                summed = f": {rest_load:.4g} ms, {rest_mem}"
            lines.append(f"  ... {len(rest)} more shards{summed}")
    if "max_over_mean_load" in est:
        lines += ["", f"max/mean load: {est['max_over_mean_load']:.3f}"]
    return "\n".join(lines)
