"""A provider's budget for one upstream (NETWORKS_FILE, per upstream): at most `max_rps` JSON-RPC calls
in any one-second window as the provider meters them (each call of a batch, a proof header, a head
poll and an identity probe counts), and at most `max_concurrency` calls in flight. A
call that finds the budget spent waits for it within its own deadline, or spills to the next
upstream that has budget (pool.py decides which).

The rate is a sliding window, not a token bucket: a bucket lets a burst and a second's refill land
in the same second, twice the rate as a provider counts it. And a request holds its place in the
window from the moment it is sent until one window after its answer came back: the provider saw it
arrive somewhere in between, so however late the network or a busy host delivered it, no window of
the provider's holds more than the budget. A request given up without an answer (timed out, or
cancelled) may still reach the node after that: it holds its place one window longer. A request
cancelled once sent (a hedge's loser, a head poll or a query past its time limit) is still being
worked on by the node: it stays in flight until its answer is read (and dropped) or its own
timeout passes (posting.py), so a cancel never lets more calls reach the node at once than
`max_concurrency`.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from proxy.upstream.shared_window import SharedWindow
from proxy.upstream.window import Limits, LocalWindow, Window

SHARED_POLL = 0.01  # seconds between looks at a shared window whose places are all in flight


ONE_CALL: tuple[str, ...] = ("",)  # a request of one call whose method costs the default


@dataclass(frozen=True, slots=True)
class UnitRate:
    """A provider's rate in compute units (NETWORKS_FILE: max_units_per_second, method_costs,
    default_cost): each call weighs its method's cost, and at most `per_second` units arrive in any
    one-second window."""

    per_second: float
    costs: Mapping[str, int] = field(default_factory=dict)
    default: int = 1

    def cost(self, methods: Sequence[str]) -> int:
        return sum(self.costs.get(m, self.default) for m in methods)


class Slot:
    """One request's places in a budget (one a JSON-RPC call, and its compute units), from its
    sending to its `release`."""

    __slots__ = ("budget", "calls", "units")

    def __init__(self, budget: Budget, calls: int = 1, units: int = 0) -> None:
        self.budget = budget  # released to the budget it was taken from, even if a reload replaced it
        self.calls = calls
        self.units = units


class Budget:
    def __init__(
        self,
        max_rps: float | None,
        max_concurrency: int | None,
        *,
        window: Window | None = None,
        clock: Callable[[], float] = time.monotonic,
        units: UnitRate | None = None,
        units_window: Window | None = None,
    ) -> None:
        self._window: Window = window if window is not None else LocalWindow()
        # The compute units' window: one place a unit (held as one entry a request), apart from the calls'
        # (max_concurrency counts calls).
        self._units_window: Window = units_window if units_window is not None else LocalWindow()
        self._clock = clock
        self._waiters: set[asyncio.Future[None]] = set()  # take_first's, woken when a place frees
        self.retune(max_rps, max_concurrency, units)

    def retune(self, max_rps: float | None, max_concurrency: int | None, units: UnitRate | None = None) -> None:
        """New limits (a reload) from the next take on, the requests in the window still counted;
        calls waiting look again at once. All of them or none: the limits are worked out first."""
        limits = Limits.of(max_rps, max_concurrency)
        unit_limits = Limits.of(units.per_second, None) if units is not None else None
        self.max_rps, self.max_concurrency, self.limits = max_rps, max_concurrency, limits
        self.units, self.unit_limits = units, unit_limits
        self._wake()

    @property
    def limited(self) -> bool:
        return self.max_rps is not None or self.max_concurrency is not None or self.units is not None

    @property
    def room(self) -> int | None:
        """The most calls one request may carry within this budget (None: no limit): its calls' room,
        and as many of its dearest calls as its compute units allow."""
        rooms = [r for r in (self.limits.room,) if r is not None]
        if self.units is not None and self.unit_limits is not None and self.unit_limits.room is not None:
            dearest = max([self.units.default, *self.units.costs.values()])
            rooms.append(max(1, self.unit_limits.room // dearest))
        return min(rooms) if rooms else None

    @property
    def shared(self) -> bool:
        return self._window.shared

    @property
    def in_flight(self) -> int:
        return self._window.in_flight()

    def _take(self, methods: Sequence[str]) -> tuple[Slot | None, float]:
        calls, now = len(methods), self._clock()
        refused = self._window.take(self.limits, now, calls)
        if refused is not None:
            return None, refused
        if self.units is None or self.unit_limits is None:
            return Slot(self, calls), 0.0
        units = self.units.cost(methods)
        refused = self._units_window.take(self.unit_limits, now, units)
        if refused is None:
            return Slot(self, calls, units), 0.0
        self._window.release(now, 0.0, calls)  # nothing was sent: its places go back, not held
        return None, refused

    def try_take(self, methods: Sequence[str] = ONE_CALL) -> Slot | None:
        """Take a request's places now (one per JSON-RPC call of `methods`, in the window and in
        flight, and their compute units), if the budget has them."""
        return self._take(methods)[0]

    def release(self, slot: Slot, *, answered: bool = True) -> None:
        """The request ended: its calls leave the window one window from now, two if it got no answer
        (it may reach the node later still)."""
        now = self._clock()
        self._window.release(now, self.limits.hold(answered), slot.calls)
        if slot.units:
            limits = self.unit_limits or Limits.of(1.0, None)  # retuned away: held one window all the same
            self._units_window.release(now, limits.hold(answered), slot.units)
        self._wake()

    def give_back(self, slot: Slot) -> None:
        """A slot taken but never sent (its call was answered elsewhere first): its places go back at
        once, not held in the window (the provider never saw it)."""
        now = self._clock()
        self._window.release(now, 0.0, slot.calls)
        if slot.units:
            self._units_window.release(now, 0.0, slot.units)
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def take(self, deadline: float, methods: Sequence[str] = ONE_CALL) -> Slot | None:
        """Wait (until loop time `deadline`) for a request's places; None if they did not come in time."""
        taken = await take_first((self,), deadline, methods)
        return taken[1] if taken is not None else None


async def take_first(
    budgets: Sequence[Budget], deadline: float, methods: Sequence[str] = ONE_CALL
) -> tuple[int, Slot] | None:
    """Wait (until loop time `deadline`) for a request's places in whichever of `budgets` has them
    first (the earliest in the sequence when several do): its position and slot; None if none came
    in time. A call never waits on one budget while another it may use frees a place."""
    loop = asyncio.get_running_loop()
    while True:
        pause = deadline - loop.time()
        for position, budget in enumerate(budgets):
            slot, wait = budget._take(methods)
            if slot is not None:
                return position, slot
            if budget.shared and not wait:  # a place in flight: a sibling's answer would wake no one here
                wait = SHARED_POLL
            if wait:  # a held place leaves the window then (0: when a place in flight is released)
                pause = min(pause, wait)
        if deadline - loop.time() <= 0:
            return None
        freed: asyncio.Future[None] = loop.create_future()
        for budget in budgets:
            budget._waiters.add(freed)
        try:
            async with asyncio.timeout(pause):
                await freed
        except TimeoutError:
            pass
        finally:
            for budget in budgets:
                budget._waiters.discard(freed)


class BudgetBook:
    """A process's budgets, one per network and upstream URL. With `run_dir` (WORKERS > 1) a budget
    that has limits counts its requests in a file there, shared by the workers."""

    def __init__(self, run_dir: str | None = None) -> None:
        self._run_dir = run_dir
        self._budgets: weakref.WeakValueDictionary[tuple[str, str], Budget] = weakref.WeakValueDictionary()

    def budget(
        self, network: str, url: str, max_rps: float | None, max_concurrency: int | None, units: UnitRate | None = None
    ) -> Budget:
        """The budget in force for `url`, retuned to these limits; a new one if there is none, or
        if these limits move it between this process's window and the workers' shared one."""
        key = (network, url)
        budget = self._budgets.get(key)
        if budget is not None:
            budget.retune(max_rps, max_concurrency, units)  # its waiters look again, under the new limits
        shared = self._run_dir is not None and (max_rps is not None or max_concurrency is not None or units is not None)
        if budget is None or budget.shared != shared:
            window = SharedWindow(self._window_path(key)) if shared else None
            # Units are counted in a file of their own, whether or not this budget has a unit rate yet.
            units_window = SharedWindow(self._window_path(key, "units")) if shared else None
            budget = self._budgets[key] = Budget(
                max_rps, max_concurrency, window=window, units=units, units_window=units_window
            )
        return budget

    def _window_path(self, key: tuple[str, str], kind: str = "window") -> str:
        assert self._run_dir is not None
        digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]  # a URL may hold a key
        return os.path.join(self._run_dir, f"budget-{digest}.{kind}")
