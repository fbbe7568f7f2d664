"""Which configuration files the proxy may trust: `.env`, API_KEYS_FILE, NETWORKS_FILE, CREDITS_FILE.

A file another local user owns, or can write, could add a key with unlimited credits or open
`anvil_*`: such a file is refused, as OpenSSH refuses an `authorized_keys` others can change.
Trusted: owned by the proxy's user or root, and writable by neither others nor a group other than
the proxy's own. A file on a read-only mount (a Kubernetes Secret, a Docker `:ro` bind mount) is
trusted whatever its owner: nobody on this system can change it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from proxy.options import ConfigError


def trust_problem(mode: int, uid: int, gid: int, *, euid: int, egid: int, read_only: bool) -> str | None:
    """Why a file with this owner and mode cannot be trusted, or None when it can."""
    if read_only:
        return None
    if uid not in (euid, 0):
        return f"is owned by uid {uid}, not by the proxy's user ({euid}) or root"
    if mode & stat.S_IWOTH:
        return "is writable by other users"
    if mode & stat.S_IWGRP and gid != egid:
        return f"is writable by group {gid}"
    return None


def check_trusted(name: str, path: Path) -> None:
    """Raise ConfigError (one line) if `path` exists and may have been planted or changed by others."""
    try:
        info = path.stat()
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):  # a FIFO would hold `check` and `serve` forever
        raise ConfigError(f"{name}: {path} is not a regular file")
    problem = trust_problem(
        info.st_mode, info.st_uid, info.st_gid, euid=os.geteuid(), egid=os.getegid(), read_only=read_only
    )
    if problem is not None:
        raise ConfigError(f"{name}: {path} {problem}: refused (chown it to the proxy's user and chmod go-w)")
