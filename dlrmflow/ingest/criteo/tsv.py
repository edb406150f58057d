r"""Raw Criteo TSV bytes -> Arrow columns, in blocks of whole lines, with the malformed lines.

Days are tens of GB, so a file is streamed in blocks of whole lines (``read_lines``): numpy
finds the line breaks and the few lines pyarrow's CSV parser must not see, the parser
splits the rest into fields (every field read as raw bytes: ``split_fields``), and each
block is validated and converted on whole columns with numpy (``convert_block``); no Python
code runs per line except for the rare malformed ones.

Lines are what ``\n`` ends (a ``\r`` just before it is part of the break; the last line
may end the file without one), numbered from 1 as any text tool numbers them. Whatever a
line holds, it is converted or comes back as a ``BadLine``, never the end of the file: a
wrong field count, an empty line, bytes that are not UTF-8, NUL bytes, a ``\r`` inside the
line (which the CSV parser would take for a line break), a line too long to be Criteo's
(longer than ``MAX_LINE_BYTES``: read past, never held whole), a bad label, integer or hex
ID. What becomes of them (the quarantine, the run's limit) is ``convert``'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from dlrmflow.ingest.schema import DENSE, LABEL, SPARSE, criteo_schema

FIELDS = (LABEL, *DENSE, *SPARSE)

# A valid line is at most 40 fields of _MAX_FIELD_CHARS, so a line this long is garbage (a
# binary file, a missing line break): it is quarantined, with its first _SHOWN_BYTES bytes,
# and read past without being held whole.
MAX_LINE_BYTES = 1 << 16
_SHOWN_BYTES = 1024
_LF, _CR = ord("\n"), ord("\r")

# Longer fields are rejected unparsed: no valid count or ID is this long, and the digit
# matrices below are (rows x longest field) wide, so one garbage field must not size them.
_MAX_FIELD_CHARS = 32
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

# Per-field error codes, turned into reasons only for the rows that have them.
_OK, _BAD, _RANGE = 0, 1, 2

# Byte -> digit value; 255 marks a byte that is not a digit of the base.
_DEC_VALUE = np.full(256, 255, np.uint8)
_DEC_VALUE[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX_VALUE = np.full(256, 255, np.uint8)
_HEX_VALUE[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16)
_HEX_VALUE[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)
_POW10 = 10 ** np.arange(9, -1, -1, dtype=np.int64)  # place values of the last 10 digits
_HIGH_BITS = np.uint64(0x8080808080808080)  # set in a byte only if it is 255 (not a digit)


@dataclass
class BadLine:
    """A malformed line: its number, why it is malformed, and its text (as the quarantine
    records it)."""

    line: int  # 1-based physical line number in the input file
    reason: str
    text: str


@dataclass
class _Lines:
    r"""Whole lines of an input: ``data`` holds lines ``first``, ``first + 1``, ... (each
    ending in ``\n``, except the file's last line if the file does not end in one);
    ``bad`` are lines already found malformed, numbered after ``data``'s."""

    first: int
    data: bytes
    bad: list[BadLine] = field(default_factory=list)


def read_lines(src: IO[bytes], block_size: int) -> Iterator[_Lines]:
    """The lines of ``src``, whole, about ``block_size`` bytes at a time.

    A line longer than ``MAX_LINE_BYTES`` is never held whole: once the unfinished line
    after a block grows past it, the rest of the line is read past and the line comes back
    as a bad one, with its first ``_SHOWN_BYTES`` bytes.
    """
    number = 1  # of the next line to come back
    carry = b""  # the start of a line whose end has not been read yet
    while chunk := src.read(block_size):
        data = carry + chunk
        end = data.rfind(b"\n") + 1
        carry = data[end:]
        if end:
            block = _Lines(number, data[:end])
            number += block.data.count(b"\n")
            yield block
        if len(carry) > MAX_LINE_BYTES:
            shown, size = carry[:_SHOWN_BYTES], len(carry)
            carry = b""
            while chunk := src.read(block_size):
                newline = chunk.find(b"\n")
                if newline >= 0:
                    size, carry = size + newline, chunk[newline + 1 :]
                    break
                size += len(chunk)
            yield _Lines(number, b"", [BadLine(number, _too_long(size), _text(shown) + "...")])
            number += 1
    if carry:
        yield _Lines(number, carry)


def _too_long(size: int) -> str:
    return f"line of {size} bytes, longer than the {MAX_LINE_BYTES} a Criteo line can be"


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


def split_fields(block: _Lines) -> tuple[pa.RecordBatch, np.ndarray, list[BadLine]]:
    r"""Split a block's lines into raw fields.

    Returns a batch of the lines that have 40 fields (every field as bytes, empty as b""),
    their line numbers, and the lines that do not (with ``block.bad``). numpy finds every
    line that pyarrow's CSV parser must not see, because it would misread or reject it:
    empty lines (read as 40 empty fields), over-long ones, and those holding a ``\r`` (a
    line break to the parser) or bytes that are not UTF-8 (which the parser decodes, and
    fails on, to report a wrong field count). Those few are judged here, line by line; the
    parser reports the rest with a wrong field count.
    """
    buf = np.frombuffer(block.data, np.uint8)
    ends = np.flatnonzero(buf == _LF)  # where each line's break is
    if len(buf) and buf[-1] != _LF:
        ends = np.append(ends, len(buf))  # the last line, ending the file without a break
    starts = np.empty_like(ends)
    starts[:1] = 0
    starts[1:] = ends[:-1] + 1
    # A "\r\n" break: the \r is not part of the line (and the parser takes it as a break).
    stops = ends - ((ends > starts) & (buf[ends - 1] == _CR))
    lengths = stops - starts
    numbers = block.first + np.arange(len(ends), dtype=np.int64)

    odd_bytes = np.flatnonzero((buf == _CR) | (buf >= 0x80))
    odd_lines = np.searchsorted(ends, odd_bytes)
    odd_lines = odd_lines[odd_bytes != stops[odd_lines]]  # not the \r of a "\r\n"
    suspects = np.union1d(odd_lines, np.flatnonzero((lengths == 0) | (lengths > MAX_LINE_BYTES)))
    bad = list(block.bad)
    dropped = []
    for i in suspects.tolist():
        raw = block.data[starts[i] : stops[i]]
        reason = _line_reason(raw)
        if reason is not None:
            text = _text(raw) if len(raw) <= MAX_LINE_BYTES else _text(raw[:_SHOWN_BYTES]) + "..."
            bad.append(BadLine(int(numbers[i]), reason, text))
            dropped.append(i)
    data: bytes | memoryview = block.data
    if dropped:
        # Few lines go: copy the stretches between them.
        view, pieces, at = memoryview(block.data), [], 0
        for i in dropped:
            pieces.append(view[at : int(starts[i])])
            at = int(ends[i]) + 1
        pieces.append(view[at:])
        data = b"".join(pieces)
        numbers = np.delete(numbers, dropped)

    wrong_count: list[Any] = []  # the parser's rows with a field count other than 40

    def on_wrong_count(row: Any) -> str:
        wrong_count.append(row)
        return "skip"

    if len(data):
        table = pacsv.read_csv(
            pa.py_buffer(data),
            read_options=pacsv.ReadOptions(
                column_names=list(FIELDS),
                use_threads=False,  # only then does the parser know line numbers
                block_size=len(data) + 1,  # one block: no line straddles two
            ),
            parse_options=pacsv.ParseOptions(
                delimiter="\t",
                quote_char=False,  # Criteo has no quoting: a quote is just a bad value
                ignore_empty_lines=False,
                invalid_row_handler=on_wrong_count,
            ),
            convert_options=pacsv.ConvertOptions(
                column_types=dict.fromkeys(FIELDS, pa.binary()), strings_can_be_null=False
            ),
        ).combine_chunks()
        batch = table.to_batches()[0] if table.num_rows else _empty_fields()
    else:
        batch = _empty_fields()
    if wrong_count:
        index = np.array([row.number - 1 for row in wrong_count], dtype=np.int64)
        bad += [
            BadLine(int(numbers[i]), _wrong_count(row.actual_columns), row.text)
            for i, row in zip(index.tolist(), wrong_count, strict=True)
        ]
        numbers = np.delete(numbers, index)
    if len(numbers) != batch.num_rows:  # the parser split lines differently: a bug here
        raise AssertionError(f"{batch.num_rows} rows parsed from {len(numbers)} lines")
    return batch, numbers, bad


def _line_reason(raw: bytes) -> str | None:
    r"""Why a line (without its break) the CSV parser must not see is malformed, or None
    for one it can take: 40 fields, no ``\r`` (bad bytes in a field are that field's
    error, found with the others)."""
    if not raw:
        return "empty line"
    if len(raw) > MAX_LINE_BYTES:
        return _too_long(len(raw))
    fields = raw.count(b"\t") + 1
    if fields != len(FIELDS):
        return _wrong_count(fields)
    if b"\r" in raw:
        return "a carriage return (\\r) inside the line"
    return None


def _wrong_count(fields: int) -> str:
    return f"expected {len(FIELDS)} fields, got {fields}"


def _empty_fields() -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=pa.schema([(f, pa.binary()) for f in FIELDS]))


def convert_block(
    batch: pa.RecordBatch, line_numbers: np.ndarray
) -> tuple[pa.Table, list[BadLine]]:
    """Parse one block of raw fields; returns the valid rows and the malformed ones."""
    columns = [batch.column(i) for i in range(len(FIELDS))]
    labels, label_error = _parse_label(columns[0])
    dense = [_parse_int32(c) for c in columns[1 : 1 + len(DENSE)]]
    sparse = [_parse_hex64(c) for c in columns[1 + len(DENSE) :]]
    errors = np.stack([label_error] + [p[2] for p in dense] + [p[2] for p in sparse], axis=1)
    ok = ~errors.any(axis=1)

    arrays = [pa.array(labels[ok], pa.int8())]
    for values, present, _ in dense:
        arrays.append(pa.array(values[ok].astype(np.int32), pa.int32(), mask=~present[ok]))
    for values, present, _ in sparse:
        arrays.append(pa.array(values[ok], pa.int64(), mask=~present[ok]))
    table = pa.Table.from_arrays(arrays, schema=criteo_schema())
    if ok.all():
        return table, []
    bad_rows = np.flatnonzero(~ok)
    return table, _describe(
        batch.take(pa.array(bad_rows)), errors[bad_rows], line_numbers[bad_rows]
    )


def _describe(raw: pa.RecordBatch, errors: np.ndarray, line_numbers: np.ndarray) -> list[BadLine]:
    """Reasons and reconstructed text of malformed rows (few, so plain Python is fine)."""
    fields = [
        [v.decode("utf-8", "backslashreplace") for v in raw.column(i).to_pylist()]
        for i in range(len(FIELDS))
    ]
    bad = []
    for r, line in enumerate(line_numbers.tolist()):
        values = [column[r] for column in fields]
        reasons = [
            _reason(name, code, value)
            for name, code, value in zip(FIELDS, errors[r].tolist(), values, strict=True)
            if code != _OK
        ]
        bad.append(BadLine(line, "; ".join(reasons), "\t".join(values)))
    return bad


def _reason(name: str, code: int, value: str) -> str:
    shown = f"'{value}'" if len(value) <= 40 else f"'{value[:40]}...'"
    if name == LABEL:
        return f"label: must be 0 or 1, got {shown}"
    if name in DENSE:
        return f"{name}: bad integer {shown}" if code == _BAD else f"{name}: {shown} not in int32"
    return f"{name}: bad hex {shown}" if code == _BAD else f"{name}: hex {shown} not in int64"


def _parse_label(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Labels as int8 and an error code per row: exactly "0" or "1" is valid."""
    offsets, data = _raw(column)
    one_byte = np.diff(offsets) == 1
    digit = np.full(len(one_byte), 255, np.uint8)
    digit[one_byte] = _DEC_VALUE[data[offsets[:-1][one_byte]]]
    valid = digit <= 1
    return np.where(valid, digit, 0).astype(np.int8), np.where(valid, _OK, _BAD).astype(np.uint8)


def _parse_int32(column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Optionally negative decimal integers: values (int64), present mask, error codes."""
    offsets, data = _raw(column)
    lengths = np.diff(offsets)
    digits = _digits(offsets, data, _DEC_VALUE)
    rows, width = digits.shape
    # A leading '-' is a sign: note it, then read it as a leading zero.
    present = lengths > 0
    negative = np.zeros(rows, bool)
    negative[present] = data[offsets[:-1][present]] == ord("-")
    sign_rows = np.flatnonzero(negative & (lengths <= width))
    digits[sign_rows, width - lengths[sign_rows]] = 0
    bad = _has_invalid(digits) | (lengths > _MAX_FIELD_CHARS) | (negative & (lengths == 1))

    magnitude = digits[:, -10:].astype(np.int64) @ _POW10[-min(width, 10) :]
    values = np.where(negative, -magnitude, magnitude)
    out_of_range = (values < _INT32_MIN) | (values > _INT32_MAX)
    if width > 10:  # digits beyond the last 10 must be leading zeros
        out_of_range |= (digits[:, :-10] != 0).any(axis=1)
    return np.where(bad, 0, values), present, _codes(bad, out_of_range)


def _parse_hex64(column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hexadecimal IDs as int64: values, present mask, error codes.

    Right-aligned nibbles are packed two per byte and read as one big-endian integer per
    row, so the whole column converts in a few array operations.
    """
    offsets, data = _raw(column)
    lengths = np.diff(offsets)
    nibbles = _digits(offsets, data, _HEX_VALUE)
    width = nibbles.shape[1]
    bad = _has_invalid(nibbles) | (lengths > _MAX_FIELD_CHARS)

    low = nibbles[:, -16:] & 0x0F  # masking keeps bad rows' 255s inside a byte
    packed = np.ascontiguousarray((low[:, 0::2] << 4) | low[:, 1::2])
    unsigned = packed.view(f">u{packed.shape[1]}")[:, 0].astype(np.uint64)
    out_of_range = unsigned > np.uint64(np.iinfo(np.int64).max)
    if width > 16:  # nibbles beyond the last 16 must be leading zeros
        out_of_range |= (nibbles[:, :-16] != 0).any(axis=1)
    values = np.where(bad | out_of_range, np.uint64(0), unsigned).view(np.int64)
    return values, lengths > 0, _codes(bad, out_of_range)


def _codes(bad: np.ndarray, out_of_range: np.ndarray) -> np.ndarray:
    return np.where(bad, _BAD, np.where(out_of_range, _RANGE, _OK)).astype(np.uint8)


def _raw(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The offsets (as int64) and bytes of a binary column; the bytes are not copied."""
    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, np.int32)[column.offset : column.offset + len(column) + 1]
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.empty(0, np.uint8)
    return offsets.astype(np.int64), data


def _digits(offsets: np.ndarray, data: np.ndarray, table: np.ndarray) -> np.ndarray:
    """A (rows, width) matrix of each value's digit values, right-aligned, left-padded with 0.

    ``table`` maps each byte to its digit value (255: not a digit). Zero padding leaves a
    number's value unchanged, so every row is read positionally. The width is 8, 16 or 32,
    whichever first fits the longest value (a multiple of 8 for ``_has_invalid``). Values
    longer than ``_MAX_FIELD_CHARS`` are left as 0; callers reject them by length.
    """
    lengths = np.diff(offsets)
    longest = int(lengths.max(initial=0))
    width = next(w for w in (8, 16, _MAX_FIELD_CHARS) if w >= min(longest, _MAX_FIELD_CHARS))
    rows = len(lengths)
    values = table.take(data[offsets[0] : offsets[-1]])
    cells = np.zeros((rows, width), np.uint8)
    if 0 < longest <= _MAX_FIELD_CHARS and ((lengths == 0) | (lengths == longest)).all():
        # Fixed-width values (Criteo's 8-digit IDs) are already a matrix in the buffer.
        cells[lengths > 0, width - longest :] = values.reshape(-1, longest)
        return cells
    # Byte i of row r lands at cell r * width + width - (end_r - i) = i + shift_r; one
    # write per byte is faster than one read per cell (a row has no more bytes than cells).
    shift = np.arange(1, rows + 1) * width - offsets[1:]
    target = np.arange(offsets[0], offsets[-1]) + np.repeat(shift, lengths)
    if longest > _MAX_FIELD_CHARS:
        fits = np.repeat(lengths <= _MAX_FIELD_CHARS, lengths)
        target, values = target[fits], values[fits]
    cells.reshape(-1)[target] = values
    return cells


def _has_invalid(values: np.ndarray) -> np.ndarray:
    """Rows of a looked-up digit matrix holding a 255 (not a digit), 8 bytes at a time."""
    words = np.bitwise_or.reduce(values.view(np.uint64), axis=1)
    return (words & _HIGH_BITS) != 0
