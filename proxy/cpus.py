"""How many CPUs this process may use (WORKERS=auto): its affinity, at most its cgroup's CPU quota.
os.cpu_count() is the host's, whatever a container's limit allows."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

# WORKERS' bound: each worker is a process with its own memory tier; past this, a typo (the
# supervisor hung building 2**53 slots).
WORKERS_MAX = 1024


def usable_cpus(cgroups: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> int:
    """The CPUs this process may use (WORKERS=auto): those its affinity allows (taskset, cpusets),
    at most its cgroup's CPU quota rounded down (a container's cpu limit: Kubernetes, docker --cpus),
    at least 1. os.cpu_count() is the host's: 64 workers, each with its own memory tier, in a
    container allowed 2 CPUs."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        count = os.cpu_count() or 1
    quota = cgroup_quota(_cgroup_files(cgroups, own))
    return max(1, min(count, int(quota)) if quota is not None else count)


def _cgroup_files(root: str, own: str) -> dict[str, str]:
    """The CPU quota files of this process's cgroup that exist, by name, read: cgroup v2's cpu.max,
    v1's cpu.cfs_quota_us and cpu.cfs_period_us, each in its own cgroup (a path in /proc/self/cgroup)
    or at the hierarchy's root (as a container's cgroup namespace shows its own)."""
    v2, v1 = "", ""
    with contextlib.suppress(OSError):
        for line in Path(own).read_text(errors="replace").splitlines():
            number, controllers, path = [*line.split(":", 2), "", ""][:3]
            if number == "0" and not controllers:
                v2 = path.strip("/")
            elif "cpu" in controllers.split(","):
                v1 = path.strip("/")
    places = {
        "cpu.max": [f"{root}/{v2}/cpu.max", f"{root}/cpu.max"],
        **{
            name: [f"{root}/{hierarchy}/{v1}/{name}" for hierarchy in ("cpu", "cpu,cpuacct")]
            + [f"{root}/{hierarchy}/{name}" for hierarchy in ("cpu", "cpu,cpuacct")]
            for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        },
    }
    texts: dict[str, str] = {}
    for name, paths in places.items():
        for place in paths:
            with contextlib.suppress(OSError):
                texts[name] = Path(place).read_text(errors="replace")
                break
    return texts


def cgroup_quota(files: Mapping[str, str]) -> float | None:
    """CPUs a cgroup's quota allows (quota / period), from its files' texts; None: no quota. cgroup
    v2's cpu.max is `max 100000` (none) or `200000 100000`; v1's cfs_quota_us is -1 for none. Pure."""
    quota = period = ""
    if "cpu.max" in files:
        parts = files["cpu.max"].split()
        quota, period = [*parts, "", ""][:2]
    elif "cpu.cfs_quota_us" in files:
        quota, period = files["cpu.cfs_quota_us"].strip(), files.get("cpu.cfs_period_us", "").strip()
    if not (quota.isdigit() and period.isdigit()) or int(period) == 0 or int(quota) == 0:
        return None  # "max", -1, missing or unreadable: no quota
    return int(quota) / int(period)
