"""Stopping a torchdata ``Prefetcher``'s thread (``runtime.torchdata_threads``): waited for
through torchdata's private iterator where it is as written against, left to end by itself
where it has moved."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from torchdata.nodes import BaseNode, IterableWrapper, Prefetcher

from dlrmflow.runtime.torchdata_threads import stop_prefetch_thread

# It times waits and signals: run alone, after the rest of the suite (make test).
pytestmark = pytest.mark.serial


class Endless(BaseNode[int]):
    """A source whose ``next()`` blocks until it is closed, as a reader waiting on I/O."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = threading.Event()
        self.count = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)

    def next(self) -> int:
        if self.count >= 2:
            self.closed.wait()
            raise StopIteration
        self.count += 1
        return self.count

    def get_state(self) -> dict[str, Any]:
        return {}


def _started(source: BaseNode[int]) -> Prefetcher:
    prefetcher = Prefetcher(source, prefetch_factor=2)
    prefetcher.reset()
    assert next(prefetcher) == 1  # the thread is running, now blocked in the source
    return prefetcher


def test_the_installed_torchdata_keeps_the_thread_where_it_is_reached():
    # Fails when a torchdata release moves the iterator's stop event or thread: the close
    # would fall back to not waiting for the thread.
    prefetcher = _started(IterableWrapper(range(1, 10)))
    iterator = prefetcher._it
    assert isinstance(iterator._stop_event, threading.Event)
    assert isinstance(iterator._thread, threading.Thread)
    assert stop_prefetch_thread(prefetcher, lambda: None, timeout=10)


def test_a_thread_blocked_in_its_source_is_stopped_and_waited_for():
    source = Endless()
    prefetcher = _started(source)
    thread = prefetcher._it._thread
    started = time.monotonic()
    assert stop_prefetch_thread(prefetcher, source.closed.set, timeout=10)
    assert not thread.is_alive() and time.monotonic() - started < 5


class _MovedIterator(Iterator[int]):
    """A torchdata iterator whose private pieces have moved, with only ``_shutdown`` left."""

    def __init__(self) -> None:
        self.shut_down = False

    def __next__(self) -> int:
        raise StopIteration

    def _shutdown(self) -> None:
        self.shut_down = True


def test_where_the_pieces_moved_the_source_is_closed_and_the_thread_left_to_end():
    closed = []
    moved = _MovedIterator()
    holder = type("Node", (), {"_it": moved})()
    assert not stop_prefetch_thread(holder, lambda: closed.append(True), timeout=10)
    assert closed == [True] and moved.shut_down
    # Nothing started: only the source is closed.
    assert stop_prefetch_thread(type("Node", (), {"_it": None})(), lambda: closed.append(1), 1)
    assert closed == [True, 1]
