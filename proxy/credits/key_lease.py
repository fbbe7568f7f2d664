"""One key's credits on one replica for one UTC day: what it was leased, spent and refunded, and
what it knows of the other replicas (leases.py keeps them; journal.py writes them down)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class KeyLease:
    """One key's credits on this replica for one UTC day."""

    api_key: str
    key: str  # the Redis hash
    allowance: int = 0  # credits this replica may consume today; never more than Redis granted
    consumed: int = 0  # cumulative debits
    refunded: int = 0  # cumulative refunds
    others: int = 0  # credits allowed to other replicas, at the last reply
    others_spent: int = 0  # credits other replicas spent (debits less refunds), at the last reply
    peers: tuple[Any, ...] = ()  # the other replicas at the last reply, to rebuild a lost entry
    known: bool = False  # Redis answered for this key today
    active: int = 1  # replicas using the key, at the last reply
    daily: int = 0
    granted_at: float = 0.0
    reported: int = 0  # `net` as Redis last saw it
    reported_at: float = 0.0
    low_water: int = 0  # free credit below which the lease is topped up in the background
    swept: int = -1  # `consumed` at the last sweep, and since when it has not moved (idle)
    idle_since: float = 0.0
    ceiling: int | None = None  # while Redis is unreachable: the most this replica may consume
    journaled: bool = False  # debits Redis has not seen yet
    returning: bool = False  # a give-back that has not reached Redis yet
    window_second: int = -1  # the per-second window while Redis is unreachable
    window_used: int = 0
    day_start: float = 0.0  # the UTC day the lease belongs to, as floats: compared with a float clock
    day_end: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def spend(self, amount: int, daily: int, now: float) -> int | None:
        """The hot path (a key with no per-second limit): `amount` spent from what this replica holds
        when that leaves the low-water mark untouched, and the balance to show; None: the ledger
        decides (another day, a top-up due, too little held, a balance other than the lease's).
        Spending to the mark never needs a top-up nor passes what is held: the ledger's own rule
        (leases.LeasedLedger.spend) holds."""
        consumed = self.consumed + amount
        if consumed > self.allowance + self.refunded - self.low_water or not self.day_start <= now < self.day_end \
                or daily != self.daily:  # another balance (a reload): the ledger leases again under it
            return None
        self.consumed = consumed
        return daily - self.others_spent - consumed + self.refunded

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
