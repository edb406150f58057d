"""A servable export: the whole model as one ``torch.export`` program, loadable without dlrmflow.

``export_servable`` turns a checkpoint into a ``.pt2`` archive (``torch.export.save``) that
a serving process opens with ``torch.export.load(path).module()`` and nothing else: no
dlrmflow, no training code. The program takes plain tensors in the project's
``KeyedJaggedTensor`` layout and returns click probabilities:

* ``dense``: float32 ``[B, n_dense]``, already transformed (as ``Batch.dense`` holds them);
* ``values``: int64 ``[N]``, the embedding rows, key-major (every sample's IDs of feature
  0, then of feature 1, ...), each a row of its own feature's table; a dynamic table's
  features (``ids: dynamic``) take their raw int64 IDs instead, which the program maps by
  the table's map frozen at export (its live IDs sorted, searched with
  ``torch.searchsorted``; an ID without a row reads the default row 0, as evaluation
  does);
* ``offsets``: int64 ``[T * B + 1]``, where bag ``k * B + i`` (feature ``k``, sample
  ``i``) holds ``values[offsets[k * B + i]:offsets[k * B + i + 1]]``; an empty bag is a
  missing ID;
* ``weights`` (only a model with per-ID weights: schema ``weights`` on some feature):
  float32 ``[N]``, each ID's weight, 1 for the IDs of features without weights; a bag is
  the weighted sum of its rows, as in training. A model without them keeps the
  three-input program it always had;
* output: float32 ``[B]``, ``sigmoid`` of the click logit.

``B`` (at least 1) and ``N`` (at least 0) are dynamic. The program checks the layout and
the IDs itself (an ID outside its feature's table would otherwise read a row of the next
table), so a raw consumer gets an error rather than a silent wrong score.

Why one flat table: every table is stacked into one ``[rows, dim]`` weight (a table that
features share, once) and an ID becomes ``its feature's table's first row + ID``, so the
whole lookup is one ``embedding_bag`` over all bags, as the training's table-batched bag
does; with one ID per bag (the usual one-hot data) and float32 tables the pooled vectors,
and so the probabilities, are bitwise those of the checkpoint's model (measured: identical
on the held-out day, see tests/train/run/test_exported_model.py).

The dense arch always runs in float32 here: a run trained with ``train.precision=bf16``
scores its checkpoint under bfloat16 autocast, so the export's check against it shows
that difference too.

Quantization shrinks the tables only (they are nearly all of a DLRM's bytes); the dense
arch stays float32:

* ``fp16``: tables stored half precision; the gathered rows are upcast to float32 before
  pooling, so the sums are float32 ones.
* ``int8``: FBGEMM's fused 8-bit row-wise format (``quantized::embedding_bag_byte_prepack``:
  each row ``dim`` uint8 codes then its float32 scale and bias, ``scale = (max - min) / 255``,
  ``bias = min``, ``q = round((w - min) / scale)``), pooled by FBGEMM's
  ``embedding_bag_byte_rowwise_offsets``, which dequantizes each gathered row before summing.
  The kernel is the one serving stacks run for these tables on CPU, and it is in every torch
  build, so the archive needs no extension to load.

What a scoring job needs to rebuild batches (the feature spec, the run's configuration,
the checkpoint and step, the quantization and this input convention) travels in the
archive as JSON (``extra_files``); ``load_servable`` reads it back with the program.

How a serving system without dlrmflow makes the inputs from a raw row is in that JSON too
(``raw_inputs``, ``recipe.raw_recipe``): each dense column's fill and transform
(standardize's mean and deviation), in ``dense``'s order; each sparse feature, in
``values``' key order, with the column(s) it reads and how they become rows: string IDs
hashed to int64, list cuts, per-ID weights, the hash with its salt or the vocabulary,
crosses' and buckets' formulas, each written out with its constants.
``tests/train/run/test_exported_model_raw.py`` builds the inputs from the recipe alone and gets
dlrmflow's scores.
"""

from __future__ import annotations

import copy
import io
import json
import warnings
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch
import torch.nn.functional as F
from torch import nn

from dlrmflow.atomic_writes import atomic_path, output_target
from dlrmflow.config import ConfigError, RunConfig, recorded_config
from dlrmflow.errors import DlrmflowError
from dlrmflow.features.batch import Batch
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.runtime.async_assert import assert_async
from dlrmflow.supervise import interrupt_on_signals, signals_deferred
from dlrmflow.train.model.dynamic_ids import DynamicIdEmbeddings
from dlrmflow.train.model.embeddings import behind
from dlrmflow.train.run.recipe import program_inputs, raw_recipe

if TYPE_CHECKING:
    from dlrmflow.train.run.checkpoint import Checkpoint

__all__ = [
    "FORMATS",
    "QUANTIZATIONS",
    "Servable",
    "ServableDLRM",
    "ServableError",
    "WeightedServableDLRM",
    "export_run",
    "export_servable",
    "is_servable",
    "load_servable",
]

FORMATS = ("safetensors", "torch-export")
QUANTIZATIONS = ("none", "fp16", "int8")
# Held-out rows the export scores through both models by default (``--verify-rows``).
VERIFY_ROWS = 50_000
# The archive member (under the archive's ``extra/``) holding the metadata, and the value
# of its ``kind``: how ``is_servable`` tells this export from any other .pt2 archive.
METADATA_FILE = "dlrmflow/servable.json"
KIND = "dlrmflow-servable"
VERSION = 1


class ServableError(DlrmflowError):
    """An export or a servable that cannot be made or used; the message names the path."""


class ServableDLRM(nn.Module):
    """A checkpoint's DLRM (or DCNv2) as plain torch ops, for ``torch.export``.

    Built from a loaded model (``from_model``); holds copies of its weights, so the
    training model can be dropped. ``forward(dense, values, offsets)`` returns the click
    probabilities (see the module docstring for the layout). Written with nothing the
    exporter cannot trace: no Python branch on tensor values, no data-dependent shape.
    A spec with per-ID weights takes ``WeightedServableDLRM``, whose program has them as
    an input.
    """

    takes_weights = False

    def __init__(
        self,
        spec: FeatureSpec,
        tables: list[torch.Tensor],
        bottom: nn.Module,
        top: nn.Module,
        *,
        arch: str,
        cross: nn.Module | None = None,
        quantize: str = "none",
        maps: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        super().__init__()
        if quantize not in QUANTIZATIONS:
            raise ConfigError(
                f"quantize must be one of {', '.join(QUANTIZATIONS)}, not {quantize!r}"
            )
        if arch not in ("dlrm", "dcnv2") or (arch == "dcnv2") != (cross is not None):
            raise ValueError(f"arch {arch!r}: dcnv2 needs its cross network, dlrm none")
        if len(tables) != len(spec.tables):
            raise ValueError(f"{len(tables)} tables for the spec's {len(spec.tables)}")
        for table, declared in zip(tables, spec.tables, strict=True):
            if table.shape[0] != declared.num_embeddings:
                raise ValueError(
                    f"table {declared.name!r} has {table.shape[0]} rows, its spec "
                    f"{declared.num_embeddings}"
                )
        # Each feature's table (several features may share one, stored once).
        index = {t.name: k for k, t in enumerate(spec.tables)}
        table_of = [index[f.table_name] for f in spec.sparse]
        dims = [tables[k].shape[1] for k in table_of]
        if arch == "dlrm" and len(set(dims)) != 1:
            raise ValueError("the dot interaction needs every table of one embedding dim")
        weighted = _weighted(spec)
        if bool(weighted) != self.takes_weights:
            raise ValueError(
                f"features with per-ID weights {weighted}: build a WeightedServableDLRM "
                "for them, a ServableDLRM without"
            )
        self.arch = arch
        self.quantize = quantize
        self.n_tables = len(spec.sparse)  # the bags' keys: one per feature
        # Tables of several widths are stored padded with zeros to the widest (zeros add
        # nothing to a bag's sum), and their own columns picked after pooling.
        self.dim = max(dims)
        keep = [k * self.dim + c for k, d in enumerate(dims) for c in range(d)]
        if len(set(dims)) != 1:
            self.register_buffer("columns", torch.tensor(keep, dtype=torch.int64, device="cpu"))
        else:
            self.columns = None  # a program of one width keeps its graph
        sizes = [t.shape[0] for t in tables]
        firsts = [sum(sizes[:k]) for k in range(len(sizes))]
        starts = [firsts[k] for k in table_of]
        rows = [sizes[k] for k in table_of]
        self.register_buffer("table_start", torch.tensor(starts, dtype=torch.int64, device="cpu"))
        self.register_buffer("table_rows", torch.tensor(rows, dtype=torch.int64, device="cpu"))
        is_mean = [f.pooling == "mean" for f in spec.sparse]
        self.has_mean = any(is_mean)
        self.register_buffer("is_mean", torch.tensor(is_mean, device="cpu"))
        flat = torch.cat(
            [F.pad(t.detach().float(), (0, self.dim - t.shape[1])).contiguous() for t in tables]
        )
        self.fp32_table_bytes = flat.numel() * flat.element_size()
        if quantize == "none":
            self.register_buffer("weight", flat)
        elif quantize == "fp16":
            self.register_buffer("weight", flat.half())
        else:
            self.register_buffer("weight", torch.ops.quantized.embedding_bag_byte_prepack(flat))
        self.bottom = bottom
        self.top = top
        self.cross = cross
        if arch == "dlrm":
            # The dot interaction's pairs, in dlrmflow.kernels.interaction's order.
            n = self.n_tables + 1
            rows_i, cols_j = torch.tril_indices(n, n, offset=-1)
            self.register_buffer("pairs", rows_i * n + cols_j)
        # Dynamic tables: each one's frozen map (raw IDs ascending, their rows) and which
        # features' IDs go through it; the program takes those features' raw IDs.
        self.n_maps = 0
        for name, (keys, rows) in (maps or {}).items():
            if name not in index:
                raise ValueError(f"a map for {name!r}, which is not among the spec's tables")
            if len(keys) == 0:  # nothing admitted: every ID reads the default row
                keys = rows = torch.zeros(1, dtype=torch.int64, device="cpu")
            through = [f.table_name == name for f in spec.sparse]
            self.register_buffer(f"map_keys_{self.n_maps}", keys.to("cpu", torch.int64))
            self.register_buffer(f"map_rows_{self.n_maps}", rows.to("cpu", torch.int64))
            self.register_buffer(f"map_features_{self.n_maps}", torch.tensor(through, device="cpu"))
            self.n_maps += 1
        for p in self.parameters():
            p.requires_grad_(False)

    @classmethod
    def from_model(
        cls, model: nn.Module, spec: FeatureSpec, quantize: str = "none"
    ) -> ServableDLRM:
        """The servable form of a loaded ``DLRM`` (``load_checkpoint(...).model``).

        The dense arch's modules are deep copies (plain ``nn.Linear``/``nn.ReLU`` stacks and
        the cross network), run in float32 whatever precision trained them.
        """
        maps = {}
        if isinstance(model.embeddings, DynamicIdEmbeddings):
            for name, id_map in model.embeddings.maps.items():
                keys, rows = id_map.frozen()
                maps[name] = (torch.from_numpy(keys), torch.from_numpy(rows))
        bag = behind(model.embeddings)
        if list(bag.names) != [t.name for t in spec.tables]:
            raise ValueError(f"the model's tables {bag.names} differ from the spec's")
        arch = model.dense_arch
        tables = [bag.table(name).detach().cpu() for name in bag.names]
        kind = WeightedServableDLRM if _weighted(spec) else ServableDLRM
        return kind(
            spec,
            tables,
            copy.deepcopy(arch.bottom).float().cpu(),
            copy.deepcopy(arch.top).float().cpu(),
            arch=arch.arch,
            cross=copy.deepcopy(arch.interaction).float().cpu() if arch.arch == "dcnv2" else None,
            quantize=quantize,
            maps=maps,
        )

    @property
    def table_bytes(self) -> int:
        """Bytes of the tables as stored here (with int8's per-row scale and bias)."""
        return self.weight.numel() * self.weight.element_size()

    def forward(
        self, dense: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        return self._probabilities(dense, values, offsets, None)

    def _probabilities(
        self,
        dense: torch.Tensor,
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
    ) -> torch.Tensor:
        """The click probabilities; ``weights`` (None: unweighted) scale each ID's row in
        its bag's sum, as the training's bag does."""
        batch, n_ids, n_tables = dense.shape[0], values.shape[0], self.n_tables
        # Each ID's table: the bags are key-major, so table k's IDs end where its last bag does.
        table_ends = offsets[1:].view(n_tables, batch)[:, -1].contiguous()
        table = torch.bucketize(torch.arange(n_ids, device=values.device), table_ends, right=True)
        # Past the last table only when the offsets are malformed (the check below fails);
        # clamped so that the check itself indexes in range.
        table = table.clamp(max=n_tables - 1)
        values = self._mapped(values, table)
        well_formed = (
            (offsets[0] == 0)
            & (offsets[-1] == n_ids)
            & (offsets[1:] >= offsets[:-1]).all()
            & (values >= 0).all()
            & (values < self.table_rows[table]).all()
        )
        if weights is None:
            assert_async(
                well_formed,
                "servable inputs: offsets must rise from 0 to len(values) and every ID must lie "
                "in its feature's table",
            )
        else:
            assert_async(
                well_formed & torch.isfinite(weights).all(),
                "servable inputs: offsets must rise from 0 to len(values), every ID must lie "
                "in its feature's table and every weight must be finite",
            )
        rows = values + self.table_start[table]
        pooled = self._pool(rows, offsets, weights)  # [T * B, dim], key-major bags
        if self.has_mean:
            lengths = offsets[1:] - offsets[:-1]
            mean = self.is_mean[:, None].expand(n_tables, batch).reshape(-1)
            pooled = pooled / torch.where(mean, lengths.clamp(min=1), 1).to(pooled.dtype)[:, None]
        pooled = pooled.view(n_tables, batch, self.dim).transpose(0, 1).reshape(batch, -1)
        if self.columns is not None:
            pooled = pooled.index_select(1, self.columns)
        dense_out = self.bottom(dense)
        if self.cross is None:
            n = n_tables + 1
            vectors = torch.cat([dense_out.unsqueeze(1), pooled.view(batch, n_tables, self.dim)], 1)
            gram = torch.bmm(vectors, vectors.transpose(1, 2)).view(batch, n * n)
            features = torch.cat([dense_out, gram.index_select(1, self.pairs)], dim=1)
        else:
            features = self.cross(torch.cat([dense_out, pooled], dim=1))
        return torch.sigmoid(self.top(features).squeeze(1))

    def _mapped(self, values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``values`` with the raw IDs of dynamic features (``table``: each ID's feature)
        replaced by their rows: an ID found in its table's frozen map reads its row, any
        other the default row 0, as evaluation looks IDs up. Every ID is searched in every
        map and the feature picks (no data-dependent shape)."""
        for i in range(self.n_maps):
            keys = getattr(self, f"map_keys_{i}")
            rows = getattr(self, f"map_rows_{i}")
            at = torch.searchsorted(keys, values).clamp(max=keys.shape[0] - 1)
            row = torch.where(keys[at] == values, rows[at], torch.zeros_like(values))
            values = torch.where(getattr(self, f"map_features_{i}")[table], row, values)
        return values

    def _pool(
        self, rows: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """(Weighted) sum of each bag's rows, float32, by the stored precision's kernel."""
        if self.quantize == "int8":
            return torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
                self.weight, rows, offsets, False, 0, False, weights, None, True
            )
        if self.quantize == "fp16":
            gathered = self.weight.index_select(0, rows).float()
            positions = torch.arange(rows.shape[0], device=rows.device)
            return F.embedding_bag(
                positions,
                gathered,
                offsets,
                mode="sum",
                per_sample_weights=weights,
                include_last_offset=True,
            )
        return F.embedding_bag(
            rows,
            self.weight,
            offsets,
            mode="sum",
            per_sample_weights=weights,
            include_last_offset=True,
        )


class WeightedServableDLRM(ServableDLRM):
    """A ``ServableDLRM`` whose spec has per-ID weights: ``forward`` takes them as a fourth
    input, ``weights`` (float32 ``[N]``, one per ID of ``values``: the feature's weight, 1
    for IDs of features without any), which scale each ID's row in its bag's sum as the
    training's bag scales it. A class of its own so that a model without weights keeps
    its three-input program."""

    takes_weights = True

    def forward(  # type: ignore[override]
        self,
        dense: torch.Tensor,
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        return self._probabilities(dense, values, offsets, weights)


def example_inputs(spec: FeatureSpec, batch: int = 3) -> tuple[torch.Tensor, ...]:
    """A small valid input to trace with: bags of 0 to 2 IDs, row 0 of each table (and a
    weight of 1 for each ID, where the spec has per-ID weights).

    ``batch`` and the ID count must not be 0 or 1 (the exporter would specialize those
    sizes), nor equal (it might take them for one size).
    """
    n_tables = len(spec.sparse)
    lengths = torch.tensor(
        [(k + i) % 3 for k in range(n_tables) for i in range(batch)], device="cpu"
    )
    if int(lengths.sum()) in (0, 1, batch):
        lengths[0] += 2
    offsets = torch.zeros(n_tables * batch + 1, dtype=torch.int64, device="cpu")
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = torch.zeros(int(offsets[-1]), dtype=torch.int64, device="cpu")
    dense = torch.zeros(batch, len(spec.dense), device="cpu")
    if not _weighted(spec):
        return dense, values, offsets
    return dense, values, offsets, torch.ones(len(values), device="cpu")


def _weighted(spec: FeatureSpec) -> list[str]:
    """The features of ``spec`` with per-ID weights: the program then takes ``weights``."""
    return [f.name for f in spec.sparse if f.weights is not None]


def export_program(module: ServableDLRM, spec: FeatureSpec) -> torch.export.ExportedProgram:
    """``module`` traced by ``torch.export`` with a dynamic batch size and ID count."""
    batch = torch.export.Dim("batch", min=1)
    ids = torch.export.Dim("ids", min=0)
    dynamic = {
        "dense": {0: batch},
        "values": {0: ids},
        "offsets": {0: len(spec.sparse) * batch + 1},
    }
    if _weighted(spec):
        dynamic["weights"] = {0: ids}  # one per ID: the program checks the sizes agree
    module.eval()
    with torch.no_grad():
        return torch.export.export(module, example_inputs(spec), dynamic_shapes=dynamic)


@dataclass
class Servable:
    """A loaded servable export: the program and what it was made from.

    ``spec`` and ``config`` rebuild batches as training did (the ID mapping is the run's
    ``features.ids``); ``metadata`` is the archive's JSON whole.
    """

    program: nn.Module  # torch.export.load(path).module()
    spec: FeatureSpec
    config: RunConfig
    metadata: dict[str, Any]
    path: Path

    def __call__(
        self,
        dense: torch.Tensor,
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Click probabilities ``[B]`` of one batch in the program's layout (on the CPU,
        cast to the program's dtypes). ``weights``: one per ID of ``values``, which a
        program of a spec with per-ID weights needs and any other refuses. An empty batch
        scores to an empty tensor."""
        weighted = _weighted(self.spec)
        if weighted and weights is None:
            raise ServableError(
                f"{self.path}: the program takes per-ID weights (of {', '.join(weighted)}; "
                "1 for other features' IDs); none were given"
            )
        if not weighted and weights is not None:
            raise ServableError(
                f"{self.path}: the program takes no per-ID weights; weights were given"
            )
        dense = dense.detach().to("cpu", torch.float32)
        if dense.shape[0] == 0:
            return torch.empty(0, device="cpu")
        n_tables = len(self.spec.sparse)
        if offsets.numel() != n_tables * dense.shape[0] + 1:
            raise ServableError(
                f"{self.path}: offsets has {offsets.numel()} entries; {dense.shape[0]} samples "
                f"of {n_tables} features need {n_tables * dense.shape[0] + 1}"
            )
        inputs = [
            dense.contiguous(),
            values.to("cpu", torch.int64).contiguous(),
            offsets.to("cpu", torch.int64).contiguous(),
        ]
        if weights is not None:
            if weights.numel() != values.numel():
                raise ServableError(
                    f"{self.path}: {weights.numel()} weights for {values.numel()} IDs; "
                    "the program takes one weight per ID"
                )
            inputs.append(weights.detach().to("cpu", torch.float32).contiguous())
        with torch.no_grad():
            return self.program(*inputs)

    def predict_batch(self, batch: Batch) -> torch.Tensor:
        """Click probabilities ``[len(batch)]`` of a project ``Batch``, one-hot (``-1`` rows
        become empty bags) or jagged, with its per-ID weights where the program takes them
        (a batch without, or with weights the program does not take, is refused)."""
        sparse = batch.sparse
        if sparse.keys != self.spec.sparse_names:
            raise ServableError(
                f"{self.path}: batch features {sparse.keys} differ from the export's "
                f"{self.spec.sparse_names}"
            )
        weighted = _weighted(self.spec)
        if sparse.weights is not None and not weighted:
            raise ServableError(
                f"{self.path}: the servable takes unweighted IDs; this batch has weights"
            )
        if weighted and sparse.weights is None:
            raise ServableError(
                f"{self.path}: the servable takes per-ID weights (of {', '.join(weighted)}); "
                "this batch has none"
            )
        if len(batch) == 0:
            return torch.empty(0, device="cpu")
        sparse = sparse.to("cpu")  # the jagged form is built on the CPU
        return self(batch.dense, sparse.values, sparse.offsets(), sparse.weights)


def archive_metadata(path: Path) -> dict[str, Any] | None:
    """The metadata JSON inside a .pt2 archive at ``path``, or None when there is none."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith(f"/extra/{METADATA_FILE}")]
            if len(names) != 1:
                return None
            data = json.loads(archive.read(names[0]))
    except (OSError, zipfile.BadZipFile, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_servable(path: str | Path) -> bool:
    """Whether ``path`` is a file this module's export wrote (read from the archive's
    directory and its small metadata member, not by loading the program)."""
    path = Path(path)
    if not path.is_file():
        return False
    data = archive_metadata(path)
    return data is not None and data.get("kind") == KIND


def load_servable(path: str | Path) -> Servable:
    """The servable export at ``path``: its program (``torch.export.load``) and metadata.

    ``ServableError`` names the path when it is missing or not such an export.
    """
    path = Path(path)
    if not path.is_file():
        raise ServableError(f"{path}: no such servable export")
    if not is_servable(path):
        raise ServableError(
            f"{path}: not a dlrmflow servable export (`dlrmflow export --format torch-export`)"
        )
    extra = {METADATA_FILE: ""}
    # A file object, not the name: torch warns about names not ending in .pt2, as the
    # export's temporary file does not.
    with open(path, "rb") as f:
        program = torch.export.load(f, extra_files=extra).module()
    metadata = json.loads(extra[METADATA_FILE])
    if metadata.get("version") != VERSION:
        raise ServableError(
            f"{path}: servable version {metadata.get('version')} is not {VERSION}, the "
            "version this dlrmflow reads"
        )
    return Servable(
        program=program,
        spec=FeatureSpec.from_dict(metadata["spec"]),
        config=recorded_config(metadata["config"]),
        metadata=metadata,
        path=path,
    )


class _Sink(io.IOBase):
    """A file for torch's archive writer that never raises into it.

    The writer (C++) calls ``write`` back through Python; an error raised there (a full
    disk, a signal's interruption) leaves its zip writer in a state whose destructor throws,
    and the process aborts. So the first error is kept, later writes are dropped, the
    writer finishes as if all went well, and ``error`` is raised once it has returned.
    """

    def __init__(self, file: BinaryIO) -> None:
        super().__init__()
        self.file = file
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: bytes | memoryview) -> int:  # type: ignore[override]
        if self.error is None:
            try:
                self.file.write(data)
            except OSError as e:
                self.error = e
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence) if self.error is None else 0

    def tell(self) -> int:
        return self.file.tell()

    def flush(self) -> None:
        if self.error is None:
            try:
                self.file.flush()
            except OSError as e:
                self.error = e


def _save_program(
    program: torch.export.ExportedProgram, path: Path, extra_files: dict[str, str]
) -> None:
    """``torch.export.save`` to ``path``, its errors raised here rather than inside torch's
    C++ writer (see ``_Sink``); a stopping signal waits for the writer to return."""
    with open(path, "wb") as f:
        sink = _Sink(f)
        with signals_deferred():
            torch.export.save(program, sink, extra_files=extra_files)  # type: ignore[arg-type]
        sink.flush()
        if sink.error is not None:
            raise sink.error


def _check_options(fmt: str, quantize: str, verify_rows: int | None) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if quantize not in QUANTIZATIONS:
        raise ConfigError(f"--quantize: {quantize!r} is not one of {', '.join(QUANTIZATIONS)}")
    if fmt == "safetensors" and (quantize != "none" or verify_rows is not None):
        raise ConfigError(
            "--quantize and --verify-rows apply to --format torch-export only; the safetensors "
            "export holds the checkpoint's float32 weights as they are"
        )
    if verify_rows is not None and verify_rows < 0:
        raise ConfigError(f"--verify-rows: {verify_rows} is negative (0 skips the check)")


def export_run(
    run_dir: str | Path,
    out: str | Path,
    *,
    checkpoint: str | Path | None = None,
    fmt: str = "safetensors",
    quantize: str = "none",
    verify_rows: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """``dlrmflow export``: the options checked, then the export ``fmt`` names.

    ``checkpoint`` (a checkpoint directory) replaces ``run_dir``'s newest; ``run_dir``
    still gives the run's ID mapping for the torch-export's check on held-out rows.
    """
    _check_options(fmt, quantize, verify_rows)
    source = Path(checkpoint if checkpoint is not None else run_dir)
    if not source.exists():
        what = "checkpoint directory" if checkpoint is not None else "run directory"
        raise ServableError(f"{source}: no such {what}; give a `dlrmflow train` run's")
    # A stopping signal ends the export in one line (the temporary file removed); inside
    # torch's writer it waits for the writer to return (``signals_deferred``).
    with interrupt_on_signals("export"):
        if fmt == "safetensors":
            from dlrmflow.train.run.export import export_model

            return export_model(source, out)
        return export_servable(
            source,
            out,
            quantize=quantize,
            run_dir=run_dir,
            verify_rows=VERIFY_ROWS if verify_rows is None else verify_rows,
            progress=progress,
        )


def export_servable(
    checkpoint: str | Path,
    out: str | Path,
    *,
    quantize: str = "none",
    run_dir: str | Path | None = None,
    verify_rows: int = VERIFY_ROWS,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write ``checkpoint``'s model (a checkpoint or run directory) as a servable ``.pt2``.

    The archive is written beside ``out`` and renamed over it only once it has been loaded
    back and, unless ``verify_rows`` is 0, scored on up to that many held-out rows (the
    run's evaluation days, by default its dataset's test day) against the checkpoint's own
    model through the evaluation's path: a failure at any point leaves ``out`` as it was.
    Returns what was written: sizes of the tables before and after quantization, and the
    check (``verify``: the largest probability difference and both AUCs; ``skipped`` with
    the reason when the dataset cannot be read).
    """
    from dlrmflow.train.run.checkpoint import load_checkpoint

    if quantize not in QUANTIZATIONS:
        raise ConfigError(f"--quantize: {quantize!r} is not one of {', '.join(QUANTIZATIONS)}")
    output_target(out)  # a directory or device there is refused before any work
    try:
        ckpt = load_checkpoint(checkpoint)
    except FileNotFoundError as e:
        raise ServableError(str(e)) from e
    module = ServableDLRM.from_model(ckpt.model, ckpt.spec, quantize)
    program = export_program(module, ckpt.spec)
    run_dir = Path(run_dir) if run_dir is not None else Path(ckpt.path).parent.parent
    metadata = {
        "kind": KIND,
        "version": VERSION,
        "format": "torch-export",
        "quantize": quantize,
        "checkpoint": str(ckpt.path),
        "run_dir": str(run_dir),
        "step": ckpt.step,
        "arch": module.arch,
        "spec": ckpt.spec.to_dict(),
        "config": ckpt.config.model_dump(mode="json"),
        "inputs": program_inputs(ckpt.spec),
        "raw_inputs": raw_recipe(ckpt.spec, ckpt.config, run_dir),
        "table_bytes": module.table_bytes,
        "torch": torch.__version__,
        "trained_multi_hot": ckpt.multi_hot,  # a one-hot model refuses multi-hot data
    }
    out = Path(out)
    with atomic_path(out) as temporary:
        _save_program(program, temporary, {METADATA_FILE: json.dumps(metadata)})
        servable = load_servable(temporary)  # what is published is what was checked
        check = (
            verify(servable, ckpt, run_dir, verify_rows, progress)
            if verify_rows > 0
            else {"skipped": "--verify-rows 0"}
        )
    if verify_rows > 0 and "skipped" in check:
        # Not only in the JSON: an unchecked export must not pass for a checked one.
        warnings.warn(
            f"{out} was not checked against the checkpoint: {check['skipped']}", stacklevel=2
        )
    return {
        "out": str(out),
        "format": "torch-export",
        "quantize": quantize,
        "checkpoint": str(ckpt.path),
        "step": ckpt.step,
        "arch": module.arch,
        "bytes": out.stat().st_size,
        "table_bytes_fp32": module.fp32_table_bytes,
        "table_bytes": module.table_bytes,
        "table_ratio": module.table_bytes / module.fp32_table_bytes,
        "dense_parameters": sum(p.numel() for p in module.parameters()),  # tables: buffers
        "verify": check,
    }


def _line_days(ckpt: Checkpoint, manifest: Any) -> tuple[list[int], str]:
    """The day to check an export on when its run holds no day out (a model line's run,
    ``data.eval_days: none``), and why that one: the day after the checkpoint's last
    training day when the dataset has it (the day the line judges it on), else the day
    its line version was validated on (``version.json`` beside the checkpoint). The check
    compares the export with the checkpoint, so a day it trained on serves that too.
    Raises ``WindowError`` saying why there is none."""
    from dlrmflow.days import WindowError

    available = {f.day for f in manifest.files}
    trained = ckpt.trained_days or []
    if trained and max(trained) + 1 in available:
        return [max(trained) + 1], "the day after its last training day"
    record = Path(ckpt.path).parent / "version.json"
    try:
        validated = json.loads(record.read_text()).get("validation") or {}
    except (OSError, ValueError):
        validated = {}
    if validated.get("day") in available:
        return [int(validated["day"])], f"the day its version was validated on ({record})"
    after = f"day {max(trained) + 1}, the day after its last training day, is not in the dataset"
    raise WindowError(
        "the run's evaluation window (data.eval_days) holds no day"
        + (f", {after} yet and {record} records no validation day" if trained else "")
    )


def verify(
    servable: Servable,
    ckpt: Checkpoint,
    run_dir: Path,
    max_rows: int,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Score up to ``max_rows`` held-out rows with the checkpoint's model (the evaluation's
    ``predict``) and with ``servable``; their largest and mean |difference| of probability
    and both AUCs. ``{"skipped": reason}`` when the run's dataset or ID mapping cannot be
    read here (an export made away from the data is still an export)."""
    from dlrmflow.ingest.manifest import check_dataset, read_manifest
    from dlrmflow.train.run.data import load_ids
    from dlrmflow.train.run.evaluate import eval_window, predict, test_loader
    from dlrmflow.train.run.metrics import click_metrics
    from dlrmflow.train.run.rank import DistEnv

    config, spec = ckpt.config, ckpt.spec
    url = config.data.url
    try:
        manifest = read_manifest(url)
        days = eval_window(config, manifest, ckpt.trained_days)
        chosen = None
        if not days:
            days, chosen = _line_days(ckpt, manifest)
        check_dataset(url, manifest, training=False, eval_days=days)
        ids = load_ids(config.features.ids, spec, run_dir)
    except (DlrmflowError, OSError, ValueError) as e:
        return {"skipped": f"held-out rows unreadable: {' '.join(str(e).split())}"}
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)

    def whole_batches(loader: Iterable[Batch]) -> Iterator[Batch]:
        # Whole batches until max_rows are in, cut only afterwards: ``predict``'s own cap
        # would take the sigmoid of a cut batch's logits, whose vectorized tail rounds a
        # row now and then one ulp away from the same row's in a whole batch.
        seen = 0
        for batch in loader:
            if seen >= max_rows:
                return
            yield batch
            seen += len(batch)

    scoring = test_loader(config, spec, ids, env, url, days, manifest=manifest)
    try:
        scored = predict(ckpt.model, whole_batches(scoring), spec, env, None, progress)
    finally:
        scoring.close()
    assert scored is not None  # one process: rank 0
    want, labels = scored.probs[:max_rows], scored.labels[:max_rows]
    got: list[torch.Tensor] = []
    seen = 0
    serving = test_loader(config, spec, ids, env, url, days, manifest=manifest)
    try:
        for batch in whole_batches(serving):
            take = min(len(batch), len(labels) - seen)
            got.append(servable.predict_batch(batch)[:take])
            if not torch.equal(batch.labels[:take], labels[seen : seen + take]):
                raise ServableError("the held-out rows came in another order on the second pass")
            seen += take
    finally:
        serving.close()
    probs = torch.cat(got) if got else torch.empty(0, device="cpu")
    if len(probs) != len(want) or len(want) == 0:
        return {"skipped": f"{len(want)} held-out rows scored, {len(probs)} by the servable"}
    if not bool(torch.isfinite(probs).all() and torch.isfinite(want).all()):
        raise ServableError(
            f"{servable.path}: some held-out rows score NaN or infinity "
            f"({int((~torch.isfinite(want)).sum())} by the checkpoint, "
            f"{int((~torch.isfinite(probs)).sum())} by the servable)"
        )
    diff = (probs.double() - want.double()).abs()
    result: dict[str, Any] = {
        "rows": len(want),
        "days": days,
        **({"days_chosen": chosen} if chosen else {}),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
    }
    try:
        before, after = click_metrics(want, labels), click_metrics(probs, labels)
    except ValueError as e:  # one class only among the rows: no AUC
        result["auc"] = f"not computed: {e}"
        return result
    result.update(
        {
            "auc_checkpoint": before["auc"],
            "auc_servable": after["auc"],
            "auc_delta": after["auc"] - before["auc"],
            "logloss_delta": after["logloss"] - before["logloss"],
        }
    )
    return result
