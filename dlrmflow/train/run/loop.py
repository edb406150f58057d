"""The training loop of every rank: read a batch, step, log, check, checkpoint, evaluate.

``TrainLoop.run`` is the loop, read top to bottom; each concern is one method beside it,
and the run's position is one ``RunProgress``. What differs between the models (the
plain DLRM, the sharded one, tables on disk) is in the ``StepRunner`` chosen before the
loop, never asked inside it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.config import RunConfig
from dlrmflow.errors import DlrmflowError
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.kernels import backends
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from dlrmflow.train.model.dynamic_ids import id_map_counts
from dlrmflow.train.run.checkpoint import (
    DataIdentity,
    prune_checkpoints,
    restore,
    save_checkpoint,
)
from dlrmflow.train.run.data import IdMapper, pass_count
from dlrmflow.train.run.evaluate import predict, test_loader
from dlrmflow.train.run.loss import StepLoss
from dlrmflow.train.run.metrics import click_metrics
from dlrmflow.train.run.progress import METRICS_FILE, RESULT_FILE, RunProgress, TrainResult
from dlrmflow.train.run.rank import DistEnv, gather_peak_rss
from dlrmflow.train.run.resume import REREAD_KEYS, ResumePoint, rewind_metrics
from dlrmflow.train.run.schedule import LearningRates, LrSchedule
from dlrmflow.train.run.steps import EpochInputs, StepRunner
from dlrmflow.train.run.tracking import Tracker

logger = logging.getLogger(__name__)


class NonFiniteLoss(DlrmflowError):
    """The loss became NaN or infinite: the model is ruined and is not checkpointed."""


def dense_optimizer(parameters: list[nn.Parameter], config: RunConfig) -> torch.optim.Optimizer:
    """The torch optimizer of the MLPs and the interaction (``train.dense_optimizer``; the
    embedding weights are buffers updated by their own fused backward).

    Adam's state is created here rather than at its first step, as torch would: a
    checkpoint loads into the state in place, so it must exist before a resumed run's
    first step (Adagrad creates its own at construction)."""
    kind = config.train.dense_optimizer or config.train.optimizer
    lr = config.train.lr
    if kind == "adam":
        adam = torch.optim.Adam(parameters, lr=lr)
        for p in parameters:
            adam.state[p] = {
                # Where and how torch's Adam keeps it when neither capturable nor fused.
                "step": torch.tensor(0.0, dtype=torch.float32, device="cpu"),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        return adam
    if kind == "adagrad":
        return torch.optim.Adagrad(parameters, lr=lr)
    return torch.optim.SGD(parameters, lr=lr)


def kernels_used(runner: StepRunner, config: RunConfig) -> dict[str, str]:
    """Which implementation ran the embedding bags and the interaction (``model.kernels``
    resolved on the model's device), for the result: "auto" hides what it picked."""
    bags = runner.embedding_bags()
    tbe = sorted({b.backend for b in bags if isinstance(b, TableBatchedEmbeddingBag)})
    dense = next(runner.model.dense_arch.parameters())
    return {
        "tbe": "+".join(tbe) or "tiered",
        "interaction": backends.interaction(config.model.kernels, dense),
    }


def kernels_reason(runner: StepRunner, config: RunConfig) -> str:
    """Why those kernels run, in words: how ``model.kernels`` resolved on the device, and
    each bag that could not run the choice (``fbgemm_refusal``) with its reason."""
    dense = next(runner.model.dense_arch.parameters())
    _, why = backends.choice(config.model.kernels, dense)
    bags = [b for b in runner.embedding_bags() if isinstance(b, TableBatchedEmbeddingBag)]
    exceptions = sorted(
        {
            f"{type(b).__name__} bags run {b.backend}: {b.fbgemm_refusal()}"
            for b in bags
            if backends.resolve(config.model.kernels, b.weight) == "fbgemm"
            and b.backend != "fbgemm"
        }
    )
    if backends.resolve(config.model.kernels, dense) == "fbgemm":
        # Bags that are no table-batched bag (tables on disk) never run FBGEMM: say why.
        exceptions += sorted(
            {
                f"{type(b).__name__} bags run their own kernels: {b.fbgemm_refusal()}"
                for b in runner.embedding_bags()
                if not isinstance(b, TableBatchedEmbeddingBag) and hasattr(b, "fbgemm_refusal")
            }
        )
    return "; ".join([why, *exceptions])


def _due(every: int | None, step: int) -> bool:
    """Whether something done every ``every`` steps (None: never) is due after ``step``."""
    return every is not None and step % every == 0


class TrainLoop:
    """One invocation's training of a built model, from its resume point to the end.

    Rank 0 writes the metrics and the result; every rank steps, evaluates and checkpoints
    (collectives), taking the same decisions from the same progress.
    """

    def __init__(
        self,
        config: RunConfig,
        env: DistEnv,
        run_dir: Path,
        spec: FeatureSpec,
        ids: IdMapper,
        loader,
        runner: StepRunner,
        resume: ResumePoint,
        digest: DataIdentity,
        data_warnings: list[str],
        on_record: Callable[[dict], None] | None,
        tracker: Tracker,
        device: torch.device,
        schedule: LrSchedule,
    ) -> None:
        self.config = config
        self.env = env
        self.rank0 = env.rank == 0
        self.run_dir = run_dir
        self.spec = spec
        self.loader = loader
        self.runner = runner
        self.resume = resume
        self.data_warnings = data_warnings
        self.on_record = on_record  # receives each metrics record as it is written
        self.tracker = tracker
        self.device = device
        self.model = runner.model
        self.optimizer = dense_optimizer(runner.dense_parameters(), config)
        self.rates = LearningRates(schedule, config, self.model, self.optimizer)
        # The mean loss over the global batch (by rows, or by weights: ``loss.py``).
        self.loss_fn = StepLoss(env, weighted=spec.weight is not None)
        self.metrics_path = run_dir / METRICS_FILE
        self.progress = self._restore()
        self.rows_before = self.progress.rows
        self.trained_from = self.progress.step
        self.lineage = resume.lineage(digest)
        self.passes = pass_count(config, list(digest.days))  # epochs, or days in day order
        # The newest checkpoint in this run dir, tracked here rather than listed from the
        # disk: every rank must take the same decisions, and rank 0 prunes while the others
        # go on. One resumed from elsewhere (another run's) does not count.
        self.saved_step = self.progress.step
        self.saved_path: Path | None = resume.info.path if resume.own else None
        self.save_seconds = 0.0
        self.last_eval: dict[str, float] = {}  # kept for the next checkpoint's manifest
        # The reader's position after the latest step (None: the start of its epoch).
        self.loader_state: dict | None = None
        self.start_time = time.perf_counter()
        self.window_start = self.start_time - self.progress.window_seconds
        self.elapsed_before = self.progress.seconds
        self.eval_loader = (
            test_loader(config, spec, ids, env, pin_memory=device.type == "cuda")
            if config.train.eval_every is not None
            else None
        )

    def run(self) -> TrainResult:
        """Train to ``train.epochs`` (in day order: through the last training day) or
        ``train.max_steps``, then checkpoint and report."""
        progress, train = self.progress, self.config.train
        max_steps = train.max_steps or math.inf
        self.model.train()
        if self.rank0:
            logger.info(
                "kernels: %s (%s)",
                kernels_used(self.runner, self.config),
                kernels_reason(self.runner, self.config),
            )
        while progress.epoch < self.passes and progress.step < max_steps:
            inputs = self._epoch_inputs()
            if inputs.batch is None:  # nothing left of this epoch (resumed right at its end)
                progress.epoch += 1
                self.loader_state = None
                continue
            while True:
                step = progress.step + 1
                last = step >= max_steps
                save_now = _due(train.checkpoint_every, step)
                # A checkpoint after this step records the reader before the next batch is
                # fetched: resuming then reads that batch again, exactly as this run will.
                self.loader_state = self.loader.state_dict() if save_now or last else None
                inputs.look_ahead(overlap=not last)
                loss, rows = self._train_step(step, inputs)
                progress.finish_step(rows, loss, epoch_ended=inputs.epoch_ends)
                if inputs.epoch_ends:  # a checkpoint now stands at the next epoch's start
                    self.loader_state = None
                if _due(train.log_every, step):
                    self._log_window()
                if _due(train.eval_every, step):
                    self._evaluate()
                if save_now:
                    self._checkpoint()
                if last or inputs.epoch_ends:
                    break
                inputs.advance()
        return self._finish()

    # -- the steps of the loop -----------------------------------------------------------

    def _restore(self) -> RunProgress:
        """The progress to continue (a fresh one without a checkpoint): the checkpoint's
        weights and optimizer state loaded, the reader repositioned unless this run reads
        the epoch afresh, and the metrics past the checkpoint dropped (rank 0)."""
        info, own = self.resume.info, self.resume.own
        progress = RunProgress()
        if info is not None:
            loader_state = restore(info, self.model, self.optimizer)
            progress = RunProgress.from_dict(info.manifest["progress"], with_window=own)
            repositioned = REREAD_KEYS & self.resume.changed.keys()
            if loader_state is not None and not repositioned:
                self.loader.load_state_dict(loader_state)
            if repositioned:  # its epoch is read again from the start: a pass begins
                progress.restart_pass()
        if self.rank0:
            if own:
                rewind_metrics(self.metrics_path, info.step, progress.window.steps > 0)
            else:
                self.metrics_path.unlink(missing_ok=True)
        return progress

    def _epoch_inputs(self) -> EpochInputs:
        """The batches of the epoch the progress stands in, the first one's input started."""
        runner = self.runner
        epoch = self.progress.epoch
        return EpochInputs(self.loader, epoch, runner, self.env, self.spec, runner.stager)

    def _train_step(self, step: int, inputs: EpochInputs) -> tuple[float, int]:
        """Forward, loss, backward and update of the current batch: the step's loss over
        the global batch and this rank's rows."""
        self.rates.set_for(step, self.progress)
        logits, batch, rows = inputs.forward()
        loss = self.loss_fn(logits, batch, rows)
        value = self._global_loss(step, loss.item())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # also updates the touched embedding rows (fused optimizer)
        self.optimizer.step()
        return value, rows

    def _global_loss(self, step: int, value: float) -> float:
        """The step's loss over the global batch (every rank's ``value`` is its rows' share),
        the same on every rank. Stops every rank at the first step whose loss is NaN or
        infinite, before that step updates anything: such a model is never checkpointed
        or reported."""
        env = self.env
        both = torch.tensor(
            [0.0 if math.isfinite(value) else 1.0, value], dtype=torch.float64, device="cpu"
        )
        if env.distributed:
            dist.all_reduce(both)
        if not bool(both[0]):
            return float(both[1]) / env.world_size
        last = (
            f"the last good checkpoint is {self.saved_path}"
            if self.saved_path
            else "no checkpoint was written"
        )
        raise NonFiniteLoss(
            f"step {step}: the loss is not finite ({value} on rank {env.rank}); training "
            f"stopped and this model was not saved ({last}); try a lower train.lr"
        )

    def _log_window(self) -> None:
        """Append one metrics record for the steps since the last one: their mean loss
        over the global batch."""
        progress, window = self.progress, self.progress.window
        now = time.perf_counter()
        progress.loss = window.mean_loss()
        record = {
            "step": progress.step,
            "epoch": progress.epoch,
            "rows": progress.rows,
            "loss": progress.loss,
            "lr": self.rates.dense,
            "samples_per_s": window.rows / max(now - self.window_start, 1e-9),
            "elapsed_s": self.elapsed_before + now - self.start_time,
            "data_wait_s": self._data_wait(),
        }
        comms = self.runner.comms
        if comms is not None:
            steps_here = max(progress.step - self.trained_from, 1)
            record["comm_bytes_per_step"] = {
                kind: n // steps_here for kind, n in comms.snapshot().items()
            }
        window.clear()
        self.window_start = now
        if not self.rank0:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.tracker.log_metrics(record, progress.step)
        if self.on_record is not None:
            self.on_record(record)

    def _evaluate(self) -> None:
        """Score the test day with the live model (every rank), log it, keep it for the
        next checkpoint's manifest, where it decides which checkpoint is the best."""
        config = self.config
        scored = predict(self.model, self.eval_loader, self.spec, self.env, config.eval.max_rows)
        if scored is None:
            return
        self.last_eval = click_metrics(scored.probs, scored.labels, scored.weights)
        progress = self.progress
        record = {"step": progress.step, "epoch": progress.epoch, **self.last_eval}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.tracker.log_metrics(self.last_eval, progress.step, prefix="eval/")

    def _checkpoint(self) -> None:
        """Save the model, the optimizer, the reader's position and the progress (a
        collective); rank 0 prunes the older checkpoints."""
        began = time.perf_counter()
        progress, plan = self.progress, self.runner.plan
        progress.seconds = self.elapsed_before + began - self.start_time
        self.saved_path = save_checkpoint(
            self.run_dir,
            model=self.model,
            optimizer=self.optimizer,
            config=self.config,
            spec=self.spec,
            progress=progress.to_dict(window_seconds=began - self.window_start),
            loader_state=self.loader_state,
            plan=plan.to_dict() if plan is not None else None,
            metrics=dict(self.last_eval),
            extra=self.lineage,
        )
        self.saved_step = progress.step
        if self.rank0:
            prune_checkpoints(self.run_dir, self.config.train.keep_checkpoints)
        self.save_seconds += time.perf_counter() - began

    def _data_wait(self) -> float:
        return self.loader.wait_seconds + self.runner.stager.wait_seconds

    # -- after the loop ------------------------------------------------------------------

    def _finish(self) -> TrainResult:
        """Write what is left (the tables on disk, a checkpoint of the last step, the open
        window's record) and the result (rank 0)."""
        config, env, progress = self.config, self.env, self.progress
        if self.eval_loader is not None:
            self.eval_loader.close()  # on an error path, the reader's exit hook closes it
        self.runner.finish()
        if progress.step == 0:
            raise ValueError(f"{config.data.url}: the training days hold no rows to train on")
        if self.saved_path is None or self.saved_step != progress.step:
            self._checkpoint()
        if progress.window.steps:
            # After the checkpoint, which keeps the window open: a run that continues this
            # one (more steps or epochs) completes it, as the uninterrupted run does.
            self._log_window()
        cache = self.runner.cache_stats()  # a collective for a job's shards on disk
        seconds = time.perf_counter() - self.start_time
        peaks = gather_peak_rss(env)
        info, comms = self.resume.info, self.runner.comms
        result = TrainResult(
            steps=progress.step,
            rows=progress.rows,
            seconds=seconds,
            samples_per_s=(progress.rows - self.rows_before) / seconds,
            final_loss=progress.loss if progress.loss is not None else float("nan"),
            checkpoint=str(self.saved_path),
            world_size=env.world_size,
            data_wait_s=self._data_wait(),
            comm_bytes_per_step=(
                {k: n // max(progress.step, 1) for k, n in comms.snapshot().items()}
                if comms is not None
                else {}
            ),
            resumed_from_step=info.step if info else None,
            embedding_cache=cache.to_dict() if cache is not None else {},
            trained_steps=progress.step - self.trained_from,
            resumed_from=str(info.path) if info else None,
            changed_on_resume=self.lineage["changed_on_resume"],
            warnings=self.data_warnings,
            checkpoint_save_s=self.save_seconds,
            checkpoint_verify_s=self.resume.verify_seconds,
            device=str(self.device),
            precision=config.train.precision,
            kernels=kernels_used(self.runner, config),
            kernels_reason=kernels_reason(self.runner, config),
            peak_rss_bytes=peaks,
            id_maps=id_map_counts(self.model.embeddings, ("admitted", "evicted", "rows_in_use")),
        )
        if self.rank0:
            write_atomic(self.run_dir / RESULT_FILE, json.dumps(result.to_dict(), indent=1))
        if env.distributed:
            dist.barrier()
        return result
