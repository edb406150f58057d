"""A split decoded: its file opened and held to the identity its footer recorded when the
splits were listed, its row group read as a table under the reader's one schema, and
validated.

Files are held to the identity their footers recorded (the digest ``dlrmflow.ingest.
dayfile`` writes): a file that is gone, replaced or not a regular file when a reader opens
it is a ``DataError`` naming its day, so a dataset rewritten under a running job stops the
job at its next file rather than mixing two datasets' rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dlrmflow.ingest.dayfile import (
    NotRegularFile,
    Stamp,
    day_path,
    footer_identity,
    open_regular_for_arrow,
)
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.splits import Split
from dlrmflow.ingest.strings import holds_strings


def row_group_of(split: Split) -> str:
    return f"{split.path}, row group {split.row_group}"


def row_groups_of(splits: Sequence[Split]) -> str:
    return "; ".join(row_group_of(s) for s in splits)


def _open_for_arrow(split: Split) -> tuple[Any, Stamp]:
    """The split's file opened for Arrow to read (a native file where it is local, else
    fsspec's), with its ``Stamp``; a file that is gone or not a regular file (a FIFO is
    never opened blocking) is a ``DataError`` naming the day.

    Arrow reads pre-buffered ranges in its own IO threads. A range read from a Python file
    object is held in a Python ``bytes``, which only the GIL can free, and the IO thread that
    drops it last can be a step behind the reader: if the interpreter is finalizing by then
    (the process exiting right after its last read, as after an error), that thread aborts
    the process ("terminate called without an active exception", exit 134). A native file's
    buffers need no GIL.
    """
    try:
        return open_regular_for_arrow(split.path)
    except FileNotFoundError as e:
        raise DataError(
            f"{day_path(split.path, split.day)}: missing; the dataset was rewritten or removed "
            "while this job read it"
        ) from e
    except NotRegularFile as e:
        raise DataError(f"{day_path(split.path, split.day)}: {e.strerror}") from e


@dataclass(frozen=True)
class _Footer:
    metadata: pq.FileMetaData
    stamp: Stamp
    # The file's string ID columns the transform takes as dictionaries (see SplitDecoder),
    # each with its Parquet leaf path (a list's strings: ``name.list.element`` or as its
    # writer named them), which ``read_dictionary`` takes.
    dictionaries: tuple[str, ...] = ()
    leaves: tuple[str, ...] = ()

    def leaves_of(self, names: list[str]) -> list[str]:
        paths = dict(zip(self.dictionaries, self.leaves, strict=True))
        return [paths[name] for name in names]


def _declared(t: pa.DataType) -> pa.DataType:
    """The type a file declares for a column decoded as ``t`` with its strings read as
    dictionaries: the dictionary's values, alone or in the same kind of list."""
    if pa.types.is_dictionary(t):
        return t.value_type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        field = t.value_field.with_type(_declared(t.value_type))
        return pa.list_(field) if pa.types.is_list(t) else pa.large_list(field)
    return t


def leaf_paths(parquet: pq.ParquetFile, names: Sequence[str]) -> tuple[str, ...]:
    """Each column's Parquet leaf path, as ``read_dictionary`` takes it: a top-level
    column's is its name, a list's strings' ``name.list.element`` (or as its writer named
    them)."""
    paths = [parquet.schema.column(i).path for i in range(len(parquet.schema))]
    leaves = []
    for name in names:
        under = [p for p in paths if p == name or p.startswith(name + ".")]
        leaves.append(under[0])
    return tuple(leaves)


class SplitDecoder:
    """Decodes splits into tables under one schema, validated.

    One per pass, shared by the pass's preparation threads. A file's footer is read at its
    first open and again whenever its ``Stamp`` (size, inode, modification time) changed
    since; each time, the digest it records must be the one the splits were listed with,
    so a file replaced under a running job fails the job at that file, naming its day,
    instead of feeding it rows of another dataset.

    A transform with ``dictionary_columns(schema)`` (``BatchTransform``) names the string
    ID columns (strings, or lists of them) of a file it takes as dictionaries: those are
    decoded as Parquet stores them when a writer dictionary-encodes strings (each distinct
    string once, and an index an ID), so that neither the decode nor the transform goes
    over every string. A column whose dictionary turns out as large as half its strings
    (a writer that gave up dictionary-encoding it, where Arrow builds one at a cost) is
    decoded plain from then on. Either way the transform gives the same rows; the schema a
    file declares is what drift is checked against.
    """

    def __init__(
        self,
        columns: list[str],
        validate: Callable[[pa.Table], None] | None,
        transform: object | None,
    ) -> None:
        """Decode ``columns``, check each table with ``validate``; ``transform`` (a
        dataset's) says which string columns to read as dictionaries, if it can."""
        self.columns = columns
        self.validate = validate
        self._dictionary_columns: Callable[[pa.Schema], list[str]] | None = getattr(
            transform, "dictionary_columns", None
        )
        self._plain: set[str] = set()  # read plain from now on (see above)
        self._footers: dict[str, _Footer] = {}
        self._schema: pa.Schema | None = None  # declared by the first row group, all nullable
        self._schema_source = ""
        self._first = threading.Lock()  # the first row group read sets the schema
        # The last decoded schema found to conform (with the columns read as dictionaries),
        # and the schema its tables take: a file's row groups share one, and comparing 40
        # fields' types each time adds up.
        self._conforming: tuple[pa.Schema, tuple[str, ...], pa.Schema] | None = None

    def read(self, split: Split) -> pa.Table:
        table, dictionaries = self._decode(split)
        table = self._conform(table, split, dictionaries)
        if self.validate is not None:
            try:
                self.validate(table)
            except Exception as e:
                raise DataError(f"{row_group_of(split)}: {e}") from e
        return table

    def _decode(self, split: Split) -> tuple[pa.Table, list[str]]:
        """The split's table and the columns read as dictionaries that the file declares
        as strings."""
        where = row_group_of(split)
        f, stamp = _open_for_arrow(split)
        try:
            with f:
                footer = self._footers.get(split.path)
                if footer is not None and footer.stamp != stamp:
                    footer = None
                dictionaries = [] if footer is None else self._dictionaries(footer)
                # pre_buffer coalesces the column-chunk reads: one request per row group on
                # object stores instead of one per column.
                parquet = pq.ParquetFile(
                    f,
                    metadata=None if footer is None else footer.metadata,
                    pre_buffer=True,
                    read_dictionary=footer.leaves_of(dictionaries) if dictionaries else None,
                )
                if footer is None:
                    self._check_identity(split, parquet.metadata)
                    names = self._dictionaries_of(parquet)
                    footer = _Footer(parquet.metadata, stamp, names, leaf_paths(parquet, names))
                    self._footers[split.path] = footer
                    dictionaries = self._dictionaries(footer)
                    if dictionaries:
                        parquet = pq.ParquetFile(
                            f,
                            metadata=footer.metadata,
                            pre_buffer=True,
                            read_dictionary=footer.leaves_of(dictionaries),
                        )
                names = parquet.schema_arrow.names
                missing = [c for c in self.columns if c not in names]
                if missing:
                    raise DataError(f"{where}: missing column {', '.join(missing)} (schema drift)")
                # Without Arrow's thread pool: every reader would spread over all cores, and
                # the loader's CPU use would no longer follow from num_workers.
                table = parquet.read_row_group(
                    split.row_group, columns=self.columns, use_threads=False
                )
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{where}: cannot decode: {e}") from e
        if table.num_rows != split.num_rows:
            raise DataError(
                f"{where}: has {table.num_rows} rows, the split listing said {split.num_rows} "
                "(file changed since list_splits)"
            )
        for name in dictionaries:
            for chunk in table.column(name).chunks:
                strings = chunk if pa.types.is_dictionary(chunk.type) else chunk.values
                if 2 * len(strings.dictionary) > len(strings):
                    self._plain.add(name)
        return table, dictionaries

    def _dictionaries_of(self, parquet: pq.ParquetFile) -> tuple[str, ...]:
        """The string ID columns of ``parquet`` that the transform takes as dictionaries."""
        if self._dictionary_columns is None:
            return ()
        schema = parquet.schema_arrow
        wanted = self._dictionary_columns(schema)
        # Only strings and lists of strings: a column the file declares a dictionary
        # already is read as one.
        return tuple(
            name
            for name in wanted
            if name in self.columns
            and schema.get_field_index(name) >= 0
            and holds_strings(schema.field(name).type)
        )

    def _dictionaries(self, footer: _Footer) -> list[str]:
        return [name for name in footer.dictionaries if name not in self._plain]

    @staticmethod
    def _check_identity(split: Split, metadata: pq.FileMetaData) -> None:
        day, digest = footer_identity(metadata)
        if digest != split.digest:
            found = digest[:12] if digest is not None else "none"
            listed = split.digest[:12] if split.digest is not None else "none"
            raise DataError(
                f"{day_path(split.path, split.day if split.day is not None else day)}: replaced "
                f"while this job read the dataset (its footer's digest is {found}, it was "
                f"{listed}); the dataset changed under the job"
            )

    def _conform(self, table: pa.Table, split: Split, dictionaries: list[str]) -> pa.Table:
        """``table`` under the reader's one schema, or a DataError if a column's type drifted.

        Row groups of one window are concatenated, which needs identical schemas; files that
        differ only in nullability or metadata are fine, so the reference is all-nullable.
        Types are compared as the files declare them: a column decoded as a dictionary
        here (``dictionaries``) is the string column its file holds, and keeps its
        decoded type.
        """
        schema = table.schema
        if dictionaries:
            declared = pa.schema(
                [f.with_type(_declared(f.type)) if f.name in dictionaries else f for f in schema]
            )
        else:
            declared = schema
        if self._schema is None:
            with self._first:
                if self._schema is None:
                    self._schema_source = row_group_of(split)
                    self._schema = pa.schema([f.with_nullable(True) for f in declared])
        conforming = self._conforming
        if (
            conforming is None
            or conforming[1] != tuple(dictionaries)
            or not schema.equals(conforming[0])
        ):
            for field, expected in zip(declared, self._schema, strict=True):
                if field.type != expected.type:
                    raise DataError(
                        f"{row_group_of(split)}: column {field.name} is {field.type}, but "
                        f"{self._schema_source} has {expected.type} (schema drift)"
                    )
            target = pa.schema(
                [e.with_type(f.type) for f, e in zip(schema, self._schema, strict=True)],
                metadata=self._schema.metadata,
            )
            conforming = self._conforming = (schema, tuple(dictionaries), target)
        if schema.equals(conforming[2]):
            return table
        return pa.Table.from_arrays(table.columns, schema=conforming[2])
