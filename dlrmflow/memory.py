"""A process's memory, measured and foreseen: its peak resident set (``peak_rss_bytes``,
restarted by ``reset_peak_rss`` where an evaluation begins, so that ``eval.json`` reports
the evaluation's own peak), what it may still take (``available_memory``) and byte counts
for a person.

``available_memory`` says how much more memory this process may take: what the kernel
could give (``MemAvailable``), or less where a cgroup limit (a container's, a systemd
unit's) would kill it first. The trainer compares a model's embeddings with it before
allocating them, so a model too large fails in one line rather than in the allocator or
the OOM killer. The allocator's settings are ``dlrmflow.runtime.glibc_malloc``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def peak_rss_bytes(pid: int | None = None) -> int:
    """This process's (or the live process ``pid``'s) peak resident set (``VmHWM``:
    anonymous memory and mapped file pages alike) since it started or since
    ``reset_peak_rss``. Elsewhere than Linux, getrusage's maximum for this process, and 0
    for another one (or one that is gone)."""
    try:
        with open(f"/proc/{'self' if pid is None else pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if pid is not None:
        return 0
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_rss() -> bool:
    """Restart ``peak_rss_bytes`` from the current resident set (Linux 4.0+: writing 5 to
    ``/proc/self/clear_refs``); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class Available:
    """Bytes of memory a process may still take, and what limits it (for the message)."""

    bytes: int
    source: str


# A cgroup v1 limit at or above this is "no limit" (the kernel's unlimited is ~2**63).
_V1_UNLIMITED = 1 << 62


def available_memory(
    meminfo: str | Path = "/proc/meminfo",
    proc_cgroup: str | Path = "/proc/self/cgroup",
    cgroup_root: str | Path = "/sys/fs/cgroup",
) -> Available | None:
    """The memory this process may still take: ``MemAvailable`` of ``/proc/meminfo``, or
    less where this process's memory cgroup (or one above it) is limited, v2
    (``memory.max``) or v1 (``memory.limit_in_bytes``). A cgroup's room is its limit less
    its usage, its file cache counted free (the kernel reclaims it before killing).
    None where neither can be read (not Linux). The paths are the kernel's; tests pass
    others."""
    candidates = []
    total = _meminfo_available(Path(meminfo))
    if total is not None:
        candidates.append(Available(total, f"MemAvailable in {meminfo}"))
    limited = _cgroup_available(Path(proc_cgroup), Path(cgroup_root))
    if limited is not None:
        candidates.append(limited)
    return min(candidates, key=lambda a: a.bytes, default=None)


def format_bytes(n: float) -> str:
    """``n`` bytes for a person, with the exact count: ``2.4 TB (2368000000000 bytes)``."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit} ({int(n)} bytes)"
    return f"{int(n)} bytes"


def _meminfo_available(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2's "max": no limit


def _file_cache(stat: Path, keys: tuple[str, ...]) -> int:
    try:
        values = dict(line.split() for line in stat.read_text().splitlines() if " " in line)
    except (OSError, ValueError):
        return 0
    return sum(int(values.get(k, 0)) for k in keys)


def _cgroup_available(proc_cgroup: Path, root: Path) -> Available | None:
    """The least room of this process's memory cgroup and those above it, if any is
    limited. A cgroup namespace shows the process at its root (``/``), where the
    container's limit is."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best: Available | None = None
    for line in lines:
        _id, controllers, name = (line.split(":", 2) + ["", ""])[:3]
        relative = name.strip().lstrip("/")
        if controllers == "" and (root / "cgroup.controllers").exists():  # v2
            base, limit_file, usage_file = root, "memory.max", "memory.current"
            cache_keys: tuple[str, ...] = ("active_file", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            base, limit_file, usage_file = (
                root / "memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
            cache_keys = ("total_active_file", "total_inactive_file")
        else:
            continue
        directory = base / relative
        if not directory.is_dir():
            directory = base  # the namespace's own root
        for level in [directory, *directory.parents]:
            if level != base and base not in level.parents:
                break
            limit = _read_int(level / limit_file)
            usage = _read_int(level / usage_file)
            if limit is not None and usage is not None and limit < _V1_UNLIMITED:
                room = max(0, limit - usage + _file_cache(level / "memory.stat", cache_keys))
                room = min(room, limit)
                if best is None or room < best.bytes:
                    best = Available(room, f"the cgroup limit {level / limit_file}")
    return best
