"""Leased credits: each replica leases blocks of a key's daily balance from Redis and spends them in
memory, so a debit is usually a decision made without a round trip.

Redis keeps one hash per key and UTC day, changed only by one Lua script (lease_script.py, where the
hash's fields and the rebuilding of a lost entry are described). Lease size adapts: a grant is the
call's cost plus whole calls' worth of a fraction of what nobody holds yet, 1 / (2 x active
replicas), at most `CREDITS_LEASE_MAX`. Far from the limit a replica answers thousands of calls per
round trip; near it the grant is exactly the call, so the last credits go out one by one and the sum
of allowances never passes the balance.

Every ledger command a call awaits is bounded by `CREDITS_REDIS_TIMEOUT` from the call's start (the
wait for another call's exchange included): past it the call is decided by the outage rule below, so
a stalled Redis delays no call by more than that.

While Redis cannot be reached, a replica keeps the last usage it saw for the key (never a full
balance) and may spend, beyond its lease, its share of what was left: (balance - used) / active
replicas (at most one of the host's workers' share), one "outage lease". A key known exhausted (by
this replica, a sibling worker, or any replica through the ledger's exhausted set, read every second)
stays refused. Outage debits are journaled (in
memory, and in `CREDITS_JOURNAL_DIR` when set) and reach Redis with the next exchange, so the day's
usage afterwards equals what was served. A key this process has not seen today is served up to
`CREDITS_LEASE_MAX` / WORKERS with `CREDITS_FAIL_OPEN=true` (the default) and refused otherwise, and
not at all when a sibling worker of its host had a lease of it from the ledger today (that one holds
the host's share).

The balance a client is shown is the key's spent usage (debits less refunds of every replica), not
what is leased: each replica reports its spending at least every `REPORT_INTERVAL` while it spends,
and learns the others' with every reply. While Redis cannot be reached it is the last view less this
replica's spending since, and only a view current when the ledger last answered (`outage_shown`):
none, or an older one, is no balance at all (shown as `unknown`), never the full daily balance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from proxy.credits.exhausted import ExhaustedKeys
from proxy.credits.journal import Journal
from proxy.credits.key_lease import KeyLease
from proxy.credits.lease_exchange import CREDIT, GIVE_BACK, TOP_UP, LeaseExchange, exhausted_key, ledger_key
from proxy.credits.ledger import DAY_TTL, Debit, Verdict, _judge
from proxy.credits.rate_window import window_after
from proxy.logs import Throttled
from proxy.redis_link import RedisLink, RedisUnavailable

log = logging.getLogger("proxy.credits")
# An outage decides every debit in process: one line per interval says so, with the count.
throttled = Throttled(log, interval=10.0)

_OK = Verdict.OK  # read once: an enum member read through its class costs more than the debit
REPORT_INTERVAL = 1.0  # seconds: a replica that spends reports it at least this often (the shown balance)
EXHAUSTED_READ_INTERVAL = 1.0  # seconds between reads of the day's exhausted keys
# A lease's view of the other replicas is current if it was taken within this many seconds of the
# ledger's last answer to this replica: a lease in use reports every REPORT_INTERVAL.
CURRENT_VIEW = 3 * REPORT_INTERVAL
STALE_GRACE = 3600  # seconds a past day's leases are kept for refunds of calls that crossed midnight


def outage_ceiling(
    lease: KeyLease, daily: int, *, fail_open: bool, lease_max: int, processes: int = 1, host_saw: bool = False
) -> int:
    """The most a replica may have consumed of a key while Redis cannot be reached: its lease plus
    its share of what nobody held at the last reply (one outage lease), a share of at most one of the
    host's `processes` workers (a sibling idle at that reply may spend it now); for a key it has not
    seen today, if failing open and no sibling worker had a lease of it (`host_saw`: that one holds
    the host's share), its share of one largest lease or of the key's balance, whichever is less (the
    host's workers share one), else nothing beyond what it holds."""
    if lease.known:
        unheld = max(0, daily - lease.others - lease.allowance)
        return lease.allowance + unheld // max(1, lease.active, processes)
    return lease.allowance + (min(lease_max, daily) // max(1, processes) if fail_open and not host_saw else 0)


def outage_verdict(
    lease: KeyLease,
    amount: int,
    daily: int,
    per_second: int | None,
    now: float,
    *,
    exhausted: bool = False,
) -> Verdict:
    """Whether a replica cut off from Redis may debit `amount` (pure). `exhausted`: the key is known
    exhausted somewhere (README "Limits and credits": the outage rule is per key)."""
    if exhausted or lease.unheld(daily) < amount:
        return Verdict.EXHAUSTED
    if lease.ceiling is None or lease.net + amount > lease.ceiling:
        return Verdict.UNAVAILABLE
    return _judge(0, lease.window, int(now), amount, daily, per_second)


def outage_shown(lease: KeyLease, amount: int, daily: int, verdict: Verdict, *, current: bool) -> int | None:
    """The balance an outage decision shows (pure): the last view less this replica's spending since,
    which never shows more than before the outage; None (unknown) when there is no such view (the key
    unseen today, or a view older than the ledger's last answer: `current`) or when the view says the
    call could be paid while it is refused for exhaustion (known exhausted elsewhere since): a 402
    never says more is left than the call needs (docs/keys-and-credits.md, the balance shown)."""
    if not (lease.known and current):
        return None
    remaining = lease.remaining(daily)
    return None if verdict is Verdict.EXHAUSTED and remaining >= amount else remaining


async def _acquire(lease: KeyLease, deadline: float) -> bool:
    """The lease's lock, if it comes before the deadline (monotonic time)."""
    if not lease.lock.locked():
        await lease.lock.acquire()  # free: taken without waiting
        return True
    budget = deadline - time.monotonic()
    if budget <= 0:
        return False
    try:
        async with asyncio.timeout(budget):
            await lease.lock.acquire()
    except TimeoutError:
        return False
    return True


class LeasedLedger:
    """The Redis ledger, spent through leases; see the module docstring for the rules."""

    def __init__(
        self,
        link: RedisLink,
        *,
        lease_max: int = 100_000,
        lease_seconds: float = 10.0,
        fail_open: bool = True,
        journal_dir: str | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        processes: int = 1,
        replica: str | None = None,
    ) -> None:
        self._link = link
        self._lease_max = lease_max
        self._lease_seconds = lease_seconds
        self._fail_open = fail_open
        self._mono = monotonic
        self._processes = processes  # the workers of one host share one outage lease of a key none has seen
        self.replica = replica or uuid.uuid4().hex[:12]
        self._journal = Journal(journal_dir, self.replica)
        self._leases: dict[tuple[int, str], KeyLease] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._today: dict[str, KeyLease] = {}  # the current day's leases, for the hot path
        self._day_start, self._day_end = 0.0, 0.0  # the hot path's day, as floats: compared with a float clock
        self._answered_at = 0.0  # monotonic time of the ledger's last answer to a read of the exhausted keys
        self.exhausted = ExhaustedKeys(link, self._background, day_ttl=DAY_TTL, key_of=exhausted_key)
        self.exchanges = LeaseExchange(
            link,
            self.replica,
            self._journal,
            self.exhausted,
            lambda: any(other.journaled for other in self._leases.values()),
            lease_max=lease_max,
            lease_seconds=lease_seconds,
            monotonic=monotonic,
        )
        self._exchange = self.exchanges.exchange
        self.on_new_lease: list[Callable[[KeyLease], None]] = []  # a key's first lease of a day here
        # Whether a sibling worker of this host had a lease of a key (its ledger key) today (credit_handover.py).
        self.host_saw: Callable[[str], bool] = lambda _key: False

    # --- debits ---------------------------------------------------------------------------

    def spend(self, api_key: str, amount: int, daily: int, now: float) -> int | None:
        """The hot path (no per-second limit): `amount` spent from the lease, the balance shown, or None."""
        lease = self.purse(api_key, now)
        if lease is None:  # none yet, or another day: `debit` opens its leases
            return None
        consumed = lease.consumed + amount
        held = lease.allowance + lease.refunded  # what this replica may have consumed
        if consumed > held or daily != lease.daily:  # another balance (a reload): `debit` leases again
            return None
        lease.consumed = consumed
        if held - consumed < lease.low_water and not lease.lock.locked():
            self._top_up(lease, amount, now)  # before it runs out, so no call waits for a refill
        return daily - lease.others_spent - consumed + lease.refunded

    def purse(self, api_key: str, now: float) -> KeyLease | None:
        """The key's lease for `now`'s day, which a hot path may spend from directly (KeyLease.spend)."""
        return self._today.get(api_key) if self._day_start <= now < self._day_end else None

    def try_debit(self, api_key: str, amount: int, daily: int, per_second: int | None, now: float) -> Debit | None:
        """A debit the lease covers, decided in memory. None: `debit` must ask Redis."""
        if per_second is None:
            remaining = self.spend(api_key, amount, daily, now)
            if remaining is not None:
                return Debit(_OK, remaining)
        lease = self.purse(api_key, now)
        if lease is not None and lease.ceiling is not None and not self._link.up:
            return self._outage_debit(lease, amount, daily, per_second, now)
        return None

    async def debit(self, api_key: str, amount: int, *, daily: int, per_second: int | None, now: float) -> Debit:
        lease = self._lease(api_key, now)
        if daily != lease.daily and lease.known:  # new terms (a reload): nothing granted under the old ones is spent
            lease.allowance, lease.returning = lease.net, True
        lease.daily = daily
        # Whatever this call awaits (another call's exchange, its own, a retry) ends by this deadline;
        # past it the outage rule decides, so a stalled Redis delays no call longer.
        deadline = time.monotonic() + self._link.timeout
        while True:
            quick = self.try_debit(api_key, amount, daily=daily, per_second=per_second, now=now)
            if quick is not None:
                return quick
            if not await _acquire(lease, deadline):
                return self._cut_off(lease, amount, daily, per_second, now)
            try:
                if per_second is None and lease.free >= amount and daily == lease.daily:
                    continue  # another call's refill covered this one too (as `spend` judges it)
                if lease.returning:  # given back first (new terms): Redis still counts what it held
                    await self._exchange(
                        lease, 0, mode=GIVE_BACK, per_second=None, now=now, budget=deadline - time.monotonic()
                    )
                verdict = await self._exchange(
                    lease, amount, mode=CREDIT, per_second=per_second, now=now, budget=deadline - time.monotonic()
                )
                if verdict is None:  # Redis did not answer in time
                    if self._link.up and time.monotonic() < deadline:
                        continue  # one quick failure is not an outage: ask again (exchanges are idempotent)
                    return self._cut_off(lease, amount, daily, per_second, now)
                if verdict is not Verdict.OK:
                    if verdict is Verdict.EXHAUSTED:
                        self.exhausted.mark(int(now) // 86400, api_key, tell=True)
                    if lease.free > 0:  # what is left here cannot pay this call: let other replicas have it
                        await self._exchange(
                            lease, 0, mode=GIVE_BACK, per_second=None, now=now, budget=deadline - time.monotonic()
                        )
                    return Debit(verdict, lease.remaining(daily))  # HELD: the caller asks again (Cashier)
                if lease.free >= amount:
                    lease.consumed += amount
                    return Debit(Verdict.OK, lease.remaining(daily))
            finally:
                lease.lock.release()

    def _cut_off(self, lease: KeyLease, amount: int, daily: int, per_second: int | None, now: float) -> Debit:
        """Redis did not answer within the call's bound: the outage rule decides."""
        if lease.ceiling is None:
            lease.ceiling = outage_ceiling(
                lease,
                daily,
                fail_open=self._fail_open,
                lease_max=self._lease_max,
                processes=self._processes,
                host_saw=not lease.known and self.host_saw(lease.key),
            )
        return self._outage_debit(lease, amount, daily, per_second, now)

    def _top_up(self, lease: KeyLease, amount: int, now: float) -> None:
        if lease.ceiling is not None or not self._link.up:
            return
        lease.low_water = 0  # one top-up per grant
        self._background(self._locked_exchange(lease, amount, TOP_UP, now))

    async def _locked_exchange(self, lease: KeyLease, cost: int, mode: int, now: float) -> None:
        async with lease.lock:
            await self._exchange(lease, cost, mode=mode, per_second=None, now=now)

    def _outage_debit(self, lease: KeyLease, amount: int, daily: int, per_second: int | None, now: float) -> Debit:
        day = int(now) // 86400
        verdict = outage_verdict(
            lease, amount, daily, per_second, now, exhausted=(day, lease.api_key) in self.exhausted.known
        )
        if verdict is Verdict.OK:
            lease.consumed += amount
            if per_second is not None:
                lease.window = window_after(lease.window, int(now), amount, per_second)
            # Every outage debit is journaled: a worker that dies now leaves its counters to its successor.
            lease.journaled = True
            self._journal.record(self.replica, lease)
            throttled.warning("outage", "credits: redis unavailable, debits decided in process and journaled")
        elif verdict is Verdict.EXHAUSTED:
            self.exhausted.mark(day, lease.api_key, tell=True)
        return Debit(verdict, outage_shown(lease, amount, daily, verdict, current=self._current(lease)))

    def _current(self, lease: KeyLease) -> bool:
        """Whether the lease's view of the others was current when the ledger last answered."""
        return lease.reported_at >= self._answered_at - CURRENT_VIEW

    async def refund(self, api_key: str, amount: int, *, now: float) -> None:
        """`now`: when the refunded debit was made. The credits go back to that day's lease, whatever
        the clock says by the time the call failed (a charge and its refund belong to one day)."""
        lease = self._leases.get((int(now) // 86400, api_key))
        if lease is not None:  # the credits go back to this replica's lease, and with it to Redis
            lease.refunded += amount
            if lease.journaled:
                self._journal.record(self.replica, lease)

    async def used(self, api_key: str, *, now: float) -> int | None:
        """The key's spent usage today (debits less refunds of every replica); None: not known here
        while Redis cannot be reached (outage_shown)."""
        lease = self._leases.get((int(now) // 86400, api_key))
        if lease is not None and lease.ceiling is not None:  # Redis unreachable: the last view, if current
            return lease.others_spent + lease.net if lease.known and self._current(lease) else None
        if lease is not None and lease.known:
            return lease.others_spent + lease.net
        day = int(now) // 86400
        entry = await self._link.run("credits_read", lambda c: c.hgetall(ledger_key(api_key, day)))
        return spent_of(entry)

    @property
    def settled(self) -> bool:
        """Every debit made without Redis has been written back to it."""
        return not any(lease.journaled or lease.ceiling is not None for lease in self._leases.values())

    @property
    def given_back(self) -> bool:
        """Every lease went back to Redis and every debit reached it (after `close`)."""
        return not any(
            lease.journaled
            or lease.ceiling is not None
            or lease.returning
            or lease.free > 0
            or lease.net != lease.reported
            for lease in self._leases.values()
        )

    def _background(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- exchanges with Redis ----------------------------------------------------------------

    def _lease(self, api_key: str, now: float) -> KeyLease:
        day = int(now) // 86400
        lease = self._leases.get((day, api_key))
        if lease is None:
            lease = self._leases[(day, api_key)] = KeyLease(
                api_key, ledger_key(api_key, day), day_start=day * 86400.0, day_end=(day + 1) * 86400.0
            )
            for callback in self.on_new_lease:
                callback(lease)
        if day * 86400 > self._day_start:  # a new day: the hot path's leases are that day's
            self._day_start, self._day_end = float(day * 86400), float((day + 1) * 86400)
            self._today = {k: v for (d, k), v in self._leases.items() if d == day}
        elif day * 86400 == self._day_start:
            self._today[api_key] = lease
        return lease

    async def sync(self, now: float) -> None:
        """One sweep: journaled debits written back, spending reported, old, idle, past days' leases given back."""
        mono = self._mono()
        today = int(now) // 86400
        if self._link.up and mono - self.exhausted.read_at >= EXHAUSTED_READ_INTERVAL:
            self.exhausted.read_at = mono
            with contextlib.suppress(RedisUnavailable):
                await self.exhausted.read(now)
                self._answered_at = mono
        for (day, _key), lease in list(self._leases.items()):
            if lease.lock.locked():
                continue
            stale = day != today
            if lease.consumed != lease.swept:  # spent since the last sweep: not idle
                lease.swept, lease.idle_since = lease.consumed, mono
            old = lease.free > 0 and (
                stale
                or mono - lease.granted_at > self._lease_seconds
                or mono - lease.idle_since > self._lease_seconds / 2
            )
            # Spending is reported, and the others' learned, every REPORT_INTERVAL while the key is in use
            # here: the balance shown trails the ledger by about that much of the other replicas' spending.
            recent = lease.net != lease.reported or (not stale and mono - lease.idle_since < self._lease_seconds)
            unreported = recent and lease.known and (stale or mono - lease.reported_at >= REPORT_INTERVAL)
            wanted = lease.asked_back and lease.free > 0  # another replica was refused for want of it
            if not (lease.journaled or lease.ceiling is not None or lease.returning or old or wanted or unreported):
                if stale and now >= (day + 1) * 86400 + STALE_GRACE:
                    del self._leases[(day, _key)]  # no refund of that day can still come
                continue
            if not self._link.up:
                return
            await self._locked_exchange(
                lease,
                0,
                GIVE_BACK if old or wanted or lease.returning else CREDIT,
                day * 86400 + 43200 if stale else now,
            )

    async def run(self, clock: Callable[[], float], interval: float = 0.25) -> None:
        task = asyncio.current_task()
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sync(clock())
            except Exception:  # the sweeper must outlive any one fault
                log.exception("credits: lease sweep failed")
            if task is not None and task.cancelling():
                # A stop that arrived as a command's own timeout expired was taken for that timeout.
                raise asyncio.CancelledError

    async def close(self, now: float) -> None:
        """On shutdown: every lease goes back and every journaled debit is written, if Redis answers."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for lease in list(self._leases.values()):
            if lease.free > 0 or lease.journaled or lease.returning or lease.net != lease.reported:
                await self._locked_exchange(lease, 0, GIVE_BACK, now)


def spent_of(entry: dict[Any, Any]) -> int:
    """A ledger entry's spent usage: every replica's debits less its refunds."""
    fields = {(k.decode() if isinstance(k, bytes) else k): int(float(v)) for k, v in entry.items()}
    return sum(v - fields.get(f"f:{k[2:]}", 0) for k, v in fields.items() if k.startswith("c:"))
