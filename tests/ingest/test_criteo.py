"""The raw Criteo converter, checked against an independent per-line parse of real rows."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest

from dlrmflow.ingest.criteo.convert import MalformedDataError, convert_criteo, day_file_name
from dlrmflow.ingest.criteo.landing import convert_landed
from dlrmflow.ingest.criteo.tsv import MAX_LINE_BYTES
from dlrmflow.ingest.lock import DatasetBusy
from dlrmflow.ingest.manifest import read_manifest
from dlrmflow.ingest.schema import DENSE, SPARSE, criteo_schema
from tests.ingest.digests import content_digest
from tests.ingest.test_synthetic import HOLD_DATASET


@pytest.fixture(scope="module")
def sample(criteo_sample: Path) -> Path:
    return criteo_sample


def sample_lines(sample: Path) -> list[str]:
    return sample.read_text().splitlines()


def reference_row(line: str) -> dict[str, int | None]:
    """The test's own reading of one raw line: what the converter must produce."""
    fields = line.split("\t")
    assert len(fields) == 40
    row: dict[str, int | None] = {"label": int(fields[0])}
    row |= {name: int(v) if v else None for name, v in zip(DENSE, fields[1:14], strict=True)}
    row |= {name: int(v, 16) if v else None for name, v in zip(SPARSE, fields[14:], strict=True)}
    return row


def day_path(out: str | Path, day: int = 0) -> str:
    """Day ``day``'s file, as the manifest lists it."""
    return read_manifest(str(out)).day_paths(str(out), [day])[0]


def day_rows(out: str | Path, day: int = 0) -> list[dict[str, int | None]]:
    with fsspec.open(day_path(out, day), "rb") as f:
        return pq.read_table(f).to_pylist()


def quarantine_records(url: str) -> list[dict[str, object]]:
    with fsspec.open(url, "r") as f:
        return [json.loads(line) for line in f]


def test_sample_converts_to_exact_values(sample: Path, tmp_path: Path) -> None:
    lines = sample_lines(sample)
    result = convert_criteo([str(sample)], str(tmp_path))

    assert (result.rows, result.bad_lines, result.quarantine) == (200, 0, None)
    table = pq.read_table(day_path(tmp_path))
    assert table.schema.equals(criteo_schema())
    got = table.to_pylist()
    assert got == [reference_row(line) for line in lines]
    # The sample really exercises missing values and negative counts.
    assert sum(v is None for row in got for v in row.values()) > 1000
    assert min(row["I2"] for row in got if row["I2"] is not None) == -1
    assert {row["C1"] for row in got} >= {0x05DB9164, 0x68FD1E64}

    manifest = read_manifest(str(tmp_path))
    positives = sum(row["label"] for row in got)
    assert manifest.source == "criteo"
    assert (manifest.rows, manifest.days, manifest.test_day) == (200, 1, 0)
    assert manifest.positive_rate == pytest.approx(positives / 200)
    assert [(f.day, f.path, f.rows) for f in manifest.files] == [
        (0, f"day=0/{day_file_name(str(sample), 65_536)}", 200)
    ]
    path = day_path(tmp_path)
    assert manifest.files[0].bytes == Path(path).stat().st_size
    assert manifest.files[0].digest == content_digest(path)
    assert manifest.schema_ == [{"name": f.name, "type": str(f.type)} for f in criteo_schema()]
    assert manifest.cardinalities is None and manifest.bayes_auc is None
    assert manifest.generator is not None and manifest.generator["inputs"] == [str(sample)]


def test_inputs_become_days_and_gzip_is_read(sample: Path, tmp_path: Path) -> None:
    plain = tmp_path / "day_0.tsv"
    plain.write_bytes(sample.read_bytes())
    packed = tmp_path / "day_1.tsv.gz"
    packed.write_bytes(gzip.compress(sample.read_bytes()))
    out = tmp_path / "out"

    result = convert_criteo([str(plain), str(packed)], str(out))

    assert result.rows == 400
    manifest = result.manifest
    assert (manifest.days, manifest.test_day) == (2, 1)
    assert [(f.day, f.rows) for f in manifest.files] == [(0, 200), (1, 200)]
    expected = [reference_row(line) for line in sample_lines(sample)]
    assert day_rows(out, 0) == expected
    assert day_rows(out, 1) == expected


def test_field_boundaries(tmp_path: Path) -> None:
    """Extremes that must convert, and near misses that must be rejected."""
    names = ["label", *DENSE, *SPARSE]

    def line(**fields: str) -> str:
        values = dict.fromkeys(names, "") | {"label": "1"} | fields
        return "\t".join(values[n] for n in names)

    good = [
        line(I1="2147483647", I2="-2147483648", I3="-0", I4="007", I5="-000000000000042"),
        line(label="0", C1="7fffffffffffffff", C2="00000000000000000000ABCDEF", C3="0"),
    ]
    bad = [
        (line(I1="2147483648"), "I1: '2147483648' not in int32"),
        (line(I1="12345678901"), "I1: '12345678901' not in int32"),
        (line(I2="-2147483649"), "I2: '-2147483649' not in int32"),
        (line(I3="-"), "I3: bad integer '-'"),
        (line(I4="+5"), "I4: bad integer '+5'"),
        (line(I5="1.0"), "I5: bad integer '1.0'"),
        (line(C1="8000000000000000"), "C1: hex '8000000000000000' not in int64"),
        (line(C2="-1"), "C2: bad hex '-1'"),
        (line(C3="0x1f"), "C3: bad hex '0x1f'"),
        (line(C4="1" * 33), f"C4: bad hex '{'1' * 33}'"),
        (line(label="", I1="x", C26="g"), "label: must be 0 or 1, got ''; I1: bad integer 'x'; "
         "C26: bad hex 'g'"),
    ]  # fmt: skip
    src = tmp_path / "edges.tsv"
    src.write_text("\n".join(good + [text for text, _ in bad]) + "\n")

    result = convert_criteo([str(src)], str(tmp_path / "out"), max_bad_fraction=1.0)

    rows = day_rows(tmp_path / "out")
    assert [rows[0][n] for n in ("label", "I1", "I2", "I3", "I4", "I5", "I6")] == [
        1, 2**31 - 1, -(2**31), 0, 7, -42, None,
    ]  # fmt: skip
    assert [rows[1][n] for n in ("label", "C1", "C2", "C3", "C4")] == [
        0, 2**63 - 1, 0xABCDEF, 0, None,
    ]  # fmt: skip
    records = quarantine_records(result.quarantine_files[0])
    assert [(r["line"], r["reason"], r["text"]) for r in records] == [
        (3 + i, reason, text) for i, (text, reason) in enumerate(bad)
    ]


def malformed_file(sample: Path, path: Path) -> tuple[list[str], dict[int, tuple[str, str]]]:
    """The sample with broken lines put in; returns the good lines and {line: (reason, text)}."""
    lines = sample_lines(sample)
    fields = [line.split("\t") for line in lines]
    short = "\t".join(fields[3][:39])
    wide = "\t".join(fields[4] + ["1"])
    bad_int = "\t".join(fields[5][:5] + ["x1"] + fields[5][6:])
    bad_hex = "\t".join(fields[6][:16] + ["zz12"] + fields[6][17:])
    bad_label = "\t".join(["2"] + fields[7][1:])
    injected = {
        2: ("expected 40 fields, got 39", short),
        3: ("expected 40 fields, got 41", wide),
        50: ("I5: bad integer 'x1'", bad_int),
        51: ("empty line", ""),
        120: ("C3: bad hex 'zz12'", bad_hex),
        121: ("expected 40 fields, got 39", short),
        199: ("label: must be 0 or 1, got '2'", bad_label),
        208: ("expected 40 fields, got 41", wide),  # the last line
    }
    out, good = [], iter(lines)
    for number in range(1, len(lines) + len(injected) + 1):
        out.append(injected[number][1] if number in injected else next(good))
    path.write_text("\n".join(out) + "\n")
    return lines, injected


def test_malformed_lines_are_quarantined_with_line_numbers(sample: Path, tmp_path: Path) -> None:
    src = tmp_path / "broken.tsv"
    lines, injected = malformed_file(sample, src)
    day_file = tmp_path / "out" / "day=0" / day_file_name(str(src), 65_536)
    seen: list[tuple[int, bool]] = []

    # Small blocks: line numbers must stay right across many blocks and skipped lines.
    result = convert_criteo(
        [str(src)], str(tmp_path / "out"), max_bad_fraction=0.0385, block_size=2048,
        progress=lambda n: seen.append((n, day_file.exists())),
    )  # fmt: skip

    assert (result.rows, result.bad_lines) == (200, len(injected))
    assert sum(n for n, _ in seen) == 200 + len(injected) and len(seen) > 10
    # A day file only appears under its real name once it is complete.
    assert not any(exists for _, exists in seen) and day_file.exists()
    assert result.quarantine == str(tmp_path / "out" / "_quarantine")
    assert result.quarantine_files == [str(tmp_path / "out" / "_quarantine" / "broken.tsv.jsonl")]
    records = quarantine_records(result.quarantine_files[0])
    assert [(r["line"], r["reason"], r["text"]) for r in records] == [
        (number, reason, text) for number, (reason, text) in sorted(injected.items())
    ]
    assert {r["file"] for r in records} == {str(src)}
    assert day_rows(tmp_path / "out") == [reference_row(line) for line in lines]
    assert result.manifest.generator == {
        "inputs": [str(src)], "lines": [208], "bad_lines": [len(injected)],
    }  # fmt: skip


def test_too_many_malformed_lines_fail_and_leave_no_day_file(sample: Path, tmp_path: Path) -> None:
    src = tmp_path / "broken.tsv"
    malformed_file(sample, src)
    out = tmp_path / "out"
    (out).mkdir()
    (out / "manifest.json").write_text("{}")  # an earlier dataset's: stays as it was

    with pytest.raises(MalformedDataError) as info:
        convert_criteo([str(src)], str(out))
    with pytest.raises(MalformedDataError, match="8 malformed lines out of 208"):
        convert_criteo([str(src)], str(out), max_bad_fraction=0.038)  # 8 / 208 = 0.03846

    message = str(info.value)
    assert str(src) in message and "8 malformed lines out of 208" in message
    assert "max_bad_fraction=0.001" in message and "broken.tsv.jsonl" in message
    assert sorted(p.name for p in (out / "day=0").iterdir()) == []
    assert (out / "manifest.json").read_text() == "{}"
    assert len(quarantine_records(str(out / "_quarantine" / "broken.tsv.jsonl"))) == 8


def test_non_utf8_field_is_quarantined(sample: Path, tmp_path: Path) -> None:
    fields = sample_lines(sample)[0].encode().split(b"\t")
    src = tmp_path / "latin.tsv"
    src.write_bytes(sample.read_bytes() + b"\t".join(fields[:14] + [b"\xe9t\xe9"] + fields[15:]))

    result = convert_criteo([str(src)], str(tmp_path / "out"), max_bad_fraction=0.01)

    assert (result.rows, result.bad_lines) == (200, 1)
    [record] = quarantine_records(result.quarantine_files[0])
    assert (record["line"], record["reason"]) == (201, "C1: bad hex '\\xe9t\\xe9'")


def truncated_gzip(sample: Path, path: Path) -> None:
    path.write_bytes(gzip.compress(sample.read_bytes())[:-20])


def not_gzip(sample: Path, path: Path) -> None:
    path.write_bytes(sample.read_bytes())


@pytest.mark.parametrize("make", [truncated_gzip, not_gzip])
def test_unreadable_input_fails_naming_the_file(
    sample: Path, tmp_path: Path, make: Callable[[Path, Path], None]
) -> None:
    """A damaged archive is no line's fault: nothing after the damage can be read."""
    src = tmp_path / "day_3.tsv.gz"
    make(sample, src)

    with pytest.raises(MalformedDataError, match=f"{src}: unreadable input"):
        convert_criteo([str(src)], str(tmp_path / "out"), max_bad_fraction=1.0)
    assert list((tmp_path / "out" / "day=0").iterdir()) == []


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


LONG = 3 * MAX_LINE_BYTES + 5


def junk_lines(sample: Path) -> dict[str, tuple[bytes, str, str]]:
    """Malformed lines by kind: {kind: (raw line without its break, reason, quarantined text)}."""
    fields = sample_lines(sample)[9].encode().split(b"\t")
    binary = bytes(b for b in range(256) if b != ord("\n")) * 3  # NUL, \t, \r, \xff, ...
    split_by_cr = b"\t".join(fields[:20]) + b"\r" + b"\t".join(fields[20:])
    cr_in_field = b"\t".join(fields[:3] + [fields[3] + b"\r"] + fields[4:])
    nul_in_field = b"\t".join(
        fields[:14] + [fields[14][:4] + b"\x00" + fields[14][4:]] + fields[15:]
    )
    long = (b"\x00\xff" + bytes(range(32, 127))) * (LONG // 97) + b"\t" * (LONG % 97)
    return {
        "not utf-8, wrong count": (b"\xff\xfe\t1", "expected 40 fields, got 2", "\\xff\\xfe\t1"),
        "binary": (binary, "expected 40 fields, got 4", _text(binary)),
        "NUL only": (b"\x00" * 50, "expected 40 fields, got 1", "\x00" * 50),
        "a field split by \\r": (split_by_cr, "expected 40 fields, got 39", _text(split_by_cr)),
        "\\r in a field": (
            cr_in_field,
            "a carriage return (\\r) inside the line",
            _text(cr_in_field),
        ),
        "NUL in an ID": (
            nul_in_field,
            f"C1: bad hex '{_text(fields[14][:4])}\x00{_text(fields[14][4:])}'",
            _text(nul_in_field),
        ),
        "empty": (b"", "empty line", ""),
        "\\r\\n only": (b"\r", "empty line", ""),  # "\r\n" is a line break
        "long": (
            long,
            f"line of {LONG} bytes, longer than the {MAX_LINE_BYTES} a Criteo line can be",
            _text(long[:1024]) + "...",
        ),
    }


def with_junk(
    sample: Path, path: Path, junk: bytes, at: list[int], end: bytes = b"\n"
) -> list[int]:
    """The sample with ``junk`` as lines ``at`` (1-based), the file ending in ``end``;
    returns the junk's line numbers."""
    lines = [line.encode() for line in sample_lines(sample)]
    for number in sorted(at):
        lines.insert(number - 1, junk)
    path.write_bytes(b"\n".join(lines) + end)
    return sorted(at)


@pytest.mark.parametrize("block_size", [1024, 1 << 24])  # a line spans blocks / one block
@pytest.mark.parametrize(
    "kind", list(junk_lines(Path(__file__).parents[1] / "data" / "criteo_sample_200.tsv"))
)
def test_any_malformed_line_is_quarantined_and_counted(
    sample: Path, tmp_path: Path, kind: str, block_size: int
) -> None:
    """Whatever bytes a line holds, it is one bad line: never the end of the file."""
    junk, reason, text = junk_lines(sample)[kind]
    src = tmp_path / "junk.tsv"
    numbers = with_junk(sample, src, junk, at=[1, 77, 78, 150, 204])

    result = convert_criteo(
        [str(src)], str(tmp_path / "out"), max_bad_fraction=0.1, block_size=block_size
    )

    assert (result.rows, result.bad_lines) == (200, 5)
    assert result.manifest.generator is not None
    assert result.manifest.generator["lines"] == [205]
    records = quarantine_records(result.quarantine_files[0])
    assert [(r["line"], r["reason"], r["text"]) for r in records] == [
        (n, reason, text) for n in numbers
    ]
    assert day_rows(tmp_path / "out") == [reference_row(line) for line in sample_lines(sample)]


@pytest.mark.parametrize("kind", ["binary", "long", "not utf-8, wrong count"])
def test_file_may_end_without_a_line_break(sample: Path, tmp_path: Path, kind: str) -> None:
    junk, reason, text = junk_lines(sample)[kind]
    good, bad = tmp_path / "good.tsv", tmp_path / "bad.tsv"
    good.write_bytes(sample.read_bytes().rstrip(b"\n"))  # a good last line, no break
    with_junk(sample, bad, junk, at=[201], end=b"")  # a junk last line, no break
    expected = [reference_row(line) for line in sample_lines(sample)]

    for block_size in (1024, 1 << 24):
        out = tmp_path / f"good-{block_size}"
        result = convert_criteo([str(good)], str(out), block_size=block_size, max_bad_fraction=0)
        assert (result.rows, day_rows(out)) == (200, expected)

        out = tmp_path / f"bad-{block_size}"
        result = convert_criteo([str(bad)], str(out), block_size=block_size, max_bad_fraction=0.01)
        assert (result.rows, day_rows(out)) == (200, expected)
        assert quarantine_records(result.quarantine_files[0]) == [
            {"file": str(bad), "line": 201, "reason": reason, "text": text}
        ]


def test_crlf_line_breaks_are_line_breaks(sample: Path, tmp_path: Path) -> None:
    src = tmp_path / "dos.tsv"
    src.write_bytes(sample.read_bytes().replace(b"\n", b"\r\n"))

    result = convert_criteo([str(src)], str(tmp_path / "out"), max_bad_fraction=0.0)

    assert (result.rows, result.bad_lines) == (200, 0)
    assert day_rows(tmp_path / "out") == [reference_row(line) for line in sample_lines(sample)]


@pytest.mark.parametrize("kind", ["binary", "not utf-8, wrong count", "long", "empty"])
def test_malformed_lines_over_the_fraction_fail_with_the_counts(
    sample: Path, tmp_path: Path, kind: str
) -> None:
    junk, _, _ = junk_lines(sample)[kind]
    src = tmp_path / "junk.tsv"
    with_junk(sample, src, junk, at=list(range(1, 250, 2))[:23])  # 23 of 223 lines: 10.3%

    with pytest.raises(MalformedDataError) as info:
        convert_criteo([str(src)], str(tmp_path / "out"), max_bad_fraction=0.1)
    assert str(info.value).startswith(f"{src}: 23 malformed lines out of 223 (10.3139%) exceed ")
    assert "\n" not in str(info.value)
    assert len(quarantine_records(str(tmp_path / "out" / "_quarantine" / "junk.tsv.jsonl"))) == 23

    # One line fewer is within the fraction.
    with_junk(sample, src, junk, at=list(range(1, 250, 2))[:22])
    result = convert_criteo([str(src)], str(tmp_path / "out"), max_bad_fraction=0.1)
    assert (result.rows, result.bad_lines) == (200, 22)


def test_convert_command_counts_binary_lines(sample: Path, tmp_path: Path) -> None:
    """As a user runs it: a binary line is counted, and too many fail in one line."""
    junk, _, _ = junk_lines(sample)["binary"]
    command = [
        str(Path(sys.executable).parent / "dlrmflow"),
        "convert",
        "--max-bad-fraction",
        "0.1",
    ]
    few, many = tmp_path / "few.tsv", tmp_path / "many.tsv"
    with_junk(sample, few, junk, at=[3])
    with_junk(sample, many, junk, at=list(range(1, 100, 3)))  # 33 of 233

    ok = subprocess.run(
        [*command, "--input", str(few), "--out", str(tmp_path / "a")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["bad_lines"] == 1 and json.loads(ok.stdout)["rows"] == 200

    failed = subprocess.run(
        [*command, "--input", str(many), "--out", str(tmp_path / "b")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert failed.returncode == 1
    assert failed.stdout == ""
    assert failed.stderr.startswith(f"error: {many}: 33 malformed lines out of 233 ")
    assert failed.stderr.endswith("\n") and failed.stderr.count("\n") == 1


@pytest.mark.parametrize("block_size", [4096, 1 << 24])  # many blocks a group, many groups a block
def test_row_groups_have_the_requested_size(sample: Path, tmp_path: Path, block_size: int) -> None:
    convert_criteo([str(sample)], str(tmp_path), row_group_size=48, block_size=block_size)

    meta = pq.ParquetFile(day_path(tmp_path)).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [48, 48, 48, 48, 8]


def test_memory_output(sample: Path) -> None:
    out = f"memory://criteo-{uuid.uuid4().hex}"
    try:
        result = convert_criteo([str(sample)], out)
        assert read_manifest(out) == result.manifest
        assert day_rows(out) == [reference_row(line) for line in sample_lines(sample)]
    finally:
        fsspec.filesystem("memory").rm(out, recursive=True)


def test_bad_arguments_are_rejected(sample: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no input files"):
        convert_criteo([], str(tmp_path))
    with pytest.raises(ValueError, match="max_bad_fraction"):
        convert_criteo([str(sample)], str(tmp_path), max_bad_fraction=1.5)
    with pytest.raises(ValueError, match="distinct file names"):
        convert_criteo([str(sample), str(sample)], str(tmp_path))


@pytest.mark.parametrize("how", ["convert", "landing"])
def test_a_conversion_into_a_dataset_another_writer_holds_is_refused(criteo_sample, tmp_path, how):
    """Conversions lock the dataset folder as generate does (see test_synthetic): while
    another process holds it, they fail at once naming it and write nothing."""
    out = tmp_path / "data"
    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "day_0.tsv").write_bytes(criteo_sample.read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "DLRMFLOW_HELD_RUN_DIRS"}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_DATASET, str(out)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(DatasetBusy, match=rf"in use by pid {holder.pid} .*another writer"):
            if how == "convert":
                convert_criteo([str(landing / "day_0.tsv")], str(out))
            else:
                convert_landed(str(landing), str(out))
    finally:
        holder.kill()
        holder.wait()
    assert not list(out.glob("day=*")) and not (out / "manifest.json").exists()
