"""One writer per dataset: ``generate`` takes the dataset folder's lock while it writes.

Two writers into one folder would remove each other's temporaries and publish each
other's half-written days, so the second fails at once, naming the holder (the lock and
how it holds: ``dlrmflow.locks``). Only a local folder is locked: an object store has no
lock its other writers would see.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import fsspec

from dlrmflow.locks import DirectoryBusy, directory_lock


class DatasetBusy(DirectoryBusy):
    """Another process is writing the dataset."""


@contextlib.contextmanager
def dataset_lock(url: str, command: str) -> Iterator[None]:
    """Hold the lock of the dataset at ``url`` (a local folder) for the block;
    ``DatasetBusy`` at once if another writer has it."""
    fs, path = fsspec.core.url_to_fs(url)
    if "file" not in fs.protocol:
        yield
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"{path}: cannot be the dataset's folder: {e.strerror}") from e
    with directory_lock(
        path, command, DatasetBusy, "another writer holds the dataset: wait for it or stop it"
    ):
        yield
