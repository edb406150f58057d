"""The Arrow window (no transform): the batches Arrow's take of the whole window gives."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest

from dlrmflow.ingest.reader import _bounds
from dlrmflow.ingest.shuffle import deal
from dlrmflow.ingest.window import ArrowWindow

TYPES = {
    "b": pa.bool_(),
    "i8": pa.int8(),
    "i16": pa.int16(),
    "i32": pa.int32(),
    "i64": pa.int64(),
    "u8": pa.uint8(),
    "u16": pa.uint16(),
    "u32": pa.uint32(),
    "u64": pa.uint64(),
    "f16": pa.float16(),
    "f32": pa.float32(),
    "f64": pa.float64(),
    "d32": pa.date32(),
    "d64": pa.date64(),
    "ts": pa.timestamp("us", tz="UTC"),
    "t32": pa.time32("s"),
    "t64": pa.time64("ns"),
    "dur": pa.duration("ms"),
    # Not fixed-width: gathered by Arrow's take.
    "s": pa.string(),
    "l": pa.list_(pa.int64()),
    "dict": pa.dictionary(pa.int32(), pa.string()),
}


def _array(name: str, t: pa.DataType, n: int, nulls: float, rng: np.random.Generator) -> pa.Array:
    """``n`` values of type ``t``, a share ``nulls`` of them null."""
    mask = rng.random(n) < nulls if nulls else None
    small = rng.integers(0, 1000, n)
    if name == "b":
        return pa.array(small % 2 == 1, mask=mask)
    if pa.types.is_floating(t):
        return pa.array((small / 8).astype(t.to_pandas_dtype()), mask=mask)
    if name == "s":
        return pa.array([f"s{v}" for v in small], mask=mask)
    if name == "l":
        return pa.array([list(range(v % 3)) for v in small], t, mask=mask)
    if name == "dict":
        indices = pa.array(small % 5, pa.int32(), mask=mask)
        return pa.DictionaryArray.from_arrays(indices, pa.array([f"k{v}" for v in range(5)]))
    if pa.types.is_integer(t):
        info = np.iinfo(t.to_pandas_dtype())  # every bit of the width in use
        return pa.array(rng.integers(info.min, info.max, n, info.dtype, endpoint=True), mask=mask)
    # Temporal: from integers of the type's width (within a day for the times).
    storage = pa.int32() if t.bit_width == 32 else pa.int64()
    return pa.array(small * 17, storage, mask=mask).cast(t)


def _table(n: int, nulls: float, rng: np.random.Generator, names: list[str]) -> pa.Table:
    """``n`` rows of every column of ``names``, a share ``nulls`` of each null."""
    return pa.table({name: _array(name, TYPES[name], n, nulls, rng) for name in names})


def _expected(tables: list[pa.Table], order: np.ndarray, pieces) -> list[pa.RecordBatch]:
    """The reader's former batches: Arrow's take of the concatenated window."""
    table = pa.concat_tables(tables)
    indices = pa.chunked_array([order[a:b] for a, b in pieces], type=pa.int64())
    return table.take(indices).to_batches()


def _check(tables: list[pa.Table], batch_size: int, seed: int, start_piece: int = 0) -> None:
    rows = sum(t.num_rows for t in tables)
    bounds = _bounds(rows, min(batch_size - 3, rows), batch_size)
    order, dest = deal(np.asarray(bounds), np.random.default_rng(seed))
    pieces = list(itertools.pairwise(bounds))[start_piece:]
    window = ArrowWindow(order, bounds)
    for table in tables:
        window.add(table)
    got = window.batches(pieces)
    want = _expected(tables, order, pieces)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.schema.equals(w.schema, check_metadata=True)
        assert g.num_rows == w.num_rows
        for name in w.schema.names:
            assert g.column(name).equals(w.column(name)), name
            assert g.column(name).null_count == w.column(name).null_count, name
        assert g.equals(w)


@pytest.mark.parametrize("seed", [0, 1])
def test_every_type_and_null_pattern_gives_takes_batches(seed):
    """No nulls, then nulls (the validity starts mid-window), few nulls, many, and all."""
    rng = np.random.default_rng(seed)
    names = list(TYPES)
    tables = [
        _table(1000, 0.0, rng, names),
        _table(777, 0.5, rng, names),
        _table(1203, 0.02, rng, names),
        _table(0, 0.0, rng, names),
        _table(901, 0.9, rng, names),
        _table(64, 1.0, rng, names),
    ]
    tables = [t.cast(tables[0].schema) for t in tables]
    _check(tables, batch_size=256, seed=seed)


def test_fixed_width_columns_alone_give_slices_of_one_window():
    rng = np.random.default_rng(3)
    names = [n for n in TYPES if n not in ("s", "l", "dict")]
    tables = [_table(5000, 0.3, rng, names), _table(3000, 0.0, rng, names)]
    _check(tables, batch_size=4096, seed=3)
    _check(tables, batch_size=1000, seed=4)


def test_sliced_and_chunked_columns():
    """Offsets that are not a multiple of 8 and columns chunked differently."""
    rng = np.random.default_rng(5)
    names = ["b", "i32", "i64", "f64", "s"]
    big = _table(3000, 0.3, rng, names)
    sliced = big.slice(13, 1500)
    chunked = pa.table(
        {
            "b": pa.chunked_array(
                [big["b"].chunks[0].slice(3, 500), big["b"].chunks[0].slice(7, 700)]
            ),
            "i32": pa.chunked_array([big["i32"].chunks[0].slice(1, 1200)]),
            "i64": pa.chunked_array(
                [big["i64"].chunks[0].slice(9, 100), big["i64"].chunks[0].slice(0, 1100)]
            ),
            "f64": pa.chunked_array([big["f64"].chunks[0].slice(5, 1200)]),
            "s": pa.chunked_array([big["s"].chunks[0].slice(2, 1200)]),
        }
    )
    aligned = pa.Table.from_batches(big.slice(1700, 900).to_batches(max_chunksize=250))
    _check([sliced, chunked, aligned], batch_size=300, seed=5)


def test_a_resumed_window_cuts_the_same_batches():
    rng = np.random.default_rng(6)
    names = ["b", "i32", "f64", "s"]
    tables = [_table(2000, 0.4, rng, names), _table(1500, 0.01, rng, names)]
    _check(tables, batch_size=512, seed=6, start_piece=3)


def test_unshuffled_window_keeps_file_order():
    rng = np.random.default_rng(7)
    tables = [_table(1000, 0.2, rng, ["i64", "b"]), _table(500, 0.0, rng, ["i64", "b"])]
    rows = 1500
    bounds = _bounds(rows, 400, 400)
    identity = np.arange(rows, dtype=np.int64)
    window = ArrowWindow(identity, bounds)
    for table in tables:
        window.add(table)
    got = pa.Table.from_batches(window.batches(list(itertools.pairwise(bounds))))
    assert got.equals(pa.concat_tables(tables).combine_chunks())


def test_too_many_or_too_few_rows_are_refused():
    rng = np.random.default_rng(8)
    table = _table(100, 0.0, rng, ["i64"])
    order, _ = deal(np.asarray([0, 100]), np.random.default_rng(0))
    window = ArrowWindow(order, [0, 100])
    window.add(table)
    with pytest.raises(ValueError, match="rows added"):
        window.add(table)
    short = ArrowWindow(order, [0, 100])
    short.add(table.slice(0, 50))
    with pytest.raises(ValueError, match="were added"):
        short.batches([(0, 100)])
