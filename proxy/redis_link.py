"""The one place Redis is called: a short timeout per command, and a breaker that skips Redis
while it is down so no request waits on it. redis-py reconnects by itself once Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from .logs import Throttled
from .metrics import Metrics

log = logging.getLogger("proxy.redis")
throttled = Throttled(log)  # a flapping Redis would otherwise log every time it drops
T = TypeVar("T")


def connect(url: str, timeout: float) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),  # a retry would only add latency; the breaker handles outages
        health_check_interval=0,
    )


class RedisUnavailable(Exception):
    """Redis is down or skipped; callers fall back to in-process state."""


class RedisLink:
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        timeout: float,
        metrics: Metrics,
        min_backoff: float = 0.5,
        max_backoff: float = 5.0,
    ) -> None:
        self.client = client
        self._timeout = timeout
        self._metrics = metrics
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._backoff = min_backoff
        self._skip_until = 0.0
        metrics.redis_up.set(1)

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._skip_until

    async def run(self, operation: str, command: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
        """Run one command; raise RedisUnavailable (never a redis error) when it cannot be done now."""
        if not self.up:
            raise RedisUnavailable(operation)
        try:
            async with asyncio.timeout(self._timeout):
                result = await command(self.client)
        except (RedisError, OSError, TimeoutError) as exc:
            self._metrics.redis_errors.labels(operation).inc()
            self._metrics.redis_up.set(0)
            if self._skip_until == 0.0:
                throttled.warning("unavailable", "redis unavailable (%s): %s; skipping it for %.1fs",
                                  operation, type(exc).__name__, self._backoff)
            self._skip_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self._max_backoff)
            raise RedisUnavailable(operation) from exc
        if self._skip_until:
            log.info("redis is back")
            self._skip_until = 0.0
            self._backoff = self._min_backoff
            self._metrics.redis_up.set(1)
        return result

    async def close(self) -> None:
        await self.client.aclose()
