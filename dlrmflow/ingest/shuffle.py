"""The reader's row shuffle: a window's rows dealt to its batches at random.

Each batch of a window gets a uniformly random set of the window's rows (every way of
splitting the rows into sets of the batches' sizes is equally likely), and lists them in
file order: a batch's loss is a sum over its rows, so their order within it does not
matter to training, while writing each batch as one ascending stream is cheaper than
writing rows to random places. This is what permuting the window at random and sorting
each batch's share gives, at a fraction of the cost (two linear passes, no sort): one
compiled pass deals batch labels by Fisher-Yates, a second lists each batch's rows.
"""

from __future__ import annotations

import numba
import numpy as np


def deal(bounds: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(order, dest)`` of a window whose batches are rows ``bounds[b]:bounds[b + 1]``.

    ``bounds`` starts at 0 and ends at the window's row count. ``order[j]`` is the window
    row emitted ``j``-th and ``dest[i]`` where row ``i`` goes (the inverse, which a
    transform that places rows needs: written in the same pass, it costs no pass of its
    own). The same ``bounds`` and generator state give the same deal.
    """
    bounds = np.asarray(bounds, np.int64)
    if bounds.ndim != 1 or len(bounds) < 1 or bounds[0] != 0 or (np.diff(bounds) < 0).any():
        raise ValueError(f"deal: bounds must rise from 0, got {bounds.tolist()}")
    rows = int(bounds[-1])
    order, dest = np.empty(rows, np.int64), np.empty(rows, np.int64)
    _deal(bounds, rng.random(rows), order, dest)
    return order, dest


@numba.njit(nogil=True, cache=True)
def _deal(bounds: np.ndarray, uniforms: np.ndarray, order: np.ndarray, dest: np.ndarray) -> None:
    rows = uniforms.shape[0]
    batch = np.empty(rows, np.int32)  # the batch each row goes to, shuffled below
    for b in range(bounds.shape[0] - 1):
        batch[bounds[b] : bounds[b + 1]] = b
    for i in range(rows - 1, 0, -1):
        # A uniform pick in [0, i]; the min guards the product rounding up to i + 1.
        j = min(np.int64(uniforms[i] * (i + 1)), i)
        batch[i], batch[j] = batch[j], batch[i]
    fill = bounds[:-1].copy()
    for i in range(rows):
        b = batch[i]
        order[fill[b]] = i
        dest[i] = fill[b]
        fill[b] += 1
