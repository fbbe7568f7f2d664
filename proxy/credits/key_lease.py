"""One key's credits on one replica for one UTC day: what it was leased, spent and refunded, and
what it knows of the other replicas (leases.py keeps them; journal.py writes them down)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from proxy.credits.rate_window import NO_WINDOW, Window


class _Term:
    """A figure KeyLease.spend compares with through the two it makes of it: setting one renews them."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = "_" + name

    def __get__(self, lease: Any, owner: type | None = None) -> int:
        return cast(int, getattr(lease, self._slot))

    def __set__(self, lease: KeyLease, value: int) -> None:
        setattr(lease, self._slot, value)
        lease._terms_moved()


class KeyLease:
    """One key's credits on this replica for one UTC day.

    `spend` (every keyed cache hit) compares with two figures made from the others, kept in step by
    the setters of those others (`_Term`), so no code that moves a lease can leave them stale:
    `_mark`, the consumption up to which the lease spends alone, and `_shown`, the balance shown
    before this replica's consumption."""

    __slots__ = (
        "_allowance",
        "_daily",
        "_low_water",
        "_mark",
        "_others_spent",
        "_refunded",
        "_shown",
        "active",
        "api_key",
        "asked_back",
        "ceiling",
        "consumed",
        "day_end",
        "day_start",
        "granted_at",
        "idle_since",
        "journaled",
        "key",
        "known",
        "lock",
        "others",
        "peers",
        "reported",
        "reported_at",
        "returning",
        "swept",
        "wanted",
        "wants",
        "window",
    )

    def __init__(
        self,
        api_key: str,
        key: str,
        *,
        allowance: int = 0,  # credits this replica may consume today; never more than Redis granted
        consumed: int = 0,  # cumulative debits
        refunded: int = 0,  # cumulative refunds
        others: int = 0,  # credits allowed to other replicas, at the last reply
        others_spent: int = 0,  # credits other replicas spent (debits less refunds), at the last reply
        peers: tuple[Any, ...] = (),  # the other replicas at the last reply, to rebuild a lost entry
        known: bool = False,  # Redis answered for this key today
        active: int = 1,  # replicas using the key, at the last reply
        daily: int = 0,
        low_water: int = 0,  # free credit below which the lease is topped up in the background
        ceiling: int | None = None,  # while Redis is unreachable: the most this replica may consume
        day_start: float = 0.0,  # the UTC day the lease belongs to, as floats: compared with a float clock
        day_end: float = 0.0,
    ) -> None:
        self.api_key, self.key = api_key, key  # the key, and its Redis hash
        self._allowance, self._refunded, self._others_spent = allowance, refunded, others_spent
        self._daily, self._low_water = daily, low_water
        self._terms_moved()
        self.consumed, self.others, self.peers, self.known, self.active = consumed, others, peers, known, active
        self.ceiling, self.day_start, self.day_end = ceiling, day_start, day_end
        self.granted_at = 0.0
        self.reported = 0  # `net` as Redis last saw it
        self.reported_at = 0.0
        self.swept = -1  # `consumed` at the last sweep, and since when it has not moved (idle)
        self.idle_since = 0.0
        self.journaled = False  # debits Redis has not seen yet
        self.returning = False  # a give-back that has not reached Redis yet
        self.wanted = 0  # when a replica last found the key's credit held elsewhere, as last heard (s)
        self.wants = 0  # how many times replicas found it so today, as last heard
        self.asked_back = False  # another replica wants what this one holds: given back at the next sweep
        self.window: Window = NO_WINDOW  # the per-second window while Redis is unreachable (ledger.py)
        self.lock = asyncio.Lock()

    allowance = _Term()
    refunded = _Term()
    others_spent = _Term()
    low_water = _Term()
    daily = _Term()

    def _terms_moved(self) -> None:
        self._mark = self._allowance + self._refunded - self._low_water
        self._shown = self._daily - self._others_spent + self._refunded

    def spend(self, amount: int, daily: int, now: float) -> int | None:
        """The hot path (a key with no per-second limit): `amount` spent from what this replica holds
        when that leaves the low-water mark untouched, and the balance to show; None: the ledger
        decides (another day, a top-up due, too little held, a balance other than the lease's).
        Spending to the mark never needs a top-up nor passes what is held: the ledger's own rule
        (leases.LeasedLedger.spend) holds."""
        consumed = self.consumed + amount
        # allowance + refunded - low_water; daily: another balance (a reload) is leased again under it
        if consumed > self._mark or daily != self._daily or not self.day_start <= now < self.day_end:
            return None
        self.consumed = consumed
        return self._shown - consumed  # daily - others_spent - (consumed - refunded)

    @property
    def net(self) -> int:
        return self.consumed - self.refunded

    @property
    def free(self) -> int:
        return self.allowance - self.net

    def unheld(self, daily: int) -> int:
        """What neither this replica spent nor another holds: other replicas' leases count as spent."""
        return daily - self.others - self.net

    def remaining(self, daily: int) -> int:
        """The balance a client is shown: the daily balance less what every replica spent."""
        return daily - self.others_spent - self.net
