"""The CPUs this process may use, for the worker's thread count.

``os.cpu_count()`` (and torch's default thread count) is every core the machine has; a worker
gets fewer when its affinity is narrower (``taskset``, a cpuset) or a CPU quota caps its cgroup
(a container run with ``--cpus 1``, a Kubernetes CPU limit). An OpenMP team wider than that is
throttled at every barrier: each thread waits for the slowest, and the slowest is the one the
quota keeps off its core. So the worker's threads start at what it may use (and
:mod:`tokenfleet.worker.tuning.threads` re-measures them while it serves, for neighbours).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuShare:
    """What this process may use: the CPUs in its affinity, and its cgroup's quota in CPUs
    (None: no quota)."""

    affinity: int
    quota: float | None

    @property
    def threads(self) -> int:
        """Threads for the worker's compute: its affinity, capped by the quota (rounded up: a
        quota of 1.5 CPUs runs two threads at three quarters each)."""
        if self.quota is None:
            return self.affinity
        return max(1, min(self.affinity, math.ceil(self.quota - 1e-9)))

    def describe(self) -> str:
        where = f"{self.affinity} CPU{'s' if self.affinity != 1 else ''} in its affinity"
        if self.quota is not None:
            where += f", a cgroup quota of {self.quota:g} CPU"
        return where


def cpu_share(root: Path = Path("/")) -> CpuShare:
    """This process's :class:`CpuShare` (``root``: where ``/proc`` and ``/sys`` are, for tests)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    return CpuShare(affinity, cgroup_quota(root))


def cgroup_quota(root: Path = Path("/")) -> float | None:
    """The tightest CPU quota on this process's cgroup or its ancestors, in CPUs: cgroup v2's
    ``cpu.max`` ("max 100000" or "150000 100000"), v1's ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us`` (-1: none). None where there is no quota or nothing can be read."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            mount = mount_point(mounts, "cgroup2", None)
            quotas += [q for q in walk(root, mount, path, v2_quota) if q is not None]
        elif "cpu" in controllers.split(","):
            mount = mount_point(mounts, "cgroup", "cpu")
            quotas += [q for q in walk(root, mount, path, v1_quota) if q is not None]
    return min(quotas, default=None)


def mount_point(mountinfo: list[str], fstype: str, option: str | None) -> str | None:
    """Where a cgroup hierarchy is mounted (``option``: the v1 controller it must carry)."""
    for line in mountinfo:
        left, _, right = line.partition(" - ")
        fields, extra = left.split(), right.split()
        if not extra or extra[0] != fstype:
            continue
        if option is None or option in extra[-1].split(",") + fields[5].split(","):
            return fields[4]
    return None


def walk(
    root: Path, mount: str | None, path: str, read: Callable[[Path], float | None]
) -> list[float | None]:
    """``read`` of the cgroup at ``path`` under ``mount`` and of each ancestor up to the mount."""
    if mount is None:
        return []
    base = root / mount.lstrip("/")
    parts = [p for p in path.strip("/").split("/") if p]
    return [read(base.joinpath(*parts[:depth])) for depth in range(len(parts), -1, -1)]


def v2_quota(group: Path) -> float | None:
    try:
        quota, period = (group / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def v1_quota(group: Path) -> float | None:
    try:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


_SIDE_WORK: set[int] = set()  # native ids of this process's threads doing side work (adapter loads)
SIDE_WORK_NICENESS = 10  # 19 starved loads: 4 s to an adapter's first token beside 8 decoding rows


def become_side_work(niceness: int = SIDE_WORK_NICENESS) -> None:
    """Mark the calling thread as side work (a thread pool's initializer): it runs below the compute
    threads' priority, so a step never waits on it, and its own waits for a CPU are not taken for a
    neighbour's load by :mod:`tokenfleet.worker.tuning.threads`."""
    tid = threading.get_native_id()
    _SIDE_WORK.add(tid)
    with contextlib.suppress(OSError):  # on Linux a thread's id names that thread alone
        os.setpriority(os.PRIO_PROCESS, tid, niceness)


def side_work_threads() -> frozenset[int]:
    return frozenset(_SIDE_WORK)
