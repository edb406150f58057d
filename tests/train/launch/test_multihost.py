"""Jobs that span hosts: ``dlrmflow train --nnodes 2 --node-rank N --rdzv-endpoint ...``.

The end-to-end tests make real hosts out of Linux network namespaces: hosts ``a`` and
``b`` and a reader host ``r``, each with its own link-local address on a bridge in a
fourth namespace; none of their addresses exists outside them, so the job can only work
if every host advertises the address the others reach. They need root and ``ip`` (CI
runs as root) and are skipped, saying why, where namespaces cannot be made. The rest
(option checks, the start-up checks' verdicts) runs anywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from dlrmflow.cli import main
from dlrmflow.config import ConfigError, DistributedConfig, RunConfig
from dlrmflow.supervise import children_of
from dlrmflow.train.launch.job import launch_command, launch_training
from dlrmflow.train.launch.multihost import (
    BACKEND,
    Hosts,
    StartupFailed,
    _check_jobs,
    _check_node_ranks,
    job_identity,
)
from dlrmflow.train.run.checkpoint import list_checkpoints, load_checkpoint
from dlrmflow.train.run.evaluate import evaluate
from tests.conftest import tiny_run_config

# It times waits and signals: run alone, after the rest of the suite (make test).
pytestmark = pytest.mark.serial

# --- option checks: anywhere -------------------------------------------------------------


def test_one_host_needs_no_hosts_and_node_ranks_stay_below_nnodes() -> None:
    assert Hosts.from_config(DistributedConfig()) is None
    with pytest.raises(ConfigError, match=r"distributed.node_rank: 2 is not below .*nnodes \(2\)"):
        Hosts.from_config(DistributedConfig(nnodes=2, node_rank=2, rdzv_endpoint="h:1"))
    with pytest.raises(ConfigError, match="distributed.rdzv_endpoint: a job of several hosts"):
        Hosts.from_config(DistributedConfig(nnodes=2))
    with pytest.raises(ConfigError, match=r"distributed.rdzv_endpoint: 'node0' is not HOST:PORT"):
        Hosts.from_config(DistributedConfig(nnodes=2, rdzv_endpoint="node0"))


def test_the_advertised_address_is_one_of_this_host_and_its_interface_carries_gloo() -> None:
    # By default: this host's address on its route to the endpoint (here: loopback).
    hosts = Hosts.from_config(
        DistributedConfig(nnodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:29500")
    )
    assert hosts is not None
    assert (hosts.local_addr, hosts.interface) == ("127.0.0.1", "lo")
    assert hosts.env({}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert hosts.env({"GLOO_SOCKET_IFNAME": "eth9"})["GLOO_SOCKET_IFNAME"] == "eth9"
    # An address this host does not have would be advertised to hosts that cannot use it.
    with pytest.raises(ConfigError, match=r"local_addr: 192\.0\.2\.77 is not an address of this"):
        Hosts.from_config(
            DistributedConfig(nnodes=2, rdzv_endpoint="127.0.0.1:1", local_addr="192.0.2.77")
        )


def test_torchrun_joins_the_checked_rendezvous_with_the_start_up_timeouts() -> None:
    dist = DistributedConfig(
        nnodes=3, node_rank=0, rdzv_endpoint="127.0.0.1:29500", connect_timeout_s=7.5
    )
    hosts = Hosts.from_config(dist)
    command = launch_command(Path("c.json"), 2, hosts)
    assert "--nnodes=3" in command and "--nproc_per_node=2" in command
    assert f"--rdzv_backend={BACKEND}" in command and "--local_addr=127.0.0.1" in command
    assert not any(arg.startswith("--master") for arg in command)
    [conf] = [arg.removeprefix("--rdzv_conf=") for arg in command if arg.startswith("--rdzv_conf")]
    settings = dict(item.split("=") for item in conf.split(","))
    assert settings == {
        "is_host": "true",  # node 0 serves the rendezvous, whatever its name resolves to
        "join_timeout": "8",  # whole seconds for c10d
        "read_timeout": "8",
        "node_rank": "0",
        "connect_timeout": "7.5",
    }
    other = Hosts.from_config(dist.model_copy(update={"node_rank": 2}))
    assert "is_host=false" in other.torchrun_args()[-1]


def test_the_start_up_checks_name_a_shared_node_rank_or_another_configuration(
    tmp_path: Path,
) -> None:
    first = {"node_rank": 0, "addr": "10.0.0.1", "job": {"train.lr": 0.05}}
    second = {"node_rank": 0, "addr": "10.0.0.2", "job": {"train.lr": 0.05}}
    with pytest.raises(
        StartupFailed,
        match=r"hosts 10.0.0.1, 10.0.0.2 share --node-rank 0: give each host its own, 0..1",
    ):
        _check_node_ranks([first, second], 2)
    second = {**second, "node_rank": 1, "job": {"train.lr": 0.1}}
    _check_node_ranks([second, first], 2)
    with pytest.raises(StartupFailed) as differs:
        _check_jobs([second, first])
    assert str(differs.value) == (
        "node 1 (10.0.0.2) runs another configuration than node 0 (10.0.0.1): "
        "train.lr 0.05 -> 0.1; give every host the same one"
    )
    # What each host is told apart: its own place in the job, nothing else.
    config = tiny_run_config("data", tmp_path / "run").model_dump()
    config["distributed"].update(node_rank=1, local_addr="10.0.0.2")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    job = job_identity(["--config", str(path), "--resolved"])
    assert "distributed.node_rank" not in job and "distributed.local_addr" not in job
    assert job["train.batch_size"] == 512 and job["distributed.nnodes"] == 1
    assert job_identity(["--evaluate", "runs/r1"]) == {"args": ["--evaluate", "runs/r1"]}


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (
            ["train", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29500"],
            "distributed.node_rank: 2 is not below distributed.nnodes (2)",
        ),
        (
            ["evaluate", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29500"]
            + ["--local-addr", "192.0.2.77"],
            "distributed.local_addr: 192.0.2.77 is not an address of this host",
        ),
    ],
)
def test_the_cli_refuses_a_bad_host_option_in_one_line_before_launching(
    args: list[str], named: str, tmp_path: Path, capsys, monkeypatch
) -> None:
    (tmp_path / "run").mkdir()  # evaluate refuses a missing run directory first
    monkeypatch.setattr("sys.argv", ["dlrmflow", *args, "--run-dir", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr().err
    assert exited.value.code == 1 and err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "run" / "config.json").exists()


# --- two hosts for real: network namespaces ------------------------------------------------

SUBNET = "169.254.77"  # link-local, on the namespaces' bridge only
ADDRESS = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2", "r": f"{SUBNET}.3"}
NOBODY = f"{SUBNET}.9"  # on the bridge's subnet, held by no host
HIDDEN = "169.254.78.1"  # an address of host a that no other host has a route to
ENDPOINT = f"{ADDRESS['a']}:29500"
READERS = f"{ADDRESS['r']}:8815"
NS_PREFIX = "dlrmflow-test-"
STEPS, EVERY = 20, 4


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Namespaces:
    """Hosts ``a``, ``b`` and ``r`` as network namespaces on a bridge (in a namespace of its
    own, so nothing is added to this machine's own network), named after this process so
    that runs side by side never meet."""

    def __init__(self) -> None:
        self.tag = f"{NS_PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.made: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def up(self) -> None:
        switch = self.ns("switch")
        self._add(switch)
        _ip("-n", switch, "link", "add", "name", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host, address in ADDRESS.items():
            ns = self._add(self.ns(host))
            port = f"port-{host}"
            _ip(
                *["-n", switch, "link", "add", "name", port, "type", "veth"],
                *["peer", "name", "eth0", "netns", ns],
            )
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        # Host a also holds HIDDEN, on an interface of its own that leads nowhere.
        a = self.ns("a")
        _ip("-n", a, "link", "add", "name", "hid0", "type", "veth", "peer", "name", "hid1")
        _ip("-n", a, "addr", "add", f"{HIDDEN}/24", "dev", "hid0")
        _ip("-n", a, "link", "set", "hid0", "up")
        _ip("-n", a, "link", "set", "hid1", "up")

    def _add(self, ns: str) -> str:
        _ip("netns", "add", ns)
        self.made.append(ns)
        return ns

    def down(self) -> None:
        """Delete every namespace made (their interfaces go with them)."""
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        self.made.clear()

    def start(self, host: str, *args: str, **popen) -> subprocess.Popen:
        """``python -m dlrmflow ARGS`` on ``host``."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), sys.executable, "-m", "dlrmflow", *args],
            text=True,
            **popen,
        )


def _remove_stale_namespaces() -> None:
    """Namespaces left by a test process that was killed before its teardown."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        owner = re.match(rf"{NS_PREFIX}(\d+)-", name)
        if owner is not None and not Path(f"/proc/{owner[1]}").exists():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@pytest.fixture(scope="module")
def net() -> Iterator[Namespaces]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and ip(8) to make network namespaces (CI runs as root)")
    _remove_stale_namespaces()
    made = Namespaces()
    try:
        made.up()
    except subprocess.CalledProcessError as e:
        made.down()
        reason = (e.stderr or "").strip() or str(e)
        pytest.skip(f"cannot make network namespaces here: {' '.join(e.cmd)}: {reason}")
    try:
        yield made
    finally:
        made.down()


def _config(data: str, run_dir: Path) -> RunConfig:
    """The job of both hosts (2 hosts x 1 rank) and of the one-host run it must equal (1
    host x 2 ranks): the same plan (one rank a host) and threads."""
    cfg = tiny_run_config(
        data,
        run_dir,
        batch_size=128,
        max_steps=STEPS,
        checkpoint_every=EVERY,
        keep_checkpoints=10,
        threads=1,
    )
    cfg.distributed.ranks_per_host = 1
    cfg.distributed.connect_timeout_s = 30
    return cfg


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir).model.state_dict()


@pytest.fixture(scope="module")
def one_host(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run of the same world size on one host, reading locally."""
    cfg = _config(tiny_dataset, tmp_path_factory.mktemp("one_host") / "run")
    cfg.distributed.nproc = 2
    launch_training(cfg)
    return Path(cfg.run_dir)


def _job(net: Namespaces, command: str, options: list[str], **per_host: list[str]) -> dict:
    """``dlrmflow COMMAND OPTIONS --nnodes 2 --node-rank N --rdzv-endpoint ...`` on hosts a
    (node 0) and b (node 1) at once, plus ``per_host`` options."""
    return {
        host: net.start(
            host,
            command,
            *options,
            *["--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", ENDPOINT],
            *per_host.get(host, []),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank, host in enumerate(["a", "b"])
    }


def _outcome(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, tuple]:
    """Each host's (exit code, stdout, stderr, seconds to end), all killed at ``timeout``."""
    began = time.monotonic()
    ended = {}
    try:
        for host, proc in procs.items():
            out, err = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - began)))
            ended[host] = (proc.returncode, out, err, time.monotonic() - began)
    finally:
        for proc in procs.values():
            _kill_tree(proc)
    return ended


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a host's command, its torchrun agent and its ranks at once, as a lost
    machine would."""
    pids = [proc.pid]
    for agent in children_of(proc.pid):
        pids += [agent, *children_of(agent)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def _reader_service(net: Namespaces, config_file: Path) -> Iterator[None]:
    """``dlrmflow readers serve`` on host r, until the block ends."""
    server = net.start(
        "r",
        *["readers", "serve", "--config", str(config_file), "--listen", READERS],
        # A link-local address in a namespace of its own: no other host is there to read.
        "--insecure",
        *["--workers", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        for line in server.stdout:
            if "serving" in line:
                break
            assert time.monotonic() < deadline, "the reader service never came up"
        else:
            pytest.fail(f"the reader service ended: exit {server.wait()}")
        yield
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_two_hosts_train_from_a_reader_service_survive_a_kill_and_evaluate(
    net: Namespaces, one_host: Path, tiny_dataset: str, tmp_path: Path
) -> None:
    cfg = _config(tiny_dataset, tmp_path / "run")  # one run directory, shared by both hosts
    cfg.distributed.readers = [READERS]
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump()))
    train = ["--config", str(config_file)]
    run_dir = Path(cfg.run_dir)
    with _reader_service(net, config_file):
        # Killed on both hosts once a checkpoint exists, as if both machines were lost.
        job = _job(net, "train", train)
        deadline = time.monotonic() + 180
        while not list_checkpoints(run_dir):
            assert time.monotonic() < deadline, "no checkpoint came"
            assert all(p.poll() is None for p in job.values()), _outcome(job, 1)
            time.sleep(0.02)
        # Node 0 holds the shared run directory's lock (rank 0 runs there); node 1 does not
        # contend for it.
        assert json.loads((run_dir / ".lock.json").read_text())["pid"] == job["a"].pid
        for proc in job.values():
            _kill_tree(proc)
        killed_at = max(c.step for c in list_checkpoints(run_dir))
        assert killed_at < STEPS, "the job finished before it could be killed"

        # The same commands again: the job resumes from that checkpoint and ends as the
        # uninterrupted one-host run of the same world size does, bitwise.
        ended = _outcome(_job(net, "train", train), timeout=240)
    for host, (code, _, err, _) in ended.items():
        assert code == 0, (host, err[-3000:])
    result = json.loads(ended["a"][1])
    assert result["world_size"] == 2 and result["steps"] == STEPS
    assert result["resumed_from_step"] == killed_at
    assert json.loads(ended["b"][1]) == {"node_rank": 1, "finished": True}
    got, want = _weights(run_dir), _weights(one_host)
    for key in want:
        assert torch.equal(got[key], want[key]), (killed_at, key)

    # Both hosts score the checkpoint (resharded to their ranks); node 0 reports.
    ended = _outcome(_job(net, "evaluate", ["--run-dir", str(run_dir)]), timeout=180)
    for host, (code, _, err, _) in ended.items():
        assert code == 0, (host, err[-3000:])
    both = json.loads(ended["a"][1])
    assert json.loads(ended["b"][1]) == {"node_rank": 1, "finished": True}
    alone = evaluate(run_dir)
    assert both["world_size"] == 2 and both["rows"] == alone["rows"]
    assert abs(both["auc"] - alone["auc"]) < 1e-4  # partial sums in another order


def _last_line(err: str) -> str:
    return [line for line in err.splitlines() if line.strip()][-1]


STARTUP_S = 3  # --connect-timeout of the failing jobs
# What starting Python and torch may add to it on a busy machine; below the 60 s the
# start-up would wait by default, so a time-out that does not reach torchrun is caught.
STARTED_S = 45


def _failing_start_args(tiny_dataset: str, tmp_path: Path) -> list[str]:
    """``dlrmflow train`` arguments of a job whose start-up is meant to fail fast."""
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(_config(tiny_dataset, tmp_path / "run").model_dump()))
    return ["--config", str(config_file), "--connect-timeout", str(STARTUP_S)]


def test_an_unreachable_rendezvous_endpoint_fails_in_bounded_time_naming_it(
    net: Namespaces, tiny_dataset: str, tmp_path: Path
) -> None:
    train = _failing_start_args(tiny_dataset, tmp_path)
    # Node 1 is told an endpoint where nobody is; node 0 waits for it in vain.
    job = _job(net, "train", train, b=["--rdzv-endpoint", f"{NOBODY}:29500"])
    ended = _outcome(job, timeout=STARTUP_S + STARTED_S + 30)
    for host, (code, _, err, seconds) in ended.items():
        print(f"host {host}: failed after {seconds:.1f} s: {_last_line(err)}")
        assert code == 1 and "Traceback" not in err, (host, err[-3000:])
        assert seconds < STARTUP_S + STARTED_S, (host, seconds)
    assert _last_line(ended["b"][2]).startswith(
        "error: training on node 1 of 2 hosts x 1 ranks could not start: could not reach the "
        f"rendezvous endpoint {NOBODY}:29500 (node 0) within {STARTUP_S} s ("
    )
    assert _last_line(ended["a"][2]) == (
        "error: training on node 0 of 2 hosts x 1 ranks could not start: not all 2 hosts "
        f"joined the rendezvous at {ENDPOINT} within {STARTUP_S} s: start every host with "
        f"--nnodes 2 and --rdzv-endpoint {ENDPOINT}"
    )


def test_an_advertised_address_another_host_cannot_reach_fails_naming_it(
    net: Namespaces, tiny_dataset: str, tmp_path: Path
) -> None:
    train = _failing_start_args(tiny_dataset, tmp_path)
    # The rendezvous succeeds; then host b cannot reach the address host a advertises
    # (what a host name resolving to an unreachable address did: a silent hang before).
    job = _job(net, "train", train, a=["--local-addr", HIDDEN])
    ended = _outcome(job, timeout=STARTUP_S + STARTED_S + 30)
    for host, (code, _, err, seconds) in ended.items():
        print(f"host {host}: failed after {seconds:.1f} s: {_last_line(err)}")
        assert code == 1 and "Traceback" not in err, (host, err[-3000:])
        assert seconds < STARTUP_S + STARTED_S, (host, seconds)
        assert re.fullmatch(
            rf"error: training on node {'ab'.index(host)} of 2 hosts x 1 ranks could not "
            rf"start: node 1 \({ADDRESS['b']}\) could not reach node 0's address "
            rf"{HIDDEN}:\d+ within {STARTUP_S} s \(.+\): each host must reach the address "
            r"every other host advertises \(--local-addr\)",
            _last_line(err),
        ), (host, err[-3000:])
    assert not (tmp_path / "run" / "checkpoints").exists()  # no rank ever started
