"""``manifest.json``: what a Parquet dataset holds, written by generate and convert.

The manifest is the contract between ingest and everything after it: which day files
exist, how many rows each has, which day is held out for evaluation, and (for synthetic
data) the Bayes-optimal metrics a trained model is compared against.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

import fsspec
from pydantic import BaseModel, ConfigDict, Field

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


class DayFile(BaseModel):
    """One day partition: its path relative to the dataset root and its row count."""

    model_config = ConfigDict(extra="forbid")
    day: int
    path: str
    rows: int
    positive_rate: float


class Manifest(BaseModel):
    """Contents of ``manifest.json`` at the root of a dataset."""

    model_config = ConfigDict(extra="forbid")
    format_version: int = FORMAT_VERSION
    source: str  # "synthetic" or "criteo"
    rows: int
    days: int
    test_day: int
    positive_rate: float
    multi_hot: bool = False
    files: list[DayFile]
    schema_: list[dict[str, str]] = Field(alias="schema")
    # Distinct IDs each categorical column can take (known for synthetic data only).
    cardinalities: dict[str, int] | None = None
    bayes_auc: float | None = None
    bayes_logloss: float | None = None
    generator: dict[str, Any] | None = None

    def day_paths(self, root: str, days: list[int] | None = None) -> list[str]:
        """Full URLs of the day files, optionally restricted to ``days``."""
        wanted = set(days) if days is not None else None
        return [join_url(root, f.path) for f in self.files if wanted is None or f.day in wanted]

    def train_days(self) -> list[int]:
        """Every day except the held-out test day."""
        return [f.day for f in self.files if f.day != self.test_day]


def join_url(root: str, *parts: str) -> str:
    """Join path parts onto an fsspec URL (``posixpath`` keeps ``memory://`` intact)."""
    return posixpath.join(root.rstrip("/"), *parts)


def write_json(root: str, name: str, data: object) -> str:
    """Write ``data`` as indented JSON to file ``name`` under ``root``; returns its URL."""
    url = join_url(root, name)
    with fsspec.open(url, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    return url


def write_manifest(root: str, manifest: Manifest) -> str:
    """Write ``manifest.json`` under ``root``; returns its URL."""
    return write_json(root, MANIFEST_NAME, manifest.model_dump(by_alias=True))


def read_manifest(root: str) -> Manifest:
    """Read and validate ``manifest.json`` under ``root``, with an error naming the file."""
    url = join_url(root, MANIFEST_NAME)
    try:
        with fsspec.open(url, "r") as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{url}: no manifest; create the dataset with `dlrmflow generate` or `dlrmflow convert`"
        ) from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{url}: not valid JSON ({e})") from e
    try:
        return Manifest.model_validate(data)
    except Exception as e:
        raise ValueError(f"{url}: invalid manifest: {e}") from e
