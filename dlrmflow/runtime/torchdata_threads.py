"""Stopping the thread of a torchdata ``Prefetcher``, for which torchdata has no public call.

A reader's prefetch thread must end before the interpreter finalizes (one caught inside a
torch call then aborts the process) and before its source is reopened; a ``Prefetcher``
only stops it when garbage collected, through ``_shutdown``, which waits 0.5 s and gives
up. What it reaches into, written against torchdata 0.11.0: the node's iterator ``_it``
(``torchdata.nodes.map._SingleThreadedMapper``), whose ``_stop_event`` ends the thread's
loop at its next item and whose ``_thread`` is the thread. No speed is gained; what it
buys is a close that waits for the thread to end.

Fallback, where those attributes have moved: the source is closed and the iterator's
``_shutdown`` (if any) is called, so the thread ends once its current item is done,
without being waited for. ``tests/runtime/test_torchdata_threads.py`` runs both paths and
fails when the installed torchdata's iterator no longer has the attributes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any


def stop_prefetch_thread(prefetcher: Any, close_source: Callable[[], None], timeout: float) -> bool:
    """Stop ``prefetcher``'s thread: tell it to stop, ``close_source()`` (a thread waiting
    in the source's ``next()`` returns), then wait up to ``timeout`` seconds for it.

    True when the thread is known to have ended (or none was started); False when it was
    left to end by itself (the fallback) or is still running after ``timeout``."""
    iterator = getattr(prefetcher, "_it", None)
    stop = getattr(iterator, "_stop_event", None)
    thread = getattr(iterator, "_thread", None)
    if iterator is None:
        close_source()
        return True
    if stop is None or thread is None:
        close_source()
        shutdown = getattr(iterator, "_shutdown", None)
        if callable(shutdown):
            with contextlib.suppress(Exception):
                shutdown()
        return False
    stop.set()
    close_source()
    if thread.is_alive():
        thread.join(timeout)
    return not thread.is_alive()
