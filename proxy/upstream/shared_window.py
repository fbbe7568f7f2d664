"""A provider budget's window shared by the workers of one host (WORKERS > 1; budget.py).

One small file per budgeted upstream under the run directory holds what every worker sent to it:
the calls in flight (counted per worker process) and when each answered one leaves the window.
A take reads it, decides with the budget's limits and writes it back under an flock held for that
alone (microseconds, no await inside), so the workers' requests together never pass the budget and
any one worker may use all of it. Times are CLOCK_MONOTONIC, one clock for every process of a host.

A worker that died with requests in flight cannot release them: once a take is refused, the counts
of processes that no longer exist are turned into places held one window from then (the node may
still have got them).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import weakref
from array import array
from collections.abc import Iterator

from proxy.upstream.window import Held, Limits, expire, hold_place
from proxy.workers.shared_table import alive

_HEADER = struct.Struct("<II")  # processes with requests in flight, held entries (when, how many)
_PROCESS = struct.Struct("<ii")  # pid, its requests in flight


class SharedWindow:
    shared = True

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        weakref.finalize(self, os.close, self._fd)
        self._pid = os.getpid()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _read(self) -> tuple[dict[int, int], Held]:
        data = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
        if len(data) < _HEADER.size:
            return {}, []
        processes, held = _HEADER.unpack_from(data)
        flying = dict(_PROCESS.iter_unpack(data[_HEADER.size : _HEADER.size + processes * _PROCESS.size]))
        start = _HEADER.size + processes * _PROCESS.size
        pairs = array("d")
        pairs.frombytes(data[start : start + 16 * held])
        return flying, [(pairs[i], int(pairs[i + 1])) for i in range(0, len(pairs), 2)]

    def _write(self, flying: dict[int, int], held: Held) -> None:
        flying = {pid: n for pid, n in flying.items() if n > 0}
        data = _HEADER.pack(len(flying), len(held)) + b"".join(_PROCESS.pack(*item) for item in flying.items())
        os.pwrite(self._fd, data + array("d", [x for pair in held for x in pair]).tobytes(), 0)

    def take(self, limits: Limits, now: float, calls: int = 1) -> float | None:
        with self._locked():
            flying, held = self._read()
            expire(held, now)
            refused = limits.refusal(sum(flying.values()), held, now, calls)
            if refused is not None and _reap(flying, held, now + limits.window, self._pid):
                refused = limits.refusal(sum(flying.values()), held, now, calls)
            if refused is None:
                flying[self._pid] = flying.get(self._pid, 0) + calls
            self._write(flying, held)
            return refused

    def release(self, now: float, hold: float, calls: int = 1) -> None:
        with self._locked():
            flying, held = self._read()
            flying[self._pid] = flying.get(self._pid, 0) - calls
            if hold > 0:
                hold_place(held, now + hold, calls)
            self._write(flying, held)

    def in_flight(self) -> int:
        with self._locked():
            return sum(self._read()[0].values())


def _reap(flying: dict[int, int], held: Held, until: float, own: int) -> bool:
    """The requests in flight of processes that are gone, held until `until` instead; True if any."""
    gone = [pid for pid in flying if pid != own and not alive(pid)]
    for pid in gone:
        hold_place(held, until, flying.pop(pid))
    return bool(gone)
