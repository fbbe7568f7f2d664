"""CACHE_KEY_BYTES_PER_MINUTE across the replicas sharing Redis (admission.py decides per host).

A store is decided in the process, with nothing awaited (it is on the path of every miss), so the
deployment's count is kept beside it: each process adds what its keys stored to one counter per key
and wall-clock minute in Redis (`rcp:adm:<key>:<minute>`, INCRBY, expiring after two minutes) every
SYNC_SECONDS, and reads back the total of every key it decided for this minute. A key is refused
once what the deployment stored this minute, as last read, and what this process stored since,
reach the limit. So the replicas together store at most the limit plus what each other process
stored of the key in the SYNC_SECONDS before it read the total (a process that had not decided for
the key yet this minute stores blind for at most that long); each host's count stays exact
(admission.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from proxy.redis_link import RedisLink, RedisUnavailable

PREFIX = "rcp:adm:"
SYNC_SECONDS = 1.0


class DeploymentSpend:
    def __init__(self, link: RedisLink, per_window: int, window: float, clock: Callable[[], float] = time.time) -> None:
        self._link = link
        self.per_window = per_window
        self._window = window
        self._clock = clock
        self._minute = -1
        self._seen: dict[str, int] = {}  # the deployment's bytes this window, as last read
        self._unsent: dict[str, int] = {}  # this process's bytes since then
        self._asked: set[str] = set()  # keys this process decided for this window: their totals are read

    def _current(self) -> int:
        minute = int(self._clock() // self._window)
        if minute != self._minute:
            self._minute, self._seen, self._unsent, self._asked = minute, {}, {}, set()
        return minute

    def allows(self, key: str, size: int) -> bool:
        """Whether `size` more bytes of `key` fit in what the deployment stored this window."""
        self._current()
        self._asked.add(key)
        return self._seen.get(key, 0) + self._unsent.get(key, 0) + size <= self.per_window

    def spent(self, key: str, size: int) -> None:
        self._current()
        self._unsent[key] = self._unsent.get(key, 0) + size

    async def sync(self) -> None:
        """This process's bytes added to the deployment's counters, and their totals read back."""
        minute = self._current()
        unsent, self._unsent = self._unsent, {}
        if not self._asked:
            return
        keys = {key: f"{PREFIX}{key}:{minute}" for key in self._asked}
        ttl = int(2 * self._window * 1000)

        async def add(client: Any) -> list[int]:
            totals = []
            for key, name in keys.items():  # one key per command: a cluster may hold them anywhere
                totals.append(await client.incrby(name, unsent.get(key, 0)))
                await client.pexpire(name, ttl)
            return totals

        try:
            totals = await self._link.run("cache_admission", add)
        except RedisUnavailable:
            if minute == self._minute:  # sent next time
                for key, size in unsent.items():
                    self._unsent[key] = self._unsent.get(key, 0) + size
            return
        if minute == self._minute:
            self._seen.update(zip(keys, (int(t) for t in totals), strict=True))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(SYNC_SECONDS)
            with contextlib.suppress(RedisUnavailable):
                await self.sync()
