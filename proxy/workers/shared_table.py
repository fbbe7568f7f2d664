"""Small tables shared by the workers of one host (WORKERS > 1), and the held counts built on them.

A table is a JSON object in a file under the run directory. An edit reads it, changes it and writes
it back under an flock held for that alone (no await inside: microseconds for the few dozen names a
table holds), so what one worker counts every sibling sees at its next edit. A table is split over a
few files by a hash of the name it is edited for, so that neither a table's size nor the workers'
contention grows with the number of keys or client addresses.

HeldCounts counts things held per name (a key's WebSockets, an address's connections, a key's upstream
calls in flight) per worker process. A take past the cap first gives back what processes that no
longer exist held (a worker killed holding sockets held them on its own connections, which are gone
with it), then decides again. LocalCounts is the same for one process, no file involved.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import weakref
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import orjson

BUCKETS = 16  # files a table is split over


class SharedTable:
    """One JSON object in a file, edited under an flock."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        weakref.finalize(self, os.close, self._fd)

    @contextlib.contextmanager
    def edit(self) -> Iterator[dict[str, Any]]:
        """The table to change in the `with` block, written back when it ends without an exception.
        Never awaited across, nor nested: flock does not exclude the process's own second taker."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            data = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
            table = _decoded(data)
            yield table
            out = orjson.dumps(table)
            if out != data:
                os.pwrite(self._fd, out, 0)
                os.ftruncate(self._fd, len(out))
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def _decoded(data: bytes) -> dict[str, Any]:
    """A table's content; empty when there is none, or a worker died halfway through writing it (its
    counts then start again from what the live workers take next)."""
    try:
        table = orjson.loads(data) if data else {}
    except orjson.JSONDecodeError:
        return {}
    return table if isinstance(table, dict) else {}


class LocalTable:
    """A table of this process alone, edited the same way as a SharedTable."""

    def __init__(self) -> None:
        self._table: dict[str, Any] = {}

    @contextlib.contextmanager
    def edit(self) -> Iterator[dict[str, Any]]:
        yield self._table


class SharedTables:
    """A table split over BUCKETS files `<kind>-<n>.json` in `directory`, by a hash of the name."""

    def __init__(self, directory: str, kind: str, buckets: int = BUCKETS) -> None:
        self._tables = [SharedTable(os.path.join(directory, f"{kind}-{n}.json")) for n in range(buckets)]

    def edit(self, name: str) -> contextlib.AbstractContextManager[dict[str, Any]]:
        """The part of the table that holds `name`."""
        return self._tables[zlib.crc32(name.encode()) % len(self._tables)].edit()


class HeldCounts(Protocol):
    """Things held per name, under a cap: LocalCounts or SharedCounts."""

    shared: bool

    def take(self, name: str, cap: int, n: int = 1) -> bool: ...

    def release(self, name: str, n: int = 1) -> None: ...

    def count(self, name: str) -> int: ...


def held_counts(run_dir: str | None, kind: str) -> HeldCounts:
    """Counted across the workers sharing `run_dir`, or in this process alone without one."""
    return SharedCounts(run_dir, kind) if run_dir is not None else LocalCounts()


class LocalCounts:
    """Things held per name in this process alone."""

    shared = False

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def take(self, name: str, cap: int, n: int = 1) -> bool:
        """Whether `n` more fit under `cap` for `name` (taken when they do)."""
        held = self._held.get(name, 0)
        if held + n > cap:
            return False
        self._held[name] = held + n
        return True

    def release(self, name: str, n: int = 1) -> None:
        left = self._held.get(name, 0) - n
        if left > 0:
            self._held[name] = left
        else:
            self._held.pop(name, None)

    def count(self, name: str) -> int:
        return self._held.get(name, 0)


class SharedCounts:
    """Things held per name across the workers of one host: per name, what each process holds."""

    shared = True

    def __init__(self, directory: str, kind: str) -> None:
        self._tables = SharedTables(directory, kind)
        self._pid = str(os.getpid())

    def take(self, name: str, cap: int, n: int = 1) -> bool:
        """Whether `n` more fit under `cap` for `name` across the workers (taken when they do)."""
        with self._tables.edit(name) as table:
            row: dict[str, int] = table.get(name, {})
            if sum(row.values()) + n > cap and reap(row, self._pid):
                _store(table, name, row)
            if sum(row.values()) + n > cap:
                return False
            row[self._pid] = row.get(self._pid, 0) + n
            _store(table, name, row)
            return True

    def release(self, name: str, n: int = 1) -> None:
        with self._tables.edit(name) as table:
            row: dict[str, int] = table.get(name, {})
            row[self._pid] = row.get(self._pid, 0) - n
            _store(table, name, row)

    def settle(self, held: Mapping[str, int]) -> None:
        """This process holds exactly `held[name]` of each name given (0: none)."""
        for name, n in held.items():
            with self._tables.edit(name) as table:
                row: dict[str, int] = table.get(name, {})
                row[self._pid] = n
                _store(table, name, row)

    def count(self, name: str) -> int:
        with self._tables.edit(name) as table:
            return sum(table.get(name, {}).values())


def _store(table: dict[str, Any], name: str, row: dict[str, int]) -> None:
    row = {pid: n for pid, n in row.items() if n > 0}
    if row:
        table[name] = row
    else:
        table.pop(name, None)


def reap(row: dict[str, int], own: str) -> bool:
    """Drops from `row` (counts per process id) the processes that are gone; True if any."""
    gone = [pid for pid in row if pid != own and not alive(int(pid))]
    for pid in gone:
        del row[pid]
    return bool(gone)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
