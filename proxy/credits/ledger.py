"""Daily credit balances per API key, and an optional credits-per-second limit: the rule, the
ledger protocol and the in-process ledger. With Redis, replicas share balances through leases
(leases.py). Balances reset at 00:00 UTC: the day is part of the ledger key.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import NamedTuple, Protocol

from proxy.credits.key_lease import KeyLease
from proxy.credits.rate_window import NO_WINDOW, Window, window_after, window_held

DAY_TTL = 2 * 86400  # ledger entries outlive their day a little, for the operator CLI


class Verdict(Enum):
    OK = "ok"
    EXHAUSTED = "exhausted"
    RATE_LIMITED = "rate"
    UNAVAILABLE = "unavailable"  # the ledger cannot be reached and this replica may not decide alone
    HELD = "held"  # the balance can pay, but other replicas' leases hold it: asked again (HELD_RETRY)


# A debit whose credit other replicas' leases hold (leases.py) is asked again every HELD_RETRY seconds,
# under the key's terms then in force, for at most HELD_WAIT: the holders hear of it at their next
# report (every second while they hold a lease) and give it back at the sweep after it.
HELD_RETRY = 0.1
HELD_WAIT = 3.0


class Debit(NamedTuple):
    verdict: Verdict
    remaining: int | None  # the balance to show; None: this replica does not know it (leases.outage_shown)


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

    def try_debit(self, api_key: str, amount: int, daily: int, per_second: int | None, now: float) -> Debit | None:
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

    async def used(self, api_key: str, *, now: float) -> int | None:
        """The key's spent usage today; None: this replica does not know it (leases.outage_shown)."""
        ...


def _judge(used: int, window: Window, second: int, amount: int, daily: int, per_second: int | None) -> Verdict:
    """The rule both ledgers apply; leases.py's script is its twin."""
    if used + amount > daily:
        return Verdict.EXHAUSTED
    # A window already in use may not go over the limit; an empty one admits one call of any size
    # (a batch dearer than the limit), whose excess fills the seconds after it (window_after): such
    # a call is slowed, not refused forever, and the key's average stays within the limit.
    if per_second is not None:
        held = window_held(window, second, per_second)
        if held > 0 and held + amount > per_second:
            return Verdict.RATE_LIMITED
    return Verdict.OK


class MemoryLedger:
    """One process's own count, as one lease per key and UTC day that holds the whole balance: the hot
    path spends from it directly (KeyLease.spend), as it does from a replica's lease with Redis."""

    def __init__(self) -> None:
        self._leases: dict[tuple[int, str], KeyLease] = {}  # (UTC day, key): the latest day's and the one before
        self._day = 0  # the latest UTC day a lease was made for
        self._windows: dict[str, Window] = {}  # per key with a per-second limit

    def _lease(self, api_key: str, daily: int, now: float) -> KeyLease:
        """The key's lease for `now`'s day, under `daily`: a reload's new balance holds from now on,
        against what was spent under the old one."""
        day = int(now) // 86400
        lease = self._leases.get((day, api_key))
        if lease is None:
            if day > self._day:  # older days are over: a refund goes back to its own day, so one is kept
                self._day = day
                self._leases = {held: kept for held, kept in self._leases.items() if held[0] >= day - 1}
            lease = self._leases[(day, api_key)] = KeyLease(
                api_key,
                daily_key(api_key, now),
                allowance=daily,
                daily=daily,
                day_start=day * 86400.0,
                day_end=(day + 1) * 86400.0,
            )
        elif lease.daily != daily:
            lease.allowance = lease.daily = daily
        return lease

    def spend(self, api_key: str, amount: int, daily: int, now: float) -> int | None:
        debit = self.try_debit(api_key, amount, daily, None, now)
        return debit.remaining if debit.verdict is Verdict.OK else None

    def purse(self, api_key: str, now: float) -> KeyLease | None:
        return self._leases.get((int(now) // 86400, api_key))

    def try_debit(self, api_key: str, amount: int, daily: int, per_second: int | None, now: float) -> Debit:
        lease = self._lease(api_key, daily, now)
        second = int(now)
        window = self._windows.get(api_key, NO_WINDOW)
        verdict = _judge(lease.net, window, second, amount, daily, per_second)
        if verdict is Verdict.OK:
            lease.consumed += amount
            if per_second is not None:
                self._windows[api_key] = window_after(window, second, amount, per_second)
        return Debit(verdict, lease.remaining(daily))

    async def debit(self, api_key: str, amount: int, *, daily: int, per_second: int | None, now: float) -> Debit:
        return self.try_debit(api_key, amount, daily=daily, per_second=per_second, now=now)

    async def refund(self, api_key: str, amount: int, *, now: float) -> None:
        lease = self.purse(api_key, now)
        if lease is not None:
            lease.refunded += min(amount, lease.net)

    async def used(self, api_key: str, *, now: float) -> int:
        lease = self.purse(api_key, now)
        return 0 if lease is None else lease.net
