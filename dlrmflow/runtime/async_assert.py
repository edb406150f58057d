"""A check on tensor values that an exported program keeps and that never waits for the device.

The servable export (``train.run.exported_model``) checks its inputs itself: offsets that rise
from 0 to the number of IDs, every ID inside its feature's table. A Python ``if`` on a
tensor cannot be traced into a ``torch.export`` program (its branch would be decided once,
at export), and on a GPU it would copy the flag to the host and stall the stream at every
call. torch's assertion operator does neither: the exporter records it as a node of the
program, and it raises when the program runs on inputs that fail it. What it reaches into,
written against torch 2.13.0: ``torch._assert_async(condition, message)`` (the operator
``aten::_assert_async.msg``). Gain: a raw consumer of an export gets an error, not the
score of a row of another table, at no synchronisation.

Fallback: none public (``torch._check`` takes a Python bool, not a tensor). Where torch no
longer has it, ``assert_async`` raises ``MissingPiece`` in one line naming the torch
version, so an export stops rather than leaving out its check.
``tests/runtime/test_async_assert.py`` exports a program with the check and runs it.
"""

from __future__ import annotations

import torch

from dlrmflow.runtime.missing import MissingPiece

CHECKED_AGAINST = "torch 2.13.0"


def assert_async(condition: torch.Tensor, message: str) -> None:
    """Fail with ``message`` where ``condition`` (a one-element bool tensor) is False: when
    the kernel runs, or when the exported program that traced this call runs."""
    check = getattr(torch, "_assert_async", None)
    if check is None:
        raise MissingPiece(
            "torch._assert_async",
            f"torch {torch.__version__}",
            CHECKED_AGAINST,
            "the input check of a servable export",
        )
    check(condition, message)
