"""The memory limit of the proxy's cgroup (its container's), exported as rpc_proxy_memory_limit_bytes
so an alert can compare process_resident_memory_bytes with the bound the kernel enforces."""

from __future__ import annotations

from pathlib import Path

# cgroup v2's file, then v1's; "max" (v2) or a huge number (v1: no limit set) means none.
_FILES = ("memory.max", "memory/memory.limit_in_bytes")
_NO_LIMIT = 1 << 60


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The limit in bytes, or None when the process has none (or no cgroup is mounted)."""
    for name in _FILES:
        try:
            text = (root / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < _NO_LIMIT:
            return int(text)
        return None
    return None
