"""Cache admission per API key: bytes of answers one key's calls may place in the tiers per window.

Answers are kept for everyone (a key's miss fills the cache others hit), so a key that asks for
many large distinct answers could push every other key's warm entries out of the memory LRU and
out of an evicting Redis. Past its budget for the window a key's answers are served but not kept.
One key therefore evicts at most `per_window` bytes per window: with the default (a sixteenth of
CACHE_MEMORY_BYTES a minute) an entry any key touched in the last 16 minutes is never evicted from
memory by one key's traffic; size Redis's maxmemory at least as large for the same bound there.
The proxy's own stores (no key) and open mode are not bounded. Pure but for the injected clock.

With workers (WORKERS > 1) a key's window is the host's: its start and bytes live in a table in the
run directory (workers/shared_table.py) that every worker's store reads and writes under a file lock,
so the workers together place at most `per_window` bytes of a key per window. Only stores pay for
that (microseconds); hits store nothing. With Redis the replicas' count is kept beside it
(admission_sync.py), within that module's tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.cache.admission_sync import DeploymentSpend
from proxy.workers.shared_table import SharedTables

WINDOW = 60.0  # seconds: CACHE_KEY_BYTES_PER_MINUTE


class Admission:
    def __init__(
        self,
        per_window: int,
        clock: Callable[[], float],
        window: float = WINDOW,
        shared: SharedTables | None = None,
        deployment: DeploymentSpend | None = None,
    ) -> None:
        self.per_window = per_window
        self._clock = clock  # CLOCK_MONOTONIC when shared: one clock for every worker of a host
        self._window = window
        self._spent: dict[str, Any] = {}  # key -> [its window's start, bytes stored in it]
        self._shared = shared
        self._deployment = deployment  # with Redis: the replicas' count beside the host's

    def admit(self, key: str | None, size: int) -> bool:
        """Whether `key` may store `size` more bytes now (counted when it may)."""
        if key is None or self.per_window <= 0:
            return True
        deployment = self._deployment
        if deployment is not None and not deployment.allows(key, size):
            return False
        if self._shared is None:
            admitted = self._admitted(self._spent, key, size)
        else:
            with self._shared.edit(key) as table:
                admitted = self._admitted(table, key, size)
        if admitted and deployment is not None:
            deployment.spent(key, size)
        return admitted

    def _admitted(self, spent: dict[str, Any], key: str, size: int) -> bool:
        now = self._clock()
        start, used = spent.get(key, (now, 0))
        if now - start >= self._window:
            start, used = now, 0
            if len(spent) > 64:  # keys idle for a window are forgotten, now and then
                for idle in [k for k, (began, _) in spent.items() if now - began >= self._window]:
                    del spent[idle]
        if used + size > self.per_window:
            return False
        spent[key] = [start, used + size]
        return True
