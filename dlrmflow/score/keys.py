"""Key columns: the columns of the scored rows that ``score`` copies beside each prediction.

A prediction is joined back to what it is about (a request, a user, an impression) by the
columns that identify its row, not only by ``(day, row)``. A dataset's schema declares
them (``FeatureSchema.keys``); ``score --keys`` chooses others. They are copied with
their own Arrow types, whatever those are, so they need not be features: the trainer's
reader never sees them. Each share reads them from the row groups it scores, in the same
order as the reader, beside it (``KeyReader``), one row group at a time.

Before anything is scored, ``key_schema`` reads the footer of every file to be scored:
a file without a key column, or with another type for it than the first file's, is one
line naming the file and the column.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dlrmflow.config import ConfigError
from dlrmflow.features.spec import dataset_schema
from dlrmflow.ingest.dayfile import footer_identity, open_regular, open_regular_for_arrow
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.manifest import Manifest, join_url
from dlrmflow.ingest.splits import Split
from dlrmflow.score.output import SCHEMA

KEYS_OPTION = "--keys"
# Footers read at once: on object stores each is a round trip or two of latency.
_FOOTER_THREADS = 16


def key_names(manifest: Manifest, keys: str | Sequence[str] | None) -> tuple[str, ...]:
    """The key columns to copy: ``keys`` (a comma-separated string or names; empty: none)
    or, when None, those the dataset's schema declares. A name twice, or one that is an
    output column's (``day``, ``row``, ``label``, ``prediction``), is a ``ConfigError``."""
    if keys is None:
        names = dataset_schema(manifest).keys
        where = "the dataset's schema (keys)"
    else:
        if isinstance(keys, str):
            keys = keys.split(",")
        names = tuple(k.strip() for k in keys if k.strip())
        where = KEYS_OPTION
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"{where}: key column {name} is named twice")
        if name in SCHEMA.names:
            raise ConfigError(
                f"{where}: key column {name}: the output has a column of that name "
                f"({', '.join(SCHEMA.names)}); rename the column in the data"
            )
    return names


def key_schema(
    url: str, manifest: Manifest, days: Sequence[int], names: Sequence[str]
) -> pa.Schema:
    """The key columns' fields (nullable, with the first file's types), after every file of
    ``days`` was found to hold each of them with that type (its footer alone is read)."""
    if not names:
        return pa.schema([])
    wanted = set(days)
    paths = [join_url(url, f.path) for f in manifest.files if f.day in wanted and f.rows > 0]

    def schema_of(path: str) -> pa.Schema:
        try:
            f, _ = open_regular(path)
            with f:
                return pq.ParquetFile(f).schema_arrow
        except Exception as e:  # whatever stops a footer being read is the file's fault
            raise DataError(f"{path}: cannot read Parquet footer: {e}") from None

    with ThreadPoolExecutor(max(1, min(_FOOTER_THREADS, len(paths)))) as pool:
        schemas = list(pool.map(schema_of, paths))
    first: dict[str, tuple[pa.DataType, str]] = {}
    for path, schema in zip(paths, schemas, strict=True):
        for name in names:
            index = schema.get_field_index(name)
            if index < 0:
                raise DataError(
                    f"{path}: column {name}: missing (a key column that score copies into its "
                    f"output; choose others with {KEYS_OPTION})"
                )
            kind = schema.field(index).type
            seen = first.setdefault(name, (kind, path))
            if kind != seen[0]:
                raise DataError(
                    f"{path}: column {name}: type {kind}, but {seen[1]} has {seen[0]}: a key "
                    "column must have one type in every file scored"
                )
    return pa.schema([pa.field(name, first[name][0]) for name in names if name in first])


def encode_schema(schema: pa.Schema) -> str:
    """``schema`` as text for a worker's command line (Arrow's IPC form, base64)."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")


def decode_schema(text: str) -> pa.Schema:
    """The schema ``encode_schema`` wrote."""
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


class KeyReader:
    """The key columns of a share's rows in read order, handed out ``take(n)`` at a time.

    It reads a row group's key columns when its first row is taken, keeps its file open
    while the next row group is in the same file, and holds each file to the digest its
    splits were listed with, as the reader does: the keys are those of the rows scored.
    """

    def __init__(self, splits: Sequence[Split], schema: pa.Schema) -> None:
        self._splits = list(splits)
        self._schema = schema
        self._next = 0  # the split to read next
        self._held: pa.Table = schema.empty_table()  # rows read and not handed out yet
        self._open: tuple[str, Any, pq.ParquetFile] | None = None

    def take(self, n: int) -> pa.Table:
        """The key columns of the next ``n`` rows; a ``DataError`` past the share's end."""
        pieces = []
        left = n
        while left:
            if not self._held.num_rows:
                if self._next == len(self._splits):
                    raise DataError(f"key columns: {left} more rows read than the share holds")
                self._held = self._read(self._splits[self._next])
                self._next += 1
                continue
            step = min(left, self._held.num_rows)
            pieces.append(self._held.slice(0, step))
            self._held = self._held.slice(step)
            left -= step
        if not pieces:
            return self._schema.empty_table()
        return pa.concat_tables(pieces)

    def _read(self, split: Split) -> pa.Table:
        where = f"{split.path}, row group {split.row_group}"
        try:
            parquet = self._parquet(split)
            table = parquet.read_row_group(
                split.row_group, columns=self._schema.names, use_threads=False
            )
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{where}: key columns {', '.join(self._schema.names)}: {e}") from e
        if table.num_rows != split.num_rows:
            raise DataError(
                f"{where}: has {table.num_rows} rows, the split listing said {split.num_rows} "
                "(file changed while scoring)"
            )
        for field in self._schema:
            if table.schema.field(field.name).type != field.type:
                raise DataError(
                    f"{where}: column {field.name}: type {table.schema.field(field.name).type}, "
                    f"but it was {field.type} when scoring began (file changed while scoring)"
                )
        return pa.Table.from_arrays(table.columns, schema=self._schema)

    def _parquet(self, split: Split) -> pq.ParquetFile:
        if self._open is not None and self._open[0] == split.path:
            return self._open[2]
        self.close()
        f, _ = open_regular_for_arrow(split.path)
        try:
            parquet = pq.ParquetFile(f)
            _, digest = footer_identity(parquet.metadata)
            if digest != split.digest:
                raise DataError(
                    f"{split.path}: replaced while it was scored (its footer's digest differs)"
                )
        except BaseException:
            f.close()
            raise
        self._open = (split.path, f, parquet)
        return parquet

    def close(self) -> None:
        """Close the file held open."""
        if self._open is not None:
            self._open[1].close()
            self._open = None

    def __enter__(self) -> KeyReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
