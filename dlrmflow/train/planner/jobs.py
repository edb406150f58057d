"""The plan a training job runs: its tables from the feature spec and the dataset's
``stats.json``, its topology from the configuration, planned on rank 0 and broadcast.

This is the one module of the planner that reads the configuration, the dataset and
``torch.distributed``; the steps beneath it plan from plain tables and a topology, so that
they can be run, tested and benchmarked (``dlrmflow plan --preset``) without a job.

What the data says: the IDs a step looks up come from each table's pooling factor (IDs per
non-empty bag) and access frequency (the share of samples with a bag), and a cache's hit
rate from how skewed the accesses are. ``tables_from_spec`` takes them from the dataset's
``stats.json`` (``dlrmflow.ingest.stats``) when there is one; without it every table is
one-hot, always accessed, and accessed uniformly (a cache of a fraction of the rows serves
that fraction of the lookups). ``plan_for_config`` records which in the plan's estimates
(``statistics``); ``plan_for_dataset`` is the same plan from the configuration alone
(what ``dlrmflow plan`` prints). ``plan_for_job`` plans on rank 0 only and broadcasts the
plan, so ranks that see different files (or compute in a different order) still run one
plan.
"""

from __future__ import annotations

from dataclasses import replace

from dlrmflow.config import RunConfig
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.ingest.manifest import STATS_NAME, join_url, read_manifest
from dlrmflow.ingest.stats.results import DatasetStats, read_stats
from dlrmflow.train.model.dynamic_ids import rows_budget
from dlrmflow.train.model.plan import ShardingPlan
from dlrmflow.train.planner.planners import plan_sharding
from dlrmflow.train.planner.types import OPTIMIZER_STATES, PlanningError, TableSpec, Topology

# A CPU job with ``train.embedding_memory_bytes``: the disk tier is bounded by the file
# system, not by the planner.
DISK_BYTES = 1e15
# The share of ``train.embedding_memory_bytes`` kept for the cache of hot rows when some
# shards must go to disk (the in-memory shards get the rest).
CACHE_SHARE = 0.25


def cpu_topology(
    world_size: int,
    ranks_per_host: int,
    embedding_memory_bytes: float | None = None,
    *,
    cache_share: float = 0.0,
) -> Topology:
    """A CPU job (gloo): the "device" tier is the process's RAM. Budgets are generous so that
    any model a CPU can train fits; bandwidths are those of a commodity server.

    ``embedding_memory_bytes`` (``train.embedding_memory_bytes``, per rank) bounds that
    memory instead, less ``cache_share`` of it kept for the cache of the shards on disk,
    and adds a disk ("ssd") tier for the rest: the trainer keeps the shards planned there in
    a tiered bag (``dlrmflow.kernels.tiered``)."""
    if not 0 <= cache_share < 1:
        raise ValueError(f"cache_share must be in [0, 1), got {cache_share}")
    budget = embedding_memory_bytes
    return Topology(
        world_size=world_size,
        ranks_per_host=ranks_per_host,
        device_bytes=64e9 if budget is None else budget * (1 - cache_share),
        dram_bytes=0.0,
        ssd_bytes=0.0 if budget is None else DISK_BYTES,
        device_bw=2e10,
        dram_bw=2e10,
        ssd_bw=1e9,
        intra_host_bw=5e9,
        inter_host_bw=1.25e9,
    )


def tables_from_spec(spec: FeatureSpec, stats: DatasetStats | None = None) -> list[TableSpec]:
    """The spec's tables. With the dataset's ``stats``, each table's pooling factor, access
    frequency, distinct IDs and cache hit rates are its feature's (a shared table's: its
    features' together, ``_shared``); without, every table is one-hot, always accessed and
    accessed uniformly. Stats lacking a table's feature raise ``PlanningError`` naming
    both."""
    features = _feature_tables(spec, stats)
    if not spec.shares_tables:
        return features
    by_feature = dict(zip(spec.sparse_names, features, strict=True))
    return [
        _shared(table.name, [by_feature[f] for f in spec.table_features(table.name)])
        for table in spec.tables
    ]


def _shared(name: str, members: list[TableSpec]) -> TableSpec:
    """One table looked up by ``members``' features: their IDs a sample add up; they share
    an ID space (why they share the table), so its distinct IDs are the widest feature's;
    and the cache's hit rates are those of the feature that looks up the most."""
    if len(members) == 1:
        return replace(members[0], name=name)
    ids = sum(m.ids_per_sample for m in members)
    access = min(1.0, sum(m.access_frequency for m in members))
    known = [m.distinct_ids for m in members if m.distinct_ids is not None]
    rows = members[0].rows
    busiest = max(members, key=lambda m: m.ids_per_sample)
    return TableSpec(
        name,
        rows,
        members[0].dim,
        pooling_factor=ids / access if access > 0 else 0.0,
        access_frequency=access,
        distinct_ids=max(known) if len(known) == len(members) else None,
        cache_hits=busiest.cache_hits,
    )


def _feature_tables(spec: FeatureSpec, stats: DatasetStats | None) -> list[TableSpec]:
    """One ``TableSpec`` per sparse feature, as if each had its own table."""
    if stats is None:
        return [TableSpec(f.name, f.num_embeddings, f.embedding_dim) for f in spec.sparse]
    by_name = {s.name: s for s in stats.sparse}
    tables = []
    for f in spec.sparse:
        s = by_name.get(f.name)
        if s is None and (f.cross is not None or f.bucketize is not None):
            # Made from other columns, so no statistics of its own: a bucket is one ID a
            # row, always present; a cross one ID a row where all its columns have one
            # (at least as often as the sparsest), over IDs spread across its rows.
            crossed = [by_name[c] for c in f.cross or () if c in by_name]
            access = min((c.access_rate for c in crossed), default=1.0)
            tables.append(
                TableSpec(f.name, f.num_embeddings, f.embedding_dim, access_frequency=access)
            )
            continue
        if s is None:
            raise PlanningError(
                f"table {f.name}: {stats.url} statistics have no feature {f.name}; "
                "run `dlrmflow stats` on the dataset again"
            )
        tables.append(
            TableSpec(
                f.name,
                f.num_embeddings,
                f.embedding_dim,
                pooling_factor=s.mean_length,
                access_frequency=s.access_rate,
                distinct_ids=max(s.distinct, 1),
                cache_hits=s.cache_hits,
            )
        )
    return tables


def load_plan_stats(root: str) -> DatasetStats | None:
    """The feature statistics beside the dataset at ``root`` (``stats.json``, which the
    ingest flow and ``dlrmflow stats`` write), or None when there are none. A file that is
    there but unreadable raises, naming it: planning on defaults would hide it."""
    try:
        return read_stats(root)
    except FileNotFoundError:
        return None


def plan_for_config(
    config: RunConfig,
    spec: FeatureSpec,
    world_size: int,
    ranks_per_host: int,
    *,
    topology: Topology | None = None,
    stats_root: str | None = None,
) -> ShardingPlan:
    """The plan the sharded trainer runs: the spec's tables on ``topology`` (default: a CPU
    topology, ``cpu_topology``), ``train.batch_size`` samples per rank,
    ``distributed.sharding`` forced on every table when set, and the state of the configured
    embedding optimizer.

    The tables' statistics come from ``stats.json`` under ``stats_root`` (default: the
    dataset, ``data.url``) when it is there, else from defaults (``tables_from_spec``);
    ``estimates["statistics"]`` says which: the file's URL, or ``"defaults"``. Each rank
    calling this may see other files: a job plans with ``plan_for_job``.

    With ``train.embedding_memory_bytes`` (and no ``topology``) each rank's memory is that
    budget less its shards of the dynamic tables' maps (``rows_budget``), and shards beyond it go to
    disk. When some do, the plan is made again with ``CACHE_SHARE`` of the budget kept for
    their cache of hot rows; a model that fits keeps all of the budget for its shards.
    """
    root = config.data.url if stats_root is None else stats_root
    stats = load_plan_stats(root)
    # Each rank holds its shards of the dynamic tables' maps in memory: the rows get the rest.
    budget = rows_budget(config.train.embedding_memory_bytes, spec, world_size)

    def plan_on(chosen: Topology) -> ShardingPlan:
        return plan_sharding(
            tables_from_spec(spec, stats),
            chosen,
            config.train.batch_size,
            force=config.distributed.sharding,
            optimizer=OPTIMIZER_STATES[config.train.optimizer],
        )

    if topology is not None:
        plan = plan_on(topology)
    else:
        plan = plan_on(cpu_topology(world_size, ranks_per_host, budget))
        on_disk = any(s.tier != "device" for t in plan.tables for s in t.shards)
        if budget is not None and on_disk:
            plan = plan_on(
                cpu_topology(world_size, ranks_per_host, budget, cache_share=CACHE_SHARE)
            )
    plan.estimates["statistics"] = join_url(root, STATS_NAME) if stats is not None else "defaults"
    return plan


def plan_for_dataset(
    config: RunConfig,
    world_size: int,
    ranks_per_host: int | None = None,
    *,
    device_bytes: float | None = None,
    dram_bytes: float | None = None,
    ssd_bytes: float | None = None,
    cache_load_factor: float | None = None,
) -> ShardingPlan:
    """The plan ``dlrmflow plan`` prints for the configuration's model: its feature spec
    from the dataset's manifest (``data.url``), on ``world_size`` ranks,
    ``ranks_per_host`` to a host (default: all on one).

    Without memory options it is the plan a job of this configuration runs (a budget in
    ``train.embedding_memory_bytes`` puts shards on disk, as the trainer's plan does); with
    any, a CPU topology (``cpu_topology``) with those memories instead, to see how the same
    model would sit on other hardware.
    """
    spec = FeatureSpec.for_dataset(read_manifest(config.data.url), config.features, config.model)
    per_host = ranks_per_host or world_size
    memory = {
        "device_bytes": device_bytes,
        "dram_bytes": dram_bytes,
        "ssd_bytes": ssd_bytes,
        "cache_load_factor": cache_load_factor,
    }
    topology = None
    if any(value is not None for value in memory.values()):
        topology = cpu_topology(world_size, per_host).with_memory(**memory)
    return plan_for_config(config, spec, world_size, per_host, topology=topology)


def plan_for_job(
    config: RunConfig,
    spec: FeatureSpec,
    world_size: int,
    ranks_per_host: int,
    *,
    stats_root: str | None = None,
) -> ShardingPlan:
    """``plan_for_config`` computed by rank 0 alone and broadcast to every rank, so that all
    ranks run rank 0's plan even where they would plan differently (another host that sees
    another ``stats.json``, or none). Every rank of the job must call it (a collective).
    Outside a ``torch.distributed`` job it is ``plan_for_config``.

    A failure to plan on rank 0 is broadcast too: rank 0 raises it, the others raise a
    ``PlanningError`` quoting it, instead of waiting in the broadcast until the job times out.

    The job is about to allocate the plan's tables, so the plan is checked against the
    memory of each host first (``dlrmflow.train.model.memory_budget.check_memory``, also a
    collective): a model its hosts cannot hold fails on every rank, in one line naming
    ``train.embedding_memory_bytes``. The memory is measured before any rank plans or
    allocates; the tables' even share is checked before planning too (a model far too
    large for the host needs no plan to say so).
    """
    import torch.distributed as dist  # here: planning alone needs only numpy, and is quick

    from dlrmflow.memory import available_memory
    from dlrmflow.train.model.memory_budget import check_memory

    available = available_memory()
    if not (dist.is_available() and dist.is_initialized()):
        plan = plan_for_config(config, spec, world_size, ranks_per_host, stats_root=stats_root)
        check_memory(config, spec, plan, available=available)
        return plan
    check_memory(config, spec, ranks_per_host=ranks_per_host, available=available)
    if dist.get_world_size() != world_size:
        raise PlanningError(
            f"plan_for_job: world_size {world_size}, but the process group has "
            f"{dist.get_world_size()} ranks"
        )
    message: list[dict | None] = [None]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            plan = plan_for_config(config, spec, world_size, ranks_per_host, stats_root=stats_root)
            message[0] = {"plan": plan.to_dict()}
        except Exception as e:  # every rank must hear of it, or the others wait forever
            failure = e
            message[0] = {"error": f"rank 0 could not plan: {e}"}
    dist.broadcast_object_list(message, src=0)
    if failure is not None:
        raise failure
    received = message[0]
    if received is None or "error" in received:
        raise PlanningError(received["error"] if received else "rank 0 sent no plan")
    plan = ShardingPlan.from_dict(received["plan"])
    plan.validate()
    check_memory(config, spec, plan, available=available)
    return plan
