"""A real Slurm cluster on this host for the tests: one slurmctld and one slurmd per emulated
node, all on 127.0.0.1, with a private slurm.conf, state and logs in the test's folder, and
always stopped, with every job process, when the test ends.

A real cluster rather than a fake ``srun``: what the launcher tests check (which variables a
task sees, how a nodelist is written, what ``scancel`` sends and when) is Slurm's behaviour,
which a fake would only restate. Several ``slurmd`` on one host, each under its own node
name and port, give real multi-node steps (``srun -N2`` runs a task on each "node").

The cluster has its own ``munged`` too (own key, own socket, named by ``AuthInfo``) rather
than the host's: it needs no set-up of /run/munge, and two clusters in concurrent test
processes never stop the daemon the other one uses.

Needs root (``SlurmUser=root``: the daemons start tasks as the submitting user) and the
Debian packages ``slurmctld slurmd slurm-client munge``; ``slurm_unavailable`` says what is
missing, for ``pytest.skip``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dlrmflow.supervise import die_with_parent

# Executables the cluster needs: daemons, and the clients the helpers call (job states
# come from scontrol: sacct would need the accounting daemon, which this cluster leaves out).
REQUIRED_PROGRAMS = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scancel",
    "squeue",
    "scontrol",
)
START_TIMEOUT_S = 60.0
# Between SIGTERM and SIGKILL, for the daemons and for job processes left at exit.
STOP_GRACE_S = 10.0
# Slurm's KillWait, its default: how long a cancelled step has between SIGTERM and SIGKILL.
KILL_WAIT_S = 30
# Between SIGTERM and SIGKILL for a slurmd whose controller is gone (it runs no job).
NO_CONTROLLER_GRACE_S = 2.0
# Starts tried when a chosen port was taken before its daemon bound it.
PORT_ATTEMPTS = 3
# What ``SlurmCluster.state`` answers for a job the controller does not know (never
# submitted, or purged after MinJobAge).
NOT_FOUND = "NOT_FOUND"
# Job states after which nothing of the job runs any more (``COMPLETING`` is not one: its
# processes may still be ending).
TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
        NOT_FOUND,
    }
)
# In the environment of a cluster's daemons and jobs (Slurm passes it on to slurmstepd
# and the tasks): "<pid>:<start time>:<slurm.conf>" of the process that started the
# cluster, so its processes are found, also once that process died.
OWNER_ENV = "TESTS_SLURM_CLUSTER"
# A cluster's munged socket and key are in /tmp/<this><owner pid>-<start time>-<random>.
MUNGE_DIR_PREFIX = "slurm-munge-"
# Variables of the calling environment that would point the clients at another job or
# cluster (pytest itself may run inside a Slurm allocation).
_FOREIGN_ENV = re.compile(r"^(SLURM_|SBATCH_|SRUN_|SALLOC_|SQUEUE_|SCANCEL_|SINFO_)")


class SlurmClusterError(RuntimeError):
    """The cluster did not start, or a Slurm command failed."""


def slurm_unavailable() -> str | None:
    """Why a real Slurm cluster cannot run here (one line, for ``pytest.skip``), or None.
    Installs nothing: a test run should not change the machine."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root: the Slurm daemons run as root (SlurmUser=root)"
    missing = [name for name in REQUIRED_PROGRAMS if shutil.which(name) is None]
    if missing:
        return (
            f"Slurm is not installed (no {', '.join(missing)}); "
            "apt-get install slurmctld slurmd slurm-client munge"
        )
    return None


@dataclass
class SlurmCluster:
    """A running cluster: run its clients with ``env`` (SLURM_CONF names ``conf``)."""

    conf: Path
    env: dict[str, str]
    node_names: list[str]
    # sbatch runs here, so a job's default working folder and slurm-<id>.out are in it.
    workdir: Path
    log_dir: Path
    _run_dir: Path = field(repr=False)
    _munge_dir: Path = field(repr=False)
    _daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    def command(
        self, *args: str, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (``args[0]``: squeue, sinfo, srun, ...) against this cluster."""
        result = subprocess.run(
            list(args),
            env=self.env,
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if check and result.returncode != 0:
            raise SlurmClusterError(
                f"{' '.join(args)} exited with {result.returncode}: {result.stderr.strip()}"
            )
        return result

    def submit(
        self,
        script: Path,
        *args: str,
        options: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> int:
        """``sbatch --parsable [options] script args``: the new job's id. ``options`` are
        sbatch's (``-N2``, ``--output``...); ``env``, if given, is the submitting
        environment (the job inherits it), else ``self.env``."""
        result = subprocess.run(
            ["sbatch", "--parsable", *options, str(script), *args],
            env=self.env if env is None else {**env, **self._own_env()},
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
        if result.returncode != 0:
            raise SlurmClusterError(f"sbatch {script} failed: {result.stderr.strip()}")
        # "<id>" or "<id>;<cluster>"
        return int(result.stdout.strip().split(";")[0])

    def output(self, job_id: int) -> Path:
        """The job's default output file (sbatch without ``--output``)."""
        return self.workdir / f"slurm-{job_id}.out"

    def job_info(self, job_id: int) -> dict[str, str] | None:
        """``scontrol show job``'s fields for the job, or None when the controller does not
        know it (never submitted, or purged MinJobAge after it ended)."""
        result = self.command("scontrol", "-o", "show", "job", str(job_id), check=False)
        if result.returncode != 0:
            if "invalid job id" in result.stderr.lower():
                return None
            raise SlurmClusterError(f"scontrol show job {job_id}: {result.stderr.strip()}")
        fields = re.findall(r"(\S+?)=(\S*)", result.stdout)
        return dict(fields)

    def state(self, job_id: int) -> str:
        """The job's state: PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED,
        TIMEOUT, ... or ``NOT_FOUND`` when the controller does not know the job."""
        info = self.job_info(job_id)
        return NOT_FOUND if info is None else info["JobState"]

    def wait(self, job_id: int, timeout: float = 60, poll: float = 0.2) -> str:
        """Poll until the job is in a terminal state (``TERMINAL_STATES``) and return it;
        TimeoutError, naming the last state, when it is not within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(job_id)
            if state in TERMINAL_STATES:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout} s")
            time.sleep(poll)

    def wait_for(
        self, job_id: int, states: Sequence[str], timeout: float = 60, poll: float = 0.2
    ) -> str:
        """Poll until the job is in one of ``states`` (RUNNING, say) or a terminal one."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(job_id)
            if state in states or state in TERMINAL_STATES:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout} s")
            time.sleep(poll)

    def cancel(self, job_id: int, signal_name: str | None = None) -> None:
        """``scancel`` the job: its steps get SIGTERM, then SIGKILL KillWait later. With
        ``signal_name`` (``USR1``...), only send that signal to its steps."""
        args = ["scancel"] if signal_name is None else ["scancel", "--signal", signal_name]
        self.command(*args, str(job_id))

    def active_jobs(self) -> list[int]:
        """Ids of the jobs not yet ended (pending, running, completing...)."""
        result = self.command("squeue", "-h", "-o", "%A", check=False)
        return [int(line) for line in result.stdout.split() if line.isdigit()]

    def processes(self) -> list[int]:
        """Pids of this cluster's processes now running: daemons, slurmstepd, job tasks
        (and their children), and clients started with ``env``. Empty once it stopped."""
        tag = self.env[OWNER_ENV]
        return _tagged(lambda value: value == tag)

    def _own_env(self) -> dict[str, str]:
        return {name: self.env[name] for name in ("SLURM_CONF", OWNER_ENV)}

    def log(self, daemon: str) -> Path:
        """A daemon's log file: ``slurmctld``, ``slurmd-<node>`` or ``munged`` (what a Slurm
        daemon writes before it opens its log, and its stderr, is in ``<daemon>.out``)."""
        return self.log_dir / f"{daemon}.log"


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports nothing listens on now (all held open until all are found)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def _short_hostname() -> str:
    """The name slurmctld compares SlurmctldHost with (``hostname -s``)."""
    return socket.gethostname().split(".")[0]


def _slurm_conf(
    *,
    base: Path,
    munge_socket: Path,
    nodes: list[str],
    cpus_per_node: int,
) -> str:
    run, log_dir = base / "run", base / "log"
    host = _short_hostname()
    ctld_port, *node_ports = _free_ports(1 + len(nodes))
    lines = [
        "ClusterName=testcluster",
        # name(address): the address is used, so nothing depends on how the host name
        # resolves; slurmctld still needs the name to be this host's to act as controller.
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={node_ports[0]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        "MpiDefault=none",
        "MailProg=/bin/true",
        # No cgroups: linuxproc tracks a step's processes by parentage, task/none binds none.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        # A node that registers again (a restarted slurmd) is usable at once.
        "ReturnToService=2",
        # scancel's SIGTERM to SIGKILL.
        f"KillWait={KILL_WAIT_S}",
        "InactiveLimit=0",
        # Ended jobs stay in scontrol/squeue this long, so a test can read their state.
        "MinJobAge=3600",
        "SlurmdTimeout=300",
        # Trust the node lines, not this host's cores: more CPUs than it has, or nodes that
        # share its cores, are not drained.
        "SlurmdParameters=config_overrides",
        f"StateSaveLocation={base / 'state'}",
        # %n: each slurmd's node name, so the node daemons share no file.
        f"SlurmdSpoolDir={base / 'spool'}/%n",
        f"SlurmctldPidFile={run / 'slurmctld.pid'}",
        f"SlurmdPidFile={run / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={log_dir / 'slurmctld.log'}",
        f"SlurmdLogFile={log_dir / 'slurmd-%n.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    for name, port in zip(nodes, node_ports, strict=True):
        lines.append(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={cpus_per_node} State=UNKNOWN"
        )
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start a daemon in the foreground (so its pid is ours to wait for), in its own
    session, stdout and stderr to ``log`` (never the test's, which pytest may capture
    and wait on), stopped by the kernel if this process dies first."""
    parent = os.getpid()
    with log.open("ab") as out:
        return subprocess.Popen(
            args,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM, parent),
        )


def _stop_all(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM each, then SIGKILL those still there ``grace`` seconds later (one wait for
    all, not one each); all reaped."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
        deadline = time.monotonic() + grace
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        proc.wait()


def _pid_from_file(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _runs_conf(pid: int, conf: Path) -> bool:
    """Whether process ``pid`` lives and has ``conf`` on its command line."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(conf).encode() in cmdline


def _if_runs_conf(pid: int, conf: Path) -> list[int]:
    """``[pid]`` while that process runs ``conf``'s daemon, else ``[]``."""
    return [pid] if _runs_conf(pid, conf) else []


def _start_time(pid: int) -> str | None:
    """When the process started (clock ticks after boot): with its pid, it names one
    process, never a later one that reused the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_id() -> str:
    """ "<pid>:<start time>" of this process."""
    pid = os.getpid()
    return f"{pid}:{_start_time(pid) or '?'}"


def _owner_tag(conf: Path) -> str:
    """``OWNER_ENV``'s value for a cluster this process starts."""
    return f"{_owner_id()}:{conf}"


def _owner_gone(tag: str) -> bool:
    """Whether the process that started the cluster ``tag`` names no longer runs."""
    pid, start, _ = (tag.split(":", 2) + ["", ""])[:3]
    if not pid.isdigit():
        return False  # not a tag of ours: leave it alone
    now = _start_time(int(pid))
    return now is None or (start != "?" and now != start)


def _process_table() -> dict[int, tuple[int, str | None]]:
    """Every live process's parent pid and ``OWNER_ENV`` value (None where it has none or
    cannot be read); zombies left out, as there is nothing in them to stop."""
    prefix = f"{OWNER_ENV}=".encode()
    table: dict[int, tuple[int, str | None]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if fields[0] in ("Z", "X"):
            continue
        tag = next(
            (
                item[len(prefix) :].decode(errors="replace")
                for item in environ
                if item.startswith(prefix)
            ),
            None,
        )
        table[int(entry.name)] = (int(fields[1]), tag)
    return table


def _tagged(select: Callable[[str], bool]) -> list[int]:
    """Pids of the processes whose ``OWNER_ENV`` value ``select`` accepts, with all their
    descendants (a task started with ``--export=NONE`` lacks the variable, its slurmstepd
    has it); never this process or one of its ancestors."""
    table = _process_table()
    found = {pid for pid, (_, tag) in table.items() if tag is not None and select(tag)}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    pid, protected = os.getpid(), set[int]()
    while pid not in protected and pid > 0:
        protected.add(pid)
        pid = table.get(pid, (0, None))[0]
    return sorted(found - protected)


def kill_orphans() -> None:
    """Stop what is left of clusters whose test process died without stopping them (killed
    with SIGKILL, say): their daemons stop with it, but jobs' slurmstepd and tasks do
    not, nor their munge folders. Clusters of running test processes are left alone.
    SIGKILL at once: a slurmstepd whose slurmd is gone ignores SIGTERM, and nothing is
    left to end gracefully for."""
    _kill_all(lambda: _tagged(_owner_gone), signals=(signal.SIGKILL,))
    for folder in Path("/tmp").glob(f"{MUNGE_DIR_PREFIX}*-*-*"):
        pid, start = folder.name[len(MUNGE_DIR_PREFIX) :].split("-")[:2]
        if _owner_gone(f"{pid}:{start}:"):
            shutil.rmtree(folder, ignore_errors=True)


def _kill_all(
    pids: Callable[[], list[int]],
    grace: float = STOP_GRACE_S,
    signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGKILL),
) -> None:
    """Send each of ``pids()`` each of ``signals`` in turn (SIGTERM, then SIGKILL to those
    still there ``grace`` seconds later)."""
    for sig in signals:
        for pid in pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pids():
            return


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _logs_of(cluster: SlurmCluster, daemon: str) -> str:
    """Where to read why ``daemon`` failed, with the end of what it wrote."""
    log, out = cluster.log(daemon), cluster.log_dir / f"{daemon}.out"
    text = f"its log {log}:\n{_tail(log)}"
    if daemon != "munged":
        text += f"\nits stderr {out}:\n{_tail(out, 600)}"
    return text


def _node_states(cluster: SlurmCluster) -> dict[str, str]:
    """Each node's State as the controller reports it ({} while it does not answer);
    SlurmClusterError, with the controller's reason, for a node it refused."""
    # A short timeout: with no controller listening, scontrol retries for a while, and the
    # caller wants to notice a daemon that exited.
    try:
        result = cluster.command("scontrol", "-o", "show", "nodes", check=False, timeout=3)
    except subprocess.TimeoutExpired:
        return {}
    if result.returncode != 0:
        return {}
    states: dict[str, str] = {}
    for line in result.stdout.splitlines():
        fields = dict(re.findall(r"(\S+?)=(\S*)", line))
        if "NodeName" not in fields:
            continue
        name, state = fields["NodeName"], fields.get("State", "")
        if "INVALID_REG" in state.split("+"):
            reason = re.search(r" Reason=(.*?)(?= \w+=|$)", line)
            raise SlurmClusterError(
                f"slurmctld refused node {name} ({state}): "
                f"{reason.group(1) if reason else 'no reason given'}; see "
                f"{cluster.log(f'slurmd-{name}')} and {cluster.log('slurmctld')}"
            )
        states[name] = state
    return states


def _wait_ready(cluster: SlurmCluster, timeout: float) -> None:
    """Until every node is IDLE; SlurmClusterError, naming the log to read, if a daemon
    exits or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        for name, proc in cluster._daemons.items():
            if proc.poll() is not None:
                raise SlurmClusterError(
                    f"{name} exited with {proc.returncode} while the cluster started; "
                    + _logs_of(cluster, name)
                )
        states = _node_states(cluster)
        if len(states) == len(cluster.node_names) and all(
            state.split("+")[0] == "IDLE" for state in states.values()
        ):
            return
        time.sleep(0.2)
    if not states:
        detail = "slurmctld does not answer; " + _logs_of(cluster, "slurmctld")
    else:
        late = [name for name in cluster.node_names if not states.get(name, "").startswith("IDLE")]
        logs = ", ".join(str(cluster.log(f"slurmd-{name}")) for name in late)
        detail = f"node states {states}; see {logs} and {cluster.log('slurmctld')}"
    raise SlurmClusterError(f"Slurm cluster not ready after {timeout} s: {detail}")


def _client_env(conf: Path, tag: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not _FOREIGN_ENV.match(key)}
    env["SLURM_CONF"] = str(conf)
    env[OWNER_ENV] = tag
    return env


@contextlib.contextmanager
def slurm_cluster(
    tmp: Path, nodes: int = 2, cpus_per_node: int = 1, start_timeout: float = START_TIMEOUT_S
) -> Iterator[SlurmCluster]:
    """A Slurm cluster of ``nodes`` nodes (n1, n2, ...) of ``cpus_per_node`` CPUs each (any
    number: the nodes' configuration, not this host's cores, counts), all daemons on this
    host, configuration, state, logs and jobs' working folder under ``tmp``. On exit, also
    on error: its jobs cancelled, the daemons stopped (SIGTERM, then SIGKILL), and any job
    process still left killed, so nothing of it outlives the block.

    Enter and leave it in one thread: the daemons are signalled to stop when the thread
    that started them ends (so a killed test process leaves no daemon either)."""
    if nodes < 1 or cpus_per_node < 1:
        raise ValueError("a cluster needs at least one node of at least one CPU")
    kill_orphans()
    cluster = _started_cluster(Path(tmp).resolve(), nodes, cpus_per_node, start_timeout)
    try:
        yield cluster
    finally:
        _shut_down(cluster)


def _started_cluster(
    tmp: Path, nodes: int, cpus_per_node: int, start_timeout: float
) -> SlurmCluster:
    """Start the daemons, again on fresh ports if one was taken between choosing it and
    binding it (the ports are free when chosen, not reserved)."""
    node_names = [f"n{i}" for i in range(1, nodes + 1)]
    for attempt in range(1, PORT_ATTEMPTS + 1):
        cluster = _new_cluster(tmp, node_names, cpus_per_node)
        try:
            _start_daemons(cluster, start_timeout)
        except BaseException as error:
            _shut_down(cluster)
            if (
                isinstance(error, SlurmClusterError)
                and attempt < PORT_ATTEMPTS
                and _port_taken(cluster.log_dir)
            ):
                failed = tmp / f"log.failed-{attempt}"
                shutil.rmtree(failed, ignore_errors=True)
                cluster.log_dir.rename(failed)
                continue
            raise
        return cluster
    raise AssertionError("unreachable: the last attempt returns or raises")


def _new_cluster(tmp: Path, node_names: list[str], cpus_per_node: int) -> SlurmCluster:
    """Fresh folders, munge key and slurm.conf (with newly chosen ports) under ``tmp``."""
    for name in ("run", "state", "spool"):
        shutil.rmtree(tmp / name, ignore_errors=True)
    for folder in (tmp / "run", tmp / "log", tmp / "jobs", tmp / "state"):
        folder.mkdir(parents=True, exist_ok=True)
    for name in node_names:
        (tmp / "spool" / name).mkdir(parents=True)
    conf = tmp / "slurm.conf"
    # munged wants every folder above its socket searchable by all, and a socket path
    # is short (sun_path), neither true of pytest's tmp_path: a folder of its own in /tmp.
    # Named after this process, so ``kill_orphans`` can tell when it is left over.
    owner = _owner_id().replace(":", "-")
    munge_dir = Path(tempfile.mkdtemp(prefix=f"{MUNGE_DIR_PREFIX}{owner}-", dir="/tmp"))
    munge_dir.chmod(0o755)
    key = munge_dir / "munge.key"
    key.touch(mode=0o600)
    key.write_bytes(os.urandom(128))
    conf.write_text(
        _slurm_conf(
            base=tmp,
            munge_socket=munge_dir / "munge.socket",
            nodes=node_names,
            cpus_per_node=cpus_per_node,
        )
    )
    return SlurmCluster(
        conf=conf,
        env=_client_env(conf, _owner_tag(conf)),
        node_names=node_names,
        workdir=tmp / "jobs",
        log_dir=tmp / "log",
        _run_dir=tmp / "run",
        _munge_dir=munge_dir,
    )


def _start_daemons(cluster: SlurmCluster, start_timeout: float) -> None:
    munge_dir = cluster._munge_dir
    conf = str(cluster.conf)
    # In the foreground munged logs to stderr only: its log is that.
    cluster._daemons["munged"] = _start(
        ["munged", "--foreground", f"--socket={munge_dir / 'munge.socket'}",
         f"--key-file={munge_dir / 'munge.key'}", f"--pid-file={munge_dir / 'munged.pid'}",
         f"--seed-file={munge_dir / 'munged.seed'}"],
        cluster.env, cluster.log("munged"),
    )  # fmt: skip
    _wait_for_socket(cluster, munge_dir / "munge.socket")
    cluster._daemons["slurmctld"] = _start(
        ["slurmctld", "-D", "-f", conf], cluster.env, cluster.log_dir / "slurmctld.out"
    )
    for name in cluster.node_names:
        cluster._daemons[f"slurmd-{name}"] = _start(
            ["slurmd", "-D", "-f", conf, "-N", name],
            cluster.env,
            cluster.log_dir / f"slurmd-{name}.out",
        )
    _wait_ready(cluster, start_timeout)


def _port_taken(log_dir: Path) -> bool:
    """Whether a daemon of this attempt failed to bind its port."""
    return any(
        "Address already in use" in path.read_text(errors="replace")
        for path in log_dir.iterdir()
        if path.is_file()
    )


def _wait_for_socket(cluster: SlurmCluster, path: Path) -> None:
    proc = cluster._daemons["munged"]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            log = cluster.log("munged")
            raise SlurmClusterError(f"munged did not start; its log {log}:\n{_tail(log)}")
        time.sleep(0.05)


def _shut_down(cluster: SlurmCluster) -> None:
    """Cancel the jobs, stop the Slurm daemons, kill any job process left, stop munged:
    every step is tried even if one before it fails."""
    daemons = cluster._daemons
    try:
        if "slurmctld" in daemons and daemons["slurmctld"].poll() is None:
            with contextlib.suppress(SlurmClusterError, subprocess.TimeoutExpired):
                jobs = cluster.active_jobs()
                if jobs:
                    cluster.command("scancel", *map(str, jobs), check=False)
                    deadline = time.monotonic() + KILL_WAIT_S + STOP_GRACE_S
                    while cluster.active_jobs() and time.monotonic() < deadline:
                        time.sleep(0.2)
    finally:
        # With no controller to answer (a start that failed), a slurmd can sit out SIGTERM
        # in its retries; it runs no job then, so it is killed sooner.
        controller_up = "slurmctld" in daemons and daemons["slurmctld"].poll() is None
        slurmds = [f"slurmd-{n}" for n in cluster.node_names]
        # Node daemons first: a slurmd outliving slurmctld only retries registering.
        _stop_all(
            [daemons[name] for name in slurmds if name in daemons],
            STOP_GRACE_S if controller_up else NO_CONTROLLER_GRACE_S,
        )
        if "slurmctld" in daemons:
            _stop_all([daemons["slurmctld"]], STOP_GRACE_S)
        for name in [*slurmds, "slurmctld"]:
            # Run with -D, a daemon's pid file holds the pid of the process we started
            # (stopped above). Any other pid there is stopped only if it is a daemon of
            # this cluster (its command line names our slurm.conf), never a process that
            # reused a stale pid.
            pid = _pid_from_file(cluster._run_dir / f"{name}.pid")
            proc = daemons.get(name)
            if pid is not None and (proc is None or pid != proc.pid):
                _kill_all(functools.partial(_if_runs_conf, pid, cluster.conf))
        # Job processes (slurmstepd, tasks) outlive slurmd; OWNER_ENV in their
        # environment says which are this cluster's.
        _kill_all(cluster.processes)
        if "munged" in daemons:
            _stop_all([daemons["munged"]], STOP_GRACE_S)
        shutil.rmtree(cluster._munge_dir, ignore_errors=True)
