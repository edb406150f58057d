"""Day files: written beside the old ones, identified by a digest in their own footer.

A dataset changes by writing each new day file under a name of its own
(``day=K/part-<name>.parquet``) beside the files the current ``manifest.json`` lists, then
switching the manifest, then removing the files it no longer lists. The name is a hash of
what the file's content is made from (the generator's parameters, or the raw input's
fingerprint and the conversion options), so writing the same day again produces the same
file under the same name, and anything else a new name: a reader of the old dataset, or a
run interrupted at any point, never meets a listed file with other content.

Each file's identity is the SHA-256 of its bytes before the Parquet footer (every data
page, in the order written), computed as the writer writes them and stored in the footer's
key-value metadata (``DIGEST_KEY``, with the day under ``DAY_KEY``); the manifest records
it with the file's size. It depends on that day's rows and encoding alone, so the same
data written again gets the same identity, and a day can be added without reading the
others. ``check_dataset`` compares footers with the manifest before work starts, and the
reader compares them again whenever it opens a file.

Files are opened for checking without blocking: a FIFO or device in a day file's place is
refused from its type, before anything is read.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import re
import stat
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import fsspec
import fsspec.core
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from dlrmflow.atomic_writes import OutputError, nearly_full, open_output

DIGEST_KEY = "dlrmflow.digest"
DAY_KEY = "dlrmflow.day"
# A day folder, and what ingest writes in one: day files and (while writing) temporaries,
# ours or those of an earlier layout (``part-00000.parquet``, ``_part-00000.parquet.partial``).
_DAY_DIR = re.compile(r"day=(\d+)")
_DAY_FILE = re.compile(r"part-[^/]*\.parquet")
_TEMPORARY = re.compile(r"(\.part-[^/]*\.tmp|_part-[^/]*\.partial)")
# Hex digits of a content hash in a file name: 64 bits, no collision among a dataset's days.
_NAME_DIGITS = 16


class NotRegularFile(OSError):
    """A day file's path holds something other than a regular file (a FIFO, a folder)."""


class DayWriteError(OutputError):
    """A day file that could not be written; the message names the day and the file."""


@dataclass(frozen=True)
class WrittenDay:
    """A finished day file: its path relative to the dataset root, digest and size."""

    path: str
    digest: str
    bytes: int


@dataclass(frozen=True)
class Stamp:
    """What tells one version of a file from another without reading it: its size, and
    where the file system reports them, its inode and modification time."""

    size: int
    version: tuple[Any, ...] = ()


def file_name(*parts: object) -> str:
    """A day file's name from what its content is made of (see the module docstring)."""
    text = "\0".join(map(str, parts))
    return f"part-{hashlib.sha256(text.encode()).hexdigest()[:_NAME_DIGITS]}.parquet"


def day_of(path: str) -> int | None:
    """The day of a path in the day-partitioned layout (``.../day=K/...``), if it is one."""
    for part in reversed(path.split("/")[:-1]):
        match = _DAY_DIR.fullmatch(part)
        if match:
            return int(match.group(1))
    return None


def day_path(path: str, day: int | None = None) -> str:
    """``day K: PATH`` for error messages (the day from the path when not given)."""
    day = day if day is not None else day_of(path)
    return path if day is None else f"day {day}: {path}"


class _HashingSink:
    """The file object a ``ParquetWriter`` writes to: hashes and counts every byte on its
    way to ``file``, and turns a failed write into a ``DayWriteError`` naming the day."""

    def __init__(self, file: IO[bytes], url: str, day: int) -> None:
        self._file, self.url, self.day = file, url, day
        self.hash = hashlib.sha256()
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        try:
            written = self._file.write(data)
        except OSError as e:
            raise self.failure(e) from e
        self.hash.update(data)
        self.size += len(memoryview(data))
        return written if written is not None else len(memoryview(data))

    def failure(self, error: BaseException) -> DayWriteError:
        local = _local_path(self.url)
        if isinstance(error, OSError) and error.errno is not None:
            reason = os.strerror(error.errno)
        elif local is not None and nearly_full(local):
            reason = os.strerror(errno.ENOSPC)
        else:
            reason = f"{type(error).__name__}: {error}"
        return DayWriteError(f"day {self.day}: {self.url}: could not be written: {reason}")


class DayFileWriter:
    """Writes one day's Parquet file; ``finish`` seals its footer with the file's digest."""

    def __init__(self, sink: _HashingSink, schema: pa.Schema, relative: str) -> None:
        self._sink, self.relative = sink, relative
        self._writer = pq.ParquetWriter(sink, schema)
        self.result: WrittenDay | None = None

    def write_table(self, table: pa.Table, row_group_size: int | None = None) -> None:
        self._writer.write_table(table, row_group_size=row_group_size)

    def finish(self) -> WrittenDay:
        """Close the file with ``DIGEST_KEY`` and ``DAY_KEY`` in its footer."""
        digest = self._sink.hash.hexdigest()
        data_bytes = self._sink.size
        self._writer.add_key_value_metadata({DIGEST_KEY: digest, DAY_KEY: str(self._sink.day)})
        self._writer.close()
        # The digest covers every byte before the footer only if the writer wrote no data
        # at close (pyarrow closes each row group as ``write_table`` returns): a writer that
        # did would leave data out of the identity, so it must fail here, not pass unseen.
        metadata = self._writer.writer.metadata
        for g in range(metadata.num_row_groups):
            for c in range(metadata.num_columns):
                chunk = metadata.row_group(g).column(c)
                start = (
                    chunk.dictionary_page_offset
                    if chunk.has_dictionary_page
                    else chunk.data_page_offset
                )
                if start + chunk.total_compressed_size > data_bytes:
                    raise AssertionError(f"{self._sink.url}: data written after its digest")
        self.result = WrittenDay(self.relative, digest, self._sink.size)
        return self.result

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()


@contextlib.contextmanager
def day_file_writer(root: str, day: int, name: str, schema: pa.Schema) -> Iterator[DayFileWriter]:
    """A writer for ``ROOT/day=DAY/NAME``, published (renamed into place, where the file
    system allows) only when the block ends without error; call ``finish`` before then.

    A failed or interrupted write leaves no file under ``NAME``; a failure to write (a
    full disk) is a ``DayWriteError`` naming the day and the file.
    """
    relative = f"day={day}/{name}"
    url = join(root, relative)
    fs, root_path = fsspec.core.url_to_fs(root)
    try:
        fs.makedirs(join(root_path, f"day={day}"), exist_ok=True)
        with open_output(url) as f:
            sink = _HashingSink(f, url, day)
            writer = DayFileWriter(sink, schema, relative)
            try:
                yield writer
            except BaseException as e:
                writer.abort()
                if isinstance(e, OSError) and not isinstance(e, OutputError):
                    # Not the output's failure (a raw input that cannot be read): carried
                    # past ``open_output``, which would take it for one.
                    raise _Carried(e) from e
                raise
            if writer.result is None:
                raise AssertionError(f"{url}: the day file was not finished")
    except _Carried as carried:
        raise carried.error from None
    except DayWriteError:
        raise
    except OutputError as e:
        raise DayWriteError(f"day {day}: {e}") from e
    except OSError as e:
        raise DayWriteError(f"day {day}: {url}: could not be written: {_reason(e)}") from e


class _Carried(Exception):
    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _reason(error: OSError) -> str:
    return os.strerror(error.errno) if error.errno is not None else str(error)


def footer_identity(metadata: pq.FileMetaData) -> tuple[int | None, str | None]:
    """The day and digest a day file's footer records (None where it records none)."""
    kv = metadata.metadata or {}
    day = kv.get(DAY_KEY.encode())
    digest = kv.get(DIGEST_KEY.encode())
    try:
        day_number = int(day) if day is not None else None
    except ValueError:
        day_number = None
    return day_number, digest.decode("ascii", "replace") if digest is not None else None


# A registered file's identity in a manifest: the SHA-256 of its Parquet footer (the file
# metadata: every row group's offsets, sizes and statistics), which a rewritten or replaced
# file changes without the data being read.
FOOTER_DIGEST = "footer-sha256:"


def footer_digest(f: IO[bytes], size: int) -> str:
    """``FOOTER_DIGEST`` and the SHA-256 of the Parquet footer of the open file ``f`` of
    ``size`` bytes (its last 8 bytes: the footer's length and ``PAR1``)."""
    if size < 12:
        raise ValueError(f"{size} bytes: too short for a Parquet file")
    f.seek(size - 8)
    tail = f.read(8)
    if tail[4:] != b"PAR1":
        raise ValueError("no Parquet magic at its end")
    length = int.from_bytes(tail[:4], "little")
    if length + 12 > size:
        raise ValueError(f"its footer of {length} bytes does not fit in {size}")
    f.seek(size - 8 - length)
    footer = f.read(length)
    f.seek(0)
    return FOOTER_DIGEST + hashlib.sha256(footer).hexdigest()


def _local_path(url: str) -> str | None:
    fs, path = fsspec.core.url_to_fs(url)
    return path if isinstance(fs, LocalFileSystem) else None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def local_stamp(st: os.stat_result) -> Stamp:
    return Stamp(st.st_size, (st.st_dev, st.st_ino, st.st_mtime_ns))


def open_regular(url: str) -> tuple[IO[bytes], Stamp]:
    """``url`` opened for reading, and its ``Stamp``, if it is a regular file.

    Never blocks: a local path is opened non-blocking and its type checked on the open
    descriptor, so a FIFO in a file's place is refused, not waited on. Raises
    ``FileNotFoundError`` for a missing file and ``NotRegularFile`` for anything else.
    """
    local = _local_path(url)
    if local is not None:
        fd = os.open(local, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFile(errno.EINVAL, f"is {_kind(st.st_mode)}, not a regular file")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb"), local_stamp(st)
        except BaseException:
            os.close(fd)
            raise
    fs, path = fsspec.core.url_to_fs(url)
    info = fs.info(path)
    if info.get("type") not in ("file", None):
        raise NotRegularFile(errno.EINVAL, f"is a {info.get('type')}, not a regular file")
    version = tuple(
        str(info[k]) for k in ("mtime", "created", "ETag", "md5Hash", "updated") if k in info
    )
    return fs.open(path, "rb"), Stamp(int(info.get("size") or 0), version)


def open_regular_for_arrow(url: str) -> tuple[Any, Stamp]:
    """As ``open_regular``, but a local file comes back as Arrow's native file, opened
    through the descriptor whose type was checked (``/proc/self/fd``), so that no FIFO
    swapped in meanwhile is opened blocking."""
    local = _local_path(url)
    if local is None:
        return open_regular(url)
    f, stamp = open_regular(url)
    with f:
        proc = f"/proc/self/fd/{f.fileno()}"
        return pa.OSFile(proc if os.path.exists(proc) else local), stamp


def remove_temporaries(root: str) -> None:
    """Remove what interrupted writes left in the day folders of ``root`` (unfinished
    files under a temporary name): called before a new write starts."""
    fs, root_path = fsspec.core.url_to_fs(root)
    for path in _day_folder_entries(fs, root_path, _TEMPORARY):
        _remove(fs, path)


def remove_unlisted(root: str, listed: Iterable[str], keep_days: Iterable[int]) -> None:
    """Remove day files (and temporaries) under ``root`` that are not in ``listed`` (paths
    relative to ``root``), then the day folders left empty outside ``keep_days``.

    Called once a new manifest is in place: until then the old files are the dataset.
    Only names ingest writes are touched; a file that cannot be removed is a warning (the
    new dataset is complete without its removal).
    """
    fs, root_path = fsspec.core.url_to_fs(root)
    keep = {posixpath.normpath(p) for p in listed}
    for path in _day_folder_entries(fs, root_path, _DAY_FILE, _TEMPORARY):
        if posixpath.normpath(posixpath.relpath(path, root_path)) not in keep:
            _remove(fs, path)
    days = set(keep_days)
    for folder, day in _day_folders(fs, root_path):
        if day not in days:
            with contextlib.suppress(OSError):
                if not fs.ls(folder, detail=False):
                    fs.rmdir(folder)


def discard_unlisted(root: str, written: Iterable[str], listed: Iterable[str] | None) -> None:
    """After a failed write: remove the day files it ``written`` (paths relative to
    ``root``) that the manifest in place does not list (``listed``; None when it could not
    be read: then nothing is removed), freeing their space. Errors are ignored: the run is
    failing already, and the next one removes them."""
    if listed is None:
        return
    fs, root_path = fsspec.core.url_to_fs(root)
    keep = {posixpath.normpath(p) for p in listed}
    for relative in written:
        if posixpath.normpath(relative) not in keep:
            with contextlib.suppress(Exception):
                fs.rm_file(join(root_path, relative))


def _day_folders(fs: fsspec.AbstractFileSystem, root: str) -> list[tuple[str, int]]:
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return []
    folders = []
    for entry in entries:
        match = _DAY_DIR.fullmatch(posixpath.basename(entry["name"].rstrip("/")))
        if match and entry.get("type") == "directory":
            folders.append((entry["name"].rstrip("/"), int(match.group(1))))
    return folders


def _day_folder_entries(
    fs: fsspec.AbstractFileSystem, root: str, *patterns: re.Pattern[str]
) -> list[str]:
    """Files in ``root``'s day folders whose names match ``patterns``."""
    found = []
    for folder, _ in _day_folders(fs, root):
        try:
            entries = fs.ls(folder, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            name = posixpath.basename(entry["name"])
            if entry.get("type") == "file" and any(p.fullmatch(name) for p in patterns):
                found.append(entry["name"])
    return found


def _remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        warnings.warn(f"{path}: could not be removed: {_reason(e)}", stacklevel=3)


def join(root: str, *parts: str) -> str:
    return posixpath.join(root.rstrip("/"), *parts)
