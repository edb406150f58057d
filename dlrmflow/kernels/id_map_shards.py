"""A dynamic ID map split into shards by ID: what lets a job's ranks each keep part of a
table's map, and a checkpoint's map load at any rank count.

A table of ``capacity`` rows has one shared default row (row 0) and ``shards`` parts; an
ID's shard is a hash of the ID alone (``shard_of``), and each shard is a ``DynamicIdMap``
(admission, eviction, candidates) over a contiguous range of rows of its own. Rows
``1 .. capacity - 1`` are split between the shards as evenly as they go, in shard order.
Since an ID always lands in the same shard and a shard's state depends only on the IDs it
is given, in order, the whole map is a function of the data and of ``shards``, whoever
holds each shard: a job whose ranks each map the IDs of their own shards, given in the
order one process would map them, ends with exactly one process's map. A job therefore
never reshards a map: it only reassigns whole shards (``owner``). One shard is a plain
``DynamicIdMap`` over every row, bitwise, and saves under the same names.

What the split changes: each shard evicts, keeps ``headroom`` free and refuses IDs when
full on its own, so a shard can fill while another has free rows (a hash spreads IDs
evenly; the imbalance shrinks as the shards grow).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields

import numba
import numpy as np

from dlrmflow.kernels.id_map import DynamicIdMap, IdMapStats

__all__ = ["ShardedIdMap", "shard_rows"]

# Salt of the shard hash, so that an ID's shard says nothing of its slot in the shard's
# own hash table (which mixes the ID without it).
_SALT = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


@numba.njit(nogil=True, cache=True)
def _shard_of(ids: np.ndarray, shards: int, out: np.ndarray) -> None:
    n_shards = np.uint64(shards)
    for n in range(ids.shape[0]):
        h = ids[n] ^ _SALT
        h ^= h >> _S30
        h *= _M1
        h ^= h >> _S27
        h *= _M2
        h ^= h >> _S31
        out[n] = np.int64(h % n_shards)


@numba.njit(nogil=True, cache=True)
def _grouped(shard: np.ndarray, shards: int, order: np.ndarray, starts: np.ndarray) -> None:
    """A stable counting sort: ``order`` lists the positions shard by shard, each shard's
    in their given order, and ``starts[s]:starts[s + 1]`` is shard ``s``'s part of it."""
    for n in range(shard.shape[0]):
        starts[shard[n] + 1] += 1
    for s in range(shards):
        starts[s + 1] += starts[s]
    at = starts[:-1].copy()
    for n in range(shard.shape[0]):
        s = shard[n]
        order[at[s]] = n
        at[s] += 1


def shard_rows(capacity: int, shards: int) -> list[int]:
    """The rows of each shard, besides the shared default row: ``capacity - 1`` split as
    evenly as it goes, the first shards taking one more."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    if capacity - 1 < shards:
        raise ValueError(
            f"capacity {capacity} leaves {capacity - 1} rows beside the default row, too few "
            f"for {shards} shards of at least one row each"
        )
    base, extra = divmod(capacity - 1, shards)
    return [base + (s < extra) for s in range(shards)]


class ShardedIdMap:
    """Raw IDs (int64) to rows ``[0, capacity)`` through ``shards`` ``DynamicIdMap``s; see
    the module docstring. ``owned``: the shards this map holds (default: all); an ID of
    another shard is refused, since its map lives elsewhere."""

    def __init__(
        self,
        capacity: int,
        shards: int = 1,
        *,
        owned: Iterable[int] | None = None,
        admit_after: int = 1,
        ttl: int | None = None,
        headroom: float = 0.05,
    ) -> None:
        sizes = shard_rows(capacity, shards)
        self.capacity = capacity
        self.shards = shards
        self.owned = tuple(sorted(set(range(shards) if owned is None else owned)))
        if any(not 0 <= s < shards for s in self.owned):
            raise ValueError(f"owned shards {self.owned} are not all among the {shards}")
        # A shard's local row j >= 1 is row offset + j - 1 of the table; local row 0 is the
        # table's default row.
        self.offsets = np.concatenate([[1], 1 + np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.parts = {
            s: DynamicIdMap(sizes[s] + 1, admit_after=admit_after, ttl=ttl, headroom=headroom)
            for s in self.owned
        }

    @staticmethod
    def bytes_for(
        capacity: int, shards: int = 1, *, admit_after: int = 1, owned: Iterable[int] | None = None
    ) -> int:
        """The memory the shards ``owned`` (default: all) of such a map hold, before it is
        made."""
        sizes = shard_rows(capacity, shards)
        chosen = range(shards) if owned is None else owned
        return sum(DynamicIdMap.bytes_for(sizes[s] + 1, admit_after=admit_after) for s in chosen)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts.values())

    @property
    def whole(self) -> bool:
        """Whether this map holds every shard (one process's, or a loaded checkpoint's)."""
        return len(self.owned) == self.shards

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        """The shard of each ID (int64 in ``[0, shards)``), whoever holds it."""
        bits = np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)
        out = np.zeros(len(bits), np.int64)
        if self.shards > 1:
            _shard_of(bits, self.shards, out)
        return out

    def _each_shard(self, ids: np.ndarray, call) -> np.ndarray:  # noqa: ANN001 (a closure)
        """``call(part, ids of its shard)`` on each shard's IDs in their given order, the
        local rows it returns made the table's rows, in the positions of ``ids``."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if self.shards == 1 and self.whole:
            return call(self.parts[0], ids)
        shard = self.shard_of(ids)
        order = np.empty(len(ids), np.int64)
        starts = np.zeros(self.shards + 1, np.int64)
        _grouped(shard, self.shards, order, starts)
        out = np.empty(len(ids), np.int64)
        for s in range(self.shards):
            lo, hi = starts[s], starts[s + 1]
            if lo == hi:
                continue
            part = self.parts.get(s)
            if part is None:
                raise ValueError(f"IDs of shard {s} reached a map holding shards {self.owned}")
            where = order[lo:hi]
            out[where] = self._table_rows(s, call(part, ids[where]))
        return out

    def _table_rows(self, shard: int, local: np.ndarray) -> np.ndarray:
        """Shard ``shard``'s local rows as the table's: 0 stays the default row."""
        return np.where(local > 0, local + (self.offsets[shard] - 1), 0)

    def map(self, ids: np.ndarray, now: int, *, admit: bool = True) -> np.ndarray:
        """``DynamicIdMap.map`` across the shards: each shard sees its IDs in order."""
        return self._each_shard(ids, lambda part, own: part.map(own, now, admit=admit))

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` as they stand, counting nothing (0: no row of its own)."""
        return self._each_shard(ids, lambda part, own: part.rows_of(own))

    def evict(self, now: int) -> np.ndarray:
        """Evict in every shard held; the table's rows freed, ascending."""
        freed = [self._table_rows(s, part.evict(now)) for s, part in self.parts.items()]
        return np.sort(np.concatenate(freed)) if freed else np.zeros(0, np.int64)

    @property
    def rows_in_use(self) -> int:
        return sum(part.rows_in_use for part in self.parts.values())

    def take_stats(self) -> IdMapStats:
        """The shards' counters since the last call (then reset), summed, and their size."""
        stats = [part.take_stats() for part in self.parts.values()]
        return IdMapStats(
            **{f.name: sum(getattr(s, f.name) for s in stats) for f in fields(IdMapStats)}
        )

    def frozen(self) -> tuple[np.ndarray, np.ndarray]:
        """``DynamicIdMap.frozen`` of the whole table: needs every shard."""
        if not self.whole:
            raise ValueError(f"a frozen map needs every shard; this one holds {self.owned}")
        keys, rows = [], []
        for s, part in self.parts.items():
            k, r = part.frozen()
            keys.append(k)
            rows.append(self._table_rows(s, r))
        keys_all, rows_all = np.concatenate(keys), np.concatenate(rows)
        order = np.argsort(keys_all, kind="stable")
        return keys_all[order], rows_all[order]

    def _name(self, shard: int, name: str) -> str:
        # One shard keeps a plain map's names: checkpoints of either load as the other.
        return name if self.shards == 1 else f"{shard}.{name}"

    def arrays(self) -> dict[str, np.ndarray]:
        """Each held shard's ``DynamicIdMap.arrays``, named ``<shard>.<array>`` (plain
        ``<array>`` for one shard): live views a checkpoint saves from and loads into."""
        return {
            self._name(s, name): array
            for s, part in self.parts.items()
            for name, array in part.arrays().items()
        }

    def state_dict(self) -> dict[str, np.ndarray]:
        """Each held shard's ``DynamicIdMap.state_dict``, named as in ``arrays``."""
        return {
            self._name(s, name): array
            for s, part in self.parts.items()
            for name, array in part.state_dict().items()
        }

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restore the held shards from a ``state_dict`` (of any holder of them)."""
        for s, part in self.parts.items():
            prefix = self._name(s, "")
            part.load_state_dict(
                {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            )
