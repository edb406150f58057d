"""Which implementation runs the TBE and the interaction: one choice for the whole model.

Three implementations share each op's semantics (see ``tbe`` and ``interaction``): plain
torch ops (any device), the compiled CPU kernels (``cpu_tbe``; CPU tensors) and the Triton
kernels (``triton_tbe``, ``triton_interaction``; CUDA tensors, or CPU tensors under Triton's
interpreter). ``auto`` takes the fastest one the tensors' device has. Forcing one is how the
Triton path is tested on a machine without a GPU, and how a slow kernel is ruled out when
a result looks wrong.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from dlrmflow.errors import DlrmflowError

KERNELS = ("auto", "torch", "compiled", "triton")


class KernelUnavailable(DlrmflowError, RuntimeError):
    """The kernels asked for cannot run here (the message says why and what to do)."""


def check_kernels(kernels: str, device: torch.device) -> None:
    """Fail in one line, before any work, when ``kernels`` cannot run on ``device``.

    Triton on CPU tensors runs only under its interpreter, which reads TRITON_INTERPRET when
    ``triton.language`` is first imported: set too late, the kernels would fail at their
    first launch with an error about pointers, far from the cause.
    """
    if kernels not in KERNELS:
        raise KernelUnavailable(f"model.kernels must be one of {KERNELS}, not {kernels!r}")
    if kernels == "compiled" and device.type != "cpu":
        raise KernelUnavailable(
            f"model.kernels=compiled runs on CPU tensors only, and the model is on {device}; "
            "use auto, torch or triton"
        )
    if kernels != "triton":
        return
    if importlib.util.find_spec("triton") is None:
        raise KernelUnavailable(
            "model.kernels=triton needs the triton package (pip install triton, or the "
            "dlrmflow[dev] extra)"
        )
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise KernelUnavailable(
            "model.kernels=triton on CPU tensors runs under Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before starting"
        )
    if device.type == "cpu" and "triton.language" in sys.modules and not _interpreting():
        raise KernelUnavailable(
            "model.kernels=triton on CPU tensors: triton was imported before TRITON_INTERPRET=1 "
            "was set; set it in the environment before starting"
        )


def _interpreting() -> bool:
    """Whether the imported ``triton.language`` was set up for the interpreter: its own
    jit'd helpers (``tl.sum``) are interpreted functions only when TRITON_INTERPRET=1 was
    set at its import."""
    import triton.language as tl

    return type(tl.sum).__name__ == "InterpretedFunction"


def resolve(kernels: str, tensor: torch.Tensor) -> str:
    """The implementation that runs for ``tensor``'s device: "torch", "compiled" or "triton".

    ``auto``: Triton on CUDA when it is installed, the compiled kernels on float32 CPU
    tensors, torch ops otherwise. A forced choice is taken as is (``check_kernels`` has
    said whether it can run).
    """
    if kernels == "auto":
        if tensor.is_cuda:
            from dlrmflow.kernels import triton_tbe

            return "triton" if triton_tbe.available() else "torch"
        return "compiled" if tensor.device.type == "cpu" else "torch"
    return kernels
