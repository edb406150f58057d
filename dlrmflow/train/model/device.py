"""Where a rank computes, and how its batches get there without stalling it.

``train.device`` picks the device: ``cuda:LOCAL_RANK`` for CUDA (one GPU per rank of a
host), else the CPU. The process group then carries CUDA tensors over NCCL and CPU tensors
(the step's small control values: batch sizes, counts, flags) over gloo, so the same
collectives run on either device. ``BatchStager`` copies each batch to the device on a side
stream, one batch ahead: the copy of batch i+1 runs while step i computes, as the papers'
pipeline overlaps data movement with compute. On the CPU every call here is a no-op, so
the CPU path and the CUDA path are one code path.
"""

from __future__ import annotations

import os
import time

import torch

from dlrmflow.config import ConfigError
from dlrmflow.features.batch import Batch
from dlrmflow.runtime.mkldnn_bf16 import bf16_supported


def resolve_device(wanted: str, local_rank: int = 0, key: str = "train.device") -> torch.device:
    """The device a rank computes on, for ``wanted`` ("auto", "cpu" or "cuda", the value
    of ``key``): auto is CUDA when a GPU is visible, else the CPU.

    A CUDA rank uses GPU ``LOCAL_RANK`` (torchrun's index of the rank on its host); asking
    for CUDA where there is none, or for more ranks on a host than it has GPUs, fails in
    one line naming the key.
    """
    if wanted not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"{key} must be auto, cpu or cuda, not {wanted!r}")
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"{key}=cuda: no CUDA device is visible to torch "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(
            f"{key}=cuda: local rank {local_rank} needs GPU {local_rank}, but this "
            f"host has {count}; start at most {count} ranks per host"
        )
    return torch.device("cuda", local_rank)


def process_group_backend(device: torch.device) -> str:
    """NCCL for the model's CUDA tensors and gloo for the CPU control tensors; gloo alone
    on the CPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def use_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (before any CUDA work or NCCL)
    and let cuBLAS run deterministically (``torch.use_deterministic_algorithms`` refuses
    its matrix products otherwise)."""
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.cuda.set_device(device)


def autocast_supported(device: torch.device) -> bool:
    """Whether bfloat16 runs natively there (CUDA, or a CPU where oneDNN has bfloat16
    kernels: ``runtime.mkldnn_bf16``); on other CPUs autocast still works, emulated and
    slower."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bf16_supported()


class BatchStager:
    """Moves batches to the device one step ahead of their use.

    ``stage(batch)`` starts the copy (pinned host memory, ``non_blocking``, on a side
    stream) and returns the device batch at once; ``ready(batch)`` is called right before
    the step uses it: the compute stream waits for the copy (a GPU-side wait) and the
    tensors are marked as used there, so the allocator does not reuse their memory while
    the step runs. ``wait_seconds`` adds the host time spent waiting for a copy that was
    not done when its step began (a data stall, reported with the reader's wait). On the
    CPU, ``stage`` and ``ready`` return the batch itself.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.wait_seconds = 0.0
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def stage(self, batch: Batch | None) -> Batch | None:
        if batch is None or self._stream is None:
            return batch
        if not batch.dense.is_pinned():
            batch = batch.pin_memory()  # readers pin in their threads; remote batches here
        with torch.cuda.stream(self._stream):
            moved = batch.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        moved.copied = event  # the copy's end, awaited once by ``ready``
        return moved

    def ready(self, batch: Batch | None) -> Batch | None:
        if batch is None or self._stream is None:
            return batch
        event = getattr(batch, "copied", None)
        if event is None:
            return batch
        batch.copied = None
        if not event.query():
            began = time.perf_counter()
            event.synchronize()
            self.wait_seconds += time.perf_counter() - began
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)
        for tensor in _tensors(batch):
            tensor.record_stream(current)
        return batch


def _tensors(batch: Batch) -> list[torch.Tensor]:
    sparse = batch.sparse
    found = [batch.dense, batch.labels]
    if batch.sample_weights is not None:
        found.append(batch.sample_weights)
    rows = sparse.one_hot_rows
    if rows is not None:
        found.append(rows)
    else:
        found += [sparse.values, sparse.lengths]
        if sparse.weights is not None:
            found.append(sparse.weights)
    return found
