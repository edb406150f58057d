"""A child process that the kernel kills when its parent dies: Linux's ``PR_SET_PDEATHSIG``.

The processes a command starts (the launcher agent, its ranks, a test's servers) must not
outlive it: killed by SIGKILL, a command runs no code that could stop them, and they would
go on training into a run directory whose lock is gone. The kernel can send a child a
signal when its parent dies, if the child asks through ``prctl(2)``, which Python does not
expose. What it reaches into, written against Linux's ``prctl(PR_SET_PDEATHSIG, sig)``
(Linux 2.1.57 and later) through glibc 2.36's ``prctl``, found by ``ctypes`` among the
process's own symbols. Nothing is gained in speed; what it buys is that no rank or agent
outlives a killed command (``tests/train/launch/test_supervision.py``).

Fallback, where there is no ``prctl`` (not Linux, no C library to load) or it refuses:
``signal_on_parent_death`` returns False and nothing changes; the supervisor's own stop and
its watchdog still end the job, but a child of a SIGKILLed command lives on.
``tests/runtime/test_parent_death.py`` kills a parent and sees its child go, and runs the
fallback.
"""

from __future__ import annotations

import ctypes

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def signal_on_parent_death(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when the thread that started it ends;
    True when it will, False where it cannot be asked (nothing is changed then)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols
        prctl = libc.prctl
    except (OSError, AttributeError, TypeError):  # TypeError: no CDLL(None) on Windows
        return False
    return prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
