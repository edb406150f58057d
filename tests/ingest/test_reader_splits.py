"""A dataset's splits: every non-empty row group listed from the footers, dealt to the
readers of each epoch exactly once."""

from __future__ import annotations

import itertools

import pytest

from dlrmflow.ingest.errors import DataError
from dlrmflow.ingest.splits import Split, assign_splits, list_splits
from tests.ingest.test_reader import ROW_GROUPS, TOTAL_ROWS, _write_dataset


@pytest.fixture
def splits(tmp_path) -> list[Split]:
    return list_splits(_write_dataset(str(tmp_path)))


def test_list_splits_reads_every_row_group(splits, tmp_path):
    assert [(s.row_group, s.num_rows) for s in splits[:4]] == list(enumerate(ROW_GROUPS[0]))
    assert splits[4].path == f"{tmp_path}/part-1.parquet"
    assert len(splits) == 12 and sum(s.num_rows for s in splits) == TOTAL_ROWS


def test_assign_splits_partitions_each_epoch(splits):
    for world_size, num_workers, epoch in itertools.product((1, 2, 3), (1, 2), (0, 1)):
        parts = [
            assign_splits(
                splits,
                rank=rank,
                world_size=world_size,
                worker=worker,
                num_workers=num_workers,
                seed=7,
                epoch=epoch,
            )
            for rank in range(world_size)
            for worker in range(num_workers)
        ]
        flat = [s for part in parts for s in part]
        assert sorted(flat, key=lambda s: (s.path, s.row_group)) == splits
    kwargs = dict(rank=0, world_size=1, worker=0, num_workers=1, seed=7)
    assert assign_splits(splits, epoch=0, **kwargs) == assign_splits(splits, epoch=0, **kwargs)
    assert assign_splits(splits, epoch=0, **kwargs) != assign_splits(splits, epoch=1, **kwargs)
    assert assign_splits(splits, epoch=3, shuffle=False, **kwargs) == splits


def test_truncated_file_is_named(tmp_path, splits):
    path = tmp_path / "part-0.parquet"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataError, match=f"{path}: cannot read Parquet footer"):
        list_splits([str(path)])
