"""What a run needs, applied to the plain DLRM by small functions (as torchtitan's
``parallelize.py`` applies its parallelisms to a plain model).

``build_model`` makes the one model class, ``DLRM``, with its tables not yet placed;
``parallelize`` then places them and sets the model up for its run:

- ``apply_local_embeddings``: one process; every table in memory, or on disk behind a
  cache when they exceed ``train.embedding_memory_bytes`` (``TieredEmbeddings``);
- ``apply_sharded_embeddings``: the ranks of a job; the shards the plan gives this rank
  (in memory or on disk), fed by the input all-to-all (``distributed.pipeline``: in the
  background, one batch ahead);
- ``apply_ddp``: the ranks of a job; the dense arch replicated, its gradients allreduced
  through a comm hook in ``distributed.dense_comms``;
- ``apply_precision``: the dense arch's ``train.precision``.

Every table is drawn from the seed by its own generators, so where and when it is placed
changes no weight: the same seed gives the same model however it is parallelized.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dlrmflow.config import RunConfig
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.kernels.optimizers import EmbeddingOptimizer
from dlrmflow.train.model.comms import CommStats, dense_comm_hook
from dlrmflow.train.model.dlrm import DLRM, embedding_optimizer, hand_pooled_in
from dlrmflow.train.model.dynamic_ids import with_dynamic_ids
from dlrmflow.train.model.embeddings import InMemoryEmbeddings, UnplacedEmbeddings
from dlrmflow.train.model.memory_budget import tiered_embeddings
from dlrmflow.train.model.plan import ShardingPlan
from dlrmflow.train.model.sharded import ShardedEmbeddingCollection, TierStorage
from dlrmflow.train.model.shared_tables import share_tables

PRECISIONS = ("fp32", "bf16")


def build_model(config: RunConfig, spec: FeatureSpec) -> DLRM:
    """The plain DLRM of ``config.model`` over ``spec``'s features, its dense arch drawn
    from torch's generator and its tables left unplaced (``parallelize`` places them)."""
    return DLRM(spec, config.model, embeddings=UnplacedEmbeddings(spec))


def parallelize(
    model: DLRM,
    config: RunConfig,
    *,
    device: torch.device,
    plan: ShardingPlan | None = None,
    tiers: TierStorage | None = None,
    embeddings_dir: Path | None = None,
    fill: bool = True,
    optimizer: EmbeddingOptimizer | None = None,
    stats: CommStats | None = None,
) -> DLRM:
    """Place ``model``'s tables and set it up on ``device`` for its run, in place.

    Without ``plan``, one process: ``embeddings_dir`` is where tables beyond
    ``train.embedding_memory_bytes`` go on disk (None: all in memory, unchecked), ``fill``
    whether their file starts from the seed's rows (False: a checkpoint's load fills it).
    With ``plan``, a rank of a job: ``tiers`` where its shards on disk go (None: all in
    memory), ``stats`` what counts the collectives' bytes. ``optimizer`` is fused into the
    embeddings' backward (``train.optimizer`` by default).
    """
    if not isinstance(model.embeddings, UnplacedEmbeddings):
        raise ValueError("parallelize takes a model from build_model, its tables unplaced")
    spec = model.embeddings.spec
    optimizer = optimizer or embedding_optimizer(config.train)
    if plan is None:
        apply_local_embeddings(model, config, spec, optimizer, embeddings_dir, fill=fill)
        model.to(device)
    else:
        embeddings = apply_sharded_embeddings(
            model, config, spec, plan, optimizer, device=device, tiers=tiers, stats=stats
        )
        model.dense_arch.to(device)
        apply_ddp(model, config, device, embeddings.stats)
    apply_precision(model, config.train.precision)
    return model


def apply_local_embeddings(
    model: DLRM,
    config: RunConfig,
    spec: FeatureSpec,
    optimizer: EmbeddingOptimizer,
    directory: Path | None,
    *,
    fill: bool = True,
) -> None:
    """Every table in this process: on disk in ``directory`` when they exceed
    ``train.embedding_memory_bytes`` (checked against the host's memory first), else in
    memory."""
    embeddings = None
    if directory is not None:
        embeddings = tiered_embeddings(config, spec, optimizer, directory, fill=fill)
    model.embeddings = embeddings or share_tables(
        InMemoryEmbeddings(
            spec.tables, optimizer, seed=config.train.seed, kernels=config.model.kernels
        ),
        spec,
    )
    model.embeddings = with_dynamic_ids(model.embeddings, spec, seed=config.train.seed)


def apply_sharded_embeddings(
    model: DLRM,
    config: RunConfig,
    spec: FeatureSpec,
    plan: ShardingPlan,
    optimizer: EmbeddingOptimizer,
    *,
    device: torch.device,
    tiers: TierStorage | None,
    stats: CommStats | None,
) -> ShardedEmbeddingCollection:
    """This rank's shards of ``plan``, on ``device`` (and on disk as ``tiers`` says)."""
    # Separate groups (with the default group's backends): the pipelined input exchange
    # runs in the background and must not interleave with the output exchange or DDP's
    # allreduce on the same group. With the job's collective timeout: a group takes
    # torch's default (30 minutes) otherwise, not the default group's.
    timeout = timedelta(seconds=config.distributed.timeout_s)
    output_group = dist.new_group(timeout=timeout)
    input_group = dist.new_group(timeout=timeout)
    embeddings = ShardedEmbeddingCollection(
        spec.tables,
        plan,
        optimizer,
        seed=config.train.seed,
        comms=config.distributed.comms,
        backward_comms=config.distributed.backward_comms,
        group=output_group,
        input_group=input_group,
        stats=stats,
        device=device,
        kernels=config.model.kernels,
        tiers=tiers,
        timeout=timeout,
    )
    embeddings.pipelined = config.distributed.pipeline
    # Dynamic tables' maps gather every rank's raw IDs on a group of their own (gloo: the
    # maps are host arrays), ordered apart from the exchanges above.
    dynamic = any(f.ids == "dynamic" for f in spec.sparse)
    maps_group = dist.new_group(timeout=timeout, backend="gloo") if dynamic else None
    model.embeddings = with_dynamic_ids(
        share_tables(embeddings, spec), spec, seed=config.train.seed, group=maps_group
    )
    return embeddings


def apply_ddp(model: DLRM, config: RunConfig, device: torch.device, stats: CommStats) -> None:
    """The dense arch replicated on every rank (DDP: its parameters broadcast from rank 0,
    its gradients allreduced in ``distributed.dense_comms``, counted in ``stats``)."""
    ddp = DistributedDataParallel(
        model.dense_arch, device_ids=[device.index] if device.type == "cuda" else None
    )
    hook, state = dense_comm_hook(config.distributed.dense_comms, stats, dist.get_world_size())
    ddp.register_comm_hook(state, hook)
    model.ddp = ddp


def apply_precision(model: DLRM, precision: str) -> None:
    """The dense arch computes under ``precision`` (bf16: autocast; its parameters,
    gradients and optimizer stay float32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    model.dense_arch.precision = precision
    hand_pooled_in(model, precision)


def sharded_dlrm(
    spec: FeatureSpec,
    config: RunConfig,
    plan: ShardingPlan,
    optimizer: EmbeddingOptimizer,
    *,
    stats: CommStats | None = None,
    device: torch.device | str = "cpu",
    tiers: TierStorage | None = None,
) -> DLRM:
    """A rank's DLRM of a job under ``plan`` in one call (for tests and benchmarks that
    build the model without the trainer)."""
    return parallelize(
        build_model(config, spec),
        config,
        device=torch.device(device),
        plan=plan,
        tiers=tiers,
        optimizer=optimizer,
        stats=stats,
    )
