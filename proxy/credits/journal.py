"""The journal of debits a replica made while the ledger's Redis could not be reached: one JSON line
per change of a key's cumulative counters, read back by the replica's next exchange and by the
operator CLI."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.rpc import jsonrpc

if TYPE_CHECKING:
    from proxy.credits.leases import KeyLease


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
        with self._path.open("ab") as handle:
            handle.write(line + b"\n")
        self._dirty = True

    def clear(self) -> None:
        """Everything journaled has reached Redis."""
        if self._path is not None and self._dirty:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
            self._dirty = False


def read_journals(directory: str | None) -> dict[str, dict[str, tuple[int, int]]]:
    """Ledger key -> replica -> (consumed, refunded), the largest each journal holds."""
    found: dict[str, dict[str, tuple[int, int]]] = {}
    if not directory or not os.path.isdir(directory):
        return found
    for path in Path(directory).glob("*.journal"):
        for line in path.read_bytes().splitlines():
            try:
                entry = jsonrpc.loads(line)
                replica, key, consumed, refunded = entry["r"], entry["k"], int(entry["c"]), int(entry["f"])
            except (jsonrpc.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # a line cut short by a crash
            old = found.setdefault(key, {}).get(replica, (0, 0))
            found[key][replica] = (max(old[0], consumed), max(old[1], refunded))
    return found
