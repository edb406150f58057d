"""Running a region on torch's own OpenMP threads, through libgomp's ``GOMP_parallel``.

torch ships GNU OpenMP privately (``torch/lib/libgomp-*.so``) and offers no call to run
Python's work on its team. The compiled TBE step (``kernels.cpu_tbe``) splits its parts
over threads: after each torch op, torch's OpenMP threads spin a while waiting for the
next one, holding the cores, so a Python thread of ours that wakes then may wait its turn,
while a region on their team starts at once. What it reaches into, written against torch
2.13's libgomp (GCC's ``GOMP_parallel(fn, data, threads, flags)``, stable since GCC 4.9):
the library found among this process's mappings (``/proc/self/maps``) in torch's library
directory, and that symbol.

Gain, measured on the forward and backward of a batch of 4096 over Criteo's 26 tables
capped at 200k rows, dim 128, in rounds alternating torch's team with a pool of Python
threads: a one-hot step is faster on the team, row-wise Adagrad and SGD alike; with 20
IDs a bag the gain is small. The figures, with the machine they came from, are in this module's
commit history.

Fallback: anything unexpected (not mapped, not loadable, no such symbol, a trial region
that fails or does not run the work, a call that fails later, a forked child) makes
``omp_runner`` None and the caller uses its pool of Python threads, with bitwise the same
results. ``tests/runtime/test_gomp.py`` runs every fallback and fails when torch here
ships a libgomp that cannot be used.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

import torch

OmpRunner = Callable[[Callable[[], None], int], None]
_OMP_BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_IMPORT_PID = os.getpid()
_omp: tuple[int, OmpRunner | None] | None = None  # (pid, the runner or None)


def omp_runner() -> OmpRunner | None:
    """``run(body, threads)`` running ``body()`` on ``threads`` of torch's OpenMP threads
    (this one among them), or None where the pool of Python threads must do instead.

    None in a forked child: libgomp's threads do not survive a fork, and a parallel region
    there would hang.
    """
    global _omp
    pid = os.getpid()
    if _omp is None or _omp[0] != pid:
        _omp = (pid, _load_omp_runner() if pid == _IMPORT_PID else None)
    return _omp[1]


def give_up() -> None:
    """Send this process's later steps to the pool of Python threads."""
    global _omp
    _omp = (os.getpid(), None)


def _load_omp_runner() -> OmpRunner | None:
    """The runner over torch's libgomp, if it loads, has ``GOMP_parallel`` and passes a
    trial region; else None."""
    library = _load_torch_libgomp()
    if library is None:
        return None
    try:
        parallel = library.GOMP_parallel
        # void GOMP_parallel(void (*fn)(void *), void *data, unsigned threads, unsigned flags)
        parallel.argtypes = [_OMP_BODY, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        parallel.restype = None
    except AttributeError:
        return None

    def run(body: Callable[[], None], threads: int) -> None:
        parallel(_OMP_BODY(lambda _: body()), None, threads, 0)

    return run if _runs_as_expected(run) else None


def _runs_as_expected(run: OmpRunner) -> bool:
    """Whether a region of two threads runs its body once or twice (a team may be given
    fewer threads), this thread's call among them, and returns without an error."""
    callers: list[int] = []
    lock = threading.Lock()

    def body() -> None:
        with lock:
            callers.append(threading.get_ident())

    try:
        run(body, 2)
    except Exception:  # noqa: BLE001 - any failure of the runtime means: do without it
        return False
    return 1 <= len(callers) <= 2 and threading.get_ident() in callers


def _load_torch_libgomp() -> ctypes.CDLL | None:
    """The libgomp this process already has mapped from torch's library directory."""
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.dirname(os.path.realpath(path)) == os.path.realpath(torch_lib):
            try:
                return ctypes.CDLL(path)
            except OSError:
                return None
    return None
