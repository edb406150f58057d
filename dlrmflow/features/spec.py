"""The feature spec: which columns feed the model, how each dense column is transformed, how
each sparse feature's IDs are made and how big each embedding table is, made from the
dataset's declared schema (``dlrmflow.schema``; Criteo's layout when it declares none).

Everything the statistics decide (a standardized column's mean and deviation, a
bucketized column's quantile boundaries, table sizes) is resolved here once and frozen into
the spec, so a checkpoint or an export carries the values its model was trained with, and
``to_dict`` is a run's identity: a changed schema gives another spec, which a resume
refuses naming the feature.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from dlrmflow.config import FeaturesConfig, ModelConfig
from dlrmflow.ingest.manifest import Manifest
from dlrmflow.ingest.schema import LABEL
from dlrmflow.schema import (
    DenseFeature,
    FeatureSchema,
    SchemaError,
    criteo_schema,
    parse_schema,
)
from dlrmflow.sparse import EmbeddingTable

if TYPE_CHECKING:
    from dlrmflow.ingest.stats.results import DatasetStats, DenseStats

# Hash tables are never smaller than this: tiny features (2-3 values) would otherwise see
# their few IDs collide, and a 1024-row table costs nothing.
MIN_HASH_ROWS = 1024
# A dynamic table's map shards when none are asked for: one per so many rows, at most so
# many (the ranks a job can spread a map over).
ROWS_PER_MAP_SHARD = 16_384
MAX_MAP_SHARDS = 64
# The fields every spec's sparse features have always written, defaults or not.
_LEGACY = ("name", "num_embeddings", "embedding_dim", "pooling")


@dataclass(frozen=True)
class SparseFeature(EmbeddingTable):
    """One categorical feature and the embedding table its IDs index (the kernels'
    ``EmbeddingTable``: name, rows, dim, pooling).

    Where its IDs come from: by default the column ``name`` (int64 or string IDs, one or a
    list a row); ``cross``: the crossed columns' IDs hashed together (``schema.Cross``);
    ``bucketize``: the bucket index of a dense column (``boundaries`` resolved, so the
    index is the row). ``ids`` (``hash`` or ``vocab``; None: the run's ``features.ids``),
    ``min_count`` (None: ``features.min_count``), ``max_length`` and ``keep``
    (ListSlice), ``weights`` (the column of per-ID weights) and ``table`` (the table it
    shares with other features; None: its own, named after it) are the schema's
    ``SparseFeature`` fields. Features sharing a table carry its rows, dim, pooling and
    ID mapping alike.
    """

    ids: Literal["hash", "vocab", "dynamic"] | None = None
    min_count: int | None = None
    max_length: int | None = None
    keep: Literal["first", "last"] = "first"
    weights: str | None = None
    cross: tuple[str, ...] | None = None
    bucketize: DenseFeature | None = None
    table: str | None = None
    admit_after: int | None = None  # ids dynamic: sightings before an ID gets a row
    ttl: int | None = None  # ids dynamic: training steps unseen before its row is freed
    evict_every: int | None = None  # ids dynamic: steps between evictions (None: 1000)
    map_shards: int | None = None  # ids dynamic: shards of its map (None: 1)

    @property
    def table_name(self) -> str:
        """The embedding table it looks up: ``table``, else its own name."""
        return self.table or self.name

    @property
    def columns(self) -> tuple[str, ...]:
        """The Parquet columns this feature reads."""
        if self.cross is not None:
            return self.cross
        if self.bucketize is not None:
            return (self.bucketize.column,)
        return (self.name,) if self.weights is None else (self.name, self.weights)

    @property
    def plain(self) -> bool:
        """IDs of a column of its own, unweighted: what the compiled transform takes
        (``max_length`` aside, a no-op on the one-hot columns it takes)."""
        return self.cross is None and self.bucketize is None and self.weights is None

    def mapping(self, default: str) -> str:
        """How this feature's IDs become rows: ``hash``, ``vocab``, ``dynamic`` (the
        trainer's map) or ``bucket`` (the bucket index is the row); ``default`` is the
        run's ``features.ids``."""
        if self.bucketize is not None:
            return "bucket"
        if self.cross is not None:
            return "hash"
        return self.ids or default

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the fields every spec had, and the others only where they are not
        their defaults (so specs written before them read and compare as they did)."""
        data: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in _LEGACY and value == f.default:
                continue
            if isinstance(value, DenseFeature):
                value = value.model_dump(mode="json", exclude_defaults=True)
            elif isinstance(value, tuple):
                value = list(value)
            data[f.name] = value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SparseFeature:
        data = dict(data)
        if data.get("cross") is not None:
            data["cross"] = tuple(data["cross"])
        if data.get("bucketize") is not None:
            data["bucketize"] = DenseFeature.model_validate(data["bucketize"])
        return cls(**data)


@dataclass(frozen=True)
class FeatureSpec:
    """Dense column names, sparse features and the label column, in model order.

    ``dense_transforms``: each dense column's null fill and transform, in ``dense`` order;
    None is Criteo's for every column (nulls as 0, then ``log(1 + max(x, 0))``), which
    the compiled transform runs and which specs written before schemas mean. A
    ``standardize`` transform carries its ``mean`` and ``std``.
    ``weight``: the column of per-example weights (``Batch.sample_weights``), None when
    the dataset declares none.
    """

    dense: tuple[str, ...]
    sparse: tuple[SparseFeature, ...]
    label: str = LABEL
    dense_transforms: tuple[DenseFeature, ...] | None = None
    weight: str | None = None

    def __post_init__(self) -> None:
        if self.dense_transforms is not None:
            columns = tuple(t.column for t in self.dense_transforms)
            if columns != self.dense:
                raise ValueError(f"dense transforms of {columns}, columns {self.dense}")
            for t in self.dense_transforms:
                if t.categorical or (t.transform == "standardize" and t.std is None):
                    raise ValueError(f"dense column {t.column}: transform {t.transform} unresolved")
        _check_shared(self.sparse)

    @property
    def columns(self) -> list[str]:
        """The Parquet columns the transform needs (everything else is never read)."""
        weight = [] if self.weight is None else [self.weight]
        found = [self.label, *weight, *self.dense]
        for f in self.sparse:
            found += [c for c in f.columns if c not in found]
        return found

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    @property
    def shares_tables(self) -> bool:
        """Whether some features share a table (so the model has fewer tables than
        sparse features)."""
        return any(f.table is not None for f in self.sparse)

    @property
    def tables(self) -> tuple[EmbeddingTable, ...]:
        """The embedding tables, in the order of their first feature: a spec without shared
        tables has one per sparse feature, the features themselves; a shared table is
        named ``table`` and has its features' rows, dim and pooling."""
        if not self.shares_tables:
            return self.sparse
        tables: dict[str, EmbeddingTable] = {}
        for f in self.sparse:
            if f.table_name not in tables:
                tables[f.table_name] = EmbeddingTable(
                    f.table_name, f.num_embeddings, f.embedding_dim, f.pooling
                )
        return tuple(tables.values())

    def table_features(self, table: str) -> list[str]:
        """The sparse features looking up ``table``, in spec order."""
        return [f.name for f in self.sparse if f.table_name == table]

    @property
    def plain_sparse(self) -> bool:
        """Every sparse feature reads IDs of a column of its own, unweighted."""
        return all(f.plain for f in self.sparse)

    def to_dict(self) -> dict:
        """Plain data for a checkpoint, so table sizes and transforms are known without the
        dataset (Criteo's transforms, and a weight column never declared, left out: such a
        spec reads as it always did)."""
        data = {
            "dense": list(self.dense),
            "sparse": [f.to_dict() for f in self.sparse],
            "label": self.label,
        }
        if self.dense_transforms is not None:
            data["dense_transforms"] = [t.record() for t in self.dense_transforms]
        if self.weight is not None:
            data["weight"] = self.weight
        return data

    @classmethod
    def from_dict(cls, data: dict) -> FeatureSpec:
        transforms = data.get("dense_transforms")
        return cls(
            dense=tuple(data["dense"]),
            sparse=tuple(SparseFeature.from_dict(f) for f in data["sparse"]),
            label=data["label"],
            dense_transforms=None
            if transforms is None
            else tuple(DenseFeature.model_validate(t) for t in transforms),
            weight=data.get("weight"),
        )

    @classmethod
    def for_dataset(
        cls,
        manifest: Manifest,
        features: FeaturesConfig,
        model: ModelConfig,
        table_rows: dict[str, int] | None = None,
        stats: DatasetStats | None = None,
    ) -> FeatureSpec:
        """The spec for ``manifest``'s dataset, from its declared schema (``dataset_schema``).

        A vocabulary's table has ``table_rows[name]`` rows when given (its size), else the
        schema's ``rows`` for the feature. Otherwise IDs are hashed: with a known
        cardinality (synthetic and registered data; a cross: the product of its columns')
        (a shared table: its widest column's, features sharing an ID space) into
        ``hash_size_factor`` buckets per distinct ID, at least ``MIN_HASH_ROWS``, so
        that few IDs share a row; with none (converted Criteo data) into
        ``max_rows_per_table`` buckets. Hash tables never exceed ``max_rows_per_table``. A
        bucketized column's table has a row per bucket.

        ``stats`` (the dataset's ``stats.json``) is needed only where the schema takes
        values from it: ``standardize`` without ``mean`` and ``std``, ``bucketize`` with
        ``buckets``. Whatever the model cannot take is a ``SchemaError`` naming the feature.
        """
        schema = dataset_schema(manifest)
        cards = manifest.cardinalities or {}
        cap = features.max_rows_per_table

        def hashed_rows(wanted_ids: float | None) -> int:
            if wanted_ids is None:
                return cap
            return min(max(math.ceil(wanted_ids * features.hash_size_factor), MIN_HASH_ROWS), cap)

        sparse = []
        for feature in schema.sparse:
            name = feature.column
            table = schema.table_settings(feature.table_name)
            ids = table.get("ids")
            if ids is None and features.ids == "dynamic":
                # The trainer's maps need to know their tables: the run's default is
                # written into the spec, as a schema's ``ids: dynamic`` is.
                ids = "dynamic"
            dynamic = ids == "dynamic"
            admit_after, ttl, evict_every, map_shards = (
                table.get(key) if table.get(key) is not None or not dynamic else default
                for key, default in (
                    ("admit_after", features.admit_after),
                    ("ttl", features.ttl),
                    ("evict_every", features.evict_every),
                    ("map_shards", features.map_shards),
                )
            )
            # A feature declared hashed never takes a vocabulary's size.
            if ids != "hash" and table_rows is not None and name in table_rows:
                rows = table_rows[name]
            elif table.get("rows") is not None:
                rows = table["rows"]
            else:
                # Features share a table because they share an ID space: its distinct IDs
                # are taken as its widest column's.
                members = schema.table_members(feature.table_name)
                known = [cards.get(m.column) for m in members]
                rows = hashed_rows(None if None in known else max(known))
            sparse.append(
                SparseFeature(
                    name,
                    max(int(rows), 1),
                    table.get("dim") or model.embedding_dim,
                    table.get("pooling") or features.pooling,
                    ids=ids,
                    min_count=table.get("min_count"),
                    max_length=feature.max_length,
                    keep=feature.keep,
                    weights=feature.weights,
                    table=feature.table if feature.table_name != name else None,
                    admit_after=admit_after,
                    ttl=ttl,
                    evict_every=evict_every,
                    map_shards=_map_shards(name, map_shards, int(rows)) if dynamic else None,
                )
            )
        dense, transforms = [], []
        for d in schema.dense:
            if d.categorical:
                resolved = _bucketized(d, stats)
                rows = len(resolved.boundaries or ()) + 1
                sparse.append(
                    SparseFeature(
                        d.column, rows, model.embedding_dim, features.pooling, bucketize=resolved
                    )
                )
                continue
            dense.append(d.column)
            transforms.append(_standardized(d, stats) if d.transform == "standardize" else d)
        for cross in schema.crosses:
            product: float | None = 1.0
            for column in cross.columns:
                known = cards.get(column)
                product = None if known is None or product is None else product * known
            rows = cross.rows if cross.rows is not None else hashed_rows(product)
            sparse.append(
                SparseFeature(
                    cross.name,
                    int(rows),
                    cross.dim or model.embedding_dim,
                    features.pooling,
                    cross=cross.columns,
                )
            )
        _check_pooling(sparse)
        _check_dims(sparse, model)
        for f in sparse:
            settings = (f.admit_after, f.ttl, f.evict_every, f.map_shards)
            if any(v is not None for v in settings) and f.ids != "dynamic":
                raise SchemaError(
                    f"sparse feature {f.name}: admit_after, ttl, evict_every and map_shards "
                    "are for ids: dynamic"
                )
        plain = all(d.plain_log for d in transforms)
        return cls(
            dense=tuple(dense),
            sparse=tuple(sparse),
            label=schema.label,
            dense_transforms=None if plain else tuple(transforms),
            weight=schema.weight,
        )


def _map_shards(name: str, wanted: int | None, rows: int) -> int | None:
    """A dynamic table's map shards: ``wanted``, else one per ``ROWS_PER_MAP_SHARD`` rows
    (at most ``MAX_MAP_SHARDS``), so that small tables keep one map and large ones can
    spread theirs over a job's ranks; None for one (what specs written before shards
    said). Too many for the rows is refused naming the feature."""
    shards = wanted or min(MAX_MAP_SHARDS, max(1, (rows - 1) // ROWS_PER_MAP_SHARD))
    if rows - 1 < shards:
        raise SchemaError(
            f"sparse feature {name}: ids dynamic with rows {rows} cannot have map_shards "
            f"{shards}: each shard needs a row besides the default row; give it rows >= "
            f"{shards + 1} or fewer map_shards"
        )
    return None if shards == 1 else shards


def _check_shared(sparse: Sequence[SparseFeature]) -> None:
    """Features sharing a table agree on what the table is, and only plain ID columns share
    one (a cross's and a bucket's rows mean something else)."""
    first: dict[str, SparseFeature] = {}
    for f in sparse:
        if f.table is not None and (f.cross is not None or f.bucketize is not None):
            raise SchemaError(f"sparse feature {f.name}: a cross or bucket shares no table")
        other = first.setdefault(f.table_name, f)
        if other is f:
            continue
        if other.cross is not None or other.bucketize is not None:
            raise SchemaError(f"sparse feature {f.name}: table {f.table_name} is a cross or bucket")
        for field in ("num_embeddings", "embedding_dim", "pooling", "ids"):
            if getattr(f, field) != getattr(other, field):
                raise SchemaError(
                    f"sparse feature {f.name}: {field} {getattr(f, field)}, but {other.name} "
                    f"has {getattr(other, field)} in their shared table {f.table_name}"
                )


def _check_dims(sparse: list[SparseFeature], model: ModelConfig) -> None:
    """The dot interaction takes the dot product of every pair of vectors, so every table
    must be as wide as the bottom MLP's output (``model.embedding_dim``); DCNv2 crosses
    one concatenated vector and takes any widths."""
    if model.arch != "dlrm":
        return
    for f in sparse:
        if f.embedding_dim != model.embedding_dim:
            raise SchemaError(
                f"feature {f.name}: dim {f.embedding_dim}, but model.arch dlrm (the dot "
                f"interaction) needs every table at model.embedding_dim "
                f"({model.embedding_dim}); drop its dim or set model.arch=dcnv2"
            )


def _check_pooling(sparse: list[SparseFeature]) -> None:
    """Per-ID weights reach the kernels as one weight per ID of the whole batch, which they
    take only when every table sums (``kernels.tbe``): refuse a mean beside weights."""
    weighted = [f.name for f in sparse if f.weights is not None]
    if not weighted:
        return
    for f in sparse:
        if f.pooling == "mean":
            raise SchemaError(
                f"sparse feature {f.name}: pooling mean, but {weighted[0]} has per-ID weights, "
                "which need sum pooling in every table; set its pooling: sum"
            )


def _column_stats(d: DenseFeature, stats: DatasetStats | None, why: str) -> DenseStats:
    if stats is None:
        raise SchemaError(
            f"dense feature {d.column}: {why} from the dataset's statistics (stats.json), "
            "which this run did not read"
        )
    for s in stats.dense:
        if s.name == d.column:
            return s
    raise SchemaError(
        f"dense feature {d.column}: {why} from the dataset's statistics, which have no "
        "such column; register the dataset again"
    )


def _standardized(d: DenseFeature, stats: DatasetStats | None) -> DenseFeature:
    """``d`` with its mean and standard deviation after the fill, from ``stats`` unless the
    schema gives them."""
    if d.std is not None:
        return d
    s = _column_stats(d, stats, "transform standardize takes its mean and std")
    if s.std is None and s.present:
        raise SchemaError(
            f"dense feature {d.column}: the dataset's statistics predate deviations; "
            "register the dataset again for transform standardize"
        )
    mean, std = s.filled_moments(d.fill)
    return d.model_copy(update={"mean": mean, "std": std})


def _bucketized(d: DenseFeature, stats: DatasetStats | None) -> DenseFeature:
    """``d`` with its boundaries: given, or the statistics' quantiles after the fill."""
    if d.buckets is None:
        return d
    s = _column_stats(d, stats, f"buckets: {d.buckets} takes its boundaries")
    if s.present and not s.sketch_counts:
        raise SchemaError(
            f"dense feature {d.column}: the dataset's statistics predate quantiles; "
            "register the dataset again for bucketize with buckets"
        )
    boundaries = s.boundaries(d.buckets, d.fill)
    return d.model_copy(update={"buckets": None, "boundaries": boundaries})


def dataset_schema(manifest: Manifest) -> FeatureSchema:
    """The feature schema ``manifest`` records (``dlrmflow register``), else Criteo's."""
    if manifest.features is None:
        return criteo_schema()
    return parse_schema(manifest.features, "manifest.json: features")
