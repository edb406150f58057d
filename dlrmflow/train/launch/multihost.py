"""Joining a job that spans hosts (``distributed.nnodes`` > 1), with a start-up that fails in
bounded time naming the address it could not reach.

Every host runs the same ``dlrmflow train`` (or ``evaluate``) with its own ``node_rank``;
node 0 serves torchrun's c10d rendezvous at ``rdzv_endpoint``. Left to itself, the c10d
rendezvous advertises each host by the name it gives itself (``socket.getfqdn()``): a name
another host cannot resolve, or resolves to an address it cannot reach, passed the
rendezvous and then hung the ranks for the whole collective timeout without a word. Here:

- each host advertises an address, never a name (``local_addr``, by default its own address
  on the route to the endpoint), and its ranks' gloo traffic goes through the interface
  that holds it (``GLOO_SOCKET_IFNAME``), not through whatever the host name resolves to;
- the rendezvous backend ``dlrmflow`` wraps torch's c10d one: before any rank starts, every
  host checks that it reaches the endpoint and every other host's advertised address, and
  that all hosts run the same configuration; each wait is bounded by
  ``distributed.connect_timeout_s`` and a failure is one line, the same on every host,
  naming the address (``StartupFailed``);
- node ranks are the user's, not the order c10d sorts host addresses in: node 0 gets ranks
  0..nproc-1, so rank 0 (which holds the run directory's lock and writes the results)
  always runs where the command that was given ``--node-rank 0`` runs.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import math
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psutil
from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)

from dlrmflow.config import ConfigError, DistributedConfig, flat_keys
from dlrmflow.errors import DlrmflowError

BACKEND = "dlrmflow"  # torchrun's --rdzv_backend for the checked c10d rendezvous
RUN_ID = "dlrmflow"  # one job per endpoint: node 0 serves a fresh store for each
# What may differ between the hosts of one job: each host's own place in it.
PER_HOST_KEYS = ("distributed.node_rank", "distributed.local_addr")
_KEY_PREFIX = "dlrmflow/"  # keys of the start-up checks in the rendezvous round's store


class StartupFailed(DlrmflowError, RuntimeError):
    """A multi-host job could not start; the message names the address or host at fault."""


@dataclass(frozen=True)
class Hosts:
    """This host's part in a job of ``nnodes`` hosts: what torchrun is told to join it."""

    nnodes: int
    node_rank: int
    endpoint: str  # HOST:PORT of node 0's rendezvous
    local_addr: str  # the IP address this host advertises
    interface: str  # the network interface holding it (for gloo)
    connect_timeout_s: float

    @classmethod
    def from_config(cls, dist: DistributedConfig) -> Hosts | None:
        """The hosts of ``dist`` (None for one host), their settings checked here: a bad
        endpoint or an address this host does not have fails before torchrun starts."""
        if dist.node_rank >= dist.nnodes:
            raise ConfigError(
                f"distributed.node_rank: {dist.node_rank} is not below distributed.nnodes "
                f"({dist.nnodes}); node ranks go 0..nnodes-1"
            )
        if dist.nnodes == 1:
            return None
        if dist.rdzv_endpoint is None:
            raise ConfigError(
                "distributed.rdzv_endpoint: a job of several hosts needs node 0's HOST:PORT "
                "(--rdzv-endpoint), the same on every host"
            )
        host, port = parse_endpoint(dist.rdzv_endpoint)
        local = advertised_address(dist.local_addr, host, port)
        return cls(
            nnodes=dist.nnodes,
            node_rank=dist.node_rank,
            endpoint=dist.rdzv_endpoint.strip(),
            local_addr=local,
            interface=interface_of(local),
            connect_timeout_s=dist.connect_timeout_s,
        )

    def torchrun_args(self) -> list[str]:
        """torchrun's options for this host (``--nproc_per_node`` aside)."""
        seconds = max(1, math.ceil(self.connect_timeout_s))  # c10d takes whole seconds
        conf = {
            "is_host": "true" if self.node_rank == 0 else "false",
            "join_timeout": seconds,  # for every host to come
            "read_timeout": seconds,  # for the endpoint to answer
            "node_rank": self.node_rank,
            "connect_timeout": self.connect_timeout_s,
        }
        return [
            f"--nnodes={self.nnodes}",
            f"--rdzv_backend={BACKEND}",
            f"--rdzv_endpoint={self.endpoint}",
            f"--rdzv_id={RUN_ID}",
            f"--local_addr={self.local_addr}",
            "--rdzv_conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
        ]

    def env(self, environ: dict[str, str]) -> dict[str, str]:
        """The ranks' environment: gloo (and NCCL's bootstrap) bind to the interface of the
        advertised address unless the user chose one."""
        return {
            name: environ.get(name, self.interface)
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        }


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) as (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"distributed.rdzv_endpoint: {text!r} is not HOST:PORT (e.g. 10.0.0.5:29500)"
        )
    return host, int(port)


def advertised_address(local_addr: str | None, endpoint_host: str, endpoint_port: int) -> str:
    """The IP address this host advertises: ``local_addr`` (a name is resolved here, once,
    so no other host has to), which must belong to this host; by default the source
    address of this host's route to the endpoint (no packet is sent to find it)."""
    if local_addr is None:
        try:
            infos = socket.getaddrinfo(endpoint_host, endpoint_port, type=socket.SOCK_DGRAM)
        except socket.gaierror as e:
            raise StartupFailed(
                f"the rendezvous endpoint {endpoint_host}: cannot resolve it ({e.strerror})"
            ) from None
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(address)  # UDP: chooses the route, sends nothing
            except OSError as e:
                raise StartupFailed(
                    f"this host has no route to the rendezvous endpoint "
                    f"{endpoint_host}:{endpoint_port} ({e.strerror})"
                ) from None
            return probe.getsockname()[0]
    try:
        family, _, _, _, address = socket.getaddrinfo(local_addr, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(
            f"distributed.local_addr: cannot resolve {local_addr!r} ({e.strerror})"
        ) from None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(address)  # only an address of this host can be bound
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                raise
            raise ConfigError(
                f"distributed.local_addr: {address[0]} is not an address of this host; "
                "give the address of this host that the other hosts reach"
            ) from None
    return address[0]


def interface_of(address: str) -> str:
    """The network interface that holds ``address``, for ``GLOO_SOCKET_IFNAME``: unset,
    gloo binds to what the host name resolves to, which may be no address another host
    reaches (or loopback). psutil lists every interface's addresses, IPv4 and IPv6
    (an IPv6 link-local one with its ``%scope`` suffix)."""
    ip = ipaddress.ip_address(address)
    for name, addresses in sorted(psutil.net_if_addrs().items()):
        for entry in addresses:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(entry.address.split("%")[0]) == ip:
                    return name
    raise ConfigError(
        f"distributed.local_addr: no network interface has {address} as its address; set "
        "GLOO_SOCKET_IFNAME to the interface the ranks should use"
    )


def job_identity(script_args: list[str]) -> dict[str, Any]:
    """What every host of a job must run alike: the configuration its ranks get (without
    ``PER_HOST_KEYS``), or their arguments when they get none (``--evaluate``)."""
    if "--config" not in script_args:
        return {"args": script_args}
    with open(script_args[script_args.index("--config") + 1]) as f:
        flat = flat_keys(json.load(f))
    return {key: value for key, value in flat.items() if key not in PER_HOST_KEYS}


_job: dict[str, Any] = {}  # this agent's job_identity (one torchrun agent per process)


def register_rendezvous(job: dict[str, Any]) -> None:
    """Make ``--rdzv_backend dlrmflow`` known to torchrun in this process, for ``job``."""
    _job.clear()
    _job.update(job)
    rendezvous_handler_registry.register(BACKEND, _create_handler)


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d rendezvous handler, reached (or served, on node 0) within the timeout
    and wrapped in the start-up checks."""
    timeout = float(params.config["connect_timeout"])
    host, port = parse_endpoint(params.endpoint)
    if not params.get_as_bool("is_host"):
        # Waited for here (node 0 may start later), so that c10d's store client, which
        # logs every failed attempt, connects at its first.
        error = _connect(host, port, time.monotonic() + timeout)
        if error is not None:
            raise StartupFailed(
                f"could not reach the rendezvous endpoint {_join(host, port)} (node 0) within "
                f"{timeout:g} s ({error})"
            )
    ours = ("node_rank", "connect_timeout")
    c10d = RendezvousParameters(
        "c10d",
        params.endpoint,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        **{k: v for k, v in params.config.items() if k not in ours},
    )
    try:
        inner = rendezvous_handler_registry.create_handler(c10d)
    except RendezvousError as e:
        cause = e.__cause__ or e
        raise StartupFailed(
            f"the rendezvous at {params.endpoint} could not start: {_one_line(cause)}"
        ) from None
    return _CheckedRendezvous(
        inner,
        endpoint=params.endpoint,
        node_rank=int(params.config["node_rank"]),
        nnodes=params.max_nodes,
        local_addr=params.local_addr,
        timeout=timeout,
        job=dict(_job),
    )


def _connect(host: str, port: int, deadline: float) -> str | None:
    """None once ``host:port`` accepts a connection, or why it did not by ``deadline``.
    Failures are retried: the other side may not listen yet, a route may come up."""
    error = "timed out"
    while (left := deadline - time.monotonic()) > 0:
        try:
            socket.create_connection((host, port), timeout=left).close()
            return None
        except OSError as e:
            error = "timed out" if isinstance(e, TimeoutError) else e.strerror or str(e)
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    return error


class _CheckedRendezvous(RendezvousHandler):
    """c10d's rendezvous, then the start-up checks, then this host's node rank as its group
    rank (the rest is c10d's)."""

    def __init__(
        self,
        inner: RendezvousHandler,
        *,
        endpoint: str,
        node_rank: int,
        nnodes: int,
        local_addr: str,
        timeout: float,
        job: dict[str, Any],
    ) -> None:
        self._inner = inner
        self._endpoint = endpoint
        self._node_rank = node_rank
        self._nnodes = nnodes
        self._local_addr = local_addr
        self._timeout = timeout
        self._job = job

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            info = self._inner.next_rendezvous()
        except RendezvousTimeoutError:
            raise StartupFailed(
                f"not all {self._nnodes} hosts joined the rendezvous at {self._endpoint} within "
                f"{self._timeout:g} s: start every host with --nnodes {self._nnodes} and "
                f"--rdzv-endpoint {self._endpoint}"
            ) from None
        except RendezvousClosedError:
            raise StartupFailed(
                f"the rendezvous at {self._endpoint} was closed: another host failed"
            ) from None
        except RendezvousError as e:
            raise StartupFailed(
                f"the rendezvous at {self._endpoint} failed: {_one_line(e.__cause__ or e)}"
            ) from None
        self._check_hosts(info)
        return RendezvousInfo(
            info.store, self._node_rank, info.world_size, info.bootstrap_store_info
        )

    def _check_hosts(self, info: RendezvousInfo) -> None:
        """Every host publishes its node rank, advertised address and job; each checks
        them and connects to every other host's address; all then read every outcome, so
        all fail alike, naming the host and address at fault."""
        deadline = time.monotonic() + self._timeout
        store, group_rank, world = info.store, info.rank, info.world_size
        # Connections wait in the backlog: no one needs to accept them.
        family = socket.AF_INET6 if ":" in self._local_addr else socket.AF_INET
        listener = socket.create_server((self._local_addr, 0), family=family, backlog=world)
        addr, port = self._local_addr, listener.getsockname()[1]
        try:
            me = {"node_rank": self._node_rank, "addr": addr, "port": port, "job": self._job}
            store.set(f"{_KEY_PREFIX}host/{group_rank}", json.dumps(me))
            hosts = self._gather(store, "host", world, deadline)
            _check_node_ranks(hosts, self._nnodes)
            _check_jobs(hosts)
            others = [h for i, h in enumerate(hosts) if i != group_rank]
            with ThreadPoolExecutor(max(1, len(others))) as pool:
                errors = list(pool.map(lambda h: _connect(h["addr"], h["port"], deadline), others))
            failed = [
                {"node_rank": h["node_rank"], "addr": h["addr"], "port": h["port"], "error": e}
                for h, e in zip(others, errors, strict=True)
                if e is not None
            ]
            reached = {"node_rank": self._node_rank, "addr": addr, "failed": failed}
            store.set(f"{_KEY_PREFIX}reached/{group_rank}", json.dumps(reached))
            # Every host probes until the deadline at most; their outcomes follow at once.
            outcomes = self._gather(store, "reached", world, deadline + 10)
        finally:
            listener.close()
        for outcome in sorted(outcomes, key=lambda o: o["node_rank"]):
            for f in outcome["failed"]:
                raise StartupFailed(
                    f"node {outcome['node_rank']} ({outcome['addr']}) could not reach node "
                    f"{f['node_rank']}'s address {_join(f['addr'], f['port'])} within "
                    f"{self._timeout:g} s ({f['error']}): each host must reach the address "
                    "every other host advertises (--local-addr)"
                )

    def _gather(self, store: Store, kind: str, world: int, deadline: float) -> list[dict]:
        """Every host's ``kind`` record, in c10d's group rank order, waiting until
        ``deadline``."""
        keys = [f"{_KEY_PREFIX}{kind}/{rank}" for rank in range(world)]
        try:
            store.wait(keys, timedelta(seconds=max(0.1, deadline - time.monotonic())))
            return [json.loads(store.get(key)) for key in keys]
        except RuntimeError:  # DistStoreError (a time-out), DistNetworkError (node 0 gone)
            raise StartupFailed(
                f"a host stopped answering at the rendezvous {self._endpoint} during the "
                f"start-up checks (waited {self._timeout:g} s)"
            ) from None

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _check_node_ranks(hosts: list[dict], nnodes: int) -> None:
    """Each node rank 0..nnodes-1 exactly once."""
    by_rank: dict[int, list[str]] = {}
    for host in hosts:
        by_rank.setdefault(host["node_rank"], []).append(host["addr"])
    for rank, addrs in sorted(by_rank.items()):
        if len(addrs) > 1:
            raise StartupFailed(
                f"hosts {', '.join(sorted(addrs))} share --node-rank {rank}: give each host "
                f"its own, 0..{nnodes - 1}"
            )


def _check_jobs(hosts: list[dict]) -> None:
    """The same job on every host; a difference is named by its keys."""
    first = min(hosts, key=lambda h: h["node_rank"])
    for host in sorted(hosts, key=lambda h: h["node_rank"]):
        mine, theirs = host["job"], first["job"]
        if mine == theirs:
            continue
        keys = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        shown = ", ".join(f"{k} {theirs.get(k)!r} -> {mine.get(k)!r}" for k in keys[:5])
        raise StartupFailed(
            f"node {host['node_rank']} ({host['addr']}) runs another configuration than node "
            f"{first['node_rank']} ({first['addr']}): {shown}; give every host the same one"
        )


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _one_line(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return " ".join(part.strip() for part in text.splitlines() if part.strip())
