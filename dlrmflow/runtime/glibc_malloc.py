"""The process's memory allocator, set for training: large buffers are reused, not remapped.

Every training step allocates and frees the same large, short-lived buffers: the pooled
embeddings and their gradients (4096 samples x 26 tables x 128 floats is 54 MB), the
reader's shuffle windows. glibc's malloc serves a request above its mmap threshold (32 MiB
at most, adjusted as it goes) with a fresh mapping and unmaps it on free, so each step
pays a page fault and the kernel's zeroing for every 4 KiB page again: ~40,000 faults a
step for a TBE at dim 128 with the dot interaction, a large share of the TBE's forward
time. With the threshold raised, those blocks stay in the heap and later steps reuse
them (the same step measured 0-14,000 faults; ``tests/test_memory.py`` keeps it so).

Threads other than the main one get arenas of their own from glibc, carved out of 64 MiB
heaps that are unmapped as soon as they empty, whatever the trim threshold: a reader thread
that builds a 40 MB shuffle window, hands it out and builds the next faulted in fresh pages
for each (1,000-9,000 faults per million rows read, and the kernel time they cost). So
the process also keeps to one arena, the main heap, where the thresholds hold; its lock
is taken rarely enough (Python's small objects never reach malloc) to cost nothing
measurable.

The price is memory: freed blocks below the trim threshold stay with the process rather
than going back to the system, so its resident size stays near its peak. That is how a
training process behaves anyway (it allocates the same sizes every step). Set
``DLRMFLOW_MMAP_THRESHOLD`` to a byte count to choose another threshold, or to 0 to leave
glibc's defaults alone. Elsewhere than glibc (macOS, musl) nothing changes.

Written against glibc 2.36 (``mallopt`` and its three parameters are public in glibc since
2.10, absent elsewhere). Fallback: where there is no glibc (macOS, musl) or ``mallopt``
refuses a setting, nothing changes and ``tune_allocator`` returns None
(``tests/runtime/test_glibc_malloc.py``); ``tests/test_memory.py`` measures the faults it
saves.
"""

from __future__ import annotations

import ctypes
import os

ENV = "DLRMFLOW_MMAP_THRESHOLD"
DEFAULT_THRESHOLD = 1 << 30

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_applied: int | None = None


def tune_allocator() -> int | None:
    """Raise glibc's mmap and trim thresholds for this process and keep it to one arena;
    return the threshold set.

    None when left alone: not glibc, or ``DLRMFLOW_MMAP_THRESHOLD=0``. Idempotent; the
    CLI, every rank of a training job and ``train`` itself call it. A value that is not a
    non-negative integer raises a ValueError naming the variable.
    """
    global _applied
    raw = os.environ.get(ENV, str(DEFAULT_THRESHOLD))
    try:
        threshold = int(raw)
        if not 0 <= threshold < 2**31:  # mallopt takes a C int
            raise ValueError
    except ValueError:
        raise ValueError(
            f"{ENV}={raw!r}: must be a byte count below 2**31 (0 leaves malloc alone)"
        ) from None
    if threshold == 0:
        return None
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return None
    # Trimming above the same size: a freed block at the top of the heap is kept as well.
    # One arena: threads started from now on allocate from the main heap too.
    settings = [(_M_MMAP_THRESHOLD, threshold), (_M_TRIM_THRESHOLD, threshold), (_M_ARENA_MAX, 1)]
    if any(mallopt(param, value) != 1 for param, value in settings):
        return None
    _applied = threshold
    return threshold


def applied_threshold() -> int | None:
    """The mmap threshold ``tune_allocator`` set in this process, if any (benchmarks report it)."""
    return _applied


def _glibc_mallopt():
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: its C library's among them
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # TypeError: no CDLL(None) on Windows
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt
