"""What a worker process knows of its place among WORKERS (supervisor.py)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass


class NoRunDirectory(Exception):
    """No directory can be made for the workers' sockets; the message says what to do."""


# A Unix socket's path is at most 107 bytes (Linux's sun_path); the longest of the workers' names
# is `metrics-supervisor.sock`, 23, after the directory and its `/`.
RUN_DIRECTORY_MAX = 107 - 24
_PREFIX = "rpc-proxy-"  # mkdtemp's name: the prefix and 8 characters
TMPDIR_MAX = RUN_DIRECTORY_MAX - len(_PREFIX) - 9


def run_directory() -> str:
    """A new private directory for the workers' sockets (tempfile's: TMPDIR, else /tmp, /var/tmp, the
    working directory); NoRunDirectory when none can be written (a container's read-only root file
    system with no /tmp mounted) or its path leaves a socket's no room (a long TMPDIR): each was a
    traceback."""
    try:
        path = tempfile.mkdtemp(prefix=_PREFIX)
    except OSError as exc:  # FileNotFoundError: "No usable temporary directory found in [...]"
        raise NoRunDirectory(
            f"no writable temporary directory for the workers' sockets ({exc.strerror or exc}): set TMPDIR"
            " to one, or mount one at /tmp (a read-only root file system has none)"
        ) from None
    if (length := len(os.fsencode(path))) > RUN_DIRECTORY_MAX:
        os.rmdir(path)
        raise NoRunDirectory(
            f"the temporary directory for the workers' sockets, {length} bytes long, leaves no room for a"
            f" socket's name (a Unix socket path is at most 107 bytes): set TMPDIR to one of {TMPDIR_MAX}"
            " bytes at most"
        )
    return path


@dataclass(frozen=True, slots=True)
class WorkerContext:
    """What a worker process knows of its place: its number, the run directory it shares and its
    deployment's Via pseudonym (via.py: the workers answer on one port, so they share one)."""

    index: int
    run_dir: str
    via: str = ""
