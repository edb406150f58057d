"""``generate --shape logs``: a team's click logs, their schema declared, a known optimum."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from dlrmflow.cli import main
from dlrmflow.config import ConfigError, DataConfig
from dlrmflow.ingest import synthetic_logs
from dlrmflow.ingest.manifest import check_dataset, read_manifest
from dlrmflow.ingest.register import register_dataset
from dlrmflow.ingest.stats.results import read_stats
from dlrmflow.ingest.synthetic_logs import LOGS_SCHEMA, RECENT_WEIGHT, generate_logs_dataset
from dlrmflow.schema import parse_schema

SMALL = {"days": 3, "rows_per_day": 4000, "row_group_size": 1000, "cardinality_scale": 0.0001}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("logs") / "data")
    generate_logs_dataset(DataConfig(url=url, **SMALL))
    return url


def _day(url: str, day: int) -> pa.Table:
    return pq.read_table(read_manifest(url).day_paths(url, [day], held_out=[])[0])


def test_the_manifest_declares_the_schema_and_the_optimum(logs):
    manifest = read_manifest(logs)
    assert parse_schema(manifest.features, "manifest") == LOGS_SCHEMA
    assert (manifest.rows, manifest.days, manifest.test_day) == (12_000, 3, 2)
    assert manifest.multi_hot and manifest.generator["shape"] == "logs"
    assert manifest.cardinalities == {
        "user_id": 500, "item_id": 100, "recent_items": 100, "tags": 20,
    }  # fmt: skip
    assert check_dataset(logs, manifest) == []
    assert 0.22 < manifest.positive_rate < 0.28  # data.positive_rate's 0.25
    # The test day's optimum, and what ignoring the tags' weights costs the true model.
    assert manifest.bayes_auc == manifest.files[-1].bayes_auc
    assert 0.68 < manifest.bayes_auc < 0.78
    assert manifest.bayes_auc - manifest.generator["auc_list_weights_ignored"] > 0.025
    # Statistics as registering writes them: the declared columns' distinct IDs.
    stats = {s.name: s for s in read_stats(logs).sparse}
    assert sorted(stats) == ["item_id", "recent_items", "tags", "user_id"]
    assert 0 < stats["tags"].distinct <= 20 and stats["user_id"].distinct > 100


def test_the_columns_look_like_a_teams_logs(logs):
    table = _day(logs, 0)
    assert table.schema.names == [
        "click", "request_id", "user_id", "item_id", "recent_items", "price", "discount", "tags",
        "tags_weight",
    ]  # fmt: skip
    assert table.column("user_id").type == pa.string() and table.column("user_id").null_count
    assert table.column("item_id").to_pylist()[0].startswith("item-")
    assert table.column("price").null_count and table.column("discount").null_count
    assert pc.min(table.column("price")).as_py() > 0
    discount = table.column("discount")
    # A few logging errors outside [0, 1], which the declared clip removes.
    assert pc.sum(pc.greater(discount, 1.0)).as_py() and pc.sum(pc.less(discount, 0.0)).as_py()
    tags, weights = table.column("tags").combine_chunks(), table.column("tags_weight")
    weights = weights.combine_chunks()
    assert tags.null_count and pc.sum(pc.equal(pc.list_value_length(tags), 0)).as_py()
    assert tags.is_null().equals(weights.is_null())
    assert pc.list_value_length(tags).equals(pc.list_value_length(weights))
    assert pc.min(weights.flatten()).as_py() > 0
    assert abs(pc.mean(weights.flatten()).as_py() - 1.0) < 0.05  # log-normal of mean 1
    recent = table.column("recent_items").combine_chunks()
    assert recent.type == pa.list_(pa.string())
    assert recent.null_count and pc.sum(pc.equal(pc.list_value_length(recent), 0)).as_py()
    assert pc.list_flatten(recent).null_count == 0  # null lists, never null IDs (as tags)
    assert 2.5 < pc.mean(pc.list_value_length(recent)).as_py() < 3.5  # Poisson of mean 3
    days = [_day(logs, d).column("request_id").to_numpy() for d in range(3)]
    assert np.unique(np.concatenate(days)).size == 12_000


def test_recent_items_share_the_item_table_and_move_the_clicks(logs, tmp_path, monkeypatch):
    """``recent_items`` is a list of item IDs declared in one table with ``item_id``, drawn
    from the same popularity, and the hidden model takes ``RECENT_WEIGHT`` times the sum of
    their item effects."""
    schema = parse_schema(read_manifest(logs).features, "manifest")
    assert [f.column for f in schema.table_members("items")] == ["item_id", "recent_items"]
    assert {f.table_name for f in schema.sparse} == {"user_id", "items", "tags"}
    # The same ID space and popularity: the most logged recent item is a popular item.
    days = [_day(logs, d) for d in range(3)]
    items = Counter(i for t in days for i in t.column("item_id").to_pylist())
    recent = Counter(i for t in days for i in pc.list_flatten(t.column("recent_items")).to_pylist())
    [(top_recent, _)] = recent.most_common(1)
    assert top_recent in [i for i, _ in items.most_common(5)]
    truth = synthetic_logs._ground_truth(DataConfig(url="unused", **SMALL))
    assert set(recent) <= set(truth.items.ids.to_pylist())  # the hidden item table's IDs

    # The term in the true logits: with the same draws, the logit less that without it is
    # RECENT_WEIGHT times the recent items' summed effects.
    with_term = synthetic_logs._sample_rows(truth, np.random.default_rng(3), 2000)
    monkeypatch.setattr(synthetic_logs, "RECENT_WEIGHT", 0.0)
    without = synthetic_logs._sample_rows(truth, np.random.default_rng(3), 2000)
    rank = {item: r for r, item in enumerate(truth.items.ids.to_pylist())}
    column = with_term.columns["recent_items"]
    assert column.equals(without.columns["recent_items"])
    summed = [sum(truth.items.effect[rank[i]] for i in row or []) for row in column.to_pylist()]
    want = RECENT_WEIGHT * np.array(summed)
    assert np.any(want != 0)
    np.testing.assert_allclose(with_term.logit - without.logit, want, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(
        with_term.logit_weights_ignored - without.logit_weights_ignored, want, atol=1e-12
    )
    # And so in the recorded optimum.
    zero = generate_logs_dataset(DataConfig(url=str(tmp_path / "zero"), **SMALL))
    assert zero.bayes_auc != read_manifest(logs).bayes_auc


def test_its_files_register_as_a_users_own_data_under_its_schema(logs, tmp_path):
    """The day files alone, registered as a user registers theirs: the same schema and
    the same files' rows and identity."""
    copy = tmp_path / "copy"
    for path in read_manifest(logs).files:
        (copy / path.path).parent.mkdir(parents=True, exist_ok=True)
        (copy / path.path).symlink_to(Path(logs) / path.path)
    registered = register_dataset(str(copy), LOGS_SCHEMA)
    generated = read_manifest(logs)
    assert registered.features == generated.features
    assert [(f.path, f.rows, f.bytes) for f in registered.files] == [
        (f.path, f.rows, f.bytes) for f in generated.files
    ]
    assert registered.positive_rate == pytest.approx(generated.positive_rate, abs=1e-12)


def test_the_same_config_writes_the_same_bytes_and_another_seed_others(logs, tmp_path):
    again = str(tmp_path / "again")
    generate_logs_dataset(DataConfig(url=again, **SMALL))
    for day in range(3):
        assert _day(again, day).equals(_day(logs, day))
    assert [f.digest for f in read_manifest(again).files] == [
        f.digest for f in read_manifest(logs).files
    ]
    other = str(tmp_path / "other")
    generate_logs_dataset(DataConfig(url=other, **{**SMALL, "days": 2, "seed": 1}))
    assert not _day(other, 0).column("click").equals(_day(logs, 0).column("click"))


def test_one_day_more_writes_only_that_day(tmp_path):
    url = str(tmp_path / "data")
    first = generate_logs_dataset(DataConfig(url=url, **{**SMALL, "days": 2}))
    day0 = Path(url) / first.files[0].path
    written = day0.stat().st_mtime_ns
    more = generate_logs_dataset(DataConfig(url=url, **{**SMALL, "days": 3}))
    assert day0.stat().st_mtime_ns == written
    assert [f.path for f in more.files[:2]] == [f.path for f in first.files]
    assert more.test_day == 2 and more.generator["auc_list_weights_ignored"] is not None
    again = generate_logs_dataset(DataConfig(url=url, **{**SMALL, "days": 3}))
    assert again == more
    assert check_dataset(url, again) == []


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        ({"multi_hot": True}, "data.multi_hot"),
        ({"drift": 0.1}, "data.drift"),
        ({"churn": 0.1}, "data.churn"),
        ({"weekly": 0.2}, "data.base_rate_step, data.weekly"),
    ],
)
def test_the_criteo_shapes_options_are_refused_naming_the_key(tmp_path, sets, key):
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        generate_logs_dataset(DataConfig(url=str(tmp_path / "d"), **SMALL, **sets))
    assert not (tmp_path / "d" / "manifest.json").exists()


def _cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.argv", ["dlrmflow", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_shape_logs_from_the_cli(tmp_path, monkeypatch, capsys):
    data = str(tmp_path / "data")
    small = ["--set", "data.row_group_size=1000", "--set", "data.cardinality_scale=0.0001"]
    args = ["generate", "--shape", "logs", "--out", data, "--days", "2", "--rows-per-day", "2000"]
    code, out, err = _cli(monkeypatch, capsys, *args, *small)
    assert code == 0, err
    info = json.loads(out)
    manifest = read_manifest(data)
    assert (info["rows"], info["test_day"], info["written_days"]) == (4000, 1, [0, 1])
    assert info["bayes_auc"] == manifest.bayes_auc and manifest.features is not None

    code, out, err = _cli(monkeypatch, capsys, "generate", "--shape", "tsv", "--out", data)
    assert code == 1 and out == ""
    assert err == "error: --shape must be one of criteo, logs, not 'tsv'\n"
    code, _, err = _cli(monkeypatch, capsys, *args, "--multi-hot")
    assert code == 1 and err.startswith("error: data.multi_hot: ") and err.count("\n") == 1
