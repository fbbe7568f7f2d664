"""Where a provider budget's requests are counted (budget.py), and the pure decision whether one more
may be sent: the limits, the requests in flight, and when each answered one leaves the window."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Protocol

WINDOW_MARGIN = 0.01  # seconds added to the one-second window: clock granularity


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

    def refusal(self, in_flight: int, held: list[float], now: float) -> float | None:
        """None if one more request may be sent now, with `in_flight` sent and unanswered and `held`
        the sorted times the answered ones leave the window; else seconds until a held place frees
        (0: until a request in flight is answered)."""
        if self.concurrency is not None and in_flight >= self.concurrency:
            return 0.0
        if self.count and in_flight + len(held) >= self.count:
            return max(0.001, held[0] - now) if held else 0.0
        return None

    def hold(self, answered: bool) -> float:
        """Seconds an ended request keeps its place in the window."""
        return self.window * (1 if answered else 2) if self.count else 0.0


class Window(Protocol):
    """Where a budget's requests are counted: in flight, and held after their answer."""

    shared: bool

    def take(self, limits: Limits, now: float) -> float | None:
        """Count one request in flight if `limits` allow it (None); else `Limits.refusal`'s wait."""
        ...

    def release(self, now: float, hold: float) -> None: ...

    def in_flight(self) -> int: ...


class LocalWindow:
    """A window of this process alone."""

    shared = False

    def __init__(self) -> None:
        self.flying = 0
        self.held: list[float] = []  # sorted: when each answered request leaves the window

    def take(self, limits: Limits, now: float) -> float | None:
        if self.held and self.held[0] <= now:
            del self.held[: bisect.bisect_right(self.held, now)]
        refused = limits.refusal(self.flying, self.held, now)
        if refused is None:
            self.flying += 1
        return refused

    def release(self, now: float, hold: float) -> None:
        self.flying -= 1
        if hold > 0:
            bisect.insort(self.held, now + hold)

    def in_flight(self) -> int:
        return self.flying
