"""Safe output files: written beside their destination, then renamed over it.

A reader of an output (a scheduled flow, a serving job, a person) sees the old file or the
new one, never half of one; a full disk or a killed process leaves the destination as it
was. The rename only ever replaces a regular file: a directory, device, FIFO or socket at
the output path is refused, and a symlink is written through (its target is replaced, the
link stays), so a path that happens to point somewhere precious is never swapped for a
plain file behind the user's back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from dlrmflow.errors import DlrmflowError


class OutputError(DlrmflowError, OSError):
    """An output that cannot be written where asked; the message names the path and why."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def output_target(path: str | Path) -> Path:
    """The file a write to ``path`` replaces: ``path`` itself, or a symlink's final target.

    Raises ``OutputError`` when something other than a regular file is there, or when the
    path's folder cannot hold a file.
    """
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise OutputError(f"{path}: cannot write: {e.strerror}") from e
    if mode is not None and not stat.S_ISREG(mode):
        shown = f"{path} (a link to {target})" if target != path else str(path)
        raise OutputError(f"{shown} is {_kind(mode)}; refusing to replace it with a file")
    if target.parent.exists() and not target.parent.is_dir():
        raise OutputError(f"{target.parent} is not a directory; cannot write {target.name}")
    return target


# Below this much free space, a failed write is taken for a full disk: writers in C++ or
# Rust (torch's serializer, safetensors) report one without the OS error behind it
# ("unexpected pos N vs M").
NEARLY_FULL_BYTES = 1 << 20


def nearly_full(where: str | Path) -> bool:
    """Whether the file system holding ``where`` (or its nearest existing parent) is full."""
    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free < NEARLY_FULL_BYTES
    except OSError:
        return False


# The mode open() asks for when it creates a file; the umask then takes bits away.
_CREATE_MODE = 0o666


def current_umask() -> int:
    """This process's umask, read without changing it (``os.umask`` can only be read by
    setting it, which would race with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# How writers in Rust or C++ (safetensors, torch's archive writer) word a full disk in
# errors that are not ``OSError``s.
_FULL_DISK_WORDS = (os.strerror(errno.ENOSPC), "os error 28", "Errno 28")


def _says_full(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a full disk."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if any(words in str(seen) for words in _FULL_DISK_WORDS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _failure(path: Path, error: BaseException, full: bool = False) -> OutputError:
    """The one-line error for ``path``; ``full``: the disk was found full while writing
    (checked before the temporary file went, which gives the space back)."""
    if full or _says_full(error):
        reason = os.strerror(errno.ENOSPC)
        with contextlib.suppress(OSError):
            where = path.parent if path.parent.exists() else Path(".")
            reason += f" ({shutil.disk_usage(where).free // 1024} KiB free there)"
    elif isinstance(error, OSError) and error.errno is not None:
        reason = os.strerror(error.errno)
    else:
        reason = f"{type(error).__name__}: {error}"
    return OutputError(f"{path}: could not be written: {reason}")


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed over it when the block ends.

    For writers that want a file name (safetensors, torch.save). If the block raises, the
    temporary file is removed and the destination is untouched; an ``OSError`` (a full
    disk, no permission) becomes an ``OutputError`` naming ``path``.
    """
    target = output_target(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as e:
        raise _failure(Path(path), e) from e
    # mkstemp makes the file 0600 whatever the umask; an output is shared (workers, other
    # users of a file system) as any file this process creates would be.
    os.fchmod(fd, _CREATE_MODE & ~current_umask())
    os.close(fd)
    temporary = Path(name)
    try:
        yield temporary
        with open(temporary, "rb+") as f:
            os.fsync(f.fileno())
        output_target(path)  # nothing else appeared there while we wrote
        os.replace(temporary, target)
    except OutputError:
        temporary.unlink(missing_ok=True)
        raise
    except OSError as e:
        temporary.unlink(missing_ok=True)
        raise _failure(Path(path), e) from e
    except Exception as e:
        # Asked before the temporary file goes: its bytes are what filled the disk.
        full = _says_full(e) or nearly_full(target)
        temporary.unlink(missing_ok=True)
        if full:
            raise _failure(Path(path), e, full=True) from e
        raise
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: bytes | str | Callable[[Path], None]) -> Path:
    """Write ``data`` (bytes, text, or a function that writes a given path) to ``path``
    through a temporary file and a rename; returns the file written (a link's target)."""
    target = output_target(path)
    with atomic_path(path) as temporary:
        if callable(data):
            data(temporary)
        elif isinstance(data, str):
            temporary.write_text(data)
        else:
            temporary.write_bytes(data)
    return target


def _local(url: str) -> str | None:
    """The local path an fsspec URL names, or None for another file system."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return (
        path
        if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        else None
    )


@contextlib.contextmanager
def open_output(url: str) -> Iterator[BinaryIO]:
    """A binary file to write the output at ``url`` (any fsspec URL) through.

    Local files go through ``atomic_path``; other file systems (object stores, memory://)
    publish an object only when it is closed whole, so they are written directly.
    """
    import fsspec

    local = _local(url)
    if local is None:
        with fsspec.open(url, "wb") as f:
            yield f
        return
    with atomic_path(local) as temporary, open(temporary, "wb") as f:
        yield f


def write_url(url: str, data: bytes | str) -> None:
    """Write ``data`` (text as UTF-8) to ``url`` whole, as ``open_output`` does."""
    with open_output(url) as f:
        f.write(data.encode() if isinstance(data, str) else data)
