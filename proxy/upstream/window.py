"""Where a provider budget's calls are counted (budget.py), and the pure decision whether one more
request may be sent: the limits, the calls in flight, and when each answered one leaves the window.
A provider meters JSON-RPC calls, not HTTP requests: a batch of ten is ten places."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Protocol

WINDOW_MARGIN = 0.01  # seconds added to the one-second window: clock granularity
# Answered requests' places, sorted: (when they leave the window, how many). One entry a request, not
# one a call or a compute unit: memory does not grow with a request's cost.
Held = list[tuple[float, int]]


@dataclass(frozen=True, slots=True)
class Limits:
    """A budget's limits as the window checks them (pure)."""

    count: int = 0  # at most `count` requests in any `window` seconds; 0: no rate limit
    window: float = 0.0
    concurrency: int | None = None

    @classmethod
    def of(cls, max_rps: float | None, max_concurrency: int | None) -> Limits:
        if max_rps is None:
            return cls(concurrency=max_concurrency)
        # A rate under 1/s: one request per 1/rate seconds.
        window = max(1.0, 1.0 / max_rps) + WINDOW_MARGIN
        return cls(max(1, math.floor(max_rps * (window - WINDOW_MARGIN))), window, max_concurrency)

    def refusal(self, in_flight: int, held: Held, now: float, calls: int = 1) -> float | None:
        """None if a request of `calls` JSON-RPC calls may be sent now, with `in_flight` calls sent and
        unanswered and `held` the places of answered ones; else seconds until enough held places
        free (0: until a request in flight is answered). A request of more calls than the limits
        allow at all goes once nothing else is counted."""
        if self.concurrency is not None and in_flight and in_flight + calls > self.concurrency:
            return 0.0
        used = in_flight + sum(places for _, places in held)
        if self.count and used and used + calls > self.count:
            to_free = used + calls - self.count  # held places that must leave first, oldest first
            for until, places in held:
                to_free -= places
                if to_free <= 0:
                    return max(0.001, until - now)
            if in_flight:
                return 0.0
            return max(0.001, held[-1][0] - now)  # a request larger than the budget: the window empties first
        return None

    @property
    def room(self) -> int | None:
        """The most calls one request may carry within these limits (None: no limit)."""
        bounds = [b for b in (self.count or None, self.concurrency) if b is not None]
        return min(bounds) if bounds else None

    def hold(self, answered: bool) -> float:
        """Seconds an ended request keeps its place in the window."""
        return self.window * (1 if answered else 2) if self.count else 0.0


class Window(Protocol):
    """Where a budget's requests are counted: in flight, and held after their answer."""

    shared: bool

    def take(self, limits: Limits, now: float, calls: int = 1) -> float | None:
        """Count a request's `calls` in flight if `limits` allow it (None); else `Limits.refusal`'s wait."""
        ...

    def release(self, now: float, hold: float, calls: int = 1) -> None: ...

    def in_flight(self) -> int: ...


class LocalWindow:
    """A window of this process alone."""

    shared = False

    def __init__(self) -> None:
        self.flying = 0
        self.held: Held = []

    def take(self, limits: Limits, now: float, calls: int = 1) -> float | None:
        expire(self.held, now)
        refused = limits.refusal(self.flying, self.held, now, calls)
        if refused is None:
            self.flying += calls
        return refused

    def release(self, now: float, hold: float, calls: int = 1) -> None:
        self.flying -= calls
        if hold > 0:
            hold_place(self.held, now + hold, calls)

    def in_flight(self) -> int:
        return self.flying


def hold_place(held: Held, until: float, calls: int) -> None:
    """`calls` places held until `until`, one entry however many; `held` kept sorted."""
    bisect.insort(held, (until, calls))


def expire(held: Held, now: float) -> None:
    """The places that left the window by `now` dropped."""
    if held and held[0][0] <= now:
        del held[: bisect.bisect_right(held, (now, math.inf))]
