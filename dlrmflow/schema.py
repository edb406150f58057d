"""The declared feature schema: which columns of a dataset are the label and the features,
and what is done with each.

A team's logs never look like Criteo, so a dataset says what its columns are: the label
column (0/1 integers, booleans, or floats in [0, 1]), dense features (a numeric column, the
value a null or NaN takes, and a transform) and sparse features (a column of IDs: int64 or
strings, one a row or a list a row, hashed or looked up in a vocabulary, each feature's
table its own or shared with others), plus hashed crosses of sparse features. ``dlrmflow
register`` records the schema in the dataset's manifest, so every stage reads the same one;
a dataset without one (generated, converted from Criteo TSV, or written before schemas) has
Criteo's layout, ``criteo_schema()``, with every stage behaving as it always has.

The operations follow NVTabular's named ops: FillMissing (``fill``), LogOp (``log``), Clip,
Normalize (``standardize``), Bucketize, HashBucket and Categorify (``ids: hash | vocab``
with ``min_count`` and a cap), ListSlice (``max_length``, ``keep``) and HashedCross
(``crosses``).

This module sits below the configuration and every stage: both declare and read it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dlrmflow.errors import DlrmflowError

# Criteo's layout: an int8 label, 13 integer counts and 26 categorical IDs.
CRITEO_LABEL = "label"
CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
CRITEO_SPARSE = tuple(f"C{i}" for i in range(1, 27))


class SchemaError(DlrmflowError, ValueError):
    """A schema that cannot be used; the message names the file and the feature."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# DenseFeature's fields since standardize and bucketize: left out of records while unset.
_ADDED_FIELDS = ("mean", "std", "boundaries", "buckets")


class DenseFeature(_Strict):
    """A numeric column fed to the bottom MLP as one float32 value a row, or (bucketized)
    turned into a categorical feature.

    A null or NaN becomes ``fill`` before the transform, and the value is cast to float32.
    ``transform``:

    * ``log`` is ``log(1 + max(x, 0))`` (counts, prices: Criteo's);
    * ``clip`` bounds the value to ``[clip_min, clip_max]``;
    * ``standardize`` is ``(x - mean) / std``, with the mean and the (population) standard
      deviation of the column after the fill, from the dataset's statistics unless given
      here. A column without spread (``std`` 0: one value, or all missing) is only
      centred: its deviation is taken as 1, so every row gets 0 and the feature is inert
      rather than a division by zero. The values used are frozen into the run's feature
      spec, so checkpoints and exports carry them;
    * ``bucketize`` makes the column categorical: a sparse feature named after the column,
      whose row is the bucket index ``i`` such that ``boundaries[i-1] <= x <
      boundaries[i]`` (``len(boundaries) + 1`` rows; ``numpy.digitize``'s convention).
      Give ``boundaries`` (strictly increasing), or ``buckets: N`` to take them from the
      statistics' quantiles after the fill (``i / N`` for ``i`` in ``1..N-1``; repeated
      quantiles merge, so a column of few values gets fewer buckets);
    * ``none`` passes the value on.
    """

    column: str = Field(min_length=1)
    fill: float = 0.0
    transform: Literal["log", "clip", "standardize", "bucketize", "none"] = "log"
    clip_min: float | None = None
    clip_max: float | None = None
    mean: float | None = None
    std: float | None = Field(None, ge=0)
    boundaries: tuple[float, ...] | None = Field(None, min_length=1)
    buckets: int | None = Field(None, ge=2)

    @model_validator(mode="after")
    def _bounds(self) -> DenseFeature:
        bounded = self.clip_min is not None or self.clip_max is not None
        if self.transform == "clip":
            if self.clip_min is None or self.clip_max is None:
                raise ValueError(f"{self.column}: transform clip needs clip_min and clip_max")
            if not self.clip_min <= self.clip_max:
                raise ValueError(f"{self.column}: clip_min must not exceed clip_max")
        elif bounded:
            raise ValueError(f"{self.column}: clip_min and clip_max are for transform clip")
        if self.transform != "standardize" and (self.mean is not None or self.std is not None):
            raise ValueError(f"{self.column}: mean and std are for transform standardize")
        if (self.mean is None) != (self.std is None):
            raise ValueError(f"{self.column}: give both mean and std, or neither")
        given = (self.boundaries is not None) + (self.buckets is not None)
        if self.transform == "bucketize":
            if given != 1:
                raise ValueError(f"{self.column}: transform bucketize needs boundaries or buckets")
        elif given:
            raise ValueError(f"{self.column}: boundaries and buckets are for transform bucketize")
        for name in ("fill", "clip_min", "clip_max", "mean", "std"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{self.column}: {name} must be finite")
        if self.boundaries is not None:
            if not all(math.isfinite(b) for b in self.boundaries):
                raise ValueError(f"{self.column}: boundaries must be finite")
            if any(b >= c for b, c in zip(self.boundaries, self.boundaries[1:], strict=False)):
                raise ValueError(f"{self.column}: boundaries must be strictly increasing")
        return self

    @property
    def categorical(self) -> bool:
        """Bucketized: a sparse feature of its own, not a dense input."""
        return self.transform == "bucketize"

    def record(self) -> dict[str, Any]:
        """Plain data as specs and checkpoints record it: every field, except those added
        with standardize and bucketize where unset, so a transform recorded before them
        compares equal to itself (a run's identity, the batches' digest)."""
        data = self.model_dump(mode="json")
        return {k: v for k, v in data.items() if not (k in _ADDED_FIELDS and v is None)}

    @property
    def plain_log(self) -> bool:
        """Criteo's transform: nulls as 0, then ``log(1 + max(x, 0))``."""
        return self.transform == "log" and self.fill == 0.0


class SparseFeature(_Strict):
    """A column of IDs, each row a bag (one ID, a list, or none) looked up in an embedding
    table of its own. IDs are int64 or strings (strings are hashed to int64 by a stable
    hash first). Every field but ``column`` defaults to the run's ``features`` section:

    * ``ids``: ``hash`` (HashBucket: ``rows`` buckets, default from the dataset's distinct
      IDs and ``features.hash_size_factor``, at most ``features.max_rows_per_table``) or
      ``vocab`` (Categorify: each ID seen at least ``min_count`` times in the training days
      gets a row of its own, the most frequent first, at most ``rows - 1`` of them; the
      rest share row 0) or ``dynamic`` (a row per live ID, kept by the trainer: an ID is
      admitted to one of ``rows`` rows once seen ``admit_after`` times (default 1), reads
      a shared default row until then or while the table is full, and gives its row up
      when unseen for ``ttl`` training steps or when it is among the least seen of a full
      table, checked every ``evict_every`` steps (default 1000); its map is split by ID
      into ``map_shards`` shards, each with rows of its own (default: one per 16,384
      rows, at most 64), which a job's ranks hold in turn; see ``dlrmflow.kernels.id_map``
      and ``dlrmflow.kernels.id_map_shards``. ``rows`` must hold one batch's IDs
      (``train.batch_size`` times the table's features, and the default row));
    * ``max_length``: a list longer than this keeps its first (``keep: first``) or last
      (``keep: last``) ``max_length`` IDs, nulls dropped first (ListSlice; a no-op on a
      one-hot column);
    * ``weights``: a column of one float weight per ID (a list aligned with the ID list,
      or one number beside a one-hot ID), which scales that ID's embedding in the sum;
      per-ID weights need sum pooling in every table (the kernels' rule);
    * ``pooling``: how a bag's embeddings combine, ``sum`` or ``mean``;
    * ``dim``: the width of its embedding table (default ``model.embedding_dim``). The dot
      interaction (``model.arch: dlrm``) takes every table at ``model.embedding_dim``;
      tables of other widths need ``model.arch: dcnv2``, which takes any;
    * ``table``: the name of the embedding table it looks up (default: its column's).
      Features naming one table share its rows (TorchRec's ``feature_names`` of one
      ``EmbeddingBagConfig``): ``item_id`` and a ``clicked_items`` list, both with
      ``table: items``, give an item the same row, and so the same vector, wherever it
      appears, each feature still pooled on its own. A shared table's rows, ``ids``,
      ``min_count``, ``pooling`` and ``dim`` are the table's: declare each on any of its
      features (values that differ are refused). Its hash (salted by the table's name)
      or vocabulary (counted over all its columns) is one for all of them.
    """

    column: str = Field(min_length=1)
    rows: int | None = Field(None, ge=1)
    ids: Literal["hash", "vocab", "dynamic"] | None = None
    min_count: int | None = Field(None, ge=1)
    admit_after: int | None = Field(None, ge=1)
    ttl: int | None = Field(None, ge=1)
    evict_every: int | None = Field(None, ge=1)
    map_shards: int | None = Field(None, ge=1)
    max_length: int | None = Field(None, ge=1)
    keep: Literal["first", "last"] = "first"
    weights: str | None = Field(None, min_length=1)
    pooling: Literal["sum", "mean"] | None = None
    dim: int | None = Field(None, ge=1)
    table: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _options(self) -> SparseFeature:
        if self.min_count is not None and self.ids in ("hash", "dynamic"):
            raise ValueError(f"{self.column}: min_count is for ids: vocab")
        dynamic = {
            "admit_after": self.admit_after,
            "ttl": self.ttl,
            "evict_every": self.evict_every,
            "map_shards": self.map_shards,
        }
        for name, value in dynamic.items():
            if value is not None and self.ids not in ("dynamic", None):
                raise ValueError(f"{self.column}: {name} is for ids: dynamic")
        if self.keep != "first" and self.max_length is None:
            raise ValueError(f"{self.column}: keep is for max_length")
        if self.weights is not None and self.pooling == "mean":
            raise ValueError(
                f"{self.column}: per-ID weights need sum pooling (the kernels weight a sum)"
            )
        if self.weights == self.column:
            raise ValueError(f"{self.column}: its weights are in a column of their own")
        return self

    @property
    def table_name(self) -> str:
        """The embedding table it looks up: ``table``, else its column's name."""
        return self.table or self.column


# What features sharing a table share: the table's settings, declared on any of them.
TABLE_SETTINGS = (
    "rows", "ids", "min_count", "pooling", "dim", "admit_after", "ttl", "evict_every",
    "map_shards",
)  # fmt: skip


class Cross(_Strict):
    """A hashed cross of two or more single-valued sparse features (HashedCross): each row's
    IDs of ``columns``, in that order, hashed together by a stable hash into a table of its
    own named ``name`` (``rows``: its size, default from the crossed columns' distinct IDs
    as for a hashed feature; ``dim``: its width, as a sparse feature's). A row where any
    crossed ID is null has an empty bag."""

    name: str = Field(min_length=1)
    columns: tuple[str, ...] = Field(min_length=2)
    rows: int | None = Field(None, ge=1)
    dim: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _distinct(self) -> Cross:
        repeated = sorted({c for c in self.columns if self.columns.count(c) > 1})
        if repeated:
            raise ValueError(f"cross {self.name}: column {repeated[0]} is crossed twice")
        return self


class FeatureSchema(_Strict):
    """What a dataset's columns are (see the module's docstring).

    ``weight``: an optional column of non-negative per-example weights (an importance or
    a sampling correction) that scale each example's loss. ``crosses``: hashed crosses of
    declared sparse columns, each a sparse feature of its own. ``keys``: columns that are not
    features but identify a row (a request or user ID); ``score`` copies them into its
    output beside each prediction. ``day_column``: a date, timestamp or integer column
    that says each row's day, for data that is not in ``day=N/`` or ``dt=YYYY-MM-DD/``
    folders (``dlrmflow register`` reads it).
    """

    label: str = Field(min_length=1)
    weight: str | None = Field(None, min_length=1)
    dense: tuple[DenseFeature, ...] = ()
    sparse: tuple[SparseFeature, ...] = Field(min_length=1)
    crosses: tuple[Cross, ...] = ()
    keys: tuple[str, ...] = ()
    day_column: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _distinct(self) -> FeatureSchema:
        columns = [self.label, *self.dense_names, *self.sparse_names]
        if self.weight is not None:
            columns.append(self.weight)
        columns += [f.weights for f in self.sparse if f.weights is not None]
        repeated = sorted({c for c in columns if columns.count(c) > 1})
        if repeated:
            raise ValueError(f"column {repeated[0]} is declared twice")
        sparse = set(self.sparse_names)
        names = set(columns)
        for cross in self.crosses:
            if cross.name in names:
                raise ValueError(f"cross {cross.name}: the name of a column")
            names.add(cross.name)
            for column in cross.columns:
                if column not in sparse:
                    raise ValueError(
                        f"cross {cross.name}: {column} is not a declared sparse column"
                    )
        self._check_tables(names)
        keys = list(self.keys)
        repeated = sorted({c for c in keys if keys.count(c) > 1})
        if repeated:
            raise ValueError(f"key column {repeated[0]} is declared twice")
        if self.label in keys:
            raise ValueError(f"key column {self.label} is the label")
        if self.day_column is not None and self.day_column in (self.label, self.weight):
            raise ValueError(f"day_column {self.day_column} is the label or the weight")
        return self

    def _check_tables(self, names: set[str]) -> None:
        """A table's name is its own features' (no other column's or cross's), and its
        features agree on its settings (``table_settings``)."""
        for f in self.sparse:
            table = f.table_name
            members = [g.column for g in self.table_members(table)]
            if table in names and table not in members:
                raise ValueError(
                    f"sparse feature {f.column}: table {table} is the name of another column "
                    "or cross; name the table after one of its own features, or anew"
                )
            self.table_settings(table)

    def table_members(self, table: str) -> tuple[SparseFeature, ...]:
        """The sparse features that look up ``table``, in schema order."""
        return tuple(f for f in self.sparse if f.table_name == table)

    def table_settings(self, table: str) -> dict[str, Any]:
        """``table``'s settings (``TABLE_SETTINGS``) as its features declare them: each
        from whichever feature declares it; ``ValueError`` naming both where two differ."""
        settings: dict[str, Any] = {}
        declared_by: dict[str, str] = {}
        for f in self.table_members(table):
            for name in TABLE_SETTINGS:
                value = getattr(f, name)
                if value is None:
                    continue
                if name in settings and settings[name] != value:
                    raise ValueError(
                        f"sparse feature {f.column}: {name} {value}, but {declared_by[name]} "
                        f"declares {settings[name]} for their shared table {table}"
                    )
                settings[name] = value
                declared_by[name] = f.column
        return settings

    @property
    def dense_names(self) -> tuple[str, ...]:
        return tuple(f.column for f in self.dense)

    @property
    def sparse_names(self) -> tuple[str, ...]:
        return tuple(f.column for f in self.sparse)

    @property
    def columns(self) -> list[str]:
        """The label, the weight if any and the features' columns: those whose role and
        type ``register`` checks. Per-ID weight columns are in ``weight_columns``."""
        weight = [] if self.weight is None else [self.weight]
        return [self.label, *weight, *self.dense_names, *self.sparse_names]

    @property
    def weight_columns(self) -> tuple[str, ...]:
        """The sparse features' per-ID weight columns, in feature order."""
        return tuple(f.weights for f in self.sparse if f.weights is not None)

    @property
    def is_criteo(self) -> bool:
        """Criteo's layout, read as it always was (the fast compiled paths apply)."""
        return self == criteo_schema()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_defaults=True)


def criteo_schema() -> FeatureSchema:
    """Criteo's layout: ``label``, ``I1``..``I13`` logged, ``C1``..``C26`` hashed."""
    return FeatureSchema(
        label=CRITEO_LABEL,
        dense=tuple(DenseFeature(column=c) for c in CRITEO_DENSE),
        sparse=tuple(SparseFeature(column=c) for c in CRITEO_SPARSE),
    )


def parse_schema(data: object, where: str) -> FeatureSchema:
    """A schema from plain data (a file's contents, a manifest's record), or
    ``SchemaError`` naming ``where`` and the first problem's place."""
    if isinstance(data, dict) and "features" in data and "label" not in data:
        data = data["features"]  # a file may hold the schema under ``features:``
    try:
        return FeatureSchema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        place = ".".join(str(p) for p in first["loc"]) or "schema"
        message = first["msg"].removeprefix("Value error, ")
        raise SchemaError(f"{where}: {place}: {message}") from None


def read_schema(path: str | Path) -> FeatureSchema:
    """The schema in the YAML (or JSON) file at ``path``."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SchemaError(f"{path}: cannot read the schema: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise SchemaError(f"{path}: not YAML: {str(e).splitlines()[0]}") from None
    return parse_schema(data, str(path))
