"""What a worker process knows of its place among WORKERS (supervisor.py)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass


class NoRunDirectory(Exception):
    """No directory can be made for the workers' sockets; the message says what to do."""


def run_directory() -> str:
    """A new private directory for the workers' sockets (tempfile's: TMPDIR, else /tmp, /var/tmp, the
    working directory); NoRunDirectory when none can be written (a container's read-only root file
    system with no /tmp mounted: it was a traceback)."""
    try:
        return tempfile.mkdtemp(prefix="rpc-proxy-")
    except OSError as exc:  # FileNotFoundError: "No usable temporary directory found in [...]"
        raise NoRunDirectory(
            f"no writable temporary directory for the workers' sockets ({exc.strerror or exc}): set TMPDIR"
            " to one, or mount one at /tmp (a read-only root file system has none)"
        ) from None


@dataclass(frozen=True, slots=True)
class WorkerContext:
    """What a worker process knows of its place: its number, the run directory it shares and its
    deployment's Via pseudonym (via.py: the workers answer on one port, so they share one)."""

    index: int
    run_dir: str
    via: str = ""
