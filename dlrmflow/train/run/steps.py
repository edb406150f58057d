"""How a training step feeds the model its batch, chosen once per run so that the loop
never asks which model it holds.

A step's embeddings need their input before the lookup: nothing more for a model whose
tables live in this process, the input all-to-all for the sharded model. Part of that work
may overlap the step before: the next batch's exchange (``distributed.pipeline``), its rows
loaded from disk into the cache (``train.embedding_memory_bytes``). A ``StepRunner`` says
what to start when; ``EpochInputs`` walks an epoch's batches and calls it in that order.

One runner serves every model: what differs between embeddings in memory, on disk or
sharded over a job is behind their common interface (``EmbeddingCollection``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dlrmflow.features.batch import Batch
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.kernels.row_cache import CacheStats
from dlrmflow.train.model.comms import CommStats
from dlrmflow.train.model.device import BatchStager
from dlrmflow.train.model.dlrm import DLRM
from dlrmflow.train.model.embeddings import EmbeddingCollection, StartedInput
from dlrmflow.train.model.plan import ShardingPlan
from dlrmflow.train.run.rank import DistEnv


class StepRunner:
    """Feeds the model its batches in the order its embeddings need: each batch's input
    started (``EmbeddingCollection.start_input``) before its lookup, the next batch's
    begun while this step computes where the embeddings allow it (the input all-to-all
    when pipelined, the rows on disk).

    A started input is whatever ``start``/``ahead`` return, handed back to ``forward`` (or
    ``overlap``) unopened.
    """

    def __init__(
        self,
        model: DLRM,
        stager: BatchStager,
        *,
        comms: CommStats | None = None,
        plan: ShardingPlan | None = None,
    ) -> None:
        """``comms``: the bytes the collectives sent, by kind; ``plan``: the plan the
        embeddings are sharded by (both None in one process)."""
        self.model = model
        self.stager = stager
        self.comms = comms
        self.plan = plan
        self._embeddings: EmbeddingCollection = model.embeddings

    def dense_parameters(self) -> list[nn.Parameter]:
        """What the dense optimizer updates (the embeddings update themselves)."""
        return self.model.dense_parameters()

    def embedding_bags(self) -> list[nn.Module]:
        """The modules that look up this process's rows (for the kernels it reports)."""
        return self._embeddings.lookup_modules()

    def start(self, batch: Batch) -> StartedInput | None:
        """Begin what the lookup of ``batch`` needs, now that it is the current batch
        (once its copy to the device is in: a wait on the device, not the host)."""
        return self._embeddings.start_input(self.stager.ready(batch).sparse)

    def ahead(self, batch: Batch) -> StartedInput | None:
        """Begin what of ``batch`` (the next step's) may overlap the step about to run;
        None when nothing was started and ``start`` must be called when it is current."""
        if not self._embeddings.begins_ahead:
            return None  # its copy to the device is not waited for before it is current
        return self._embeddings.start_input(self.stager.ready(batch).sparse, ahead=True)

    def forward(self, batch: Batch, started: StartedInput) -> tuple[torch.Tensor, int]:
        """The step's logits and the rows this rank computed them for."""
        batch = self.stager.ready(batch)
        received = started.wait()
        logits = self.model.forward_received(batch.dense, received)
        return logits, self._embeddings.input_rows(received)

    def overlap(self, started_next: StartedInput | None) -> None:
        """After this step's forward: what of the next batch may overlap the backward."""
        self._embeddings.prefetch_next(started_next)

    def finish(self) -> None:
        """Write what the embeddings hold only in memory (the rows cached from disk)."""
        self._embeddings.flush()

    def cache_stats(self) -> CacheStats | None:
        """The cache of the tables on disk (every rank's, summed: a collective where the
        ranks share the tables), None when all are in memory."""
        return self._embeddings.cache_stats()


class _Batches:
    """The loader's batches, with every rank taking part in every step of the epoch.

    Ranks read different splits, so one can run out a few batches before another, and a
    rank missing from a step's collectives would hang the others. A rank whose splits
    ended steps on with empty batches until every rank's have (the loss is a sum over the
    global batch, so an empty batch adds nothing but still joins the exchanges): every row
    of the epoch is trained, none dropped.
    """

    def __init__(self, loader, env: DistEnv, spec: FeatureSpec, stager: BatchStager) -> None:
        self._iter = iter(loader)
        self._env = env
        self._spec = spec
        self._stager = stager
        self._done = False

    def next(self) -> Batch | None:
        """The next batch, its copy to the device started; None once every rank's share
        of the epoch has run out."""
        batch = None if self._done else next(self._iter, None)
        self._done = batch is None
        batch = self._stager.stage(batch)
        if not self._env.distributed:
            return batch
        anyone = torch.tensor([int(batch is not None)], device="cpu")
        dist.all_reduce(anyone, op=dist.ReduceOp.MAX)
        if not bool(anyone):
            return None
        if batch is not None:
            return batch
        spec = self._spec
        weighted = spec.weight is not None
        return Batch.empty(len(spec.dense), spec.sparse_names, self._stager.device, weighted)


class EpochInputs:
    """One epoch's batches as the loop steps through them: the current one with its input
    started, and the next one, fetched one step ahead (it tells whether this step ends the
    epoch) and started as early as the runner allows."""

    def __init__(
        self,
        loader,
        epoch: int,
        runner: StepRunner,
        env: DistEnv,
        spec: FeatureSpec,
        stager: BatchStager,
    ) -> None:
        loader.set_epoch(epoch)
        self._batches = _Batches(loader, env, spec, stager)
        self._runner = runner
        self.batch = self._batches.next()  # None: nothing left (resumed right at its end)
        self._started = runner.start(self.batch) if self.batch is not None else None
        self._following: Batch | None = None
        self._following_started: Any = None

    def look_ahead(self, *, overlap: bool) -> None:
        """Fetch the next batch (at the run's last step too: it tells whether the step
        ends the epoch); ``overlap``: begin its input while this step computes."""
        self._following = self._batches.next()
        self._following_started = None
        if self._following is not None and overlap:
            self._following_started = self._runner.ahead(self._following)

    @property
    def epoch_ends(self) -> bool:
        """Whether the current batch is the epoch's last (after ``look_ahead``)."""
        return self._following is None

    def forward(self) -> tuple[torch.Tensor, Batch, int]:
        """The current batch's logits, the batch and its rows; what of the next batch may
        overlap the backward starts."""
        logits, rows = self._runner.forward(self.batch, self._started)
        self._runner.overlap(self._following_started)
        return logits, self.batch, rows

    def advance(self) -> None:
        """Make the next batch the current one, starting its input if it has not been."""
        started = self._following_started
        if started is None:
            started = self._runner.start(self._following)
        self.batch, self._started = self._following, started
