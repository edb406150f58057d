"""``string_ids``: the stable hash that turns string IDs into int64 ones.

Every string ID of every dataset, its statistics, its vocabularies and the rows a trained
model learned rest on this hash, so its values are pinned here: a change to them is a
format change, never a refactoring.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from dlrmflow.ingest.strings import string_ids

_MASK = (1 << 64) - 1


def reference_hash(s: str) -> int:
    """FNV-1a 64 of the UTF-8 bytes, then splitmix64's finalizer, as a signed int64."""
    h = 0xCBF29CE484222325
    for byte in s.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001B3) & _MASK
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & _MASK
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & _MASK
    h ^= h >> 31
    return h - (1 << 64) if h >> 63 else h


# Written out once from ``reference_hash``; they must never change.
PINNED = {
    "": -780787492076525413,
    "a": 198367012849983736,
    "alice": -4192475849746331044,
    "bob": 7963897756087913964,
    "user-42": 8797103408588478355,
    "héllo": 1793390062926416830,
    "日本": -5191301689507172602,
}


def test_known_strings_map_to_pinned_ids():
    assert {s: reference_hash(s) for s in PINNED} == PINNED
    for string_type in (pa.string(), pa.large_string()):
        ids = string_ids(pa.array(list(PINNED), string_type))
        assert ids.dtype == np.int64
        assert ids.tolist() == list(PINNED.values())


@pytest.mark.parametrize("string_type", [pa.string(), pa.large_string()])
def test_sliced_and_null_slots(string_type):
    words = ["x", None, "alice", "", "bob", None, "日本", "a" * 300]
    array = pa.array(words, string_type)
    for start, stop in [(0, 8), (1, 8), (2, 5), (5, 8), (3, 3)]:
        part = array.slice(start, stop - start)
        ids = string_ids(part)
        expected = [w for w in words[start:stop]]
        got = [int(i) for i, w in zip(ids, expected, strict=True) if w is not None]
        assert got == [reference_hash(w) for w in expected if w is not None]
    # An array of nulls only (its data buffer may be absent) still gives a value a slot.
    assert len(string_ids(pa.nulls(4, string_type))) == 4
    assert len(string_ids(pa.array([], string_type))) == 0


def test_random_strings_match_the_reference():
    rng = np.random.default_rng(0)
    alphabet = list("abcXYZ019-_ é€😀")
    words = ["".join(rng.choice(alphabet, size=rng.integers(0, 40))) for _ in range(300)]
    assert string_ids(pa.array(words)).tolist() == [reference_hash(w) for w in words]
    # Hashed four at a time, the rest one by one: every count and offset of a slice.
    array = pa.array(words)
    for start, stop in ((1, 300), (2, 299), (3, 6), (5, 6), (7, 14)):
        expected = [reference_hash(w) for w in words[start:stop]]
        assert string_ids(array[start:stop]).tolist() == expected


def test_offsets_outside_the_data_are_refused():
    offsets = pa.py_buffer(np.array([0, 5, 3], np.int32).tobytes())
    bad = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"abcde")])
    with pytest.raises(ValueError, match="offsets lie outside its data"):
        string_ids(bad)


def test_other_types_are_refused():
    with pytest.raises(TypeError, match="expected a string or large_string array, got int64"):
        string_ids(pa.array([1, 2]))
