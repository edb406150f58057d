"""The benchmark report: how ``run_report`` puts the benchmarks' records together into
``report.json``, ``report.md`` and plots, the tiered-cache benchmark it defines, and the
documents generated from a report's JSON; never speed.

Every other benchmark's record, report section and plots are checked at quick size in its
own test file (``tests/test_bench_<name>.py``; the TorchRec comparison's in
``test_bench_train.py``, beside the training benchmark whose config, batches and plot it
shares). Here ``StandIns`` take the place of the benchmarks, sections and plots, so that
the report is put together in each of its modes (quick, full, TorchRec skipped) without
running again a benchmark that the suite runs already.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from dlrmflow.bench import report
from dlrmflow.bench.docs import BENCHMARKS, OPTIONAL, RESULTS_END, RESULTS_START, write_docs
from dlrmflow.bench.report import (
    INGEST_QUICK,
    NOISE_NOTE,
    PLOTS,
    READERS_QUICK,
    markdown_table,
    plot_cache,
    run_report,
    run_tiered_benchmark,
    tiered_section,
    torchrec_section,
)
from dlrmflow.bench.torchrec_compare import torchrec_missing
from dlrmflow.ingest.synthetic_logs import SHAPE as LOGS_SHAPE
from tests.test_bench_helpers import check_plot, report_section, table_rows

COMMITTED_REPORT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.json"
NOT_IMPORTED = "ModuleNotFoundError: No module named 'torchrec'"
# What the report's record holds beside the benchmarks' records.
REPORT_KEYS = {"quick", "seconds", "noise", "plots", "machine"}


def _jsonable(value: object) -> object:
    """``value`` as it reads back from JSON: tuples as lists, paths as strings."""
    return json.loads(json.dumps(value, default=str))


class StandIns:
    """``run_report``'s benchmarks, sections and plots, each replaced by a stand-in that
    says what it was given: a benchmark returns a token of its name and arguments, a section
    renders its arguments under its name, and a plot writes them to its file. ``calls``
    keeps the order of the calls, ``tune_allocator``'s among them."""

    def __init__(self, patch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name, real in list(vars(report).items()):
            benchmark = name.startswith("run_") and name != "run_report"
            if benchmark or name.endswith("_section") or name.startswith("plot_"):
                patch.setattr(report, name, self._stand_in(name, real))
        tune = report.tune_allocator

        def tune_allocator() -> int | None:
            self.calls.append("tune_allocator")
            return tune()

        patch.setattr(report, "tune_allocator", tune_allocator)

    def _stand_in(self, name: str, real):
        signature = inspect.signature(real)

        def stand_in(*args, **kwargs):
            self.calls.append(name)
            given = _jsonable(signature.bind(*args, **kwargs).arguments)
            if name.endswith("_section"):
                return f"## {name}\n\n{json.dumps(given)}"
            if name.startswith("plot_"):
                Path(given.pop("path")).write_text(json.dumps(given))
                return None
            return {"stand_in": name, **given}

        return stand_in


def token(runner: str, **given: object) -> dict:
    """What the stand-in for ``runner`` returns when called with ``given``."""
    return {"stand_in": runner, **_jsonable(given)}


@dataclass
class Composed:
    """One ``run_report`` with stand-ins: where it wrote, what it returned, the calls it
    made, and why the TorchRec comparison was skipped (None: it ran)."""

    out: Path
    record: dict
    calls: list[str]
    quick: bool
    skipped: str | None


# Each mode of the report: run_report's arguments, and what stands in for torchrec_missing
# (None: the real one, so the comparison runs or is skipped as this environment allows).
MODES = {
    "quick": ({"quick": True}, None),
    "full": ({"quick": False}, None),
    "quick, --no-torchrec": ({"quick": True, "torchrec": False}, None),
    "quick, torchrec not importable": ({"quick": True}, NOT_IMPORTED),
}


@pytest.fixture(scope="module", params=list(MODES))
def composed(request, tmp_path_factory) -> Composed:
    kwargs, missing = MODES[request.param]
    out = tmp_path_factory.mktemp("report")
    with pytest.MonkeyPatch.context() as patch:
        stand_ins = StandIns(patch)
        if missing is not None:
            patch.setattr(report, "torchrec_missing", lambda: missing)
        record = run_report(out, **kwargs)
    if not kwargs.get("torchrec", True):
        skipped = "not requested (torchrec=False)"
    else:
        skipped = missing or torchrec_missing()
    return Composed(out, record, stand_ins.calls, kwargs["quick"], skipped)


def expected_records(composed: Composed) -> dict:
    """Each benchmark's record: the token of the runner that ``run_report`` calls for it, at
    the quick sizes in a quick report and at the runner's own (full) sizes otherwise."""
    quick = composed.quick
    ingest = INGEST_QUICK if quick else {}
    return {
        "ingest": token("run_ingest_benchmark", **ingest),
        # A team's layout (string IDs, lists, weights): the jagged path.
        "ingest_logs": token("run_ingest_benchmark", **ingest, shape=LOGS_SHAPE),
        "kernels": token("run_kernel_benchmark", quick=quick),
        "train": token("run_train_benchmark", quick=quick),
        "step": token("run_step_benchmark", quick=quick),
        "tiered": token("run_tiered_benchmark", quick=quick),
        "readers": token("run_readers_benchmark", **(READERS_QUICK if quick else {})),
        "ingest_days": token("run_ingest_days_benchmark", quick=quick),
        "precision": token("run_precision_benchmark", quick=quick),
        "torchrec": (
            token("run_torchrec_comparison", quick=quick)
            if composed.skipped is None
            else {"skipped": composed.skipped}
        ),
    }


def test_report_json_holds_every_benchmarks_record_as_returned(composed):
    record = composed.record
    assert json.loads((composed.out / "report.json").read_text()) == _jsonable(record)
    expected = expected_records(composed)
    assert set(record) == set(expected) | REPORT_KEYS
    assert {key: record[key] for key in expected} == expected
    assert record["quick"] is composed.quick and record["seconds"] > 0
    assert record["noise"] == NOISE_NOTE and record["plots"] == sorted(PLOTS.values())
    assert record["machine"]["cpu_count"] >= 1


def test_report_md_is_a_header_then_each_benchmarks_section_of_its_record(composed):
    record = composed.record
    markdown = (composed.out / "report.md").read_text()
    header, *parts = markdown.removesuffix("\n").split("\n\n## ")
    title, machine = header.split("\n\n")
    quick = " (quick: tiny sizes, not speed)" if composed.quick else ""
    assert title == f"# dlrmflow benchmark report{quick}"
    assert f"{record['machine']['cpu_count']} CPUs" in machine and machine.endswith(NOISE_NOTE)
    sections = [
        (name, json.loads(given)) for name, _, given in (p.partition("\n\n") for p in parts)
    ]
    comparison = None if composed.skipped is not None else record["torchrec"]
    assert sections == [
        ("ingest_section", {"record": record["ingest"]}),
        ("ingest_section", {"record": record["ingest_logs"]}),
        ("kernels_section", {"record": record["kernels"]}),
        ("train_section", {"record": record["train"]}),
        ("step_section", {"record": record["step"]}),
        ("tiered_section", {"record": record["tiered"]}),
        ("readers_section", {"record": record["readers"]}),
        ("ingest_days_section", {"record": record["ingest_days"]}),
        ("precision_section", {"record": record["precision"]}),
        ("torchrec_section", {"record": comparison, "missing": composed.skipped}),
    ]


def test_every_plot_is_drawn_from_the_records_it_shows(composed):
    record = composed.record
    comparison = None if composed.skipped is not None else record["torchrec"]
    drawn = {name: json.loads((composed.out / file).read_text()) for name, file in PLOTS.items()}
    assert drawn == {
        "throughput": {"record": record["train"], "comparison": comparison},
        "bytes": {"record": record["train"]},
        "cache": {"record": record["tiered"]},
    }


def test_the_comparison_runs_where_torchrec_imports_and_was_asked_for(composed):
    ran = "run_torchrec_comparison" in composed.calls
    assert ran is (composed.skipped is None)
    if composed.skipped is not None:
        assert composed.record["torchrec"] == {"skipped": composed.skipped}


def test_the_allocator_is_tuned_before_any_benchmark_runs(composed):
    # The in-process benchmarks (tiered too) run under the setting the CLI's would.
    assert composed.calls[0] == "tune_allocator"
    assert composed.calls.count("tune_allocator") == 1


def test_the_docs_render_every_benchmark_of_the_report(composed):
    documented = {key for key, *_ in BENCHMARKS}
    benchmarks = set(composed.record) - REPORT_KEYS
    assert benchmarks <= documented  # each has its section in docs/benchmarks.md
    assert documented - OPTIONAL <= benchmarks  # and write_docs takes the report


def test_skipped_comparison_says_why():
    section = torchrec_section(None, NOT_IMPORTED)
    assert section.startswith("## TorchRec comparison")
    assert f"Skipped: {NOT_IMPORTED}." in section
    assert "|" not in section


def test_table_rows_read_back_the_tables_the_report_writes():
    text = "\n\n".join(
        [
            "## A section",
            markdown_table(["name", "value"], [["a", 1], ["b", 2.5]]),
            "Between the tables.",
            markdown_table(["other"], [["c"]]),
        ]
    )
    assert table_rows(text) == [["a", "1"], ["b", "2.5"], ["c"]]


# -- the tiered-cache benchmark ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiered() -> dict:
    return run_tiered_benchmark(quick=True)


def test_tiered_record_has_sane_hit_rates(tiered):
    runs = tiered["results"].values()
    need = 2 * tiered["max_distinct_rows_per_batch"]
    assert all(need <= r["cache_rows"] <= tiered["config"]["table_rows"] for r in runs)
    assert all(0 < r["hit_rate"] <= 1 and r["samples_per_s"] > 0 for r in runs)
    for r in runs:
        if r["prefetch"]:
            # Every timed batch was prefetched whole: its forward found all its rows.
            assert r["hit_rate"] == 1.0 and r["prefetched_per_step"] > 0
    lru = sorted(
        (r["cache_rows"], r["hit_rate"], r["evictions_per_step"]) for r in runs if not r["prefetch"]
    )
    # The cache that holds every row only misses rows never seen: no smaller one does better.
    assert lru[-1][2] == 0 and all(hit <= lru[-1][1] for _, hit, _ in lru)
    assert lru[0][2] > 0  # the smallest cache does evict
    assert set(tiered["ratios"]) == set(tiered["results"])


def test_the_tiered_section_has_the_baseline_and_a_row_per_cache_size_and_mode(tiered):
    section = report_section(tiered_section, tiered)
    assert section.startswith("## Tiered embeddings")
    rows = table_rows(section)
    runs = list(tiered["results"].values())
    assert len(runs) >= 4 and rows[0][0] == "in-memory TBE (baseline, median)"
    assert [row[:2] for row in rows[1:]] == [
        ["prefetch" if r["prefetch"] else "LRU", f"{r['cache_rows']:,}"] for r in runs
    ]
    assert f"]({PLOTS['cache']})" in section  # the plot is shown in the report


def test_the_cache_plot_is_a_valid_png(tiered, tmp_path):
    path = tmp_path / PLOTS["cache"]
    plot_cache(tiered, path)
    check_plot(path)


# -- the documents generated from a report's JSON ------------------------------------------


def test_docs_are_generated_from_the_report_json(tmp_path):
    # A report as `bench report --quick` leaves it: the committed report's records, marked
    # quick. (Each benchmark's section of a fresh record is checked in its own test file.)
    record = {**json.loads(COMMITTED_REPORT.read_text()), "quick": True}
    report_json = tmp_path / "report" / "report.json"
    report_json.parent.mkdir()
    report_json.write_text(json.dumps(record))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{RESULTS_START}\nold figures\n{RESULTS_END}\n\nafter\n")
    write_docs(report_json, tmp_path / "docs", readme)
    assert json.loads((tmp_path / "docs" / "benchmarks.json").read_text()) == record
    markdown = (tmp_path / "docs" / "benchmarks.md").read_text()
    titles = [title for key, title, *_ in BENCHMARKS if key in record]
    for title in titles:
        assert f"\n## {title}\n" in markdown, title
    assert markdown.count("### How it runs") == len(titles) and "Quick run" in markdown
    text = readme.read_text()
    assert "old figures" not in text and text.endswith("after\n")
    ratio = record["ingest"]["ratios"]["reader_transform_vs_pyarrow_decode_1w"]
    row = "| Ingest | `reader_transform_vs_pyarrow_decode_1w` | pyarrow decode, same threads |"
    assert f"{row} {ratio:.2f} |" in text


def test_an_older_logs_record_keeps_the_plain_strings_headline():
    """Records from before the baseline read dictionaries: ours read them alone, so the
    fairer figure was every string decoded plain on both sides."""
    from dlrmflow.bench.docs import _ingest_headline

    older = {
        "results": {"workers_1": {"pyarrow_decode_rows_per_s": 1.0}},
        "ratios": {
            "reader_transform_vs_pyarrow_decode_1w": 0.7,
            "reader_transform_plain_strings_vs_pyarrow_decode_1w": 0.5,
        },
    }
    assert [k for k in older["ratios"] if _ingest_headline(older, k)] == [
        "reader_transform_plain_strings_vs_pyarrow_decode_1w"
    ]
    newer = json.loads(json.dumps(older))
    newer["results"]["workers_1"]["pyarrow_decode_dictionaries_rows_per_s"] = 2.0
    assert [k for k in newer["ratios"] if _ingest_headline(newer, k)] == [
        "reader_transform_vs_pyarrow_decode_1w"
    ]
