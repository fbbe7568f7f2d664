"""Daily credit balances per API key, and an optional credits-per-second limit.

With Redis the ledger is shared by every replica: one Lua script checks and debits atomically,
so concurrent requests never overdraw. Without Redis (or while it is down) the ledger lives in
process. Balances reset at 00:00 UTC: the day is part of the ledger key.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from .logs import Throttled
from .redis_link import RedisLink, RedisUnavailable

log = logging.getLogger("proxy.credits")
throttled = Throttled(log)  # an outage would otherwise log once per request
DAY_TTL = 2 * 86400  # ledger entries outlive their day a little, for the operator CLI


class Verdict(Enum):
    OK = "ok"
    EXHAUSTED = "exhausted"
    RATE_LIMITED = "rate"


@dataclass(frozen=True, slots=True)
class Debit:
    verdict: Verdict
    remaining: int


def day_of(now: float) -> str:
    """The UTC day a timestamp falls on: balances reset when it changes."""
    return time.strftime("%Y%m%d", time.gmtime(now))


def seconds_to_midnight(now: float) -> int:
    return 86400 - int(now) % 86400


def daily_key(api_key: str, now: float) -> str:
    return f"rcp:credits:{day_of(now)}:{api_key}"


class Ledger(Protocol):
    async def debit(self, api_key: str, amount: int, *, daily: int, per_second: int | None, now: float) -> Debit: ...

    async def refund(self, api_key: str, amount: int, *, now: float) -> None: ...

    async def used(self, api_key: str, *, now: float) -> int: ...


def _judge(used: int, window: int, amount: int, daily: int, per_second: int | None) -> Verdict:
    """The rule both ledgers apply; the Lua script below is its twin."""
    if used + amount > daily:
        return Verdict.EXHAUSTED
    # A window already in use may not go over the limit; an empty one admits one call of any size,
    # so a call dearer than the per-second limit is slowed, not refused forever.
    if per_second is not None and window > 0 and window + amount > per_second:
        return Verdict.RATE_LIMITED
    return Verdict.OK


class MemoryLedger:
    def __init__(self) -> None:
        self._used: dict[str, int] = defaultdict(int)
        self._window: dict[str, int] = defaultdict(int)

    async def debit(self, api_key: str, amount: int, *, daily: int, per_second: int | None, now: float) -> Debit:
        key = daily_key(api_key, now)
        rate_key = f"{api_key}:{int(now)}"
        verdict = _judge(self._used[key], self._window[rate_key], amount, daily, per_second)
        if verdict is Verdict.OK:
            self._used[key] += amount
            if per_second is not None:
                self._window = defaultdict(int, {k: v for k, v in self._window.items() if k == rate_key})
                self._window[rate_key] += amount
        return Debit(verdict, daily - self._used[key])

    async def refund(self, api_key: str, amount: int, *, now: float) -> None:
        key = daily_key(api_key, now)
        self._used[key] = max(0, self._used[key] - amount)

    async def used(self, api_key: str, *, now: float) -> int:
        return self._used.get(daily_key(api_key, now), 0)


# KEYS: daily ledger key, per-second window key.
# ARGV: amount, daily limit, per-second limit (0: none), ledger TTL.
# Returns {verdict, remaining}: verdict 1 ok, 0 exhausted, -1 rate limited.
DEBIT_SCRIPT = """
local amount = tonumber(ARGV[1])
local daily = tonumber(ARGV[2])
local per_second = tonumber(ARGV[3])
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if used + amount > daily then
  return {0, daily - used}
end
if per_second > 0 then
  local window = tonumber(redis.call('GET', KEYS[2]) or '0')
  if window > 0 and window + amount > per_second then
    return {-1, daily - used}
  end
  redis.call('INCRBY', KEYS[2], amount)
  redis.call('EXPIRE', KEYS[2], 2)
end
used = redis.call('INCRBY', KEYS[1], amount)
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
return {1, daily - used}
"""

REFUND_SCRIPT = """
local left = redis.call('DECRBY', KEYS[1], tonumber(ARGV[1]))
if left < 0 then redis.call('SET', KEYS[1], 0, 'KEEPTTL') end
return left
"""

_VERDICTS = {1: Verdict.OK, 0: Verdict.EXHAUSTED, -1: Verdict.RATE_LIMITED}


class RedisLedger:
    """Debits in Redis; while Redis is unreachable, the in-process ledger stands in (fail open)."""

    def __init__(self, link: RedisLink) -> None:
        self._link = link
        self._fallback = MemoryLedger()
        self._debit: Any = link.client.register_script(DEBIT_SCRIPT)
        self._refund: Any = link.client.register_script(REFUND_SCRIPT)

    async def debit(self, api_key: str, amount: int, *, daily: int, per_second: int | None, now: float) -> Debit:
        keys = [daily_key(api_key, now), f"rcp:rate:{api_key}:{int(now)}"]
        args = [amount, daily, per_second or 0, DAY_TTL]
        try:
            verdict, remaining = await self._link.run("credits_debit", lambda _c: self._debit(keys=keys, args=args))
        except RedisUnavailable:
            throttled.warning("redis", "credits: redis unavailable, debiting in process")
            return await self._fallback.debit(api_key, amount, daily=daily, per_second=per_second, now=now)
        return Debit(_VERDICTS[int(verdict)], int(remaining))

    async def refund(self, api_key: str, amount: int, *, now: float) -> None:
        try:
            await self._link.run("credits_refund",
                                 lambda _c: self._refund(keys=[daily_key(api_key, now)], args=[amount]))
        except RedisUnavailable:
            await self._fallback.refund(api_key, amount, now=now)

    async def used(self, api_key: str, *, now: float) -> int:
        raw = await self._link.run("credits_read", lambda c: c.get(daily_key(api_key, now)))
        return int(raw or 0)
