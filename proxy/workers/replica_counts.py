"""Things held per name counted for every replica sharing Redis (REDIS_URL), and every worker of each.

One Redis hash per name (`rcp:held:<kind>:<name>`) holds what each process holds (field `<host>:<pid>:
<random>`) and until when that entry stands (field `t:<process>`, wall-clock ms). A take runs one Lua
script: entries past their time are dropped (a replica or worker that died stops renewing: what it
held is given back within HOLD_TTL), the rest summed, and the take refused past the cap. Every
HOLD_TTL / 3 each process writes what it holds now with a new time (renew), which also mends a
release lost to a Redis error. So the cap holds for the deployment to within what dead processes held
in their last HOLD_TTL seconds, and clocks of the replicas' hosts within a second of each other.

While Redis cannot be reached a take is counted in the host's counts instead (`local`: the workers'
table, shared_table.py), and given back there: the cap then holds per host, as without Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any, Literal

from proxy.redis_link import RedisLink, RedisUnavailable
from proxy.workers.shared_table import HeldCounts

HOLD_TTL = 15.0  # seconds an entry stands without its process renewing it
PREFIX = "rcp:held:"
Hold = Literal["redis", "host"]  # where a take was counted, so its release goes there too

# KEYS: the name's hash. ARGV: this process, cap, n (negative: given back), now (ms), ttl (ms).
# Returns 1 when taken (or given back), 0 when the cap refuses it.
TAKE = """
local key, me = KEYS[1], ARGV[1]
local cap, n, now, ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local all = redis.call('HGETALL', key)
local held = 0
for i = 1, #all, 2 do
  local field = all[i]
  if string.sub(field, 1, 2) == 't:' then
    local owner = string.sub(field, 3)
    if owner ~= me and tonumber(all[i + 1]) < now then
      redis.call('HDEL', key, field, owner)
    end
  end
end
all = redis.call('HGETALL', key)
for i = 1, #all, 2 do
  if string.sub(all[i], 1, 2) ~= 't:' then
    held = held + tonumber(all[i + 1])
  end
end
if n > 0 and held + n > cap then
  return 0
end
local mine = redis.call('HINCRBY', key, me, n)
if mine <= 0 then
  redis.call('HDEL', key, me, 't:' .. me)
else
  redis.call('HSET', key, 't:' .. me, now + ttl)
end
redis.call('PEXPIRE', key, 2 * ttl)
return 1
"""

# KEYS: the names' hashes. ARGV: this process, now (ms), ttl (ms), then what it holds of each name.
RENEW = """
local me, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i, key in ipairs(KEYS) do
  local n = tonumber(ARGV[3 + i])
  if n > 0 then
    redis.call('HSET', key, me, n, 't:' .. me, now + ttl)
    redis.call('PEXPIRE', key, 2 * ttl)
  else
    redis.call('HDEL', key, me, 't:' .. me)
  end
end
return 1
"""


class ReplicaCounts:
    """Held counts of one kind: in Redis when `link` is given and answers, else in `local`."""

    def __init__(
        self,
        link: RedisLink | None,
        kind: str,
        local: HeldCounts,
        ttl: float = HOLD_TTL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._link = link
        self._kind = kind
        self._local = local
        self._ttl_ms = int(ttl * 1000)
        self._clock = clock
        self._take: Any = link.client.register_script(TAKE) if link is not None else None
        self._renew: Any = link.client.register_script(RENEW) if link is not None else None
        self._me = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._mine: dict[str, int] = {}  # what this process holds in Redis, per name

    @property
    def ttl(self) -> float:
        return self._ttl_ms / 1000

    def _key(self, name: str) -> str:
        return f"{PREFIX}{self._kind}:{name}"

    async def take(self, name: str, cap: int, n: int = 1) -> Hold | None:
        """Where `n` more of `name` were counted under `cap`; None when the cap refuses them."""
        if self._link is not None:
            args = [self._me, cap, n, int(self._clock() * 1000), self._ttl_ms]
            try:
                taken = await self._link.run("held_counts", lambda _c: self._take(keys=[self._key(name)], args=args))
            except RedisUnavailable:
                pass
            else:
                if not taken:
                    return None
                self._mine[name] = self._mine.get(name, 0) + n
                return "redis"
        return "host" if self._local.take(name, cap, n) else None

    async def release(self, name: str, hold: Hold, n: int = 1) -> None:
        if hold == "host" or self._link is None:
            self._local.release(name, n)
            return
        self._mine[name] = self._mine.get(name, 0) - n
        args = [self._me, 0, -n, int(self._clock() * 1000), self._ttl_ms]
        with contextlib.suppress(RedisUnavailable):  # else the next renewal writes what is held
            await self._link.run("held_counts", lambda _c: self._take(keys=[self._key(name)], args=args))

    async def renew(self) -> None:
        """Every entry of this process written again with a new time (and what it holds now)."""
        if self._link is None or not self._mine:
            return
        names = list(self._mine)
        held = [max(0, self._mine[name]) for name in names]
        args = [self._me, int(self._clock() * 1000), self._ttl_ms, *held]
        keys = [self._key(name) for name in names]
        with contextlib.suppress(RedisUnavailable):
            if self._link.is_cluster:  # one script per key: a cluster runs a script on one slot
                for key, n in zip(keys, held, strict=True):
                    await self._renew_one(key, [*args[:3], n])
            else:
                await self._link.run("held_counts", lambda _c: self._renew(keys=keys, args=args))
            for name, n in zip(names, held, strict=True):
                if n <= 0 and self._mine.get(name, 0) <= 0:
                    self._mine.pop(name, None)

    async def _renew_one(self, key: str, args: list[Any]) -> None:
        assert self._link is not None
        await self._link.run("held_counts", lambda _c: self._renew(keys=[key], args=args))

    async def run(self) -> None:
        """Renewing, every third of the entries' time to live, until cancelled."""
        while True:
            await asyncio.sleep(self.ttl / 3)
            await self.renew()
