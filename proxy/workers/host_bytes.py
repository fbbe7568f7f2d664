"""Bytes of request bodies being received by every worker of one host (WORKERS > 1), held against
MAX_INFLIGHT_BODY_BYTES: each worker enforcing its own copy let the host receive N times the bound.

One file in the run directory, mapped into every worker: one 8-byte count per worker, written
by that worker alone (so no count is ever torn between writers), read by the others straight from
memory. A body's admission (rare: only a body that does not arrive in the read that began it) checks
the worker's own count plus its siblings' and adds its length under an flock on the file, so two
workers cannot both pass the bound at once. (MAX_PENDING_ANSWER_BYTES_PER_KEY is not counted here: each
worker holds a key to its even share of it, proxy/http/answer_bytes.py, so no shared count sits on the
answers' path.)

A worker zeroes its count when it starts: what its predecessor in that place held died with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import weakref
from collections.abc import Iterator

WORD = 8  # one signed count per worker


class HostBytes:
    """This worker's count, and its siblings' counts to read, of the host's body bytes."""

    def __init__(self, run_dir: str, index: int, workers: int) -> None:
        self._fd = os.open(os.path.join(run_dir, "host-bytes"), os.O_RDWR | os.O_CREAT, 0o600)
        weakref.finalize(self, os.close, self._fd)
        size = max(workers, index + 1) * WORD
        if os.fstat(self._fd).st_size < size:  # never shrunk: a sibling may have made it already
            os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        self._counts = memoryview(self._map).cast("q")
        self._own = index
        self._siblings = [worker for worker in range(workers) if worker != index]
        self._counts[index] = 0

    def others(self) -> int:
        """What the sibling workers hold."""
        counts, total = self._counts, 0
        for worker in self._siblings:
            total += counts[worker]
        return total

    def add(self, delta: int) -> None:
        self._counts[self._own] += delta

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held while a check of the siblings' counts and this worker's change must be one step. Never
        awaited across, nor nested (flock does not exclude the process's own second taker)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
