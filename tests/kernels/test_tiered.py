"""The tiered bag against the in-memory TBE: bitwise-equal training, LRU, files, errors."""

import os

import numpy as np
import pytest
import torch
from torch import nn

from dlrmflow.config import ModelConfig
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.kernels import row_file
from dlrmflow.kernels.optimizers import SGD, Adam, RowWiseAdagrad
from dlrmflow.kernels.row_cache import SLOT_BOOKKEEPING_BYTES, CacheTooSmall
from dlrmflow.kernels.row_file import HEADER_BYTES, DiskSpaceError
from dlrmflow.kernels.tbe import TableBatchedEmbeddingBag, init_table_rows, initial_rows
from dlrmflow.kernels.tiered import TieredEmbeddingBag
from dlrmflow.sparse import KeyedJaggedTensor
from dlrmflow.train.model.dlrm import DLRM
from tests.conftest import small_tmpfs
from tests.kernels.batches import random_jagged, random_one_hot

# Three groups of dims (4, 2, 4) and a mean-pooled table, as in the TBE's tests.
TABLES = [
    SparseFeature("a", 60, 4),
    SparseFeature("b", 40, 4, "mean"),
    SparseFeature("c", 25, 2),
    SparseFeature("d", 50, 4),
]
SPEC = FeatureSpec(
    dense=("I1", "I2", "I3"), sparse=tuple(SparseFeature(f"C{k}", 80, 4) for k in range(4))
)
MODEL = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8])
BATCH = 16


@pytest.fixture(autouse=True)
def one_thread():
    """The tensors are tiny: a second OpenMP thread only waits on the first, which on a
    busy two-core machine measured 50x slower per kernel call."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _jagged(seed: int, tables=TABLES, batch=BATCH, max_len=3, weighted=False):
    return random_jagged(seed, tables, batch, max_len, weighted)


def _one_hot(seed: int, tables=TABLES, batch=BATCH):
    return random_one_hot(seed, tables, batch)


def _distinct_rows(kjt: KeyedJaggedTensor) -> int:
    return sum(values.unique().numel() for values in kjt.values.split(kjt.length_per_key()))


def _train_pair(ref, tiered, batches, prefetch: bool):
    """The same fixed output gradients through both bags, in the train pipeline's order."""
    for step, kjt in enumerate(batches):
        if prefetch and step + 1 < len(batches):
            tiered.prefetch(batches[step + 1])
        grad = torch.randn(
            kjt.stride, ref.output_dim, generator=torch.Generator().manual_seed(step)
        )
        out_ref, out_tiered = ref(kjt), tiered(kjt)
        assert torch.equal(out_ref, out_tiered), step
        out_ref.backward(grad)
        out_tiered.backward(grad)


def _assert_same_tables(ref, tiered):
    for t in ref.tables:
        assert torch.equal(ref.table(t.name), tiered.table(t.name)), t.name
        ref_state, tiered_state = ref.state(t.name), tiered.state(t.name)
        assert ref_state.keys() == tiered_state.keys()
        for key, value in ref_state.items():
            assert torch.equal(value, tiered_state[key]), (t.name, key)


def _dlrm_batches(multi_hot: bool, steps: int):
    gen = torch.Generator().manual_seed(11)
    keys = [f.name for f in SPEC.sparse]
    out = []
    for _ in range(steps):
        dense = torch.rand(BATCH, len(SPEC.dense), generator=gen)
        labels = (torch.rand(BATCH, generator=gen) < 0.3).float()
        if multi_hot:
            lengths = torch.randint(0, 5, (len(keys) * BATCH,), generator=gen).int()
            values = torch.randint(0, 80, (int(lengths.sum()),), generator=gen)
            sparse = KeyedJaggedTensor(keys, values, lengths)
        else:
            sparse = KeyedJaggedTensor.from_one_hot(
                keys, torch.randint(0, 80, (BATCH, len(keys)), generator=gen)
            )
        out.append((dense, sparse, labels))
    return out


def _train_dlrm(model: DLRM, batches, prefetch) -> None:
    optimizer = torch.optim.Adagrad(model.dense_arch.parameters(), lr=0.05)
    loss_fn = nn.BCEWithLogitsLoss()
    for step, (dense, sparse, labels) in enumerate(batches):
        if prefetch and step + 1 < len(batches):
            model.embeddings.prefetch(batches[step + 1][1])
        loss = loss_fn(model(dense, sparse), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("multi_hot", [False, True], ids=["onehot", "multihot"])
@pytest.mark.parametrize(
    "optimizer", [SGD(lr=0.3), RowWiseAdagrad(lr=0.3)], ids=["sgd", "rowwise_adagrad"]
)
def test_dlrm_trains_to_bitwise_identical_weights_with_a_small_cache(
    tmp_path, optimizer, multi_hot
):
    batches = _dlrm_batches(multi_hot, steps=12)
    torch.manual_seed(0)
    reference = DLRM(SPEC, MODEL, optimizer, seed=5)
    tiered_bag = TieredEmbeddingBag(SPEC.sparse, optimizer, tmp_path, cache_rows=200, seed=5)
    torch.manual_seed(0)
    tiered = DLRM(SPEC, MODEL, embeddings=tiered_bag)
    _train_dlrm(reference, batches, prefetch=False)
    _train_dlrm(tiered, batches, prefetch=True)

    touched = {
        (key, int(v))
        for _, sparse, _ in batches
        for key, (values, _) in sparse.split_by_key().items()
        for v in values
    }
    assert len(touched) > tiered_bag.cache_rows == 200  # the working set exceeds the cache
    _assert_same_tables(reference.embeddings, tiered_bag)
    for a, b in zip(reference.dense_arch.parameters(), tiered.dense_arch.parameters(), strict=True):
        assert torch.equal(a, b)
    stats = tiered_bag.stats
    assert stats.lookups == sum(_distinct_rows(s) for _, s, _ in batches)
    assert stats.evictions > 0 and stats.prefetched > 0
    assert 0 < stats.hits < stats.lookups and stats.hit_rate == stats.hits / stats.lookups
    # Every loaded row evicted another, once the cache had filled: loads = cache + evictions.
    forward_misses = stats.lookups - stats.hits
    assert stats.prefetched + forward_misses == tiered_bag.cache_rows + stats.evictions


@pytest.mark.parametrize(
    "optimizer",
    [SGD(lr=0.2, weight_decay=0.01), RowWiseAdagrad(lr=0.2), Adam(lr=0.05, weight_decay=0.01)],
    ids=["sgd", "rowwise_adagrad", "adam"],
)
@pytest.mark.parametrize("prefetch", [False, True], ids=["no_prefetch", "prefetch"])
def test_mixed_dims_and_mean_pooling_match_the_tbe(tmp_path, optimizer, prefetch):
    ref = TableBatchedEmbeddingBag(TABLES, optimizer, seed=3)
    tiered = TieredEmbeddingBag(TABLES, optimizer, tmp_path, cache_rows=120, seed=3)
    batches = [_jagged(s) if s % 2 else _one_hot(s) for s in range(10)]
    _train_pair(ref, tiered, batches, prefetch)
    _assert_same_tables(ref, tiered)
    assert tiered.stats.evictions > 0
    tiered.eval()
    with torch.no_grad():
        assert torch.equal(ref.eval()(batches[0]), tiered(batches[0]))


def test_per_sample_weights_match_the_tbe(tmp_path):
    tables = [SparseFeature("a", 60, 4), SparseFeature("c", 25, 2)]
    ref = TableBatchedEmbeddingBag(tables, RowWiseAdagrad(lr=0.1))
    tiered = TieredEmbeddingBag(tables, RowWiseAdagrad(lr=0.1), tmp_path, cache_rows=50)
    _train_pair(ref, tiered, [_jagged(s, tables, weighted=True) for s in range(6)], True)
    _assert_same_tables(ref, tiered)


def test_same_run_twice_gives_the_same_counters(tmp_path):
    batches = [_one_hot(s) for s in range(8)]
    runs = []
    for run in range(2):
        tiered = TieredEmbeddingBag(TABLES, SGD(lr=0.1), tmp_path / str(run), cache_rows=70)
        _train_pair(TableBatchedEmbeddingBag(TABLES, SGD(lr=0.1)), tiered, batches, True)
        runs.append((tiered.stats, tiered.table("a")))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])


def test_lru_evicts_the_least_recently_used_row(tmp_path):
    table = [SparseFeature("t", 10, 2)]
    tiered = TieredEmbeddingBag(table, SGD(lr=0.1), tmp_path, cache_rows=4)

    def look_up(*rows: int) -> tuple[int, int]:
        before = tiered.stats
        tiered(
            KeyedJaggedTensor.from_one_hot(["t"], torch.tensor([[r] for r in rows]))
        ).sum().backward()
        after = tiered.stats
        return after.hits - before.hits, after.evictions - before.evictions

    assert look_up(0, 1) == (0, 0)
    assert look_up(2, 3) == (0, 0)  # the cache is now full: 0, 1, 2, 3
    assert look_up(0, 4) == (1, 1)  # 0 was used last step; 1 is the least recent: evicted
    assert look_up(0, 2, 3, 4) == (4, 0)
    assert look_up(1) == (0, 1)
    assert tiered.stats.writebacks == 2  # the two evicted rows had been updated


def test_flush_writes_rows_and_state_that_a_resumed_bag_trains_on(tmp_path):
    optimizer = Adam(lr=0.05)  # its global step count must survive the reopen too
    ref = TableBatchedEmbeddingBag(TABLES, optimizer, seed=1)
    tiered = TieredEmbeddingBag(TABLES, optimizer, tmp_path, cache_rows=100, seed=1, name="bag")
    batches = [_jagged(s) for s in range(8)]
    _train_pair(ref, tiered, batches[:4], prefetch=True)
    assert tiered.stats.writebacks > 0
    tiered.close()
    assert (tmp_path / "bag.tiered").is_file()
    resumed = TieredEmbeddingBag(
        TABLES, optimizer, tmp_path, cache_rows=100, name="bag", resume=True
    )
    assert resumed.stats.lookups == 0  # a cold cache: everything below comes from the file
    _assert_same_tables(ref, resumed)
    _train_pair(ref, resumed, batches[4:], prefetch=False)
    _assert_same_tables(ref, resumed)


def test_bad_files_and_inputs_fail_with_the_file_or_feature_named(tmp_path):
    tiered = TieredEmbeddingBag(TABLES, RowWiseAdagrad(lr=0.1), tmp_path, cache_rows=100)
    path = str(tiered.path)
    tiered.close()
    with pytest.raises(FileExistsError, match=path):
        TieredEmbeddingBag(TABLES, RowWiseAdagrad(lr=0.1), tmp_path, cache_rows=100)
    with pytest.raises(FileNotFoundError, match="other.tiered"):
        TieredEmbeddingBag(TABLES, SGD(lr=0.1), tmp_path, cache_rows=9, name="other", resume=True)
    with pytest.raises(ValueError, match=f"{path}.*'optimizer'"):
        TieredEmbeddingBag(TABLES, SGD(lr=0.1), tmp_path, cache_rows=100, resume=True)
    bigger = [*TABLES[:3], SparseFeature("d", 51, 4)]
    with pytest.raises(ValueError, match=f"{path}.*'tables'"):
        TieredEmbeddingBag(bigger, RowWiseAdagrad(lr=0.1), tmp_path, cache_rows=100, resume=True)
    with open(path, "r+b") as f:
        f.truncate(5000)
    with pytest.raises(ValueError, match=f"{path}.*truncated"):
        TieredEmbeddingBag(TABLES, RowWiseAdagrad(lr=0.1), tmp_path, cache_rows=100, resume=True)

    fresh = TieredEmbeddingBag(TABLES, SGD(lr=0.1), tmp_path / "new", cache_rows=8)
    bad = _one_hot(0)
    bad.one_hot_rows[3, 2] = 25
    with pytest.raises(IndexError, match="feature 'c': ID 25 of sample 3"):
        fresh(bad)
    with pytest.raises(
        CacheTooSmall, match="distinct rows in memory at once but the cache holds 8$"
    ) as e:
        fresh(_one_hot(1))
    assert e.value.missing_bytes == (e.value.rows - 8) * (4 * 4 + SLOT_BOOKKEEPING_BYTES)


def test_backward_of_a_superseded_forward_is_refused(tmp_path):
    tiered = TieredEmbeddingBag(TABLES, SGD(lr=0.1), tmp_path, cache_rows=175)
    first = tiered(_one_hot(0))
    tiered(_one_hot(1)).sum().backward()
    with pytest.raises(RuntimeError, match="superseded"):
        first.sum().backward()


def test_checkpoint_views_save_and_load_the_rows_in_place(tmp_path):
    """A checkpoint reads and writes the file through views (no copy of a table), and the
    bag then serves what was written, not the rows it had cached."""
    optimizer = RowWiseAdagrad(lr=0.2)
    ref = TableBatchedEmbeddingBag(TABLES, optimizer, seed=2)
    tiered = TieredEmbeddingBag(TABLES, optimizer, tmp_path, cache_rows=120, seed=2)
    _train_pair(ref, tiered, [_one_hot(s) for s in range(4)], prefetch=True)
    tiered.flush()  # the file holds every update
    views = tiered.checkpoint_views("a")
    assert np.shares_memory(views["weight"].numpy(), tiered.file.memmap)  # no copy
    assert views.keys() == {"weight", "sum_squares"}
    assert torch.equal(views["weight"], ref.table("a"))
    assert torch.equal(views["sum_squares"], ref.state("a")["sum_squares"])

    other = TableBatchedEmbeddingBag(TABLES, optimizer, seed=9)
    _train_pair(other, TableBatchedEmbeddingBag(TABLES, optimizer, seed=9), [_one_hot(7)], False)
    for name in tiered.names:  # a load: the values of another model, written in place
        for key, view in tiered.checkpoint_views(name).items():
            view.copy_(other.table(name) if key == "weight" else other.state(name)[key])
    tiered.reload()
    _assert_same_tables(other, tiered)
    _train_pair(other, tiered, [_jagged(s) for s in range(8, 12)], prefetch=True)
    _assert_same_tables(other, tiered)

    tiered(_one_hot(20)).sum().backward()  # an update the file does not have yet
    with pytest.raises(RuntimeError, match="reload would drop rows updated"):
        tiered.reload()


def test_a_shard_initialises_its_rows_as_the_whole_table_does(tmp_path):
    """``init`` fills a shard's rows (here rows 20-59, columns 1-3 of a 4-column table)
    with the whole table's initial values, chunk by chunk."""
    whole = TableBatchedEmbeddingBag([SparseFeature("a", 60, 4)], SGD(lr=0.1), seed=4)

    def init(k: int, out: torch.Tensor, first: int) -> None:
        init_table_rows(out, "a", 4, table_rows=60, row_start=20 + first, col_start=1, table_dim=4)

    shard = TieredEmbeddingBag(
        [SparseFeature("a", 40, 3)], SGD(lr=0.1), tmp_path, cache_rows=8, init=init
    )
    assert torch.equal(shard.table("a"), whole.table("a")[20:, 1:])


def _mapped_file_bytes() -> int:
    """This process's resident pages backed by files (``RssFile``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssFile in /proc/self/status")


@pytest.mark.parametrize("allowance", [16 << 20, 1 << 40])
def test_training_keeps_the_files_mapped_pages_within_the_allowance(
    tmp_path, monkeypatch, allowance
):
    """Rows read and written at random map the file's pages (and the kernel maps cached
    neighbours with each fault); past ``MAPPED_ALLOWANCE_BYTES`` the bag unmaps them. With
    no allowance to speak of (1 TiB) the same steps map most of the 264 MB file: the
    measurement sees what the mechanism prevents."""

    monkeypatch.setattr(row_file, "MAPPED_ALLOWANCE_BYTES", allowance)
    rows = 2_000_000
    bag = TieredEmbeddingBag(
        [SparseFeature("t", rows, 32)], RowWiseAdagrad(0.01), tmp_path, cache_rows=20_000
    )
    before = _mapped_file_bytes()
    generator = torch.Generator().manual_seed(0)
    for _ in range(24):
        ids = torch.randint(0, rows, (4096, 1), generator=generator)
        bag(KeyedJaggedTensor.from_one_hot(["t"], ids)).sum().backward()
    grown = _mapped_file_bytes() - before
    if allowance < bag.path.stat().st_size:
        # The allowance plus one chunk's pages: 256 rows x 2 parts x 64 KiB.
        assert grown <= allowance + (32 << 20), grown
    else:
        assert grown > bag.path.stat().st_size // 2, grown
    bag.close()


# 4 tables of 40,000 rows, dim 8, with row-wise Adagrad: 5.76 MB of rows and state.
LARGE = [SparseFeature(name, 40_000, 8) for name in "wxyz"]
LARGE_BYTES = HEADER_BYTES + 4 * 4 * 40_000 * (8 + 1)


def test_a_new_file_reserves_its_blocks(tmp_path):
    """Every block of the file is allocated at creation (not a sparse file): writing rows
    into it later can never meet a full disk, which through the mapping is a SIGBUS."""
    with small_tmpfs(tmp_path / "disk") as disk:
        bag = TieredEmbeddingBag(LARGE, RowWiseAdagrad(lr=0.1), disk, cache_rows=10, fill=False)
        stat = bag.path.stat()
        assert stat.st_size == LARGE_BYTES
        assert stat.st_blocks * 512 >= LARGE_BYTES
        bag.close()


@pytest.mark.parametrize("checked", [True, False], ids=["free-space-check", "reservation"])
def test_a_file_larger_than_the_free_space_fails_naming_it_and_leaves_nothing(
    tmp_path, monkeypatch, checked: bool
):
    """Refused before anything is written, naming the file, the bytes it needs and those
    free; the file and the directories made for it are gone. ``reservation``: the free
    space looked sufficient (another writer took it since), so ``posix_fallocate`` is what
    finds the disk full."""
    if not checked:
        monkeypatch.setattr(row_file, "_check_free", lambda path, size: None)
    with small_tmpfs(tmp_path / "disk", size="4m") as disk:
        with pytest.raises(DiskSpaceError) as e:
            TieredEmbeddingBag(LARGE, RowWiseAdagrad(lr=0.1), disk / "run" / "rank0", cache_rows=10)
        message = str(e.value)
        assert message.startswith(f"{disk}/run/rank0/embeddings.tiered: ")
        assert f"need 5.8 MB ({LARGE_BYTES} bytes)" in message
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        assert f"its file system has 4.2 MB ({free} bytes) free" in message
        assert list(disk.iterdir()) == []
        assert isinstance(e.value, OSError)  # the CLI's one-line errors


@pytest.mark.parametrize("optimizer", [RowWiseAdagrad(lr=0.1), Adam(lr=0.05)], ids=type)
def test_reset_rows_start_them_afresh_in_memory_and_on_disk(tmp_path, optimizer):
    """A row handed to a new ID (a dynamic table's eviction) returns to its initial draw
    with no optimizer state, in memory and on disk alike (the disk bag's cached copy
    forgotten), and training on continues the same in both; other rows keep theirs."""
    ref = TableBatchedEmbeddingBag(TABLES, optimizer, seed=3)
    tiered = TieredEmbeddingBag(TABLES, optimizer, tmp_path, cache_rows=120, seed=3)
    batches = [_jagged(s) for s in range(8)]
    _train_pair(ref, tiered, batches[:4], prefetch=False)
    rows = torch.tensor([0, 7, 31, 59])
    trained = ref.table("a").clone()
    fresh = initial_rows("a", 3, rows, table_rows=60, dim=4)
    assert not torch.equal(trained[rows], fresh)  # the rows had moved: a reset shows
    for bag in (ref, tiered):
        bag.reset_rows("a", rows, fresh)
        assert torch.equal(bag.table("a")[rows], fresh)
        for value in bag.state("a").values():
            assert not value[rows].any()
        others = torch.ones(60, dtype=torch.bool)
        others[rows] = False
        assert torch.equal(bag.table("a")[others], trained[others])
    _train_pair(ref, tiered, batches[4:], prefetch=True)
    _assert_same_tables(ref, tiered)


def test_initial_rows_are_the_tables_birth_values():
    bag = TableBatchedEmbeddingBag(TABLES, SGD(lr=0.1), seed=9)
    rows = torch.tensor([3, 0, 49, 3])
    assert torch.equal(initial_rows("d", 9, rows, table_rows=50, dim=4), bag.table("d")[rows])
    with pytest.raises(IndexError, match=r"table 'd': rows to reset must lie in \[0, 50\)"):
        bag.reset_rows("d", torch.tensor([50]), torch.zeros(1, 4))
