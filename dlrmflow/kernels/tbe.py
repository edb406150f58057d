"""Table-batched embedding bag with the optimizer fused into backward.

All tables live back to back in one flat float32 weight, whatever their dims; a lookup over
every feature is one gather per run of consecutive tables that share a dim (one gather in
total for the usual model, where they all do). Backward never builds a gradient for a
whole table, nor a sparse gradient for an optimizer to coalesce: it takes one gradient per
looked-up ID's bag, sums each distinct row's gradients in the order its IDs occur, and
updates the touched rows of the weight and of the optimizer state in place, as FBGEMM's
``SplitTableBatchedEmbeddingBagsCodegen`` does. Three implementations share these
semantics: on the CPU a compiled loop (``cpu_tbe``) for SGD and row-wise Adagrad; torch
ops (a stable sort and a CSR incidence product) for Adam and for the sharded trainer's
hooks, which need the sorted rows; Triton kernels (``triton_tbe``) on CUDA.

Why this order: each row's gradient is then the sum of its IDs' gradients in the order
of (table, sample, position in the bag), whatever the thread count and whichever
input form (jagged or one-hot) the batch came in, so the weights after any number of
steps are bitwise-identical across runs. No step accumulates with atomics or in an
order that a thread schedule decides.

The optimizers (``dlrmflow.kernels.optimizers``: SGD, row-wise Adagrad, Adam) describe
their row state and update rule; the bag keeps each state part in a buffer of its name
(so that ``state_dict`` checkpoints it with the weight) and asks the optimizer for the
rule. The fused update runs once per backward pass.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable

from dlrmflow.kernels import backends, cpu_tbe, fbgemm_tbe, triton_tbe
from dlrmflow.kernels.bag import EmbeddingBagBase
from dlrmflow.kernels.optimizers import EmbeddingOptimizer, StatePart, StepContext
from dlrmflow.kernels.tbe_layout import GroupLookup, TableGroup, groups_of
from dlrmflow.sparse import EmbeddingTable, KeyedJaggedTensor

# The CSR product is stable API in practice; torch still prints a beta notice on first use.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")

__all__ = ["TableBatchedEmbeddingBag", "init_table_rows", "initial_rows"]

# Rows drawn per generator in the init: each block has its own seed, so any row range of a
# table (a shard) is drawn without drawing the rows before it.
INIT_BLOCK_ROWS = 8192

GradientHook = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
SquareSumHook = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def init_table_rows(
    out: torch.Tensor,
    name: str,
    seed: int,
    *,
    table_rows: int,
    row_start: int = 0,
    col_start: int = 0,
    table_dim: int | None = None,
) -> None:
    """Fill ``out`` with rows ``[row_start, row_start + len(out))`` and columns
    ``[col_start, col_start + out.shape[1])`` of table ``name``'s initial weights.

    The weights are uniform in +-sqrt(1 / table_rows), as in the DLRM reference, drawn in
    blocks of ``INIT_BLOCK_ROWS`` rows whose generators are seeded by (seed, name, block):
    a shard of a table, at any world size and sharding, starts from exactly the values the
    same rows have in a single-process model.
    """
    rows, cols = out.shape
    dim = table_dim if table_dim is not None else cols
    bound = math.sqrt(1.0 / table_rows)
    name_key = zlib.crc32(name.encode())
    first, last = row_start // INIT_BLOCK_ROWS, (row_start + rows - 1) // INIT_BLOCK_ROWS
    for block in range(first, last + 1):
        gen = torch.Generator().manual_seed(
            ((seed * 1_000_003 + name_key) * 1_000_003 + block) % 2**63
        )
        block_start = block * INIT_BLOCK_ROWS
        n = min(INIT_BLOCK_ROWS, table_rows - block_start)
        values = torch.empty(n, dim).uniform_(-bound, bound, generator=gen)
        lo, hi = max(row_start, block_start), min(row_start + rows, block_start + n)
        out[lo - row_start : hi - row_start] = values[
            lo - block_start : hi - block_start, col_start : col_start + cols
        ]


def initial_rows(
    name: str, seed: int, rows: torch.Tensor, *, table_rows: int, dim: int
) -> torch.Tensor:
    """Rows ``rows`` of table ``name``'s initial weights (``init_table_rows``), ``[len(rows),
    dim]``: what a row handed to a new ID starts from, as at the table's birth. Each block
    of ``INIT_BLOCK_ROWS`` holding one of them is drawn once."""
    rows = torch.as_tensor(rows, dtype=torch.int64, device="cpu")
    out = torch.empty(rows.numel(), dim)
    blocks = rows // INIT_BLOCK_ROWS
    for block in torch.unique(blocks).tolist():
        start = block * INIT_BLOCK_ROWS
        drawn = torch.empty(min(INIT_BLOCK_ROWS, table_rows - start), dim)
        init_table_rows(drawn, name, seed, table_rows=table_rows, row_start=start)
        mine = (blocks == block).nonzero().squeeze(1)
        out[mine] = drawn[rows[mine] - start]
    return out


class _FusedLookup(torch.autograd.Function):
    """Forward returns the pooled lookups; backward applies the optimizer and returns None."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        trigger: torch.Tensor,
        module: TableBatchedEmbeddingBag,
        pooled: torch.Tensor,
        lookups: list[GroupLookup],
    ) -> torch.Tensor:
        ctx.module = module
        ctx.lookups = lookups
        return pooled

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.module._apply_gradient(grad_out, ctx.lookups)
        return None, None, None, None


class TableBatchedEmbeddingBag(EmbeddingBagBase):
    """Several embedding tables in one flat weight, pooled per feature, trained in backward.

    ``forward(kjt)`` returns ``[B, sum of dims]``, table after table in config order; in
    training mode with autograd enabled, the backward of that output updates the looked-up
    rows in place (see the module docstring for the optimizers). ``weight`` never requires
    a gradient: do not hand it to a ``torch.optim`` optimizer.
    """

    # Whether FBGEMM's fused backward may replace ``_apply_gradient`` (a subclass that
    # extends the update says no).
    fbgemm_capable: ClassVar[bool] = True

    def __init__(
        self,
        tables: Sequence[EmbeddingTable],
        optimizer: EmbeddingOptimizer,
        seed: int = 0,
        init: Callable[[int, torch.Tensor], None] | None = None,
        kernels: str = "auto",
    ) -> None:
        """``init(k, rows)`` fills table ``k``'s ``[num_embeddings, dim]`` rows in place; by
        default ``init_table_rows`` draws them from ``seed`` and the table's name. The
        weights are made on the CPU (the same draws on every device); ``.to(device)`` moves
        them. ``kernels`` picks the implementation (``dlrmflow.kernels.backends``)."""
        super().__init__(tables, optimizer, kernels)
        sizes = [t.num_embeddings for t in tables]
        dims = [t.embedding_dim for t in tables]
        self.groups = groups_of(self.tables)
        # Row of each table inside its group's 2-D view, indexed by key.
        local_start = [0] * len(tables)
        for group in self.groups:
            for k in range(group.first_key + 1, group.end_key):
                local_start[k] = local_start[k - 1] + sizes[k - 1]
        self.register_buffer("_local_start", torch.tensor(local_start), persistent=False)
        self.register_buffer("_sizes", torch.tensor(sizes), persistent=False)
        self.register_buffer(
            "_is_mean", torch.tensor([t.pooling == "mean" for t in tables]), persistent=False
        )
        numel = sum(n * d for n, d in zip(sizes, dims, strict=True))
        self.register_buffer("weight", torch.empty(numel))
        with torch.no_grad():
            for k, t in enumerate(tables):
                if init is None:
                    init_table_rows(self.table(t.name), t.name, seed, table_rows=t.num_embeddings)
                else:
                    init(k, self.table(t.name))
        # Called with (group index, group-local unique rows, their reduced gradients) before
        # the update; returns the (rows, gradients) to apply. Data-parallel tables allreduce
        # here, so every replica applies the same global update.
        self.gradient_hook: GradientHook | None = None
        # Row-wise Adagrad on a column shard: called with (group index, rows, each row's sum
        # of squared gradients over this shard's columns); returns the mean over the whole
        # row's columns, which the shards holding the other columns contribute to.
        self.square_sum_hook: SquareSumHook | None = None
        self._scratch: cpu_tbe.Scratch | None = None  # see _cpu_scratch
        # What the pooled rows are handed on as: bfloat16 for a dense arch computing in it
        # (``train.precision``), which on the compiled path are gathered straight into it
        # (``cpu_tbe.gather_bf16``) and whose bfloat16 gradient the fused step reads,
        # instead of a float32 copy cast each way.
        self.pooled_dtype = torch.float32
        for part in optimizer.state_parts:
            self.register_buffer(part.name, torch.zeros(sum(sizes) if part.per_row else numel))
        if optimizer.step_key is not None:
            self.register_buffer("step", torch.zeros((), dtype=torch.int64))

    def _table_part(self, k: int, part: StatePart | None) -> torch.Tensor:
        """Views into the flat buffers: ``weight`` or the part's buffer of its name."""
        if part is not None and part.per_row:
            start = sum(t.num_embeddings for t in self.tables[:k])
            return getattr(self, part.name)[start : start + self.tables[k].num_embeddings]
        return self._rows_of(self.weight if part is None else getattr(self, part.name), k)

    def step_count(self) -> int:
        """The optimizer's global step count (0 for one that counts none)."""
        return 0 if self.optimizer.step_key is None else int(self.step)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """Pooled embeddings ``[B, sum of dims]``, each table's columns in config order."""
        if kjt.keys != self.names:
            raise ValueError(f"batch keys {kjt.keys} differ from the tables {self.names}")
        if self._backend() == "fbgemm":
            return self._fbgemm_forward(kjt)
        rows = kjt.one_hot_rows
        if rows is not None:
            if not self._cpu_ids(rows):  # the compiled pass checks the IDs as it goes
                self._check_one_hot(rows)
            parts = [self._lookup_one_hot(g, rows) for g in self.groups]
        else:
            if kjt.weights is not None and bool(self._is_mean.any()):
                raise ValueError("per-sample weights need sum pooling for every table")
            if not self._cpu_ids(kjt.values):  # the compiled pass checks the IDs as it goes
                self._check_jagged(kjt)
            if self._on_triton():
                parts = [
                    triton_tbe.lookup_jagged(self.weight, g, kjt, self._local_start, self._is_mean)
                    for g in self.groups
                ]
            else:
                parts = [self._lookup_jagged(g, kjt) for g in self.groups]
        pooled = parts[0][0] if len(parts) == 1 else torch.cat([p for p, _ in parts], dim=1)
        pooled = pooled.to(self.pooled_dtype)
        if not (self.training and torch.is_grad_enabled()):
            return pooled
        # The weight never requires grad; an empty leaf that does puts the op in the graph.
        trigger = torch.empty(0, requires_grad=True, device=pooled.device)
        return _FusedLookup.apply(trigger, self, pooled, [lookup for _, lookup in parts])

    @property
    def backend(self) -> str:
        """What runs this bag's steps: "torch", "compiled", "triton" or "fbgemm"
        (``kernels`` resolved for the weight's device and for this bag)."""
        return self._backend()

    def _backend(self) -> str:
        resolved = backends.resolve(self.kernels, self.weight)
        if resolved == "fbgemm" and self.fbgemm_refusal() is not None:
            return backends.besides_fbgemm(self.weight)
        return resolved

    def fbgemm_refusal(self) -> str | None:
        """Why FBGEMM's kernels cannot run this bag's steps (None: they can). Its fused
        backward reduces and updates in one go, so a bag whose update needs a step in
        between (the sharded trainer's hooks, a subclass's extension), a global step count
        only backward advances (Adam) or weight decay runs ``auto``'s kernels instead."""
        if not self.fbgemm_capable:
            return f"{type(self).__name__} extends the update"
        refusal = self.optimizer.fbgemm_refusal()
        if refusal is not None:
            return refusal
        if self.gradient_hook is not None or self.square_sum_hook is not None:
            return "the sharded trainer reduces this bag's gradients across ranks"
        if self.weight.device.type not in ("cpu", "cuda") or self.weight.dtype != torch.float32:
            return (
                f"FBGEMM runs float32 weights on cpu or cuda, not {self.weight.dtype} on "
                f"{self.weight.device}"
            )
        return fbgemm_tbe.refusal(self.weight.device.type)

    def _fbgemm_forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """The lookup on FBGEMM's kernels, working in this bag's buffers; in training with
        autograd on, its backward applies the optimizer as ``_apply_gradient`` would."""
        rows = kjt.one_hot_rows
        if rows is not None:
            self._check_one_hot(rows)
        else:
            if kjt.weights is not None and bool(self._is_mean.any()):
                raise ValueError("per-sample weights need sum pooling for every table")
            self._check_jagged(kjt)
        device = self.weight.device
        fb = self.__dict__.get("_fbgemm")
        if fb is None or fb.device != device:
            fb = fbgemm_tbe.FbgemmTables(self.tables, self.optimizer, device)
            self.__dict__["_fbgemm"] = fb  # not a submodule: it only views our buffers
        fb.bind(self.weight, self._row_state_buffer())
        mean = self._is_mean if bool(self._is_mean.any()) else None
        if self.training and torch.is_grad_enabled():
            return fb.lookup(kjt, lr=self.lr, mean_tables=mean, train=True)
        with torch.no_grad():
            return fb.lookup(kjt, lr=self.lr, mean_tables=mean, train=False)

    def _on_triton(self) -> bool:
        """The Triton kernels (``triton_tbe``): CUDA weights with triton installed, or forced."""
        return self._backend() == "triton"

    def _fusable(self) -> bool:
        """Whether a fused kernel can reduce and update in one go: they cover SGD and
        row-wise Adagrad without the sharded trainer's hooks (which need the sorted rows
        the torch ops build); the rest stays on the torch ops, which run on CUDA too."""
        return (
            self.optimizer.fused_rule is not None
            and self.gradient_hook is None
            and self.square_sum_hook is None
        )

    def _fused_on_triton(self) -> bool:
        return self._on_triton() and self._fusable()

    def _compiled(self) -> bool:
        return self._backend() == "compiled" and cpu_tbe.supports(self.weight)

    def _fused_on_cpu(self) -> bool:
        return self._compiled() and self._fusable()

    def _cpu_ids(self, ids: torch.Tensor) -> bool:
        """IDs on the CPU (one-hot or jagged) are checked and turned into group rows (and
        bag positions) by one compiled pass (``cpu_tbe``)."""
        return self._compiled() and ids.device.type == "cpu"

    def _row_state_buffer(self) -> torch.Tensor | None:
        """The per-row state the fused kernels update beside the weights (row-wise
        Adagrad's sums of squares), None when the optimizer keeps none."""
        parts = [p for p in self.optimizer.state_parts if p.per_row]
        return getattr(self, parts[0].name) if parts else None

    def _state_view(self, part: StatePart, group: TableGroup) -> torch.Tensor:
        """One state part's rows of ``group``: ``[rows]`` per row, ``[rows, dim]`` per
        element (views)."""
        flat = getattr(self, part.name)
        return self._group_rows(flat, group) if part.per_row else self._view(flat, group)

    def _cpu_scratch(self) -> cpu_tbe.Scratch:
        """The compiled step's buffers, made on first use (one per module)."""
        if self._scratch is None:
            self._scratch = cpu_tbe.Scratch(max(g.num_rows for g in self.groups))
        return self._scratch

    def _rows_of(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        start = sum(t.num_embeddings * t.embedding_dim for t in self.tables[:k])
        table = self.tables[k]
        return flat[start : start + table.num_embeddings * table.embedding_dim].view(
            -1, table.embedding_dim
        )

    def _view(self, flat: torch.Tensor, group: TableGroup) -> torch.Tensor:
        end = group.first_element + group.num_rows * group.dim
        return flat[group.first_element : end].view(-1, group.dim)

    def _check_one_hot(self, rows: torch.Tensor) -> None:
        bad = (rows < -1) | (rows >= self._sizes)
        if bool(bad.any()):
            sample, key = (int(i) for i in bad.nonzero()[0])
            raise IndexError(
                f"feature {self.names[key]!r}: ID {int(rows[sample, key])} of sample {sample} "
                f"is outside its table's [0, {self.tables[key].num_embeddings}) rows"
            )

    def _check_jagged(self, kjt: KeyedJaggedTensor) -> None:
        per_key = torch.tensor(kjt.length_per_key(), dtype=torch.int64, device=kjt.values.device)
        limit = self._sizes.repeat_interleave(per_key, output_size=kjt.values.numel())
        bad = (kjt.values < 0) | (kjt.values >= limit)
        if bool(bad.any()):
            position = int(bad.nonzero()[0, 0])
            key = int(torch.searchsorted(per_key.cumsum(0), position, right=True))
            raise IndexError(
                f"feature {self.names[key]!r}: ID {int(kjt.values[position])} is outside its "
                f"table's [0, {self.tables[key].num_embeddings}) rows"
            )

    def _lookup_one_hot(
        self, group: TableGroup, rows: torch.Tensor
    ) -> tuple[torch.Tensor, GroupLookup]:
        n_keys = group.end_key - group.first_key
        keys = slice(group.first_key, group.end_key)
        if self._cpu_ids(rows):
            ids, missing, bad = cpu_tbe.one_hot_ids(
                rows, group.first_key, self._local_start[keys], self._sizes[keys]
            )
            if bad >= 0:
                self._check_one_hot(rows)  # raises, naming the feature
                sample, key = divmod(bad, n_keys)
                raise IndexError(
                    f"ID {int(rows[sample, group.first_key + key])} is outside its table"
                )
            present = (rows[:, keys] >= 0).reshape(-1) if missing else None
        else:
            flat = rows[:, keys].reshape(-1)
            present = flat >= 0
            ids = (flat + self._local_start[keys].repeat(rows.shape[0])).masked_fill_(~present, 0)
            if bool(present.all()):
                present = None
        table = self._view(self.weight, group)
        if self.pooled_dtype == torch.bfloat16 and self._cpu_ids(rows):
            gathered = cpu_tbe.gather_bf16(table, ids)
        else:
            gathered = table.index_select(0, ids)
        positions = None
        if present is not None:
            # Zeroing the few missing rows by index: cheaper than a mask over all rows.
            gathered.index_fill_(0, (~present).nonzero().squeeze(1), 0.0)
            positions = present.nonzero().squeeze(1)
            ids = ids.index_select(0, positions)
        # A bag of one is its own mean, so mean pooling needs no divisor here.
        pooled = gathered.view(rows.shape[0], n_keys * group.dim)
        return pooled, GroupLookup(ids, positions, divisor=None, weights=None)

    def _lookup_jagged(
        self, group: TableGroup, kjt: KeyedJaggedTensor
    ) -> tuple[torch.Tensor, GroupLookup]:
        batch = kjt.stride
        n_keys = group.end_key - group.first_key
        offsets = kjt.offsets()[group.first_key * batch : group.end_key * batch + 1]
        first, last = int(offsets[0]), int(offsets[-1])
        lengths = kjt.lengths[group.first_key * batch : group.end_key * batch].long()
        per_key = lengths.view(n_keys, batch).sum(1)
        keys = slice(group.first_key, group.end_key)
        n_ids = last - first
        positions = key_counts = None
        if self._cpu_ids(kjt.values):
            # Only the compiled backward splits its work by key; without the counts it
            # would still be right, scanning every ID for its keys' (see cpu_tbe._spans).
            key_counts = per_key.tolist()
            ids, positions, bad = cpu_tbe.jagged_rows(
                kjt.values, offsets, self._local_start[keys], self._sizes[keys], batch
            )
            if bad >= 0:
                self._check_jagged(kjt)  # raises, naming the feature
                raise IndexError(f"ID {int(kjt.values[first + bad])} is outside its table")
        else:
            ids = kjt.values[first:last] + self._local_start[keys].repeat_interleave(
                per_key, output_size=n_ids
            )
        weights = None if kjt.weights is None else kjt.weights[first:last]
        pooled = F.embedding_bag(
            ids,
            self._view(self.weight, group),
            offsets - first,
            mode="sum",
            per_sample_weights=weights,
            include_last_offset=True,
        )
        divisor = None
        if group.has_mean:
            bag_divisor = torch.where(
                self._is_mean[keys].repeat_interleave(batch), lengths.clamp(min=1), 1
            ).to(pooled.dtype)
            pooled /= bag_divisor[:, None]
            divisor = bag_divisor.repeat_interleave(lengths, output_size=n_ids)
        # Key-major bags -> sample-major: each sample's tables side by side in the output.
        pooled = pooled.view(n_keys, batch, group.dim).transpose(0, 1).reshape(batch, -1)
        if positions is None:
            bag = torch.arange(n_keys * batch, device=ids.device)
            bag = bag.repeat_interleave(lengths, output_size=n_ids)
            positions = (bag % batch) * n_keys + bag // batch
        return pooled, GroupLookup(ids, positions, divisor, weights, key_counts)

    @torch.no_grad()
    def _apply_gradient(self, grad_out: torch.Tensor, lookups: list[GroupLookup]) -> None:
        if not self._fused_on_cpu():  # only the compiled step reads a bfloat16 gradient
            grad_out = grad_out.float()
        if self.optimizer.step_key is not None:
            self.step += 1
        row_state = self._row_state_buffer()
        for g, (group, lookup) in enumerate(zip(self.groups, lookups, strict=True)):
            if lookup.ids.numel() == 0 and self.gradient_hook is None:
                continue
            columns = slice(group.first_column, group.first_column + self._group_width(group))
            bag_grads = grad_out[:, columns].reshape(-1, group.dim)
            scale = None if lookup.divisor is None else lookup.divisor.reciprocal()
            if lookup.weights is not None:
                scale = lookup.weights if scale is None else scale * lookup.weights
            if self._fused_on_cpu():
                # One compiled pass reduces by row and updates (``cpu_tbe``).
                rowwise = self.optimizer.fused_rule == "rowwise_adagrad"
                cpu_tbe.fused_step(
                    self._view(self.weight, group),
                    None if row_state is None else self._group_rows(row_state, group),
                    self._cpu_scratch(),
                    lookup.ids,
                    bag_grads,
                    lookup.positions,
                    scale,
                    n_keys=group.end_key - group.first_key,
                    key_counts=lookup.key_counts,
                    rowwise_adagrad=rowwise,
                    lr=self.lr,
                    weight_decay=self.optimizer.weight_decay,
                    eps=getattr(self.optimizer, "eps", 0.0),
                )
                continue
            if self._fused_on_triton():
                # Reduce and update in one kernel: the row gradients never reach memory.
                triton_tbe.reduce_and_update(
                    self.weight,
                    row_state,
                    group,
                    lookup.ids,
                    bag_grads,
                    lookup.positions,
                    scale,
                    self.optimizer,
                    self.lr,
                )
                continue
            triton = self._on_triton() and self.optimizer.fused_rule is not None
            reduce = triton_tbe.reduce_by_row if triton else _reduce_by_row
            rows, row_grads = reduce(lookup.ids, bag_grads, lookup.positions, scale)
            if self.gradient_hook is not None:
                rows, row_grads = self.gradient_hook(g, rows, row_grads)
            if triton and self.square_sum_hook is None:
                triton_tbe.update_rows(
                    self.weight,
                    row_state,
                    group,
                    rows,
                    row_grads,
                    self.optimizer,
                    self.lr,
                )
                continue
            self._update(group, rows, row_grads, g)

    def _group_width(self, group: TableGroup) -> int:
        return (group.end_key - group.first_key) * group.dim

    def _update(
        self, group: TableGroup, rows: torch.Tensor, grads: torch.Tensor, group_index: int = 0
    ) -> None:
        """One optimizer step on the (unique, sorted) group-local ``rows``: their weights
        and state gathered, updated by the optimizer's rule, and written back."""
        weight = self._view(self.weight, group)
        w = weight.index_select(0, rows)
        views = {part.name: self._state_view(part, group) for part in self.optimizer.state_parts}
        state = {name: view.index_select(0, rows) for name, view in views.items()}
        ctx = StepContext(self.lr, self.step_count())
        hook = self.square_sum_hook
        if hook is not None:
            ctx = replace(ctx, mean_square=lambda g: hook(group_index, rows, g.square().sum(1)))
        self.optimizer.update(w, grads, state, ctx)
        for name, view in views.items():
            view.index_copy_(0, rows, state[name])
        weight.index_copy_(0, rows, w)

    def _group_rows(self, flat: torch.Tensor, group: TableGroup) -> torch.Tensor:
        return flat[group.first_row : group.first_row + group.num_rows]


def _reduce_by_row(
    ids: torch.Tensor,
    bag_grads: torch.Tensor,
    bags: torch.Tensor | None,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique sorted ``ids`` and each one's gradient: the sum, over its occurrences in input
    order, of ``scale[i] * bag_grads[bags[i]]`` (``bags`` None: occurrence ``i`` is bag ``i``).

    The sum is a product with a CSR incidence matrix (a row per unique ID, its occurrences
    as columns in stable-sorted order): each output row accumulates its own entries in that
    fixed order whatever the thread count, and the per-ID gradients, which on multi-hot
    batches are ~20x the bag gradients, are never materialised, which makes it faster than
    gathering them and summing duplicates with ``segment_reduce``.
    """
    sorted_ids, order = torch.sort(ids, stable=True)
    rows, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    columns = order if bags is None else bags.index_select(0, order)
    values = (
        torch.ones(ids.numel(), dtype=bag_grads.dtype, device=ids.device)
        if scale is None
        else scale.index_select(0, order).to(bag_grads.dtype)
    )
    row_starts = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=row_starts[1:])
    incidence = torch.sparse_csr_tensor(
        row_starts,
        columns,
        values,
        size=(rows.numel(), bag_grads.shape[0]),
        check_invariants=False,  # built sorted and in range above
    )
    return rows, incidence @ bag_grads
