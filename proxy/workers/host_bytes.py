"""Bytes held against the host's memory bounds by every worker of one host (WORKERS > 1): request
bodies being received (MAX_INFLIGHT_BODY_BYTES) and each API key's answers made and not yet taken
(MAX_PENDING_ANSWER_BYTES_PER_KEY). Each worker enforcing its own copy let the host hold N times either.

One file in the run directory, mapped into every worker: a row of 8-byte counts per worker, written by
that worker alone (so no count is ever torn between writers), read by the others straight from memory.
A bound is checked against the worker's own count plus its siblings' rows: a read of N-1 words, no
system call, on the answers' path. A body's admission (rare: only a body that does not arrive in the
read that began it) is also taken under an flock on the file, so two workers cannot both pass the
body bound at once. A key's counts sit at a slot chosen by a hash of the key (KEY_SLOTS of them):
keys sharing a slot share their siblings' part of the bound (stricter, never looser).

A worker zeroes its row when it starts: what its predecessor in that place held died with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import weakref
import zlib
from collections.abc import Iterator

BODIES = 0  # the slot of bytes of bodies being received
KEY_SLOTS = 16384  # slots for keys' answer bytes, after BODIES
ROW = 1 + KEY_SLOTS  # counts per worker
WORD = 8


SLOTS_KEPT = 4096  # keys whose slot a worker remembers (then it forgets them all and starts again)


def key_slot(key: str) -> int:
    """The slot of a key's answer bytes: the same in every worker (crc32, not Python's salted hash)."""
    return 1 + zlib.crc32(key.encode()) % KEY_SLOTS


class HostBytes:
    """This worker's row, and its siblings' rows to read, of the host's byte counts."""

    def __init__(self, run_dir: str, index: int, workers: int) -> None:
        self._fd = os.open(os.path.join(run_dir, "host-bytes"), os.O_RDWR | os.O_CREAT, 0o600)
        weakref.finalize(self, os.close, self._fd)
        size = max(workers, index + 1) * ROW * WORD
        if os.fstat(self._fd).st_size < size:  # never shrunk: a sibling may have made it already
            os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        self._counts = memoryview(self._map).cast("q")
        self._own = index * ROW
        self._siblings = [worker * ROW for worker in range(workers) if worker != index]
        self._slots: dict[str, int] = {}
        self._map[self._own * WORD : (self._own + ROW) * WORD] = bytes(ROW * WORD)

    def others(self, slot: int) -> int:
        """What the sibling workers hold at `slot`."""
        counts, total = self._counts, 0
        for row in self._siblings:
            total += counts[row + slot]
        return total

    def slot(self, key: str) -> int:
        """key_slot(key), remembered: it is asked for on every answer of a key."""
        slot = self._slots.get(key)
        if slot is None:
            if len(self._slots) >= SLOTS_KEPT:
                self._slots.clear()
            slot = self._slots[key] = key_slot(key)
        return slot

    def add(self, slot: int, delta: int) -> None:
        self._counts[self._own + slot] += delta

    def own(self, slot: int) -> int:
        return int(self._counts[self._own + slot])

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held while a check of the siblings' rows and this worker's change must be one step. Never
        awaited across, nor nested (flock does not exclude the process's own second taker)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
