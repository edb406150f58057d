"""Reader servers that hang without dying: a stopped process (SIGSTOP) keeps its sockets open,
so nothing but the deadline (``distributed.reader_timeout_s``) tells it from a slow one.

Its streams must fail over from their exact position, training must not notice, and with
no endpoint left the error is one line naming them. Each test waits for its readers with a
bound (``within``): without the deadline they would wait for good.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from dlrmflow.config import ConfigError, RunConfig, apply_overrides, load_config
from dlrmflow.errors import DlrmflowError
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.features.transform import BatchTransform
from dlrmflow.ingest.service.client import ReaderUnavailableError
from dlrmflow.ingest.service.processes import ReaderProcess
from dlrmflow.train.launch.reader_servers import reader_processes
from dlrmflow.train.run.data import IdMapper
from tests.conftest import same_weights, tiny_run_config
from tests.ingest.test_service import within
from tests.train.launch.test_readers import (
    TRAIN,
    assert_same_batches,
    epoch,
    loader_for,
    with_readers,
)

# It times waits and signals: run alone, after the rest of the suite (make test).
pytestmark = pytest.mark.serial

DEADLINE_S = 2.0
# Beyond the deadlines a test waits out: reading the tiny epoch, starting a training run.
SLACK_S = 30.0


class StallingTransform(BatchTransform):
    """``BatchTransform`` that takes ``DEADLINE_S / 2`` for each row group after the first.

    A stream of it sends its first window at once, then one window a second: well within
    the deadline, yet a server that the test stops after its first batch has not sent the
    rest into gRPC's buffers, so the client does wait on it. It sleeps rather than burns
    CPU, so that a loaded machine does not stretch it past the deadline.
    """

    def __init__(self, spec: FeatureSpec, ids: IdMapper) -> None:
        super().__init__(spec, ids)
        self._row_groups = itertools.count()

    def validate(self, table: pa.Table) -> None:
        # Every reader path validates each row group once, in the thread that prepares it.
        super().validate(table)
        if next(self._row_groups) > 0:
            time.sleep(DEADLINE_S / 2)


class SelfStoppingTransform(BatchTransform):
    """``BatchTransform`` whose server process SIGSTOPs itself at its third row group.

    A server prepares a stream's next window while it sends the batches of the one before,
    so by then it has sent its first window (at least): the stop comes mid-stream however
    long the trainer takes to start, which a stop sent by the test could not promise.
    """

    def __init__(self, spec: FeatureSpec, ids: IdMapper) -> None:
        super().__init__(spec, ids)
        self._row_groups = itertools.count()

    def validate(self, table: pa.Table) -> None:
        super().validate(table)
        if next(self._row_groups) == 2:
            os.kill(os.getpid(), signal.SIGSTOP)


@pytest.fixture
def config(tiny_dataset: str, tmp_path: Path) -> RunConfig:
    """Two reader streams (reader w on endpoint w), one window per row group, a 2 s deadline."""
    config = tiny_run_config(tiny_dataset, tmp_path / "run", **TRAIN)
    return apply_overrides(config, {"distributed.reader_timeout_s": DEADLINE_S})


@contextmanager
def killed_on_exit(*servers: ReaderProcess) -> Iterator[None]:
    """Kill ``servers`` on the way out. A stopped process ignores SIGTERM until continued,
    which would cost ``reader_processes`` its 5 s grace per server; and a killed one ends
    whatever call of this process still waits on it."""
    try:
        yield
    finally:
        for server in servers:
            os.kill(server.process.pid, signal.SIGKILL)


def stop(server: ReaderProcess) -> float:
    """SIGSTOP ``server``: alive, connected, silent. Returns when (``time.time()``)."""
    os.kill(server.process.pid, signal.SIGSTOP)
    return time.time()


def process_state(server: ReaderProcess) -> str:
    """The state letter ``ps`` shows for ``server`` (T: stopped)."""
    stat = Path(f"/proc/{server.process.pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0]


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """pytest's ``caplog``, also attached to the service's own logger: its warnings are
    captured even when something earlier in the session changed how records reach the
    root logger."""
    service = logging.getLogger("dlrmflow.ingest.service")
    service.addHandler(caplog.handler)
    yield caplog
    service.removeHandler(caplog.handler)


def deadline_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    # A record that also reached the root logger's capture is listed once.
    found = {id(r): r for r in caplog.records if "did not answer within" in r.getMessage()}
    return list(found.values())


def test_stopped_server_is_caught_and_its_stream_resumes_exactly(config, caplog):
    with (
        reader_processes(config, 1, 1, transform=StallingTransform) as [stopped],
        reader_processes(config, 1, 1) as [backup],
        killed_on_exit(stopped),
    ):
        # Reader 0 is served by the first endpoint, reader 1 by the second.
        remote = with_readers(config, stopped.endpoint, backup.endpoint)
        stopped_at: list[float] = []

        def read() -> tuple[list, int]:
            with loader_for(remote) as loader:
                loader.set_epoch(1)
                batches = []
                for batch in loader:
                    if not batches:
                        stopped_at.append(stop(stopped))
                    batches.append(batch)
                return batches, loader.failovers

        batches, failovers = within(DEADLINE_S + SLACK_S, read)
    assert failovers == 1
    assert_same_batches(epoch(config, n=1), batches)  # the uninterrupted batches, in order
    [warning] = deadline_warnings(caplog)
    assert warning.getMessage().startswith("rank 0 reader 0 of 2: ")
    assert f"reader {stopped.endpoint} failed (did not answer within 2 s)" in warning.getMessage()
    assert warning.getMessage().endswith(f"on {backup.endpoint}")
    # Caught at the deadline: the call waiting when it stopped started at most then.
    assert warning.created - stopped_at[0] < DEADLINE_S + 1.0


def test_training_with_a_server_stopped_mid_run_equals_training_with_healthy_ones(
    config, tmp_path, caplog
):
    # Imported here, not above: each reader server process imports this module (for the
    # transforms), and the trainer would add a second to its start.
    from dlrmflow.train.run.checkpoint import load_checkpoint
    from dlrmflow.train.run.trainer import train

    local = apply_overrides(config, {"run_dir": str(tmp_path / "local")})
    with (
        reader_processes(config, 1, 1, transform=SelfStoppingTransform) as [stopped],
        reader_processes(config, 1, 1) as [backup],
        killed_on_exit(stopped),
    ):
        remote = with_readers(
            config, stopped.endpoint, backup.endpoint, run_dir=str(tmp_path / "remote")
        )
        remote_result = within(DEADLINE_S + SLACK_S, lambda: train(remote))
        assert process_state(stopped) == "T"  # stopped, not dead
    local_result = train(local)
    [warning] = deadline_warnings(caplog)
    assert f"reader {stopped.endpoint} failed (did not answer within 2 s)" in warning.getMessage()
    assert "'window': 0, 'offset': 0" not in warning.getMessage()  # it had sent batches
    assert (remote_result.steps, remote_result.rows) == (local_result.steps, local_result.rows)
    assert remote_result.final_loss == local_result.final_loss
    got = load_checkpoint(tmp_path / "remote").model.state_dict()
    want = load_checkpoint(tmp_path / "local").model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("when", ["before-any-request", "mid-epoch"])
def test_every_server_stopped_fails_in_one_line_naming_them(config, when):
    with (
        reader_processes(config, 2, 1, transform=StallingTransform) as servers,
        killed_on_exit(*servers),
    ):
        remote = with_readers(config, *(s.endpoint for s in servers))

        def read() -> None:
            # Before any request, the streams wait for their start state (a unary call);
            # mid-epoch, for a next batch, then for the other server to accept the stream.
            if when == "before-any-request":
                for server in servers:
                    stop(server)
            with loader_for(remote) as loader:
                batches = iter(loader)
                if when == "mid-epoch":
                    next(batches)
                    for server in servers:
                        stop(server)
                list(batches)

        start = time.monotonic()
        # Each stream waits out one deadline per endpoint, the two streams at once.
        with pytest.raises(ReaderUnavailableError) as raised:
            within(2 * DEADLINE_S + SLACK_S, read)
        seconds = time.monotonic() - start
    message = str(raised.value)
    assert isinstance(raised.value, DlrmflowError)
    assert message.startswith("rank 0 reader ") and "\n" not in message
    for server in servers:
        assert f"{server.endpoint}: did not answer within 2 s" in message
    assert "distributed.reader_timeout_s" in message
    assert seconds >= 2 * DEADLINE_S


def test_reader_timeout_is_a_positive_finite_number_of_seconds(config):
    assert RunConfig().distributed.reader_timeout_s == 30.0
    env = {"DLRMFLOW_DISTRIBUTED__READER_TIMEOUT_S": "7.5"}
    assert load_config(env=env).distributed.reader_timeout_s == 7.5
    for bad in (0, -1, True, "1e999", "soon"):
        with pytest.raises(ConfigError, match=r"distributed\.reader_timeout_s: "):
            apply_overrides(config, {"distributed.reader_timeout_s": bad})


def test_two_ranks_fed_by_servers_under_the_default_schedule_train_as_local_reading(
    config, tmp_path, caplog
):
    """The default schedule decays over each pass's steps: at two ranks a rank's share of the
    row groups is not its share of the rows, so only the row groups the servers list give
    the pass's length that local readers count. One server stops mid-run; its streams fail
    over, and the run still ends bitwise where reading locally does."""
    from dlrmflow.train.launch.job import launch_training

    # Four streams on two single-slot servers and two ranks on two cores: a longer deadline
    # than the other tests', so that only the stopped server misses it.
    deadline_s = 10.0
    two = {"distributed.nproc": 2, "distributed.reader_timeout_s": deadline_s}
    assert config.train.lr_schedule.decay == "linear" and config.train.max_steps is None
    local = apply_overrides(config, {**two, "run_dir": str(tmp_path / "local")})
    with (
        reader_processes(config, 1, 1, transform=SelfStoppingTransform) as [stopped],
        reader_processes(config, 1, 1) as [backup],
        killed_on_exit(stopped),
    ):
        remote = with_readers(
            config, stopped.endpoint, backup.endpoint, run_dir=str(tmp_path / "remote"), **two
        )
        remote_result = within(deadline_s + 2 * SLACK_S, lambda: launch_training(remote))
        assert process_state(stopped) == "T"  # it did stop mid-run
    local_result = launch_training(local)
    assert (remote_result.steps, remote_result.rows) == (local_result.steps, local_result.rows)
    assert remote_result.final_loss == local_result.final_loss
    rates = [
        [json.loads(line).get("lr") for line in (tmp_path / run / "metrics.jsonl").open()]
        for run in ("remote", "local")
    ]
    assert rates[0] == rates[1] and rates[0][-1]
    same_weights(tmp_path / "remote", tmp_path / "local")
