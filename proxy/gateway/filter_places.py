"""A key's live filters counted across the replicas sharing Redis (MAX_FILTERS_PER_KEY; filters.py).

One sorted set per key (`rcp:filters:<key>`): each of its filters scored by when it lapses (its last
poll plus FILTER_TIMEOUT, wall-clock seconds), and each place held while a node is asked for a new
one scored PLACE_SECONDS ahead. A place is taken by one Lua script (lapsed members dropped, then the
cap checked), so two replicas making a key's last filter cannot both pass. A filter lapses in Redis
as it does on the node, when unpolled; a replica that dies leaves nothing behind but places that
lapse within PLACE_SECONDS. Scores are wall-clock times: replicas' clocks agree to within a second.
While Redis cannot be reached the host's count alone decides (filters.py's table).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from proxy.redis_link import RedisLink, RedisUnavailable

PREFIX = "rcp:filters:"
PLACE_SECONDS = 120.0  # a place held while a node is asked for a filter lapses after this

# KEYS: the key's set. ARGV: place, cap, now, the place's score, the set's TTL (ms). Returns 1 or 0.
HOLD = """
local key = KEYS[1]
redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[3])
if redis.call('ZCARD', key) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', key, ARGV[4], ARGV[1])
redis.call('PEXPIRE', key, ARGV[5])
return 1
"""


class FilterPlaces:
    """The keys' filters in Redis; every method does nothing without a link, or when Redis fails."""

    def __init__(self, link: RedisLink | None, timeout: float, clock: Callable[[], float] = time.time) -> None:
        self._link = link
        self._timeout = timeout  # FILTER_TIMEOUT
        self._clock = clock
        self._hold: Any = link.client.register_script(HOLD) if link is not None else None

    async def hold(self, account: str, place: str, cap: int) -> bool:
        """Whether `place` fits among the key's filters of every replica (held when it does)."""
        if self._link is None:
            return True
        now = self._clock()
        ttl_ms = int(1000 * max(self._timeout, PLACE_SECONDS)) * 2
        args = [place, cap, now, now + PLACE_SECONDS, ttl_ms]
        try:
            held = await self._link.run("filters", lambda _c: self._hold(keys=[PREFIX + account], args=args))
        except RedisUnavailable:
            return True
        return bool(held)

    async def settle(self, account: str, place: str, own_id: str | None) -> None:
        """`place` given back, and the filter made in it (if one was) counted until it lapses."""
        if self._link is None:
            return
        key, score = PREFIX + account, self._clock() + self._timeout

        async def settle(client: Any) -> None:
            pipe = client.pipeline(transaction=True)
            pipe.zrem(key, place)
            if own_id is not None:
                pipe.zadd(key, {own_id: score})
            await pipe.execute()

        with contextlib.suppress(RedisUnavailable):
            await self._link.run("filters", settle)

    async def polled(self, account: str, own_id: str) -> None:
        """A poll the node answered: the filter lapses FILTER_TIMEOUT from now."""
        if self._link is None:
            return
        key, score = PREFIX + account, self._clock() + self._timeout
        with contextlib.suppress(RedisUnavailable):
            await self._link.run("filters", lambda client: client.zadd(key, {own_id: score}))

    async def dropped(self, account: str, own_id: str) -> None:
        if self._link is None:
            return
        with contextlib.suppress(RedisUnavailable):
            await self._link.run("filters", lambda client: client.zrem(PREFIX + account, own_id))
