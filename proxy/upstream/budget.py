"""A provider's budget for one upstream (NETWORKS_FILE, per upstream): at most `max_rps` requests in
any one-second window as the provider sees them, and at most `max_concurrency` requests in flight. A
call that finds the budget spent waits for it within its own deadline, or spills to the next
upstream that has budget (pool.py decides which).

The rate is a sliding window, not a token bucket: a bucket lets a burst and a second's refill land
in the same second, twice the rate as a provider counts it. And a request holds its place in the
window from the moment it is sent until one window after its answer came back: the provider saw it
arrive somewhere in between, so however late the network or a busy host delivered it, no window of
the provider's holds more than the budget. A request given up without an answer (timed out, or
cancelled) may still reach the node after that: it holds its place one window longer.

A budget's window lives in one place per host: in the process (LocalWindow), or with WORKERS > 1 in
a file all the workers take from (shared_window.py), so their requests together never pass it and
together they may use all of it. `BudgetBook` hands out one budget per network and upstream URL: a
reload retunes the budget in force (its window and calls in flight kept, its waiters re-checked), and
a pool a reload replaced shares its budget with its successor while it drains.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import weakref
from collections.abc import Callable

from proxy.upstream.shared_window import SharedWindow
from proxy.upstream.window import Limits, LocalWindow, Window

SHARED_POLL = 0.01  # seconds between looks at a shared window whose places are all in flight


class Slot:
    """One request's place in a budget, from its sending to its `release`."""

    __slots__ = ("budget",)

    def __init__(self, budget: Budget) -> None:
        self.budget = budget  # released to the budget it was taken from, even if a reload replaced it


class Budget:
    def __init__(
        self,
        max_rps: float | None,
        max_concurrency: int | None,
        *,
        window: Window | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window: Window = window if window is not None else LocalWindow()
        self._clock = clock
        self._freed = asyncio.Event()
        self.retune(max_rps, max_concurrency)

    def retune(self, max_rps: float | None, max_concurrency: int | None) -> None:
        """New limits (a reload) from the next take on, the requests in the window still counted;
        calls waiting look again at once."""
        self.max_rps = max_rps
        self.max_concurrency = max_concurrency
        self.limits = Limits.of(max_rps, max_concurrency)
        self._freed.set()

    @property
    def limited(self) -> bool:
        return self.max_rps is not None or self.max_concurrency is not None

    @property
    def shared(self) -> bool:
        return self._window.shared

    @property
    def in_flight(self) -> int:
        return self._window.in_flight()

    def _take(self) -> tuple[Slot | None, float]:
        refused = self._window.take(self.limits, self._clock())
        return (Slot(self), 0.0) if refused is None else (None, refused)

    def try_take(self) -> Slot | None:
        """Take one request's place now (in the window and in flight), if the budget has it."""
        return self._take()[0]

    def release(self, slot: Slot, *, answered: bool = True) -> None:
        """The request ended: it leaves the window one window from now, two if it got no answer (it
        may reach the node later still)."""
        self._window.release(self._clock(), self.limits.hold(answered))
        self._freed.set()

    async def take(self, deadline: float) -> Slot | None:
        """Wait (until loop time `deadline`) for one request's place; None if it did not come in time."""
        loop = asyncio.get_running_loop()
        while True:
            slot, wait = self._take()
            if slot is not None:
                return slot
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            if self.shared and not wait:  # a place in flight: a sibling's answer would wake no one here
                wait = SHARED_POLL
            self._freed.clear()
            try:
                async with asyncio.timeout(min(remaining, wait or remaining)):
                    await self._freed.wait()
            except TimeoutError:
                pass


class BudgetBook:
    """A process's budgets, one per network and upstream URL. With `run_dir` (WORKERS > 1) a budget
    that has limits counts its requests in a file there, shared by the workers."""

    def __init__(self, run_dir: str | None = None) -> None:
        self._run_dir = run_dir
        self._budgets: weakref.WeakValueDictionary[tuple[str, str], Budget] = weakref.WeakValueDictionary()

    def budget(self, network: str, url: str, max_rps: float | None, max_concurrency: int | None) -> Budget:
        """The budget in force for `url`, retuned to these limits; a new one if there is none, or
        if these limits move it between this process's window and the workers' shared one."""
        key = (network, url)
        budget = self._budgets.get(key)
        if budget is not None:
            budget.retune(max_rps, max_concurrency)  # its waiters look again, under the new limits
        shared = self._run_dir is not None and (max_rps is not None or max_concurrency is not None)
        if budget is None or budget.shared != shared:
            window = SharedWindow(self._window_path(key)) if shared else None
            budget = self._budgets[key] = Budget(max_rps, max_concurrency, window=window)
        return budget

    def _window_path(self, key: tuple[str, str]) -> str:
        assert self._run_dir is not None
        digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]  # a URL may hold a key
        return os.path.join(self._run_dir, f"budget-{digest}.window")
