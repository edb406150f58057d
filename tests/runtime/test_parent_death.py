"""A child the kernel kills when its parent dies (``runtime.parent_death``), and a plain
False where ``prctl`` cannot be asked."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import dlrmflow
from dlrmflow.runtime.parent_death import signal_on_parent_death

REPO = Path(dlrmflow.__file__).resolve().parent.parent

# The parent starts a child that asks for SIGKILL at its parent's death, says whether it
# will and its pid, then sleeps; the parent ends as soon as the child has asked.
PARENT = """
import subprocess, sys
CHILD = '''
import os, sys, time
from dlrmflow.runtime.parent_death import signal_on_parent_death
print(signal_on_parent_death(9), os.getpid(), flush=True)
time.sleep(60)
'''
child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline(), end="", flush=True)
"""


def _gone(pid: int) -> bool:
    """Whether ``pid`` has ended (exited, or a zombie that nothing reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_parent():
    # Fails when this system's C library has no prctl, or the kernel refuses it: children
    # of a killed command would outlive it.
    parent = subprocess.run(
        [sys.executable, "-c", PARENT], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert parent.returncode == 0, parent.stderr[-2000:]
    armed, pid = parent.stdout.split()
    assert armed == "True"
    deadline = time.monotonic() + 30
    while not _gone(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _gone(int(pid)):
        os.kill(int(pid), signal.SIGKILL)
        pytest.fail("the child outlived its parent")


def _no_library(*args, **kwargs):
    raise OSError("cannot load the C library")


@pytest.mark.parametrize(
    "library",
    [
        _no_library,
        lambda *args, **kwargs: types.SimpleNamespace(),  # a C library without prctl
        lambda *args, **kwargs: types.SimpleNamespace(prctl=lambda *args: -1),  # refused
    ],
    ids=["no_library", "no_prctl", "refused"],
)
def test_where_prctl_cannot_be_asked_it_says_so_and_raises_nothing(monkeypatch, library):
    monkeypatch.setattr(ctypes, "CDLL", library)
    assert signal_on_parent_death(signal.SIGKILL) is False
