"""The loader graph: readers behind prefetch threads, taking turns, closable.

Readers are threads, not processes: pyarrow, numpy and torch release the GIL, so readers
run in parallel with training and a batch reaches the consumer without an inter-process
copy. Each reader is a ``torchdata.nodes`` node (``ingest.reader.SplitReader``) behind a
prefetch thread (``ReaderPrefetcher``, which passes a reader's errors on unchanged);
``RoundRobin`` interleaves them in a fixed order, and ``make_loader`` wraps the graph in a
``Loader`` that can be closed (``ReaderLoader``: it stops and waits for every thread).
Inside a reader, ``threads`` preparation threads (two where the cores allow, see
``reader_threads``) prepare its windows.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from collections.abc import Sequence
from typing import Any

from torchdata.nodes import BaseNode, Loader, Prefetcher

from dlrmflow.ingest.reader import ParquetBatchDataset, SplitReader
from dlrmflow.runtime.torchdata_threads import stop_prefetch_thread


class RoundRobin(BaseNode[Any]):
    """One item from each source in turn; a source that runs out leaves the rotation.

    The order depends only on the sources, never on which one is ready first, so a run's
    batch order is reproducible. The state holds whose turn it is, the sources still in the
    rotation and every source's state.
    """

    def __init__(self, sources: Sequence[BaseNode[Any]]) -> None:
        super().__init__()
        if not sources:
            raise ValueError("RoundRobin needs at least one source")
        self.sources = list(sources)
        self._active: list[int] = []  # indices into sources, in rotation order
        self._turn = 0  # index into _active

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            for source in self.sources:
                source.reset()
            self._active, self._turn = list(range(len(self.sources))), 0
            return
        if "sources" not in initial_state:
            raise ValueError(
                "not a round-robin state (was it saved by a loader with num_workers=0?)"
            )
        states = initial_state["sources"]
        if len(states) != len(self.sources):
            raise ValueError(
                f"state holds {len(states)} sources, this round robin has {len(self.sources)} "
                "(was it saved with another num_workers?)"
            )
        for source, state in zip(self.sources, states, strict=True):
            source.reset(state)
        self._active = [int(i) for i in initial_state["active"]]
        self._turn = int(initial_state["turn"])

    def next(self) -> Any:
        while self._active:
            source = self.sources[self._active[self._turn]]
            try:
                item = next(source)
            except StopIteration:
                del self._active[self._turn]
                if self._turn == len(self._active):
                    self._turn = 0
                continue
            self._turn = (self._turn + 1) % len(self._active)
            return item
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {
            "turn": self._turn,
            "active": list(self._active),
            "sources": [source.state_dict() for source in self.sources],
        }

    def close(self) -> None:
        """Close every source that can be closed (ends their threads)."""
        for source in self.sources:
            close_node(source)


def close_node(node: BaseNode[Any]) -> None:
    """``node.close()``, for the nodes that hold threads or connections; others have none."""
    close = getattr(node, "close", None)
    if close is not None:
        close()


class _KeepError(BaseNode[Any]):
    """``source`` unchanged, keeping the error that its ``next`` or state last raised.

    torchdata's prefetch thread passes an error on as its type and formatted traceback
    only; the consumer raises the kept original instead (see ``ReaderPrefetcher``). The
    state is the source's own, so states are those of a plain ``Prefetcher``. With
    ``pin_memory`` each item is copied to page-locked memory here, in the prefetch thread
    (items with a ``pin_memory()`` method, such as the features' ``Batch``).
    """

    def __init__(self, source: BaseNode[Any], pin_memory: bool = False) -> None:
        super().__init__()
        self.source = source
        self.pin_memory = pin_memory
        self.error: Exception | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.error = None
        self.source.reset(initial_state)

    def next(self) -> Any:
        try:
            item = next(self.source)
            return item.pin_memory() if self.pin_memory else item
        except StopIteration:
            raise
        except Exception as e:
            self.error = e
            raise

    def get_state(self) -> dict[str, Any]:
        try:
            return self.source.state_dict()
        except Exception as e:
            self.error = e
            raise

    def close(self) -> None:
        close_node(self.source)

    def take_error(self) -> Exception | None:
        error, self.error = self.error, None
        return error


class ReaderPrefetcher(Prefetcher):
    """torchdata's ``Prefetcher`` (a thread keeping ``prefetch_factor`` items of ``source``
    ready), for reader nodes: their errors arrive whole, and their threads can be stopped.

    An error raised in the thread reaches the consumer as itself: its type, one-line
    message and cause, not torchdata's copy whose message is "Caught DataError in
    _populate_queue" and the thread's traceback. ``close()`` stops the thread and closes
    ``source``, waiting for both; the next ``reset`` starts afresh. Prefetchers still open
    when the interpreter exits are closed then (``_close_open_prefetchers``): the thread is
    a daemon, and one caught inside a torch call as the interpreter finalizes aborts the
    process ("terminate called without an active exception", exit 134).
    """

    JOIN_TIMEOUT_S = 10.0  # a thread ends once its source's current item is done

    def __init__(
        self, source: BaseNode[Any], prefetch_factor: int, pin_memory: bool = False
    ) -> None:
        self._kept = _KeepError(source, pin_memory)
        super().__init__(self._kept, prefetch_factor)
        _open_prefetchers.add(self)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        try:
            # Starting the thread may fail in it (the source's first state, e.g. a reader
            # server asked for it that cannot be reached).
            super().reset(initial_state)
        except Exception as wrapped:
            error = self._kept.take_error() or wrapped
        else:
            return
        raise error

    def next(self) -> Any:
        try:
            return super().next()
        except StopIteration:
            raise
        except Exception as wrapped:
            error = self._kept.take_error() or wrapped
        # Raised outside the handler: the original's context stays its own.
        raise error

    def close(self) -> None:
        stop_prefetch_thread(self, lambda: close_node(self._kept), self.JOIN_TIMEOUT_S)


_open_prefetchers: weakref.WeakSet[ReaderPrefetcher] = weakref.WeakSet()


@atexit.register
def _close_open_prefetchers() -> None:
    """Stop every prefetch thread before the interpreter finalizes (see ``ReaderPrefetcher``).

    Runs after the preparation pools were waited for; a failed close must not hide others.
    """
    for prefetcher in list(_open_prefetchers):
        with contextlib.suppress(Exception):
            prefetcher.close()


class ReaderLoader(Loader[Any]):
    """torchdata's ``Loader`` over a reader graph, plus ``close()``: it stops every reader
    and preparation thread and waits for them (a later ``for`` starts them again). Also a
    context manager that closes on exit."""

    def close(self) -> None:
        close_node(self.root)

    def __enter__(self) -> ReaderLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def reader_threads(num_workers: int) -> int:
    """Preparation threads per reader when not given: two where the cores allow, else one.

    With two, a reader prepares its next two windows at once (the consumer waits less on
    one core's decode). More threads than cores only add contention: two readers of two
    threads each on two cores used more CPU per row than two of one thread.
    """
    return max(1, min(2, _cores() // max(1, num_workers)))


def make_loader(
    dataset: ParquetBatchDataset,
    num_workers: int = 1,
    prefetch_factor: int = 4,
    threads: int | None = None,
    pin_memory: bool = False,
) -> ReaderLoader:
    """A resumable loader whose ``num_workers`` readers run ahead of the consumer.

    Each reader prepares windows in ``threads`` threads (default ``reader_threads``) and
    keeps up to ``prefetch_factor`` batches ready; with ``num_workers=0`` the one reader
    hands its batches out in the consumer's thread (its preparation threads still work
    ahead). ``threads`` changes nothing but speed: the batches are the same. ``for batch
    in loader`` starts a fresh pass over the epoch set with ``dataset.set_epoch``, unless a
    state was loaded with ``load_state_dict``: then the pass resumes in that state's epoch,
    right after its last batch. A state taken after an epoch's last batch restores to a
    fresh pass, so call ``set_epoch`` with the next epoch first. With ``pin_memory`` (for a
    GPU trainer) each reader's prefetch thread pins the batches it hands out; states are
    the same either way. A reader's error
    (a ``DataError`` naming the file, row group and column) is raised as it was raised in
    the reader's thread; ``close()`` stops the threads.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be non-negative, got {num_workers}")
    if prefetch_factor < 1:
        raise ValueError(f"prefetch_factor must be positive, got {prefetch_factor}")
    if threads is None:
        threads = reader_threads(num_workers)
    if num_workers == 0:
        return ReaderLoader(SplitReader(dataset, threads=threads))
    readers = [
        ReaderPrefetcher(
            SplitReader(dataset, worker, num_workers, threads), prefetch_factor, pin_memory
        )
        for worker in range(num_workers)
    ]
    return ReaderLoader(RoundRobin(readers))
