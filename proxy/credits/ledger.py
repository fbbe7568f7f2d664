"""Daily credit balances per API key, and an optional credits-per-second limit: the rule, the
ledger protocol and the in-process ledger. With Redis, replicas share balances through leases
(leases.py). Balances reset at 00:00 UTC: the day is part of the ledger key.
"""

from __future__ import annotations

import time
from collections import defaultdict
from enum import Enum
from typing import NamedTuple, Protocol

from proxy.credits.key_lease import KeyLease

DAY_TTL = 2 * 86400  # ledger entries outlive their day a little, for the operator CLI


class Verdict(Enum):
    OK = "ok"
    EXHAUSTED = "exhausted"
    RATE_LIMITED = "rate"
    UNAVAILABLE = "unavailable"  # the ledger cannot be reached and this replica may not decide alone


class Debit(NamedTuple):
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
    """`api_key` is whatever string names the key to the ledger; nothing here reads it otherwise."""

    def spend(self, api_key: str, amount: int, daily: int, now: float) -> int | None:
        """A key without a per-second limit: `amount` spent without awaiting anything, and the balance
        left to show; None when that cannot be decided so (a refusal too): ask `try_debit`/`debit`."""
        ...

    def try_debit(self, api_key: str, amount: int, daily: int, per_second: int | None,
                  now: float) -> Debit | None:
        """A verdict made without awaiting anything, or None: ask `debit`."""
        ...

    def purse(self, api_key: str, now: float) -> KeyLease | None:
        """A lease of the key's credits for `now`'s day that the hot path may spend from directly
        (KeyLease.spend: to its low-water mark, no further); None: every debit goes through `spend`."""
        ...

    async def debit(self, api_key: str, amount: int, *, daily: int, per_second: int | None, now: float) -> Debit: ...

    async def refund(self, api_key: str, amount: int, *, now: float) -> None:
        """Give back a debit made at `now` (its time, not the refund's: both belong to one UTC day)."""
        ...

    async def used(self, api_key: str, *, now: float) -> int: ...


def _judge(used: int, window: int, amount: int, daily: int, per_second: int | None) -> Verdict:
    """The rule both ledgers apply; leases.py's script is its twin."""
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

    def spend(self, api_key: str, amount: int, daily: int, now: float) -> int | None:
        debit = self.try_debit(api_key, amount, daily, None, now)
        return debit.remaining if debit.verdict is Verdict.OK else None

    def purse(self, api_key: str, now: float) -> None:
        return None  # no leases: one process's own count

    def try_debit(self, api_key: str, amount: int, daily: int, per_second: int | None, now: float) -> Debit:
        key = daily_key(api_key, now)
        rate_key = f"{api_key}:{int(now)}"
        verdict = _judge(self._used[key], self._window[rate_key], amount, daily, per_second)
        if verdict is Verdict.OK:
            self._used[key] += amount
            if per_second is not None:
                self._window = defaultdict(int, {k: v for k, v in self._window.items() if k == rate_key})
                self._window[rate_key] += amount
        return Debit(verdict, daily - self._used[key])

    async def debit(self, api_key: str, amount: int, *, daily: int, per_second: int | None, now: float) -> Debit:
        return self.try_debit(api_key, amount, daily=daily, per_second=per_second, now=now)

    async def refund(self, api_key: str, amount: int, *, now: float) -> None:
        key = daily_key(api_key, now)
        self._used[key] = max(0, self._used[key] - amount)

    async def used(self, api_key: str, *, now: float) -> int:
        return self._used.get(daily_key(api_key, now), 0)
