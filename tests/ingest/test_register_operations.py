"""``register`` holds per-ID weight columns and crosses to what the feature transform takes:
a weight column pairs with its IDs (a list of numbers beside a list, one number beside
one ID), a crossed column holds one ID a row, and anything else fails in one line naming
the file and the column (and the cross)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrmflow.features.ids import HashIds
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.features.spec import SparseFeature as SpecFeature
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.register import register_dataset
from dlrmflow.schema import Cross, FeatureSchema, SparseFeature
from tests.conftest import run_cli

ROWS = 40


def _ids(kind: pa.DataType, rng: np.random.Generator) -> tuple[pa.Array, list[int]]:
    """IDs of type ``kind`` (one a row, or lists of 0..2) and each row's count of IDs."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        text = pa.types.is_string(kind.value_type) or pa.types.is_large_string(kind.value_type)
        lists = [
            [str(v) if text else int(v) for v in rng.integers(0, 30, i % 3)] for i in range(ROWS)
        ]
        return pa.array(lists, kind), [len(x) for x in lists]
    ids = pa.array(rng.integers(0, 30, ROWS), pa.int64())
    if pa.types.is_dictionary(kind):
        return ids.cast(pa.string()).dictionary_encode(), [1] * ROWS
    return ids.cast(kind), [1] * ROWS


def _weights(kind: pa.DataType, counts: list[int]) -> pa.Array:
    """A weight column of type ``kind``: a list as long as each row's IDs, or one value."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        item = "w" if pa.types.is_string(kind.value_type) else 2
        return pa.array([[item] * n for n in counts], kind)
    return pa.array([2] * len(counts), pa.int64()).cast(kind)


def _write_days(root: Path, columns: dict[str, pa.DataType], days: int = 2) -> Path:
    """``days`` day folders of one file each: ``click`` and ``columns``; a weight column
    (named ``*_w``) pairs with the IDs of the column named before its ``_w``."""
    rng = np.random.default_rng(3)
    for day in range(days):
        table = {"click": pa.array(rng.integers(0, 2, ROWS), pa.int8())}
        counts: dict[str, list[int]] = {}
        for name, kind in columns.items():
            if name.endswith("_w"):
                table[name] = _weights(kind, counts[name.removesuffix("_w")])
            else:
                table[name], counts[name] = _ids(kind, rng)
        folder = root / f"day={day}"
        folder.mkdir(parents=True)
        pq.write_table(pa.table(table), folder / "part-0.parquet")
    return root


def _weighted_schema() -> FeatureSchema:
    return FeatureSchema(label="click", sparse=(SparseFeature(column="ids", weights="ids_w"),))


def _transform_accepts(root: Path, schema: FeatureSchema) -> bool:
    """Whether the feature transform takes the first day's file under ``schema``."""
    feature = schema.sparse[0]
    spec = FeatureSpec(
        dense=(),
        sparse=(SpecFeature(feature.column, 64, 4, weights=feature.weights),),
        label=schema.label,
    )
    try:
        BatchTransform(spec, HashIds.from_spec(spec)).validate(
            pq.read_table(root / "day=0" / "part-0.parquet")
        )
    except ValueError:
        return False
    return True


LIST = pa.list_(pa.int64())


@pytest.mark.parametrize(
    ("ids", "weights", "wanted"),
    [
        (LIST, pa.list_(pa.float32()), None),
        (LIST, pa.large_list(pa.float64()), None),
        (pa.large_list(pa.int64()), pa.list_(pa.int32()), None),
        (pa.int64(), pa.float64(), None),
        (pa.dictionary(pa.int32(), pa.string()), pa.int16(), None),
        (LIST, pa.float32(), "a list of integers or floats a row, as its IDs are a list"),
        (LIST, pa.list_(pa.string()), "a list of integers or floats a row"),
        (pa.int64(), pa.list_(pa.float32()), "one integer or float a row, as it has one ID"),
        (pa.int64(), pa.string(), "one integer or float a row"),
    ],
    ids=[
        "list-list",
        "list-large-list",
        "large-list-list",
        "one-hot-number",
        "dictionary-one-hot-number",
        "list-number",
        "list-of-strings",
        "one-hot-list-of-one",
        "one-hot-string",
    ],
)
def test_per_id_weights_register_exactly_where_the_transform_takes_them(
    tmp_path, ids, weights, wanted
):
    root = _write_days(tmp_path / "data", {"ids": ids, "ids_w": weights})
    schema = _weighted_schema()
    accepted = _transform_accepts(root, schema)
    assert accepted == (wanted is None)
    if wanted is None:
        manifest = register_dataset(str(root), schema)
        assert manifest.days == 2 and manifest.rows == 2 * ROWS
        return
    with pytest.raises(DataError) as caught:
        register_dataset(str(root), schema)
    message = str(caught.value)
    path = root / "day=0" / "part-0.parquet"
    written = pq.read_schema(path).field("ids_w").type  # Parquet names a list's item
    assert message.startswith(
        f"{path}: column ids_w: type {written} cannot be the per-ID weights of ids ("
    )
    assert wanted in message and "\n" not in message
    assert not (root / "manifest.json").exists()


@pytest.mark.parametrize(
    ("indices", "fits"), [(pa.int8(), True), (pa.uint8(), False)], ids=["signed", "unsigned"]
)
def test_dictionary_ids_register_exactly_where_the_transform_takes_them(tmp_path, indices, fits):
    root = tmp_path / "data"
    for day in range(2):
        ids = pa.DictionaryArray.from_arrays(
            pa.array([i % 3 for i in range(ROWS)], indices), pa.array(["a", "b", "c"])
        )
        (root / f"day={day}").mkdir(parents=True)
        table = pa.table({"click": pa.array([day] * ROWS, pa.int8()), "ids": ids})
        pq.write_table(table, root / f"day={day}" / "part-0.parquet")
    schema = FeatureSchema(label="click", sparse=(SparseFeature(column="ids"),))
    assert _transform_accepts(root, schema) == fits
    if fits:
        assert register_dataset(str(root), schema).cardinalities == {"ids": 3}
        return
    with pytest.raises(DataError) as caught:
        register_dataset(str(root), schema)
    assert str(caught.value) == (
        f"{root}/day=0/part-0.parquet: column ids: type dictionary<values=string, "
        "indices=uint8, ordered=0> cannot be a sparse feature"
    )


def test_a_missing_weight_column_is_named(tmp_path):
    root = _write_days(tmp_path / "data", {"ids": LIST})
    with pytest.raises(DataError) as caught:
        register_dataset(str(root), _weighted_schema())
    assert str(caught.value) == (
        f"{root}/day=0/part-0.parquet: column ids_w: missing (the schema's per-ID weights of ids)"
    )


def test_a_weight_column_whose_type_changes_between_days_is_named(tmp_path):
    root = _write_days(tmp_path / "data", {"ids": LIST, "ids_w": pa.list_(pa.float32())})
    path = root / "day=1" / "part-0.parquet"
    table = pq.read_table(path)
    wider = table.column("ids_w").cast(pa.list_(pa.float64()))
    pq.write_table(table.set_column(2, "ids_w", wider), path)
    with pytest.raises(
        DataError,
        match=r"day=1/part-0.parquet: column ids_w: type list<element: double>, but "
        r".*day=0/part-0.parquet has list<element: float>: every day must have the same types",
    ):
        register_dataset(str(root), _weighted_schema())


def _crossed(*columns: str) -> FeatureSchema:
    return FeatureSchema(
        label="click",
        sparse=tuple(SparseFeature(column=c) for c in columns),
        crosses=(Cross(name="x", columns=columns),),
    )


def test_a_cross_of_single_valued_columns_registers(tmp_path):
    root = _write_days(tmp_path / "data", {"a": pa.int64(), "b": pa.string()})
    manifest = register_dataset(str(root), _crossed("a", "b"))
    assert manifest.features["crosses"] == [{"name": "x", "columns": ["a", "b"]}]


@pytest.mark.parametrize("kind", [LIST, pa.large_list(pa.string())], ids=["list", "large-list"])
def test_a_crossed_list_is_refused_naming_the_cross_and_the_column(tmp_path, kind):
    root = _write_days(tmp_path / "data", {"a": pa.int64(), "b": kind})
    with pytest.raises(DataError) as caught:
        register_dataset(str(root), _crossed("a", "b"))
    path = root / "day=0" / "part-0.parquet"
    written = pq.read_schema(path).field("b").type  # Parquet names a list's item
    assert str(caught.value) == (
        f"{path}: cross x: column b: type {written} is a list; a cross takes columns of one "
        "ID a row"
    )


def test_register_command_refuses_a_bad_weight_column_in_one_line(tmp_path, monkeypatch, capsys):
    root = _write_days(tmp_path / "data", {"tags": LIST, "tags_w": pa.float32()})
    schema = tmp_path / "schema.yaml"
    schema.write_text("label: click\nsparse:\n  - column: tags\n    weights: tags_w\n")
    code, printed, err = run_cli(
        monkeypatch, capsys, "register", "--data", str(root), "--schema", str(schema)
    )
    assert code == 1 and printed == ""
    assert err == [
        f"error: {root}/day=0/part-0.parquet: column tags_w: type float cannot be the per-ID "
        "weights of tags (list<element: int64>): they must be a list of integers or floats a "
        "row, as its IDs are a list"
    ]
