"""Which implementation runs the TBE and the interaction: one choice for the whole model.

Four implementations share the TBE's semantics (see ``tbe``): plain torch ops (any
device), the compiled CPU kernels (``cpu_tbe``; CPU tensors), the Triton kernels
(``triton_tbe``; CUDA tensors, or CPU tensors under Triton's interpreter) and FBGEMM's
(``fbgemm_tbe``: fbgemm_gpu's CPU or CUDA build, whichever is installed). The interaction
has torch ops and Triton kernels (``interaction``); FBGEMM has none, so under ``fbgemm`` it
runs what ``auto`` would. ``auto`` takes the fastest one the tensors' device has: on CUDA
FBGEMM's kernels where they load and pass a test step, else Triton's, else torch's; on the
CPU the compiled kernels, which the kernel benchmark measures against FBGEMM's CPU kernels
(``dlrmflow bench kernels``). Forcing one is how the Triton path is tested on a machine
without a GPU, and how a slow kernel is ruled out when a result looks wrong.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from dlrmflow.errors import DlrmflowError

KERNELS = ("auto", "torch", "compiled", "triton", "fbgemm")


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
    if kernels == "fbgemm":
        from dlrmflow.kernels import fbgemm_tbe

        why = fbgemm_tbe.refusal(device.type)
        if why is not None:
            raise KernelUnavailable(
                f"model.kernels=fbgemm cannot run on {device.type}: {why} (the CPU build is "
                "fbgemm-gpu-cpu, the CUDA one fbgemm-gpu from the torch CUDA index; or use auto)"
            )
        return
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
    """The TBE implementation for ``tensor``'s device: "torch", "compiled", "triton" or
    "fbgemm" (``choice`` says why). A forced choice is taken as is (``check_kernels`` has
    said whether it can run)."""
    return choice(kernels, tensor)[0]


def choice(kernels: str, tensor: torch.Tensor) -> tuple[str, str]:
    """The TBE implementation for ``tensor``'s device and why it is the one, in words.

    ``auto``: FBGEMM on CUDA where fbgemm_gpu's CUDA build loads and passes a test step,
    else Triton where it is installed, else torch ops; the compiled kernels on float32 CPU
    tensors (faster than FBGEMM's CPU kernels: the kernel benchmark's FBGEMM line,
    docs/benchmarks.md); torch ops otherwise.
    """
    if kernels != "auto":
        return kernels, f"model.kernels={kernels}"
    if not tensor.is_cuda:
        picked = besides_fbgemm(tensor)
        if picked == "compiled":
            return picked, "auto on the CPU: the compiled kernels, faster than FBGEMM's CPU kernels"
        return picked, f"auto on {tensor.device.type}: torch ops, the only ones for the device"
    from dlrmflow.kernels import fbgemm_tbe

    why_not = fbgemm_tbe.refusal("cuda")
    if why_not is None:
        return "fbgemm", "auto on CUDA: FBGEMM's kernels load and pass a test step"
    if besides_fbgemm(tensor) == "triton":
        return "triton", f"auto on CUDA: Triton, as {why_not}"
    return "torch", f"auto on CUDA: torch ops, as {why_not} and triton is not installed"


def besides_fbgemm(tensor: torch.Tensor) -> str:
    """What ``auto`` runs where FBGEMM cannot: Triton (or torch ops) on CUDA, the compiled
    kernels on the CPU."""
    if tensor.is_cuda:
        from dlrmflow.kernels import triton_tbe

        return "triton" if triton_tbe.available() else "torch"
    return "compiled" if tensor.device.type == "cpu" else "torch"


def interaction(kernels: str, tensor: torch.Tensor) -> str:
    """The interaction's implementation, "triton" or "torch": FBGEMM has no interaction
    kernel, so under ``fbgemm`` it runs Triton's where ``auto`` would."""
    resolved = resolve(kernels, tensor)
    if resolved == "fbgemm":
        resolved = besides_fbgemm(tensor)
    return "triton" if resolved == "triton" else "torch"
