"""The outage rule's memory (README "Limits and credits"): keys known refused for exhaustion today,
here, on sibling workers (told through the run directory) and on other replicas (the day's set in
Redis, read every EXHAUSTED_READ_INTERVAL), so such a key stays refused everywhere through an outage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.redis_link import RedisLink, RedisUnavailable


class ExhaustedKeys:
    def __init__(
        self, link: RedisLink, background: Callable[[Any], None], *, day_ttl: int, key_of: Callable[[int], str]
    ) -> None:
        self._link = link
        self._background = background
        self._day_ttl = day_ttl
        self._key_of = key_of
        self.known: set[tuple[int, str]] = set()  # (day, key) known refused for exhaustion
        self.read_at = 0.0  # monotonic time of the last read of the day's set
        self.on_exhausted: list[Callable[[str, int], None]] = []  # told siblings (workers) of a refusal

    def mark(self, day: int, api_key: str, *, tell: bool) -> None:
        if (day, api_key) in self.known:
            return
        self.known.add((day, api_key))
        if tell:
            for callback in self.on_exhausted:
                callback(api_key, day)
            key = self._key_of(day)
            self._background(
                self._run("credits_exhausted", lambda c: c.sadd(key, api_key), lambda c: c.expire(key, self._day_ttl))
            )

    async def _run(self, operation: str, *commands: Callable[[Any], Any]) -> None:
        """Commands run in order until one fails (Redis unavailable: the set is a hint, kept in memory too)."""
        for command in commands:
            try:
                await self._link.run(operation, command)
            except RedisUnavailable:
                return

    def heard(self, api_key: str, day: int) -> None:
        """A sibling worker was refused for this key's exhaustion."""
        self.mark(day, api_key, tell=False)

    def forget(self, day: int, api_key: str) -> None:
        """The key has credits again (a refund, a lease)."""
        if (day, api_key) in self.known:
            self.known.discard((day, api_key))
            key = self._key_of(day)
            self._background(self._run("credits_exhausted", lambda c: c.srem(key, api_key)))

    async def read(self, now: float) -> None:
        day = int(now) // 86400
        key = self._key_of(day)
        members = await self._link.run("credits_exhausted", lambda c: c.smembers(key))
        names = {m.decode() if isinstance(m, bytes) else str(m) for m in members}
        self.known = {(day, name) for name in names} | {e for e in self.known if e[0] != day}
