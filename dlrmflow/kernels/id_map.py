"""A dynamic ID map: raw 64-bit IDs to the rows of one table of fixed capacity, with
admission and eviction, so that a model line keeps one row per live ID as its ID space
grows and churns (TorchRec's managed-collision modules, Monolith's collisionless tables).

* Row 0 is the table's default row: shared, trained like any other, read by every ID that
  has no row of its own (not admitted yet, or the table full). No ID ever reads a zero or
  another ID's vector.
* An ID with a row keeps that row while it lives. A new ID is admitted (given a free row)
  once it has been seen ``admit_after`` times; until then it is a candidate, counted in a
  bounded table (``candidates`` IDs at most; beyond that new IDs are not counted until
  eviction frees candidate slots), so the map's memory stays bounded.
* ``evict(now)`` (at a day boundary, or every N steps) frees the rows of IDs not seen for
  ``ttl`` time units, then, when fewer than ``headroom`` of the rows are free, those of
  the IDs seen least often since the last eviction (ties: the longest unseen, then the
  lowest row). It returns the freed rows, whose weights and optimizer state the owner
  resets before any ID reuses them. Candidates not seen for ``ttl`` are dropped too.

Everything is deterministic: IDs are taken in the order given, free rows are handed out
lowest first, and the hash table is open addressing with linear probing and
backward-shift deletion (no tombstones, so its layout depends only on the operations
done). Lookups and admission run in one compiled pass (numba); eviction, rare, in numpy.
The map's whole state is a handful of arrays (``state_dict``), saved with the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

__all__ = ["DynamicIdMap", "IdMapStats"]

EMPTY = -1  # a slot's value when it holds no ID
_M1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finalizer
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
# Counters of ``map`` calls, in ``_counters``' order.
_LOOKUPS, _DEFAULTS, _ADMITTED, _FULL, _UNCOUNTED = range(5)


@numba.njit(nogil=True, cache=True, inline="always")
def _home(key: np.uint64, shift: np.uint64) -> np.int64:
    h = key
    h ^= h >> _S30
    h *= _M1
    h ^= h >> _S27
    h *= _M2
    h ^= h >> _S31
    return np.int64(h >> shift)


@numba.njit(nogil=True, cache=True)
def _find(keys: np.ndarray, values: np.ndarray, key: np.uint64, shift: np.uint64) -> tuple:
    """(slot, found): where ``key`` is, or the empty slot where it would go."""
    mask = keys.shape[0] - 1
    i = _home(key, shift)
    while values[i] != EMPTY:
        if keys[i] == key:
            return i, True
        i = (i + 1) & mask
    return i, False


@numba.njit(nogil=True, cache=True)
def _delete(
    keys: np.ndarray, values: np.ndarray, extra: np.ndarray, slot: int, shift: np.uint64
) -> None:
    """Empty ``slot``, shifting later entries of its probe run back (``extra``: a second
    value per slot that moves with its entry)."""
    mask = keys.shape[0] - 1
    i = slot
    while True:
        values[i] = EMPTY
        j = i
        while True:
            j = (j + 1) & mask
            if values[j] == EMPTY:
                return
            home = _home(keys[j], shift)
            # The entry at j may move to i unless its home lies cyclically in (i, j].
            stays = (i < home <= j) if i <= j else (home > i or home <= j)
            if not stays:
                break
        keys[i], values[i], extra[i] = keys[j], values[j], extra[j]
        i = j


@numba.njit(nogil=True, cache=True)
def _map(
    ids: np.ndarray,
    now: int,
    admit: bool,
    admit_after: int,
    keys: np.ndarray,
    rows: np.ndarray,
    shift: np.uint64,
    candidate_keys: np.ndarray,
    candidate_counts: np.ndarray,
    candidate_seen: np.ndarray,
    candidate_shift: np.uint64,
    candidate_limit: int,
    id_of_row: np.ndarray,
    last_seen: np.ndarray,
    hits: np.ndarray,
    free: np.ndarray,
    sizes: np.ndarray,  # [free rows, candidates]
    counters: np.ndarray,
    out: np.ndarray,
) -> None:
    for n in range(ids.shape[0]):
        key = ids[n]
        counters[_LOOKUPS] += 1
        slot, found = _find(keys, rows, key, shift)
        if found:
            row = rows[slot]
            out[n] = row
            if admit:
                last_seen[row] = now
                hits[row] += 1
            continue
        out[n] = 0
        counters[_DEFAULTS] += 1
        if not admit:
            continue
        candidate, known = -1, False
        if admit_after > 1:
            candidate, known = _find(candidate_keys, candidate_counts, key, candidate_shift)
            if known:
                candidate_counts[candidate] += 1
                candidate_seen[candidate] = now
            elif sizes[1] < candidate_limit:
                candidate_keys[candidate] = key
                candidate_counts[candidate] = 1
                candidate_seen[candidate] = now
                sizes[1] += 1
                known = True
            else:
                counters[_UNCOUNTED] += 1
                continue
            if candidate_counts[candidate] < admit_after:
                continue
        if sizes[0] == 0:
            counters[_FULL] += 1
            continue
        sizes[0] -= 1
        row = free[sizes[0]]
        if known:
            _delete(candidate_keys, candidate_counts, candidate_seen, candidate, candidate_shift)
            sizes[1] -= 1
        keys[slot] = key
        rows[slot] = row
        id_of_row[row] = key
        last_seen[row] = now
        hits[row] = 1
        out[n] = row
        counters[_ADMITTED] += 1


@numba.njit(nogil=True, cache=True)
def _forget(
    evicted: np.ndarray,
    keys: np.ndarray,
    rows: np.ndarray,
    spare: np.ndarray,
    shift: np.uint64,
    id_of_row: np.ndarray,
) -> None:
    for row in evicted:
        slot, found = _find(keys, rows, id_of_row[row], shift)
        if found:
            _delete(keys, rows, spare, slot, shift)


# The state's arrays, as ``state_dict`` names them.
_STATE = (
    "settings",
    "keys",
    "rows",
    "candidate_keys",
    "candidate_counts",
    "candidate_seen",
    "id_of_row",
    "last_seen",
    "hits",
    "free",
    "sizes",
)


@dataclass(frozen=True)
class IdMapStats:
    """What a map did since its counters were last taken (``DynamicIdMap.take_stats``)
    and where it stands: ``rows_in_use`` of ``capacity - 1`` rows an ID may hold."""

    lookups: int
    default_lookups: int  # lookups that read the default row (row 0)
    admitted: int
    refused_full: int  # admissions due but no row free: the ID read the default row
    uncounted: int  # new IDs not counted as candidates, the candidate table full
    evicted: int
    rows_in_use: int
    candidates: int


def _slots_for(entries: int) -> tuple[int, np.uint64]:
    """A power of two at least twice ``entries`` (probe runs stay short), and the shift
    that takes a 64-bit hash to a slot."""
    bits = max(3, (2 * max(entries, 1) - 1).bit_length())
    return 1 << bits, np.uint64(64 - bits)


class DynamicIdMap:
    """Raw IDs (int64, any bit pattern) to rows ``[0, capacity)`` of one table; see the
    module docstring. ``ttl`` (None: never by age) and ``now`` are in whatever unit the
    owner counts (days, steps); ``headroom`` is the share of rows eviction keeps free."""

    def __init__(
        self,
        capacity: int,
        *,
        admit_after: int = 1,
        ttl: int | None = None,
        headroom: float = 0.05,
        candidates: int | None = None,
    ) -> None:
        if capacity < 2:
            raise ValueError(
                f"capacity must be at least 2 (the default row and one ID), got {capacity}"
            )
        if admit_after < 1:
            raise ValueError(f"admit_after must be at least 1, got {admit_after}")
        if ttl is not None and ttl < 1:
            raise ValueError(f"ttl must be at least 1 (or None: never by age), got {ttl}")
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"headroom must be in [0, 1), got {headroom}")
        self.capacity = capacity
        self.admit_after = admit_after
        self.ttl = ttl
        self.headroom = headroom
        # Candidates: as many as rows by default, none when every ID is admitted at once.
        limit = (capacity if candidates is None else candidates) if admit_after > 1 else 0
        if limit < 0:
            raise ValueError(f"candidates must be non-negative, got {candidates}")
        self.candidate_limit = limit
        slots, self._shift = _slots_for(capacity)
        self._keys = np.zeros(slots, np.uint64)
        self._rows = np.full(slots, EMPTY, np.int64)
        candidate_slots, self._candidate_shift = _slots_for(limit)
        self._candidate_keys = np.zeros(candidate_slots, np.uint64)
        self._candidate_counts = np.full(candidate_slots, EMPTY, np.int64)
        self._candidate_seen = np.zeros(candidate_slots, np.int64)
        self._id_of_row = np.zeros(capacity, np.uint64)
        self._last_seen = np.full(capacity, EMPTY, np.int64)  # EMPTY: the row is free
        self._hits = np.zeros(capacity, np.int64)
        # Free rows as a stack whose top is the lowest row: handed out 1, 2, 3 ...
        self._free = np.arange(capacity - 1, 0, -1, dtype=np.int64)
        self._sizes = np.array([capacity - 1, 0], np.int64)
        self._counters = np.zeros(5, np.int64)
        self._evicted = 0

    @staticmethod
    def bytes_for(capacity: int, *, admit_after: int = 1, candidates: int | None = None) -> int:
        """The memory a map of these settings holds (``nbytes``), before it is made."""
        limit = (capacity if candidates is None else candidates) if admit_after > 1 else 0
        slots, candidate_slots = _slots_for(capacity)[0], _slots_for(limit)[0]
        # keys, rows; candidate keys, counts, seen; a row's ID, last sighting, hits; the
        # free rows; sizes and counters.
        return 8 * (2 * slots + 3 * candidate_slots + 3 * capacity + capacity - 1 + 2 + 5)

    @property
    def nbytes(self) -> int:
        """The memory the map's arrays hold."""
        return sum(a.nbytes for a in vars(self).values() if isinstance(a, np.ndarray))

    def map(self, ids: np.ndarray, now: int, *, admit: bool = True) -> np.ndarray:
        """The rows of ``ids`` (int64, in order), counting and admitting as it goes when
        ``admit`` (training); evaluation and scoring look up without admitting."""
        bits = np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)
        out = np.empty(len(bits), np.int64)
        _map(
            bits,
            int(now),
            bool(admit),
            self.admit_after,
            self._keys,
            self._rows,
            self._shift,
            self._candidate_keys,
            self._candidate_counts,
            self._candidate_seen,
            self._candidate_shift,
            self.candidate_limit,
            self._id_of_row,
            self._last_seen,
            self._hits,
            self._free,
            self._sizes,
            self._counters,
            out,
        )
        return out

    def evict(self, now: int) -> np.ndarray:
        """Free the rows of expired, then of the least seen IDs (see the module
        docstring); returns the freed rows, ascending, for their owner to reset."""
        in_use = np.flatnonzero(self._last_seen >= 0)
        in_use = in_use[in_use > 0]
        expired = np.zeros(len(in_use), np.bool_)
        if self.ttl is not None:
            expired = now - self._last_seen[in_use] >= self.ttl
        keep = in_use[~expired]
        most = int((self.capacity - 1) * (1.0 - self.headroom))
        excess = len(keep) - most
        evicted = in_use[expired]
        if excess > 0:
            # Least seen first; then the longest unseen; then the lowest row.
            order = np.lexsort((keep, self._last_seen[keep], self._hits[keep]))
            evicted = np.concatenate([evicted, keep[order[:excess]]])
        evicted = np.sort(evicted)
        # The rows' table has no second value a slot: its rows stand in (moved twice alike).
        _forget(evicted, self._keys, self._rows, self._rows, self._shift, self._id_of_row)
        self._last_seen[evicted] = EMPTY
        self._hits[evicted] = 0
        self._id_of_row[evicted] = 0
        self._hits[:] = 0  # frequency is counted per period between evictions
        # Lowest on top, whatever was freed when.
        free = np.sort(np.concatenate([evicted, self._free[: self._sizes[0]]]))[::-1]
        self._free[: len(free)] = free
        self._sizes[0] = len(free)
        if self.ttl is not None and self.candidate_limit:
            self._drop_stale_candidates(now)
        self._evicted += len(evicted)
        return evicted

    def _drop_stale_candidates(self, now: int) -> None:
        assert self.ttl is not None
        stale = np.flatnonzero(
            (self._candidate_counts != EMPTY) & (now - self._candidate_seen >= self.ttl)
        )
        keys = self._candidate_keys[stale]
        for key in keys:  # each deletion may shift others: find each afresh
            slot, found = _find(
                self._candidate_keys, self._candidate_counts, key, self._candidate_shift
            )
            if found:
                _delete(
                    self._candidate_keys,
                    self._candidate_counts,
                    self._candidate_seen,
                    slot,
                    self._candidate_shift,
                )
                self._sizes[1] -= 1

    @property
    def rows_in_use(self) -> int:
        return self.capacity - 1 - int(self._sizes[0])

    def take_stats(self) -> IdMapStats:
        """The counters since the last call (then reset) and the map's present size."""
        c = self._counters
        stats = IdMapStats(
            lookups=int(c[_LOOKUPS]),
            default_lookups=int(c[_DEFAULTS]),
            admitted=int(c[_ADMITTED]),
            refused_full=int(c[_FULL]),
            uncounted=int(c[_UNCOUNTED]),
            evicted=self._evicted,
            rows_in_use=self.rows_in_use,
            candidates=int(self._sizes[1]),
        )
        c[:] = 0
        self._evicted = 0
        return stats

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` as they stand, counting nothing (0: no row of its own)."""
        counters = self._counters.copy()
        out = self.map(ids, 0, admit=False)
        self._counters[:] = counters
        return out

    def frozen(self) -> tuple[np.ndarray, np.ndarray]:
        """The map as a sorted lookup that admits nothing: (the raw IDs with a row of their
        own, ascending as int64; their rows). Any other ID reads row 0, as ``rows_of``
        says: an export searches the IDs instead of carrying the hash table."""
        rows = np.flatnonzero(self._last_seen >= 0)
        rows = rows[rows > 0]
        keys = self._id_of_row[rows].view(np.int64)
        order = np.argsort(keys, kind="stable")
        return keys[order], rows[order].astype(np.int64)

    def arrays(self) -> dict[str, np.ndarray]:
        """The map's live state arrays by name, as int64 views (IDs' bit patterns kept):
        a checkpoint saves from them and loads into them in place."""
        return {
            name: getattr(self, f"_{name}").view(np.int64) for name in _STATE if name != "settings"
        }

    def state_dict(self) -> dict[str, np.ndarray]:
        """The map's whole state as arrays (a checkpoint's); ``load_state_dict`` of a map
        made with the same settings restores it exactly."""
        return {
            "settings": self._settings(),
            **{name: getattr(self, f"_{name}").copy() for name in _STATE[1:]},
        }

    def _settings(self) -> np.ndarray:
        """What a saved state must have been made with: capacity, admit_after, ttl (0:
        None) and the candidate limit."""
        return np.array(
            [self.capacity, self.admit_after, self.ttl or 0, self.candidate_limit], np.int64
        )

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restore a ``state_dict``; a map of other settings (capacity, admission, TTL,
        candidates) is refused, naming the first that differs."""
        mine = self._settings()
        names = ("capacity", "admit_after", "ttl", "candidates")
        for name, have, got in zip(names, mine, state["settings"], strict=True):
            if int(have) != int(got):
                raise ValueError(f"id map: saved with {name} {int(got)}, this map has {int(have)}")
        for name in _STATE[1:]:
            target = getattr(self, f"_{name}")
            if state[name].shape != target.shape:
                raise ValueError(f"id map: saved {name} of shape {state[name].shape}")
            target[...] = state[name]
