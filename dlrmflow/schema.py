"""The declared feature schema: which columns of a dataset are the label and the features,
and what is done with each.

A team's logs never look like Criteo, so a dataset says what its columns are: the label
column (0/1 integers, booleans, or floats in [0, 1]), dense features (a numeric column, the
value a null or NaN takes, and a transform) and sparse features (a column of IDs: int64 or
strings, one a row or a list a row, hashed into a table). ``dlrmflow register`` records the
schema in the dataset's manifest, so every stage reads the same one; a dataset without one
(generated, converted from Criteo TSV, or written before schemas) has Criteo's layout,
``criteo_schema()``, with every stage behaving as it always has.

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


class DenseFeature(_Strict):
    """A numeric column fed to the bottom MLP as one float32 value a row.

    ``transform``: ``log`` is ``log(1 + max(x, 0))`` (counts, prices: Criteo's), ``clip``
    bounds the value to ``[clip_min, clip_max]``, ``none`` passes it on. A null or NaN
    becomes ``fill`` before the transform.
    """

    column: str = Field(min_length=1)
    fill: float = 0.0
    transform: Literal["log", "clip", "none"] = "log"
    clip_min: float | None = None
    clip_max: float | None = None

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
        for name in ("fill", "clip_min", "clip_max"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{self.column}: {name} must be finite")
        return self

    @property
    def plain_log(self) -> bool:
        """Criteo's transform: nulls as 0, then ``log(1 + max(x, 0))``."""
        return self.transform == "log" and self.fill == 0.0


class SparseFeature(_Strict):
    """A column of IDs, each row a bag (one ID, a list, or none) looked up in an embedding
    table of its own. IDs are int64 or strings (strings are hashed to int64 by a stable
    hash first); ``rows`` fixes the table's size (default: from the dataset's distinct IDs
    and ``features.hash_size_factor``, at most ``features.max_rows_per_table``)."""

    column: str = Field(min_length=1)
    rows: int | None = Field(None, ge=1)


class FeatureSchema(_Strict):
    """What a dataset's columns are (see the module's docstring).

    ``weight``: an optional column of non-negative per-example weights (an importance or
    a sampling correction) that scale each example's loss. ``keys``: columns that are not
    features but identify a row (a request or user ID); ``score`` copies them into its
    output beside each prediction. ``day_column``: a date, timestamp or integer column
    that says each row's day, for data that is not in ``day=N/`` or ``dt=YYYY-MM-DD/``
    folders (``dlrmflow register`` reads it).
    """

    label: str = Field(min_length=1)
    weight: str | None = Field(None, min_length=1)
    dense: tuple[DenseFeature, ...] = ()
    sparse: tuple[SparseFeature, ...] = Field(min_length=1)
    keys: tuple[str, ...] = ()
    day_column: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _distinct(self) -> FeatureSchema:
        columns = [self.label, *self.dense_names, *self.sparse_names]
        if self.weight is not None:
            columns.append(self.weight)
        repeated = sorted({c for c in columns if columns.count(c) > 1})
        if repeated:
            raise ValueError(f"column {repeated[0]} is declared twice")
        keys = list(self.keys)
        repeated = sorted({c for c in keys if keys.count(c) > 1})
        if repeated:
            raise ValueError(f"key column {repeated[0]} is declared twice")
        if self.label in keys:
            raise ValueError(f"key column {self.label} is the label")
        if self.day_column is not None and self.day_column in (self.label, self.weight):
            raise ValueError(f"day_column {self.day_column} is the label or the weight")
        return self

    @property
    def dense_names(self) -> tuple[str, ...]:
        return tuple(f.column for f in self.dense)

    @property
    def sparse_names(self) -> tuple[str, ...]:
        return tuple(f.column for f in self.sparse)

    @property
    def columns(self) -> list[str]:
        """Every column training reads: the label, the weight if any, the features."""
        weight = [] if self.weight is None else [self.weight]
        return [self.label, *weight, *self.dense_names, *self.sparse_names]

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
