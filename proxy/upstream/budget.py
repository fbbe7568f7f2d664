"""A provider's budget for one upstream (NETWORKS_FILE, per upstream): at most `max_rps` requests in
any one-second window and at most `max_concurrency` requests in flight. A call that finds the budget
spent waits for it within its own deadline, or spills to the next upstream that has budget (pool.py
decides which).

The rate is a sliding window, not a token bucket: a bucket lets a burst and a second's refill land
in the same second, twice the rate as a provider counts it. Each request is spaced so that any
window of one second plus WINDOW_MARGIN holds at most `max_rps` of them, the margin absorbing the
network's jitter between here and the provider's clock. With WORKERS=N each worker holds 1/N of
the budget (the pool is built with `share=N`): together they never exceed it, with no shared state.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable

WINDOW_MARGIN = 0.05  # seconds added to the one-second window


class Budget:
    def __init__(
        self, max_rps: float | None, max_concurrency: int | None, *, share: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_rps = max_rps
        self.max_concurrency = max_concurrency
        rate = max_rps / share if max_rps is not None else None
        # At most `count` requests in any `window` seconds (a rate under 1/s: one per 1/rate seconds).
        self.window = (max(1.0, 1.0 / rate) + WINDOW_MARGIN) if rate is not None else 0.0
        self.count = max(1, math.floor(rate * (self.window - WINDOW_MARGIN))) if rate is not None else 0
        self.concurrency = max(1, max_concurrency // share) if max_concurrency is not None else None
        self._sent: deque[float] = deque()
        self._clock = clock
        self.in_flight = 0
        self._freed = asyncio.Event()

    def try_take(self) -> bool:
        """Take one request's worth now (a place in the window and a slot), if the budget has it."""
        if self.concurrency is not None and self.in_flight >= self.concurrency:
            return False
        if self.count:
            now = self._clock()
            sent = self._sent
            while sent and sent[0] <= now - self.window:
                sent.popleft()
            if len(sent) >= self.count:
                return False
            sent.append(now)
        self.in_flight += 1
        return True

    def release(self) -> None:
        """A request taken with try_take/take is done."""
        self.in_flight -= 1
        self._freed.set()

    def wait_hint(self) -> float:
        """Seconds until the window has room (0 when it has); a full concurrency waits for a release."""
        if not self.count or len(self._sent) < self.count:
            return 0.0
        return max(0.0, self._sent[0] + self.window - self._clock())

    async def take(self, deadline: float) -> bool:
        """Wait (until loop time `deadline`) for one request's worth; False if it did not come in time."""
        loop = asyncio.get_running_loop()
        while not self.try_take():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._freed.clear()
            try:
                async with asyncio.timeout(min(remaining, self.wait_hint() or remaining)):
                    await self._freed.wait()
            except TimeoutError:
                pass
        return True
