"""How raw categorical IDs become embedding rows: feature hashing or a frequency vocabulary.

Raw IDs are int64 and may take any value, negatives included; both mappers treat an ID by
its 64-bit two's-complement bit pattern, so ``-1`` and ``2**64 - 1`` are the same ID.

* ``HashIds`` needs no preprocessing pass and maps every ID, seen or not, to a row in
  ``[0, num_embeddings)``; unrelated IDs may share a row (hash collisions).
* ``Vocabulary`` is built by one counting pass over the training data: each ID seen at least
  ``min_count`` times gets a row of its own, ordered by frequency, and every other ID (rare or
  never seen) shares row 0, the out-of-vocabulary row.
* ``FeatureIds`` is both at once, for a schema that chooses per feature: its vocabulary's
  features look up rows there, the others are hashed.

All expose the same small interface (``IdMapper``) and are plain picklable objects because
DataLoader worker processes receive a copy of the transform that holds them.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlrmflow.atomic_writes import write_url
from dlrmflow.features import jit
from dlrmflow.ingest.strings import is_string, string_ids
from dlrmflow.schema import SchemaError

if TYPE_CHECKING:
    from dlrmflow.features.spec import FeatureSpec

_MASK64 = (1 << 64) - 1
_M1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's multipliers
_M2 = np.uint64(0x94D049BB133111EB)
_S32 = np.uint64(32)
# IDs per pass of ``stable_hash``: a chunk (256 KiB) stays in L2 cache across the hash's
# numpy calls, and the scratch stays below glibc's mmap threshold, so it is reused from
# the heap instead of being mapped and page-faulted afresh for every call.
_CHUNK = 32768
VOCAB_FORMAT_VERSION = 1
_Columns = tuple[np.ndarray, ...]  # one array per feature, as the compiled kernels take them


class IdMapper(Protocol):
    """What the transform needs from an ID mapper."""

    def num_embeddings(self, name: str) -> int:
        """Rows of feature ``name``'s embedding table; mapped rows are below this."""
        ...

    def map(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Embedding rows (int64) of feature ``name``'s raw IDs."""
        ...

    def map_keyed(self, names: Sequence[str], ids: Sequence[np.ndarray]) -> np.ndarray:
        """Rows of several features' IDs, key after key: ``ids[k]`` are ``names[k]``'s IDs.

        Returns one new int64 array in the ``KeyedJaggedTensor`` values layout. The inputs
        are only read, so they may be read-only views of Arrow buffers; one call for all
        features lets the mapper write every row straight into place (no concatenation)
        and fuse that copy into its first pass.
        """
        ...


def _mix(z: np.ndarray, tmp: np.ndarray) -> None:
    """``z ^= z >> 32; z *= M1; z ^= z >> 32; z *= M2`` in place on a uint64 array.

    After this the top 32 bits of the hash are final. ``tmp`` is scratch of ``z``'s size.
    """
    for multiplier in (_M1, _M2):
        np.right_shift(z, _S32, out=tmp)
        np.bitwise_xor(z, tmp, out=z)
        np.multiply(z, multiplier, out=z)


def _mix_top(z: np.ndarray) -> None:
    """``_mix`` over ``z`` chunk by chunk, so that each chunk stays in cache."""
    scratch = np.empty(min(len(z), _CHUNK), np.uint64)
    for start in range(0, len(z), _CHUNK):
        part = z[start : start + _CHUNK]
        _mix(part, scratch[: len(part)])


def _as_bits(ids: np.ndarray, name: str) -> np.ndarray:
    """The IDs' 64-bit two's-complement patterns as uint64 (no copy for int64 input)."""
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer IDs, got dtype {ids.dtype}")
    return ids.astype(np.int64, copy=False).view(np.uint64)


def stable_hash(ids: np.ndarray, salt: int = 0) -> np.ndarray:
    """A 64-bit hash of each ID that is identical on every platform, process and run.

    ``z = id + salt``, then ``z ^= z >> 32; z *= M1; z ^= z >> 32; z *= M2; z ^= z >> 32``
    in wrapping uint64 arithmetic: murmur3's fmix64 with 32-bit shifts and splitmix64's
    multipliers (shifts of 32 let the top half, which ``HashIds`` uses, be final before
    the last fold). Every step is a bijection, so distinct IDs never collide before range
    reduction, and every output bit depends on every input bit. Rows taken from the top
    32 bits fill buckets as evenly as ideal random hashing (checked on random, sequential,
    strided, negative, ``j << 32`` and ``j << 40`` IDs, salted and not); one round fewer
    left salted ``j << 32`` IDs 1.5% short of ideal. A salt per feature sends equal raw
    IDs of different features to unrelated rows. Python's ``hash`` is never used: it is
    not a mixer for integers and is salted per process for strings.
    """
    z = np.add(_as_bits(ids, "stable_hash"), np.uint64(salt & _MASK64))  # copy + salt
    _mix_top(z)
    np.bitwise_xor(z, z >> _S32, out=z)
    return z


def feature_salt(name: str, seed: int = 0) -> int:
    """The salt of feature ``name``: 64 bits of BLAKE2b, the same in every process."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class _OneHotMapper:
    """``map_one_hot``, which both mappers offer: the transform's compiled path."""

    def map_one_hot(
        self,
        names: Sequence[str],
        ids: Sequence[np.ndarray],
        valid: Sequence[np.ndarray | None],
        out: np.ndarray,
        dest: np.ndarray,
    ) -> None:
        """Write ``names[k]``'s row of ``ids[k][i]`` into ``out[dest[i], k]``.

        ``out`` is the sample-major [B, keys] one-hot form (int32 or int64); a slot whose
        ``valid[k]`` entry is False (an empty bag) gets -1. All ``ids`` and ``dest``
        (int64, distinct rows of ``out``) have one length. The transform's transpose,
        shuffle, narrowing and null marking happen in the mapping's one pass.
        """
        keys = [self._known(name) for name in names]
        _check_scatter(ids, valid, out, dest)
        bits = tuple(
            jit.frozen(_as_bits(part, f"feature {k}")) for k, part in zip(keys, ids, strict=True)
        )
        self._scatter(keys, bits, jit.masks(valid), out, dest)

    def _known(self, name: str) -> str:
        raise NotImplementedError

    def _scatter(
        self, keys: list[str], bits: _Columns, valid: _Columns, out: np.ndarray, dest: np.ndarray
    ) -> None:
        """The compiled kernel of ``map_one_hot`` on checked inputs."""
        raise NotImplementedError


class HashIds(_OneHotMapper):
    """Maps feature ``name``'s IDs to ``(stable_hash(ids, salt) >> 32) * n >> 32``.

    ``salt = feature_salt(name, seed)`` and ``n = num_embeddings[name]``. The range
    reduction is Lemire's multiply-shift rather than ``hash % n``: a 64-bit modulo costs
    more in numpy than the whole hash, a multiply-shift much less. It uses the
    hash's top 32 bits, the best mixed, and gives every row floor or ceil of ``2**32 / n``
    hash values, the bias of a modulo of a 32-bit hash; tables are limited to ``2**32`` rows.
    The hash's final fold only changes its low 32 bits, so it is skipped here. The loop is
    compiled (``jit``): one pass, where the same steps as numpy calls pass over the array
    once each.
    """

    def __init__(
        self,
        num_embeddings: Mapping[str, int],
        *,
        seed: int = 0,
        tables: Mapping[str, str] | None = None,
    ) -> None:
        """``tables`` names the table of each feature that shares one (by default each is
        its own): the salt is the table's, so an ID takes one row in all its features."""
        for name, n in num_embeddings.items():
            if not 1 <= n <= 2**32:
                raise ValueError(f"feature {name}: num_embeddings must be in [1, 2**32], got {n}")
        self.seed = seed
        self.tables = {k: v for k, v in (tables or {}).items() if k != v}
        self._rows = {name: int(n) for name, n in num_embeddings.items()}
        self._salts = {
            name: np.uint64(feature_salt(self.tables.get(name, name), seed))
            for name in num_embeddings
        }

    @classmethod
    def from_spec(cls, spec: FeatureSpec, *, seed: int = 0) -> HashIds:
        """Hash every sparse feature of ``spec`` into its table's rows. A feature the
        schema declares ``ids: vocab`` is refused (``SchemaError``): its rows come from a
        vocabulary (``features.fit.feature_ids``), and hashing it would train other rows."""
        for f in spec.sparse:
            if f.ids == "vocab":
                raise SchemaError(
                    f"sparse feature {f.name}: ids vocab, but this run hashes every feature; "
                    "its rows come from a vocabulary fitted on the training days"
                )
        return cls({f.name: f.num_embeddings for f in spec.sparse}, seed=seed, tables=shared(spec))

    @property
    def table_rows(self) -> dict[str, int]:
        return dict(self._rows)

    def num_embeddings(self, name: str) -> int:
        return self._rows[self._known(name)]

    def map(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self.map_keyed([name], [ids])

    def map_keyed(self, names: Sequence[str], ids: Sequence[np.ndarray]) -> np.ndarray:
        parts = [_as_bits(part, f"feature {name}") for name, part in zip(names, ids, strict=True)]
        out = np.empty(sum(len(bits) for bits in parts), np.int64)
        start = 0
        for name, bits in zip(names, parts, strict=True):
            salt, rows = self._salts[self._known(name)], np.uint64(self._rows[name])
            jit.hash_rows(bits, salt, rows, out[start : start + len(bits)])
            start += len(bits)
        return out

    def _scatter(
        self, keys: list[str], bits: _Columns, valid: _Columns, out: np.ndarray, dest: np.ndarray
    ) -> None:
        salts = np.array([self._salts[k] for k in keys], np.uint64)
        rows = np.array([self._rows[k] for k in keys], np.uint64)
        jit.one_hot_rows(bits, valid, salts, rows, out, dest)

    def _known(self, name: str) -> str:
        if name not in self._rows:
            raise KeyError(f"feature {name}: no hash table size given (have {sorted(self._rows)})")
        return name

    def __repr__(self) -> str:
        return f"HashIds(seed={self.seed}, tables={self._rows})"


def shared(spec: FeatureSpec) -> dict[str, str]:
    """The table of each of ``spec``'s features that shares one (``SparseFeature.table``)."""
    return {f.name: f.table for f in spec.sparse if f.table is not None}


def _check_scatter(
    ids: Sequence[np.ndarray],
    valid: Sequence[np.ndarray | None],
    out: np.ndarray,
    dest: np.ndarray,
) -> None:
    """Refuse what would make the compiled scatter read or write out of bounds."""
    n = len(dest)
    if out.ndim != 2 or out.shape[1] != len(ids) or not ids:
        raise ValueError(f"map_one_hot: out must be [B, {len(ids)}], got {out.shape}")
    if any(len(part) != n for part in ids) or any(v is not None and len(v) != n for v in valid):
        raise ValueError("map_one_hot: ids, valid and dest must have one length")
    if n and (int(dest.min()) < 0 or int(dest.max()) >= len(out)):
        raise IndexError(f"map_one_hot: dest must lie in [0, {len(out)})")


def _home_hash(ids: np.ndarray) -> np.ndarray:
    """Unsalted ``stable_hash`` up to its final fold: the top bits pick a home slot."""
    z = ids.view(np.uint64).copy()
    _mix_top(z)
    return z


def _build_region(ranked: np.ndarray) -> tuple[np.ndarray, int]:
    """(slots, shift) of one feature's linear-probing region.

    ``slots`` is int64 [size, 2] of (ID, row) with row 0 marking an empty slot. The region
    has ``2**bits >= 2n`` home slots (at most half full, which keeps probe sequences short)
    plus an overflow tail that ends in an empty slot, so probes never wrap and a probe
    never runs into the next region without crossing an empty slot. IDs are inserted in
    rounds, all at once: an ID whose slot is free takes it, ties going to the most frequent
    ID, which therefore tends to sit at its home slot and be found by the first probe.
    """
    n = len(ranked)
    bits = max(1, (2 * n - 1).bit_length())
    shift = 64 - bits
    home = (_home_hash(ranked) >> np.uint64(shift)).view(np.int64)
    want = home.copy()
    occupied = np.zeros((1 << bits) + n + 1, np.bool_)
    slot = np.empty(n, np.int64)
    pending = np.arange(n)
    while pending.size:
        free = ~occupied[want[pending]]
        taken, first = np.unique(want[pending][free], return_index=True)  # first: most frequent
        occupied[taken] = True
        slot[pending[free][first]] = taken
        placed = np.zeros(len(pending), np.bool_)
        placed[np.flatnonzero(free)[first]] = True
        pending = pending[~placed]
        want[pending] += 1
    size = max(1 << bits, int(slot.max(initial=0)) + 1) + 1
    slots = np.zeros((size, 2), np.int64)
    slots[slot, 0] = ranked
    slots[slot, 1] = np.arange(1, n + 1)
    return slots, shift


class _ProbeTable:
    """ID -> row lookups for all features of a vocabulary in one open-addressing table.

    Binary search over sorted IDs (``np.searchsorted``) pays ~17 dependent cache misses
    per ID. Linear probing needs about one random read per ID (ID and row sit side by
    side, so one read fetches both), and the compiled probe (``jit.vocab_rows``,
    ``jit.one_hot_vocab_rows``) hashes and probes each ID in registers, as the hashing
    mapper's loops do.
    """

    def __init__(self, ranked: Mapping[str, np.ndarray]) -> None:
        parts = []
        self.regions: dict[str, tuple[int, int]] = {}  # name -> (first slot, shift)
        base = 0
        for name, ids in ranked.items():
            slots, shift = _build_region(ids)
            self.regions[name] = (base, shift)
            parts.append(slots)
            base += len(slots)
        slots = np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)
        self.slots = slots.view(np.uint64)  # IDs as the kernels compare them: their bits

    def region(self, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(first slot, shift) of each of ``names``' regions, as uint64 arrays."""
        both = np.array([self.regions[name] for name in names], np.uint64).reshape(-1, 2)
        return np.ascontiguousarray(both[:, 0]), np.ascontiguousarray(both[:, 1])

    def lookup(self, names: Sequence[str], ids: Sequence[np.ndarray]) -> np.ndarray:
        """Rows (int64) of each of ``names``' uint64 ``ids``, key after key."""
        out = np.empty(sum(len(part) for part in ids), np.int64)
        bases, shifts = self.region(names)
        start = 0
        for k, part in enumerate(ids):
            jit.vocab_rows(part, self.slots, bases[k], shifts[k], out[start : start + len(part)])
            start += len(part)
        return out


class Vocabulary(_OneHotMapper):
    """Per-feature ID -> row tables built from frequency counts; row 0 is out-of-vocabulary.

    ``ids[name][i]`` owns row ``i + 1``; rows are ordered by descending count, then
    ascending ID, so the same data always gives the same vocabulary. ``min_count`` is the
    threshold it was built with: one for every feature, or one per feature.
    """

    def __init__(
        self,
        ids: Mapping[str, np.ndarray],
        counts: Mapping[str, np.ndarray],
        *,
        min_count: int | Mapping[str, int],
    ) -> None:
        if set(ids) != set(counts):
            raise ValueError("vocabulary: ids and counts must name the same features")
        self.min_count = min_count if isinstance(min_count, int) else dict(min_count)
        self.ids = {name: np.ascontiguousarray(v, dtype=np.int64) for name, v in ids.items()}
        self.counts = {name: np.ascontiguousarray(counts[name], np.int64) for name in ids}
        for name, ranked in self.ids.items():
            if len(ranked) != len(self.counts[name]):
                raise ValueError(f"vocabulary {name}: {len(ranked)} IDs but a different count")
            if len(ranked) >= 2**31 - 1:
                raise ValueError(f"vocabulary {name}: {len(ranked)} IDs is too many rows")
            if len(np.unique(ranked)) != len(ranked):
                raise ValueError(f"vocabulary {name}: duplicate IDs")
        self._table = _ProbeTable(self.ids)

    @property
    def names(self) -> list[str]:
        return list(self.ids)

    @property
    def table_rows(self) -> dict[str, int]:
        """Table size per feature, as ``FeatureSpec.for_dataset(table_rows=...)`` takes it."""
        return {name: self.num_embeddings(name) for name in self.ids}

    def num_embeddings(self, name: str) -> int:
        return len(self.ids[self._known(name)]) + 1

    def map(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self.map_keyed([name], [ids])

    def map_keyed(self, names: Sequence[str], ids: Sequence[np.ndarray]) -> np.ndarray:
        bits = [
            _as_bits(part, f"feature {self._known(name)}")
            for name, part in zip(names, ids, strict=True)
        ]
        return self._table.lookup(names, bits)

    def _scatter(
        self, keys: list[str], bits: _Columns, valid: _Columns, out: np.ndarray, dest: np.ndarray
    ) -> None:
        bases, shifts = self._table.region(keys)
        jit.one_hot_vocab_rows(bits, valid, bases, shifts, self._table.slots, out, dest)

    def save(self, url: str) -> None:
        """Write the vocabulary to one ``.npz`` file at ``url`` (any fsspec URL)."""
        meta = {"format_version": VOCAB_FORMAT_VERSION, "min_count": self.min_count}
        meta["names"] = list(self.ids)
        arrays = {"meta": np.array(json.dumps(meta))}
        for i, name in enumerate(self.ids):
            arrays[f"ids_{i}"] = self.ids[name]
            arrays[f"counts_{i}"] = self.counts[name]
        buf = io.BytesIO()
        np.savez(buf, **arrays)  # uncompressed: IDs are high-entropy, zlib buys little
        write_url(url, buf.getvalue())

    @classmethod
    def load(cls, url: str) -> Vocabulary:
        """Read a vocabulary written by ``save``; errors name the file."""
        with fsspec.open(url, "rb") as f:
            data = f.read()
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                meta = json.loads(str(npz["meta"]))
                if meta.get("format_version") != VOCAB_FORMAT_VERSION:
                    raise ValueError(f"unsupported format_version {meta.get('format_version')}")
                names = meta["names"]
                ids = {name: npz[f"ids_{i}"] for i, name in enumerate(names)}
                counts = {name: npz[f"counts_{i}"] for i, name in enumerate(names)}
        except (ValueError, KeyError, OSError, zipfile.BadZipFile) as e:
            raise ValueError(f"{url}: not a dlrmflow vocabulary file: {e}") from e
        threshold = meta["min_count"]
        threshold = (
            {k: int(v) for k, v in threshold.items()}
            if isinstance(threshold, dict)
            else int(threshold)
        )
        return cls(ids, counts, min_count=threshold)

    def _known(self, name: str) -> str:
        if name not in self.ids:
            raise KeyError(f"feature {name}: not in the vocabulary (have {self.names})")
        return name

    def __repr__(self) -> str:
        return f"Vocabulary(min_count={self.min_count}, tables={self.table_rows})"


class RawIds:
    """The IDs themselves (their 64-bit patterns as int64), for features of ``ids:
    dynamic``: the trainer's map gives their rows (``train.model.dynamic_ids``), in
    training order, which a reader running ahead cannot. ``num_embeddings`` is the
    table's capacity."""

    def __init__(self, num_embeddings: Mapping[str, int]) -> None:
        self._rows = {name: int(n) for name, n in num_embeddings.items()}

    @property
    def table_rows(self) -> dict[str, int]:
        return dict(self._rows)

    def num_embeddings(self, name: str) -> int:
        return self._rows[name]

    def map(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self.map_keyed([name], [ids])

    def map_keyed(self, names: Sequence[str], ids: Sequence[np.ndarray]) -> np.ndarray:
        parts = [_as_bits(part, f"feature {name}") for name, part in zip(names, ids, strict=True)]
        return np.concatenate([np.zeros(0, np.uint64), *parts]).view(np.int64)

    def __repr__(self) -> str:
        return f"RawIds(tables={self._rows})"


class FeatureIds:
    """A vocabulary's features looked up in it, dynamic ones passed on raw, every other
    feature hashed: the mapping of a schema that chooses ``ids`` per feature. Rows are
    exactly what the ``Vocabulary``, the ``HashIds`` and the ``RawIds`` alone give their
    features."""

    def __init__(
        self, vocabulary: Vocabulary | None, hashed: HashIds, raw: RawIds | None = None
    ) -> None:
        owners = [o.table_rows for o in (vocabulary, hashed, raw) if o is not None]
        seen: set[str] = set()
        for rows in owners:
            both = seen & set(rows)
            if both:
                raise ValueError(f"feature {sorted(both)[0]}: mapped two ways")
            seen |= set(rows)
        self.vocabulary = vocabulary
        self.hashed = hashed
        self.raw = raw

    @property
    def table_rows(self) -> dict[str, int]:
        rows = dict(self.hashed.table_rows)
        for owner in (self.vocabulary, self.raw):
            if owner is not None:
                rows.update(owner.table_rows)
        return rows

    def num_embeddings(self, name: str) -> int:
        return self._owner(name).num_embeddings(name)

    def map(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self._owner(name).map(name, ids)

    def map_keyed(self, names: Sequence[str], ids: Sequence[np.ndarray]) -> np.ndarray:
        """Each owner maps its features' IDs in one call; the rows go back in key order."""
        out = np.empty(sum(len(part) for part in ids), np.int64)
        starts = np.cumsum([0, *(len(part) for part in ids)])
        for owner in (self.vocabulary, self.hashed, self.raw):
            if owner is None:
                continue
            mine = [k for k, name in enumerate(names) if self._owner(name) is owner]
            if not mine:
                continue
            rows = owner.map_keyed([names[k] for k in mine], [ids[k] for k in mine])
            at = 0
            for k in mine:
                size = len(ids[k])
                out[starts[k] : starts[k] + size] = rows[at : at + size]
                at += size
        return out

    def _owner(self, name: str) -> Vocabulary | HashIds | RawIds:
        if self.raw is not None and name in self.raw.table_rows:
            return self.raw
        if self.vocabulary is not None and name in self.vocabulary.ids:
            return self.vocabulary
        return self.hashed

    def __repr__(self) -> str:
        return f"FeatureIds({self.vocabulary!r}, {self.hashed!r}, {self.raw!r})"


_ID_TYPES = "int64 or string IDs, or lists of them (optionally dictionary-encoded)"


def _flat_ids(column: pa.ChunkedArray, where: str) -> pa.ChunkedArray:
    """The non-null int64 IDs of an ID column, lists flattened, as the transform sees them:
    strings hashed by ``string_ids`` and dictionaries decoded (a null entry is no ID)."""
    declared = t = column.type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        column, t = pc.list_flatten(column), t.value_type
    if pa.types.is_dictionary(t):
        column, t = column.cast(t.value_type), t.value_type
    if is_string(t):
        return pa.chunked_array(
            [pa.array(string_ids(chunk)) for chunk in pc.drop_null(column).chunks], pa.int64()
        )
    if t != pa.int64():
        raise ValueError(f"{where}: expected {_ID_TYPES}, got {declared}")
    return pc.drop_null(column)


class _CountTable:
    """Running (id, count) totals of one column, merged in bulk to stay vectorized."""

    def __init__(self) -> None:
        self.merged = pa.table({"id": pa.array([], pa.int64()), "count": pa.array([], pa.int64())})
        self.pending: list[pa.Table] = []
        self.pending_rows = 0

    def add(self, ids: pa.ChunkedArray) -> None:
        vc = pc.value_counts(ids)
        part = pa.table({"id": vc.field("values"), "count": vc.field("counts").cast(pa.int64())})
        self.pending.append(part)
        self.pending_rows += part.num_rows
        # Merge once the backlog is as large as the totals (and at least a few million
        # pairs): amortised linear work without holding every row group's counts at once.
        if self.pending_rows >= max(1 << 22, self.merged.num_rows):
            self.merge()

    def merge(self) -> pa.Table:
        if self.pending:
            both = pa.concat_tables([self.merged, *self.pending])
            summed = both.group_by("id").aggregate([("count", "sum")])
            self.merged = summed.rename_columns(["id", "count"])
            self.pending, self.pending_rows = [], 0
        return self.merged


def _ranked(counts: pa.Table, min_count: int, max_size: int | None) -> tuple[np.ndarray, ...]:
    """IDs with at least ``min_count`` occurrences by descending count, then ascending ID."""
    kept = counts.filter(pc.greater_equal(counts["count"], min_count))
    order = pc.sort_indices(kept, sort_keys=[("count", "descending"), ("id", "ascending")])
    if max_size is not None:
        order = order[:max_size]
    kept = kept.take(order)
    return kept["id"].to_numpy(), kept["count"].to_numpy()


def build_vocabulary(
    paths: Sequence[str],
    columns: Sequence[str],
    *,
    min_count: int | Mapping[str, int],
    max_size: int | None | Mapping[str, int | None] = None,
    tables: Mapping[str, str] | None = None,
) -> Vocabulary:
    """Count every ID of ``columns`` over the Parquet files ``paths`` and keep the frequent.

    Files are read row group by row group and only the named columns are decoded; nulls
    (and null elements of list columns) are not IDs and are not counted. ``max_size`` caps
    each table at that many frequent IDs (plus the out-of-vocabulary row). Both
    ``min_count`` and ``max_size`` are one for every column, or one per column.
    ``tables`` names the shared table of columns that share one: their IDs are counted
    together, and each of them gets the table's vocabulary (the same rows for an ID).
    """
    thresholds = {c: min_count if isinstance(min_count, int) else min_count[c] for c in columns}
    caps = {c: max_size if not isinstance(max_size, Mapping) else max_size[c] for c in columns}
    for name in columns:
        if thresholds[name] < 1:
            raise ValueError(f"{name}: min_count must be >= 1, got {thresholds[name]}")
        if caps[name] is not None and caps[name] < 0:
            raise ValueError(f"{name}: max_size must be >= 0, got {caps[name]}")
    table_of = {name: (tables or {}).get(name, name) for name in columns}
    counted = {table: _CountTable() for table in table_of.values()}
    for path in paths:
        for rg, part in _row_groups(path, columns):
            for name in columns:
                ids = _flat_ids(part.column(name), f"{path} row group {rg}: {name}")
                counted[table_of[name]].add(ids)
    ranked = {}
    for name in columns:
        table = table_of[name]
        if table not in ranked:
            ranked[table] = _ranked(counted[table].merge(), thresholds[name], caps[name])
    ids = {name: ranked[table_of[name]][0] for name in columns}
    counts = {name: ranked[table_of[name]][1] for name in columns}
    return Vocabulary(ids, counts, min_count=min_count)


def _row_groups(path: str, columns: Sequence[str]) -> Iterable[tuple[int, pa.Table]]:
    with fsspec.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
        for rg in range(pf.num_row_groups):
            yield rg, pf.read_row_group(rg, columns=list(columns))
