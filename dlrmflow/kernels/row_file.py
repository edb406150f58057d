"""The file behind a tiered embedding bag: every row of its tables and the rows'
optimizer state, memory-mapped.

The file holds a 4 KiB JSON header (layout, optimizer, step count) and then, per run of
same-dim tables (a region), the weights of every row (``[rows, dim]``) followed by each
optimizer state part in the same row order (row-wise Adagrad: ``[rows, 1]``; Adam: the two
moments, each ``[rows, dim]``). Each table's weights and states are thus contiguous in the
file, so a checkpoint saves and loads them as views of the mapping, never as a copy of a
table that may not fit in memory.

The file's blocks are reserved when it is created (``posix_fallocate``), so a disk too
small for it fails there, as a ``DiskSpaceError`` naming the file and the bytes, with the
file removed. Without the reservation the file would be sparse, and the first write into
a hole of a full disk's mapping kills the process with SIGBUS, mid-run and without a word.

Resident memory stays bounded however much of the file a run touches: pages of a shared
file mapping count in a process's resident set once touched, and the kernel leaves them
mapped while memory is free. Random reads and write-backs go in chunks of
``PAGE_CHUNK_ROWS`` rows; once the pages they may have mapped add up to
``MAPPED_ALLOWANCE_BYTES``, the process's shared resident set is read and, past that
allowance, every page of the file is unmapped (``MADV_DONTNEED``) at once. Sequential bulk
accesses (a table's initialisation, a checkpoint item) unmap the range they touched as
they go. The data stays in the page cache (dirty pages are written back by the kernel);
only this process's mapping of it is dropped. Why an allowance rather than unmapping
after every chunk: each unmapping makes the next accesses to those pages fault again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dlrmflow.errors import DlrmflowError
from dlrmflow.kernels.optimizers import EmbeddingOptimizer
from dlrmflow.kernels.tbe import INIT_BLOCK_ROWS, init_table_rows
from dlrmflow.memory import format_bytes
from dlrmflow.sparse import EmbeddingTable

__all__ = ["DiskSpaceError", "Pages", "Region", "RowFile", "record_width"]

HEADER_BYTES = 4096
MAGIC = "dlrmflow-tiered-embeddings"
FORMAT_VERSION = 2  # 1 stored a row's weights and state side by side
FILE_SUFFIX = ".tiered"
# Rows initialised per write: whole init blocks, so that no block is drawn twice.
INIT_CHUNK_ROWS = 8 * INIT_BLOCK_ROWS
# Random rows gathered from or scattered to the file at once: each row touches a page per
# part, and a fault maps up to 16 cached neighbours with it (FAULT_AROUND_BYTES), so one
# chunk maps at most 2 x 64 KiB x PAGE_CHUNK_ROWS (32 MiB at 256) of the file.
PAGE_CHUNK_ROWS = 256
FAULT_AROUND_BYTES = 64 << 10
# The file's pages a process keeps mapped before it unmaps them all: its resident set
# holds at most this plus one chunk's worth of them. They are page cache (reclaimable);
# a small allowance unmaps often, and every unmapped page faults again when next used.
MAPPED_ALLOWANCE_BYTES = 256 << 20


class DiskSpaceError(DlrmflowError, OSError):
    """The file system cannot hold a new tiered embedding file (none is left behind)."""


class Pages:
    """The file's mapping, and dropping this process's mapped pages of a range of it."""

    def __init__(self, memmap: np.memmap) -> None:
        mapping = memmap.base  # the mapping numpy made (from HEADER_BYTES)
        if not isinstance(mapping, mmap.mmap):
            raise ValueError("the tier's memmap must be numpy's own mapping of the file")
        self._mmap: mmap.mmap = mapping
        if memmap.offset % mmap.ALLOCATIONGRANULARITY:
            raise ValueError(f"the header ({memmap.offset} bytes) must be whole pages")
        self._base = memmap.ctypes.data
        self._size = len(self._mmap)
        if hasattr(mmap, "MADV_RANDOM"):
            self._mmap.madvise(mmap.MADV_RANDOM)  # no readahead: rows are read at random
        # Bytes the random accesses since the last look may have mapped (an upper bound),
        # and the shared resident set when the file's pages were last unmapped.
        self._unchecked = 0
        self._shared_at_drop = _shared_resident()
        self._lock = threading.Lock()  # the prefetch thread accesses rows too

    def touched(self, rows: int, parts: int) -> None:
        """After ``rows`` random rows of ``parts`` parts were read or written: unmap every
        page of the file once this process's shared resident set has grown by more than
        ``MAPPED_ALLOWANCE_BYTES`` since they were last unmapped (looked at only when the
        accesses since the last look could have taken it there)."""
        with self._lock:
            self._unchecked += rows * parts * FAULT_AROUND_BYTES
            if self._unchecked < MAPPED_ALLOWANCE_BYTES:
                return
            grown = _shared_resident() - self._shared_at_drop
            if grown <= MAPPED_ALLOWANCE_BYTES:
                self._unchecked = max(grown, 0)
                return
            self.drop_all()
            self._shared_at_drop = _shared_resident()
            self._unchecked = 0

    def drop(self, array: np.ndarray, first: int, last: int) -> None:
        """Unmap the pages of rows ``first..last`` (inclusive) of ``array``, a 2-D view of
        the mapping; their data stays in the page cache and the file."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        row_bytes = array.strides[0]
        start = array.ctypes.data - self._base + first * row_bytes
        end = array.ctypes.data - self._base + (last + 1) * row_bytes
        start -= start % mmap.PAGESIZE
        end = min(end + (-end % mmap.PAGESIZE), self._size)
        if end > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def drop_all(self) -> None:
        if hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED)


def _shared_resident() -> int:
    """This process's resident pages backed by files or shared memory, in bytes (the third
    field of ``/proc/self/statm``); 0 where there is no such file, which never unmaps."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[2]) * mmap.PAGESIZE
    except (OSError, IndexError, ValueError):
        return 0


@dataclass(frozen=True)
class Region:
    """The rows ``[start, end)`` of one run of same-dim tables in the file: one 2-D array
    per record part (the weights, then each optimizer state), ``[end - start, width]``."""

    start: int
    end: int
    parts: list[np.ndarray]

    def gather(self, local: np.ndarray, pages: Pages) -> np.ndarray:
        """Records ``[len(local), width]`` of rows ``local`` (sorted or not)."""
        out = np.empty((len(local), sum(p.shape[1] for p in self.parts)), np.float32)
        for lo in range(0, len(local), PAGE_CHUNK_ROWS):
            chunk = local[lo : lo + PAGE_CHUNK_ROWS]
            column = 0
            for part in self.parts:
                width = part.shape[1]
                out[lo : lo + len(chunk), column : column + width] = part[chunk]
                column += width
            pages.touched(len(chunk), len(self.parts))
        return out

    def scatter(self, local: np.ndarray, records: np.ndarray, pages: Pages) -> None:
        """Write ``records`` (their first columns) as rows ``local``."""
        for lo in range(0, len(local), PAGE_CHUNK_ROWS):
            chunk = local[lo : lo + PAGE_CHUNK_ROWS]
            column = 0
            for part in self.parts:
                width = part.shape[1]
                part[chunk] = records[lo : lo + len(chunk), column : column + width]
                column += width
            pages.touched(len(chunk), len(self.parts))

    def read_rows(self, first: int, end: int, pages: Pages) -> np.ndarray:
        """A copy of the records of local rows ``[first, end)``."""
        out = np.empty((end - first, sum(p.shape[1] for p in self.parts)), np.float32)
        step = PAGE_CHUNK_ROWS * 64  # sequential: faults map neighbours, not strangers
        for lo in range(first, end, step):
            hi = min(lo + step, end)
            column = 0
            for part in self.parts:
                width = part.shape[1]
                out[lo - first : hi - first, column : column + width] = part[lo:hi]
                pages.drop(part, lo, hi - 1)
                column += width
        return out

    def write_rows(self, first: int, records: np.ndarray, pages: Pages) -> None:
        """Write ``records`` as local rows ``first, first + 1, ...``."""
        step = PAGE_CHUNK_ROWS * 64
        for lo in range(0, len(records), step):
            hi = min(lo + step, len(records))
            column = 0
            for part in self.parts:
                width = part.shape[1]
                part[first + lo : first + hi] = records[lo:hi, column : column + width]
                pages.drop(part, first + lo, first + hi - 1)
                column += width


def record_width(optimizer: EmbeddingOptimizer, dim: int) -> int:
    """Floats per row in the file: the weights, then the optimizer state."""
    return sum(optimizer.record_widths(dim))


class RowFile:
    """The mapped file ``path`` of ``tables`` (grouped into regions by ``group_keys``, runs
    of same-dim tables), for ``optimizer``'s state: created with every row drawn
    (``init(k, rows, first)``, default ``init_table_rows`` from ``seed``; ``fill=False``
    leaves zeros), or opened (``resume``) after checking its header and size. ``step`` is
    the optimizer's step count stored in the header."""

    def __init__(
        self,
        path: Path,
        tables: Sequence[EmbeddingTable],
        optimizer: EmbeddingOptimizer,
        group_keys: list[tuple[int, int]],
        *,
        resume: bool,
        seed: int = 0,
        init: Callable[[int, torch.Tensor, int], None] | None = None,
        fill: bool = True,
    ) -> None:
        self.path = path
        self.tables = list(tables)
        self.optimizer = optimizer
        self.group_keys = group_keys
        sizes = torch.tensor([t.num_embeddings for t in self.tables])
        self.starts = torch.zeros(len(self.tables) + 1, dtype=torch.int64)
        torch.cumsum(sizes, 0, out=self.starts[1:])
        self.step = 0
        self.memmap = self._open() if resume else self._create(seed, init, fill)
        self.pages = Pages(self.memmap)
        self.regions = self._regions(self.memmap)

    def _region_shapes(self) -> list[tuple[int, int, int]]:
        """(first global row, rows, record width) of each group's region."""
        return [
            (
                int(self.starts[first]),
                int(self.starts[end] - self.starts[first]),
                record_width(self.optimizer, self.tables[first].embedding_dim),
            )
            for first, end in self.group_keys
        ]

    def _regions(self, memmap: np.memmap) -> list[Region]:
        regions, offset = [], 0
        for (start, rows, _), (first, _end) in zip(
            self._region_shapes(), self.group_keys, strict=True
        ):
            parts = []
            for width in self.optimizer.record_widths(self.tables[first].embedding_dim):
                parts.append(memmap[offset : offset + rows * width].reshape(rows, width))
                offset += rows * width
            regions.append(Region(start, start + rows, parts))
        return regions

    def _header(self) -> dict:
        return {
            "magic": MAGIC,
            "format": FORMAT_VERSION,
            "tables": [[t.name, t.num_embeddings, t.embedding_dim] for t in self.tables],
            "optimizer": type(self.optimizer).__name__,
            "step": self.step,
        }

    def _file_bytes(self) -> int:
        return HEADER_BYTES + 4 * sum(rows * width for _, rows, width in self._region_shapes())

    def _write_header(self) -> None:
        raw = json.dumps(self._header()).encode()
        if len(raw) > HEADER_BYTES:
            raise ValueError(f"{self.path}: {len(self.tables)} tables overflow the file header")
        with self.path.open("r+b") as f:
            f.write(raw.ljust(HEADER_BYTES, b" "))

    def _create(
        self, seed: int, init: Callable[[int, torch.Tensor, int], None] | None, fill: bool
    ) -> np.memmap:
        if self.path.exists():
            raise FileExistsError(
                f"{self.path}: already exists; pass resume=True to train on from it, or "
                "delete it to start over"
            )
        size = self._file_bytes()
        created = _make_directories(self.path.parent)
        try:
            _check_free(self.path, size)
            with self.path.open("wb") as f:
                # Zeros (the initial optimizer state) without writing them, then every
                # block reserved: a full disk is an error now, not a SIGBUS mid-run.
                f.truncate(size)
                _reserve(f.fileno(), self.path, size, new=True)
            self._write_header()
            memmap = np.memmap(self.path, np.float32, "r+", offset=HEADER_BYTES)
            if fill:
                self._fill(memmap, seed, init)
        except BaseException:
            self.path.unlink(missing_ok=True)
            for directory in created:
                with contextlib.suppress(OSError):  # not empty: another file is there
                    directory.rmdir()
            raise
        return memmap

    def _fill(
        self, memmap: np.memmap, seed: int, init: Callable[[int, torch.Tensor, int], None] | None
    ) -> None:
        """Write every table's initial rows into a new file (its state stays zeros)."""
        pages = Pages(memmap)
        for region, (first, end) in zip(self._regions(memmap), self.group_keys, strict=True):
            weights = region.parts[0]
            for k in range(first, end):
                t = self.tables[k]
                row = int(self.starts[k]) - region.start
                for start in range(0, t.num_embeddings, INIT_CHUNK_ROWS):
                    rows = min(INIT_CHUNK_ROWS, t.num_embeddings - start)
                    chunk = torch.empty(rows, t.embedding_dim)
                    if init is None:
                        init_table_rows(
                            chunk, t.name, seed, table_rows=t.num_embeddings, row_start=start
                        )
                    else:
                        init(k, chunk, start)
                    weights[row + start : row + start + rows] = chunk.numpy()
                    pages.drop(weights, row + start, row + start + rows - 1)
        memmap.flush()

    def _open(self) -> np.memmap:
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no tiered embedding file to resume from")
        with self.path.open("rb") as f:
            raw = f.read(HEADER_BYTES)
        try:
            header = json.loads(raw.decode().rstrip())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.path}: not a tiered embedding file ({e})") from None
        if not isinstance(header, dict) or header.get("magic") != MAGIC:
            raise ValueError(f"{self.path}: not a tiered embedding file (no {MAGIC} header)")
        wanted = self._header()
        for key in ("format", "tables", "optimizer"):
            if header.get(key) != wanted[key]:
                raise ValueError(
                    f"{self.path}: header field {key!r} is {header.get(key)!r}, but this bag "
                    f"needs {wanted[key]!r}"
                )
        size, expected = self.path.stat().st_size, self._file_bytes()
        if size != expected:
            raise ValueError(
                f"{self.path}: {size} bytes, but the layout in its header needs {expected} "
                "(truncated or damaged)"
            )
        self.step = int(header["step"])
        # A file written sparse (before files were reserved, or copied) gets its holes'
        # blocks now: writing into a hole of a full disk would be a SIGBUS.
        with self.path.open("r+b") as f:
            _reserve(f.fileno(), self.path, size, new=False)
        return np.memmap(self.path, np.float32, "r+", offset=HEADER_BYTES)

    def flush(self) -> None:
        """Write the mapping's dirty pages and the header (with ``step``) to the file."""
        self.memmap.flush()
        self._write_header()

    def discard(self) -> None:
        """Delete the file, unflushed; the object is unusable after."""
        del self.memmap, self.pages, self.regions
        self.path.unlink(missing_ok=True)

    def region_of(self, k: int) -> Region:
        """The region holding table ``k``."""
        start = int(self.starts[k])
        return next(r for r in self.regions if r.start <= start < r.end)

    def views(self, k: int, first: int, end: int) -> dict[str, torch.Tensor]:
        """Rows ``[first, end)`` of table ``k``: its weights (``"weight"``) and each
        optimizer state part (keyed as the bag's ``state``), as views of the file."""
        region = self.region_of(k)
        offset = int(self.starts[k]) - region.start
        parts = [torch.from_numpy(part[offset + first : offset + end]) for part in region.parts]
        views = {"weight": parts[0]}
        for part, view in zip(self.optimizer.state_parts, parts[1:], strict=True):
            views[part.name] = view.view(-1) if part.per_row else view
        return views


def _make_directories(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; return those created, deepest first,
    for a failed creation to remove."""
    missing = []
    for path in [directory, *directory.parents]:
        if path.exists():
            break
        missing.append(path)
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def _free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    try:
        stat = os.statvfs(path.parent)
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        return None
    return stat.f_bavail * stat.f_frsize


def _no_space(path: Path, size: int, free: int | None) -> DiskSpaceError:
    have = "" if free is None else f", but its file system has {format_bytes(free)} free"
    return DiskSpaceError(
        f"{path}: the embedding rows and optimizer state kept on disk need "
        f"{format_bytes(size)}{have}; free space there or keep the file elsewhere"
    )


def _check_free(path: Path, size: int) -> None:
    """Refuse at once a file larger than the free space (reserving would fail anyway,
    after briefly filling the disk for every other writer)."""
    free = _free_bytes(path)
    if free is not None and size > free:
        raise _no_space(path, size, free)


def _reserve(fd: int, path: Path, size: int, *, new: bool) -> None:
    """Allocate every block of the open file ``fd`` (``size`` bytes), keeping its contents:
    writes through the mapping then never meet a full disk. Where the file system cannot
    reserve (no ``posix_fallocate``, or it says not supported), the file stays sparse: a
    ``new`` one was checked against the free space first. A ``new`` file that does not fit
    is emptied before the free space is reported."""
    if not hasattr(os, "posix_fallocate"):  # macOS, Windows
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            if new:
                os.ftruncate(fd, 0)  # give back what it got, then say what is free
            raise _no_space(path, size, _free_bytes(path)) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
