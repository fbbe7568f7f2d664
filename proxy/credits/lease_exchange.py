"""One exchange of a key's lease with Redis: the lease script run with the lease's counters (its
arguments in the order lease_script.py reads them), and its reply applied to the lease."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from proxy.credits.exhausted import ExhaustedKeys
from proxy.credits.journal import Journal
from proxy.credits.key_lease import KeyLease
from proxy.credits.lease_script import LEASE_SCRIPT, parse_reply
from proxy.credits.ledger import DAY_TTL, Verdict, day_of
from proxy.redis_link import RedisLink, RedisUnavailable
from proxy.redis_topology import slot_tag

log = logging.getLogger("proxy.credits")

_VERDICTS = {
    1: Verdict.OK,
    0: Verdict.EXHAUSTED,
    -1: Verdict.RATE_LIMITED,
    -2: Verdict.UNAVAILABLE,
    -3: Verdict.HELD,
}
CREDIT, GIVE_BACK, TOP_UP = 0, 1, 2  # the script's modes
# Seconds a replica's finding that the key's credit is held elsewhere stays news to the others: they
# hear it at their next report (every REPORT_INTERVAL while they hold a lease), never an old one.
WANTED_FOR = 3


def ledger_key(api_key: str, day: int) -> str:
    """The key's ledger hash for a UTC day. It and the key's per-second windows (`rate_key`) carry
    the key's name as their hash tag: the script touches both, so a Redis Cluster must hold them in
    one slot."""
    return f"rcp:credits:{day_of(day * 86400)}:{slot_tag(api_key)}"


def untagged_ledger_key(api_key: str, day: int) -> str:
    """The ledger hash's name before hash tags (a one-server or Sentinel Redis may still hold it)."""
    return f"rcp:credits:{day_of(day * 86400)}:{api_key}"


def exhausted_key(day: int) -> str:
    """The set of keys a replica was refused for exhaustion on a UTC day (the outage rule's memory)."""
    return f"rcp:exhausted:{day_of(day * 86400)}"


def rate_key(api_key: str) -> str:
    """The key's per-second window: a hash of rate_window.py's (start, last, used)."""
    return f"rcp:rate:{slot_tag(api_key)}:window"


class LeaseExchange:
    def __init__(
        self,
        link: RedisLink,
        replica: str,
        journal: Journal,
        exhausted: ExhaustedKeys,
        any_journaled: Callable[[], bool],
        *,
        lease_max: int,
        lease_seconds: float,
        monotonic: Callable[[], float],
    ) -> None:
        self._link = link
        self._script: Any = link.client.register_script(LEASE_SCRIPT)
        self._replica = replica
        self._journal = journal
        self._exhausted = exhausted
        self._any_journaled = any_journaled  # whether any lease of the ledger still has journaled debits
        self._lease_max = lease_max
        self._lease_seconds = lease_seconds
        self._mono = monotonic
        self._seqs = itertools.count(1)
        self.on_known: list[Callable[[KeyLease], None]] = []  # a key's first reply from the ledger here today

    async def exchange(
        self,
        lease: KeyLease,
        cost: int,
        *,
        mode: int,
        per_second: int | None,
        now: float,
        budget: float | None = None,
    ) -> Verdict | None:
        """One run of the script (callers hold `lease.lock`); None: no answer within `budget` seconds."""
        if budget is not None and budget <= 0:
            return None
        if mode == GIVE_BACK:
            lease.allowance = lease.net  # nothing more is spent from this lease meanwhile
            lease.returning = True
        args = [
            self._replica,
            next(self._seqs),
            lease.consumed,
            lease.refunded,
            cost,
            mode,
            lease.daily,
            self._lease_max,
            int(now),
            3 * self._lease_seconds,
            per_second or 0,
            lease.allowance,
            1 if lease.known else 0,
            DAY_TTL,
            *lease.peers,
        ]
        keys = [lease.key, rate_key(lease.api_key)]
        if not self._link.is_cluster:  # no cluster held the untagged names: its keys need one slot
            keys.append(untagged_ledger_key(lease.api_key, int(now) // 86400))
        sent_consumed, sent_net, daily = lease.consumed, lease.net, lease.daily
        try:
            raw = await self._link.run("credits_lease", lambda _c: self._script(keys=keys, args=args), timeout=budget)
        except RedisUnavailable:
            return None
        reply = parse_reply(raw)
        if reply.restored:
            log.warning(
                "credits: a key's ledger entry was missing in Redis; rebuilt from this replica's own "
                "lease and what it last saw of the others"
            )
        if reply.allowance > lease.allowance and cost:
            lease.granted_at = self._mono()
            lease.low_water = (reply.allowance - lease.net) // 4
        lease.allowance, lease.others, lease.active = reply.allowance, reply.used - reply.allowance, reply.active
        lease.others_spent, lease.peers = reply.spent - sent_net, reply.peers
        lease.reported, lease.reported_at = sent_net, self._mono()
        if not lease.known:
            for callback in self.on_known:
                callback(lease)
        lease.known, lease.ceiling, lease.returning = True, None, False
        if daily != lease.daily and mode != GIVE_BACK:  # granted under a balance a reload replaced meanwhile
            lease.allowance, lease.returning = lease.net, True
        if lease.journaled and lease.consumed == sent_consumed:
            lease.journaled = False
            if not self._any_journaled():
                self._journal.clear()
        verdict = _VERDICTS[reply.verdict]
        if mode == GIVE_BACK:
            lease.asked_back = False
        elif (reply.wants > lease.wants or reply.wanted > lease.wanted) and reply.wanted >= int(now) - WANTED_FOR:
            # Another replica found the key's credit held elsewhere since (a want told by its count, as
            # two in one second are two; by its second too, as a replica of an older release counts none):
            # what is free here goes back at the next sweep (a replica's own want is its own: it gives
            # back as it is refused).
            lease.asked_back = verdict is not Verdict.HELD
        lease.wanted, lease.wants = max(lease.wanted, reply.wanted), max(lease.wants, reply.wants)
        if verdict is Verdict.OK and cost:
            self._exhausted.forget(int(now) // 86400, lease.api_key)
        return verdict

    async def release(self, replica: str, key: str, api_key: str, counters: tuple[int, int], now: float) -> bool:
        """Give back the lease of a replica that died (a worker's predecessor, handover.py): its allowance
        shrinks to what it spent, as its last report or journal says. False: Redis did not answer."""
        consumed, refunded = counters
        args = [
            replica,
            2**50,
            consumed,
            refunded,
            0,
            GIVE_BACK,
            0,
            self._lease_max,
            int(now),
            3 * self._lease_seconds,
            0,
            0,
            0,
            DAY_TTL,
        ]
        keys = [key, rate_key(api_key)]
        try:
            await self._link.run("credits_lease", lambda _c: self._script(keys=keys, args=args))
        except RedisUnavailable:
            return False
        return True
