"""The journal of debits a replica made while the ledger's Redis could not be reached: one JSON line
per change of a key's cumulative counters, read back by the replica's next exchange and by the
operator CLI."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path

from proxy.credits.key_lease import KeyLease
from proxy.logs import Throttled
from proxy.rpc import jsonrpc

log = logging.getLogger("proxy.credits")
throttled = Throttled(log, interval=10.0)


def journal_dir_problem(directory: str) -> str | None:
    """Why a journal directory cannot be used (None: it can). Checked at start-up by writing a file, so
    an outage never finds out first (README "Limits and credits")."""
    if not os.path.isdir(directory):
        return f"CREDITS_JOURNAL_DIR {directory!r} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return f"CREDITS_JOURNAL_DIR {directory!r} is not writable: {exc.strerror}"
    return None


class Journal:
    """Debits made while Redis was unreachable, as one JSON line per change of a key's cumulative
    counters in `<dir>/<replica>.journal`. Counters merge by max, so any reader (the operator CLI)
    may apply a line any number of times."""

    def __init__(self, directory: str | None, replica: str) -> None:
        self._path = Path(directory) / f"{replica}.journal" if directory else None
        self._dirty = False

    def record(self, replica: str, lease: KeyLease) -> None:
        if self._path is None:
            return
        line = jsonrpc.dumps({"r": replica, "k": lease.key, "c": lease.consumed, "f": lease.refunded})
        try:
            with self._path.open("ab") as handle:
                handle.write(line + b"\n")
        except OSError as exc:  # the debit stands (kept in memory); a journal fault never fails a call
            throttled.warning("journal", "credits: cannot write the journal %s: %s", self._path, exc.strerror)
            return
        self._dirty = True

    def clear(self) -> None:
        """Everything journaled has reached Redis."""
        if self._path is not None and self._dirty:
            with contextlib.suppress(OSError):
                self._path.unlink()
            self._dirty = False


def read_journals(directory: str | None) -> dict[str, dict[str, tuple[int, int]]]:
    """Ledger key -> replica -> (consumed, refunded), the largest each journal holds."""
    found: dict[str, dict[str, tuple[int, int]]] = {}
    if not directory or not os.path.isdir(directory):
        return found
    for path in Path(directory).glob("*.journal"):
        try:
            lines = path.read_bytes().splitlines()
        except OSError:
            continue  # removed meanwhile: written back
        for line in lines:
            try:
                entry = jsonrpc.loads(line)
                replica, key, consumed, refunded = entry["r"], entry["k"], int(entry["c"]), int(entry["f"])
            except (jsonrpc.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # a line cut short by a crash
            old = found.setdefault(key, {}).get(replica, (0, 0))
            found[key][replica] = (max(old[0], consumed), max(old[1], refunded))
    return found
