"""A provider's budget for one upstream (NETWORKS_FILE, per upstream): at most `max_rps` requests in
any one-second window as the provider sees them, and at most `max_concurrency` requests in flight. A
call that finds the budget spent waits for it within its own deadline, or spills to the next
upstream that has budget (pool.py decides which).

The rate is a sliding window, not a token bucket: a bucket lets a burst and a second's refill land
in the same second, twice the rate as a provider counts it. And a request holds its place in the
window from the moment it is sent until one window after its answer came back: the provider saw it
arrive somewhere in between, so however late the network or a busy host delivered it, no window of
the provider's holds more than the budget. With WORKERS=N each worker holds 1/N of the budget (the
pool is built with `share=N`): together they never exceed it, with no shared state.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

WINDOW_MARGIN = 0.01  # seconds added to the one-second window: clock granularity


class Slot:
    """One request's place in a budget: in flight until `done`, then held one window longer."""

    __slots__ = ("budget", "done")

    def __init__(self, budget: Budget) -> None:
        self.budget = budget  # released to the budget it was taken from, even if a reload replaced it
        self.done: float | None = None


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
        self._held: list[Slot] = []  # requests in flight or answered less than a window ago
        self._clock = clock
        self.in_flight = 0
        self._freed = asyncio.Event()

    def try_take(self) -> Slot | None:
        """Take one request's place now (in the window and in flight), if the budget has it."""
        if self.concurrency is not None and self.in_flight >= self.concurrency:
            return None
        slot = Slot(self)
        if self.count:
            now = self._clock()
            self._held = [s for s in self._held if s.done is None or s.done > now - self.window]
            if len(self._held) >= self.count:
                return None
            self._held.append(slot)
        self.in_flight += 1
        return slot

    def release(self, slot: Slot) -> None:
        """The request is answered (or failed): it leaves the window one window from now."""
        slot.done = self._clock()
        self.in_flight -= 1
        self._freed.set()

    def wait_hint(self) -> float:
        """Seconds until an answered request leaves the window (0: wait for a release)."""
        done = [s.done for s in self._held if s.done is not None]
        if not self.count or len(self._held) < self.count or not done:
            return 0.0
        return max(0.001, min(done) + self.window - self._clock())

    async def take(self, deadline: float) -> Slot | None:
        """Wait (until loop time `deadline`) for one request's place; None if it did not come in time."""
        loop = asyncio.get_running_loop()
        while (slot := self.try_take()) is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            self._freed.clear()
            try:
                async with asyncio.timeout(min(remaining, self.wait_hint() or remaining)):
                    await self._freed.wait()
            except TimeoutError:
                pass
        return slot
