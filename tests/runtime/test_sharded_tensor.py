"""Sharded checkpoints through torch's ``ShardedTensor`` (``runtime.sharded_tensor``): a
table saved in one split loads into another, its local pieces are the tensors given (no
copy), and where torch no longer has the pieces the error is one line."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dlrmflow
from dlrmflow.runtime import sharded_tensor
from dlrmflow.runtime.missing import MissingPiece

REPO = Path(dlrmflow.__file__).resolve().parent.parent

# One rank: a [5, 4] table saved as three pieces (rows 0-1 whole; rows 2-4 in two column
# blocks), loaded into two others (rows 0-2 and 3-4, whole): DCP reads each loaded
# piece's rows and columns from wherever they were saved.
RESHARD = """
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dlrmflow.runtime.sharded_tensor import shard_metadata, sharded_tensor

dist.init_process_group(
    "gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1,
    timeout=timedelta(seconds=60),
)
table = torch.arange(20, dtype=torch.float32).view(5, 4)


def split(pieces):
    local = [(table[r0:r1, c0:c1].clone() * 0, shard_metadata([r0, c0], [r1 - r0, c1 - c0],
              "rank:0/cpu")) for r0, r1, c0, c1 in pieces]
    return local, sharded_tensor(local, [m for _, m in local], [5, 4])


saved, tensor = split([(0, 2, 0, 4), (2, 5, 0, 2), (2, 5, 2, 4)])
for (piece, _), (r0, r1, c0, c1) in zip(saved, [(0, 2, 0, 4), (2, 5, 0, 2), (2, 5, 2, 4)]):
    piece.copy_(table[r0:r1, c0:c1])
views = [s.tensor.data_ptr() for s in tensor.local_shards()]
assert views == [piece.data_ptr() for piece, _ in saved], "a local piece was copied"
dcp.save({"table": tensor}, checkpoint_id=sys.argv[2])
loaded, into = split([(0, 3, 0, 4), (3, 5, 0, 4)])
dcp.load({"table": into}, checkpoint_id=sys.argv[2])
assert torch.equal(loaded[0][0], table[0:3]) and torch.equal(loaded[1][0], table[3:5])
dist.destroy_process_group()
print("resharded")
"""


def test_a_table_saved_in_one_split_loads_into_another(tmp_path: Path) -> None:
    # Fails when the installed torch no longer has the pieces (MissingPiece), or when DCP
    # no longer reshards what they describe.
    done = subprocess.run(
        [sys.executable, "-c", RESHARD, str(tmp_path / "store"), str(tmp_path / "checkpoint")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "resharded"


def _uses_fail_in_one_line(module) -> None:
    assert module.ShardedTensor is None
    for use in (
        lambda: module.shard_metadata([0], [1], "rank:0/cpu"),
        lambda: module.sharded_tensor([], [], [1]),
    ):
        with pytest.raises(MissingPiece) as error:
            use()
        message = str(error.value)
        assert "\n" not in message
        assert message.startswith(f"{module.PIECE} is missing from torch {torch.__version__} ")
        assert "checked against torch 2.13.0" in message and "sharded checkpoint" in message


def test_without_torch_shard_the_import_works_and_a_use_fails_in_one_line() -> None:
    try:
        with pytest.MonkeyPatch.context() as gone:
            for name in [n for n in sys.modules if n.startswith("torch.distributed._shard")]:
                gone.setitem(sys.modules, name, None)
            gone.setitem(sys.modules, "torch.distributed._shard", None)
            _uses_fail_in_one_line(importlib.reload(sharded_tensor))
    finally:
        importlib.reload(sharded_tensor)  # with torch's pieces back
    assert sharded_tensor.ShardedTensor is not None
