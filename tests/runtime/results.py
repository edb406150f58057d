"""What the kernels compute, for comparing their runs with and without a runtime piece:
bitwise, since the optimizer updates are deterministic (see ``dlrmflow.kernels.tbe``) and
neither a thread team nor a prefetch changes a value."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import dlrmflow
from dlrmflow.features import jit
from dlrmflow.kernels import cpu_tbe
from dlrmflow.kernels.optimizers import SGD, RowWiseAdagrad
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag
from tests.kernels.batches import random_jagged, random_one_hot
from tests.kernels.test_tbe import MANY_TABLES

REPO = Path(dlrmflow.__file__).resolve().parent.parent  # where ``tests`` imports from

# Enough keys per weight group that a step splits into parts (dims 4 and 2).
TABLES = MANY_TABLES
OPTIMIZERS = [SGD(0.2, weight_decay=0.1), RowWiseAdagrad(0.2, 1e-6, 0.05)]


def trained_states() -> dict[str, np.ndarray]:
    """Weights and row-wise state after jagged and one-hot steps, each split over 2 threads."""
    states = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_tbe, "_threads", lambda elements: 2)
        for optimizer in OPTIMIZERS:
            tbe = TableBatchedEmbeddingBag(TABLES, optimizer, seed=5)
            for step in range(3):
                for kjt in (random_jagged(step, TABLES, 12), random_one_hot(step, TABLES, 12)):
                    gen = torch.Generator().manual_seed(100 + step)
                    tbe(kjt).backward(torch.randn(kjt.stride, tbe.output_dim, generator=gen))
            for name, buffer in tbe.state_dict().items():
                states[f"{type(optimizer).__name__}.{name}"] = buffer.numpy().copy()
    return states


def transformed_window() -> dict[str, np.ndarray]:
    """The feature transform's writers into a shuffled window: hashed IDs (with nulls) and
    dense values, over more blocks than the kernels prefetch ahead."""
    rng = np.random.default_rng(7)
    n, keys, window = 3 * 512 + 100, 5, 4096
    ids = tuple(jit.frozen(rng.integers(0, 2**40, n).view(np.uint64)) for _ in range(keys))
    valid = [None if k % 2 else rng.random(n) > 0.2 for k in range(keys)]
    salts = rng.integers(0, 2**63, keys, dtype=np.uint64)
    rows = rng.integers(1, 2**20, keys, dtype=np.uint64)
    dest = rng.permutation(window)[:n].astype(np.int64)
    sparse = np.zeros((window, keys), np.int32)
    jit.one_hot_rows(ids, jit.masks(valid), salts, rows, sparse, dest)
    dense = np.zeros((window, 3), np.float32)
    jit.scatter_rows(rng.random((3, n), dtype=np.float32), dense, dest)
    return {"sparse": sparse, "dense": dense}


def finished(run: Callable[[], dict[str, np.ndarray]], seconds: float = 120):
    """``run()``'s result; fails rather than hangs if a step waits for work never done."""
    result: list[dict[str, np.ndarray]] = []
    thread = threading.Thread(target=lambda: result.append(run()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, "the steps did not finish (or raised: see the thread's traceback)"
    return result[0]


def assert_bitwise_equal(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name].dtype == expected[name].dtype, name
        assert got[name].tobytes() == expected[name].tobytes(), name
