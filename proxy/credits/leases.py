"""Leased credits: each replica leases blocks of a key's daily balance from Redis and spends them in
memory, so a debit is usually a decision made without a round trip.

Redis keeps one hash per key and UTC day. `a:<replica>` is the allowance of each replica (what it
may consume today), `used` their sum; `c:`/`f:` are the replica's cumulative debits and refunds as
last reported, `s:` its last applied request, `t:` when it last asked. One Lua script
(`LEASE_SCRIPT`) does every exchange atomically: it takes the replica's counters (merging by max,
so a report that arrives twice or late changes nothing), grows the allowance when the replica needs
credit, or shrinks it to what was consumed when the replica gives its lease back.

Lease size adapts: a grant is the call's cost plus whole calls' worth of a fraction of what nobody
holds yet, 1 / (2 x active replicas), at most `CREDITS_LEASE_MAX`. Far from the limit a replica
answers thousands of calls per round trip; near it the grant is exactly the call, so the last
credits go out one by one and the sum of allowances never passes the balance. A key's remaining
credit never gains from a lost or late message: grants are decided by Redis alone, and a replica
spends only what it was granted.

While Redis cannot be reached, a replica keeps the last usage it saw for the key (never a full
balance) and may spend, beyond its lease, its share of what was left: (balance - used) / active
replicas, one "outage lease". Those debits are journaled (in memory, and in `CREDITS_JOURNAL_DIR`
when set) and reach Redis with the next exchange, so the day's usage afterwards equals what was
served. A key this replica has not seen today is served up to `CREDITS_LEASE_MAX` with
`CREDITS_FAIL_OPEN=true` (the default) and refused otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.credits.journal import Journal
from proxy.credits.ledger import DAY_TTL, Debit, Verdict, _judge, day_of
from proxy.logs import Throttled
from proxy.redis_link import RedisLink, RedisUnavailable
from proxy.redis_topology import slot_tag

log = logging.getLogger("proxy.credits")
# An outage decides every debit in process: one line per interval says so, with the count.
throttled = Throttled(log, interval=10.0)

# KEYS: the key's ledger hash for the day, its per-second window, and (off a cluster) the day's hash
#   under its name from before hash tags, renamed to the first on first use so an upgrade loses no usage.
# ARGV: replica, request seq, consumed, refunded, cost (0: no credit wanted), mode (0: credit for a call,
#   1: give the lease back, 2: top the lease up ahead of need: the extra part of a grant alone), daily
#   balance, largest lease, now (s), active window (s), per-second limit (0: none), the replica's
#   allowance and the key's usage as it last knew them (to restore a lost entry), entry TTL.
# Returns {verdict (1 ok, 0 exhausted, -1 rate limited), allowance, used, active replicas, restored}.
LEASE_SCRIPT = """
local key, me = KEYS[1], ARGV[1]
local seq, consumed, refunded = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cost, give_back, top_up = tonumber(ARGV[5]), ARGV[6] == '1', ARGV[6] == '2'
local daily, lease_max = tonumber(ARGV[7]), tonumber(ARGV[8])
local now, window, per_second = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local known_allowance, known_used = tonumber(ARGV[12]), tonumber(ARGV[13])
if KEYS[3] and redis.call('EXISTS', key) == 0 and redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('RENAME', KEYS[3], key)
end
local h = {}
local flat = redis.call('HGETALL', key)
for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
local used = tonumber(h['used'] or '0')
local before = tonumber(h['a:' .. me] or '-1')
local restored = 0
if before < 0 then
  before = 0
  if known_used > 0 then
    -- The entry was lost (a restart without persistence, a deletion, an eviction) while this
    -- replica knew it: put back its allowance and at least the usage it last saw.
    before = known_allowance
    used = math.max(used + known_allowance, known_used)
    restored = 1
  end
end
local a = before
consumed = math.max(consumed, tonumber(h['c:' .. me] or '0'))
refunded = math.max(refunded, tonumber(h['f:' .. me] or '0'))
local net = consumed - refunded
if net > a then a = net end  -- spent while Redis was unreachable (journaled): counted now
local active = 1
for name, value in pairs(h) do
  if string.sub(name, 1, 2) == 't:' and name ~= 't:' .. me and tonumber(value) > now - window then
    active = active + 1
  end
end
local verdict = 1
local fresh = seq > tonumber(h['s:' .. me] or '0')  -- a late duplicate changes no lease
if fresh then
  if give_back then a = math.max(net, 0) end
  if cost > 0 then
    local need = math.max(net + cost - a, 0)
    local free = daily - (used - before + a)
    if need > free then
      verdict = 0
    elseif per_second > 0 then
      local spent = tonumber(redis.call('GET', KEYS[2]) or '0')
      if spent > 0 and spent + cost > per_second then
        verdict = -1
      else
        redis.call('INCRBY', KEYS[2], cost)
        redis.call('EXPIRE', KEYS[2], 2)
        a = a + need
      end
    elseif need > 0 or top_up then
      local calls = math.floor((free - need) / (2 * active * cost))
      a = a + need + math.min(calls, math.floor(lease_max / cost)) * cost
    end
  end
  redis.call('HSET', key, 's:' .. me, seq)
end
used = used - before + a
redis.call('HSET', key, 'used', used, 'a:' .. me, a, 'c:' .. me, consumed, 'f:' .. me, refunded, 't:' .. me, now)
redis.call('EXPIRE', key, tonumber(ARGV[14]))
return {verdict, a, used, active, restored}
"""

_VERDICTS = {1: Verdict.OK, 0: Verdict.EXHAUSTED, -1: Verdict.RATE_LIMITED}
_OK = Verdict.OK  # read once: an enum member read through its class costs more than the debit
_new_tuple = tuple.__new__  # a Debit made without NamedTuple's Python-level __new__
CREDIT, GIVE_BACK, TOP_UP = 0, 1, 2  # the script's modes


def ledger_key(api_key: str, day: int) -> str:
    """The key's ledger hash for a UTC day. It and the key's per-second windows (`rate_key`) carry
    the key's name as their hash tag: the script touches both, so a Redis Cluster must hold them in
    one slot."""
    return f"rcp:credits:{day_of(day * 86400)}:{slot_tag(api_key)}"


def untagged_ledger_key(api_key: str, day: int) -> str:
    """The ledger hash's name before hash tags (a one-server or Sentinel Redis may still hold it)."""
    return f"rcp:credits:{day_of(day * 86400)}:{api_key}"


def rate_key(api_key: str, second: int) -> str:
    return f"rcp:rate:{slot_tag(api_key)}:{second}"


@dataclass(slots=True)
class KeyLease:
    """One key's credits on this replica for one UTC day."""

    api_key: str
    key: str  # the Redis hash
    allowance: int = 0  # credits this replica may consume today; never more than Redis granted
    consumed: int = 0  # cumulative debits
    refunded: int = 0  # cumulative refunds
    others: int = 0  # credits allowed to other replicas, at the last reply
    known: bool = False  # Redis answered for this key today
    active: int = 1  # replicas using the key, at the last reply
    daily: int = 0
    granted_at: float = 0.0
    low_water: int = 0  # free credit below which the lease is topped up in the background
    swept: int = -1  # `consumed` at the last sweep, and since when it has not moved (idle)
    idle_since: float = 0.0
    ceiling: int | None = None  # while Redis is unreachable: the most this replica may consume
    journaled: bool = False  # debits Redis has not seen yet
    returning: bool = False  # a give-back that has not reached Redis yet
    window_second: int = -1  # the per-second window while Redis is unreachable
    window_used: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def net(self) -> int:
        return self.consumed - self.refunded

    @property
    def free(self) -> int:
        return self.allowance - self.net

    def remaining(self, daily: int) -> int:
        """The key's balance as far as this replica knows: other replicas' leases count as spent."""
        return daily - self.others - self.net


def outage_ceiling(lease: KeyLease, daily: int, *, fail_open: bool, lease_max: int) -> int:
    """The most a replica may have consumed of a key while Redis cannot be reached: its lease plus
    its share of what nobody held at the last reply (one outage lease); for a key it has not seen
    today, one largest lease if failing open, else nothing beyond what it holds."""
    if lease.known:
        unheld = max(0, daily - lease.others - lease.allowance)
        return lease.allowance + unheld // max(1, lease.active)
    return lease.allowance + (min(lease_max, daily) if fail_open else 0)


def outage_verdict(lease: KeyLease, amount: int, daily: int, per_second: int | None, now: float) -> Verdict:
    """Whether a replica cut off from Redis may debit `amount` (pure)."""
    if lease.remaining(daily) < amount:
        return Verdict.EXHAUSTED
    if lease.ceiling is None or lease.net + amount > lease.ceiling:
        return Verdict.UNAVAILABLE
    window = lease.window_used if lease.window_second == int(now) else 0
    return _judge(0, window, amount, daily, per_second)


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
    ) -> None:
        self._link = link
        self._script: Any = link.client.register_script(LEASE_SCRIPT)
        self._lease_max = lease_max
        self._lease_seconds = lease_seconds
        self._fail_open = fail_open
        self._mono = monotonic
        self.replica = uuid.uuid4().hex[:12]
        self._journal = Journal(journal_dir, self.replica)
        self._leases: dict[tuple[int, str], KeyLease] = {}
        self._seqs = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._today: dict[str, KeyLease] = {}  # the current day's leases, for the hot path
        self._day_start, self._day_end = 0, 0

    # --- debits ---------------------------------------------------------------------------

    def try_debit(self, api_key: str, amount: int, *, daily: int, per_second: int | None, now: float) -> Debit | None:
        """The hot path: a debit the lease covers, decided in memory. None: `debit` must ask Redis."""
        if not self._day_start <= now < self._day_end:
            return None  # another day: `debit` opens its leases
        lease = self._today.get(api_key)
        if lease is None:
            return None
        consumed = lease.consumed
        free = lease.allowance - consumed + lease.refunded  # lease.free, inlined
        if per_second is None and free >= amount:
            lease.consumed = consumed = consumed + amount
            if free - amount < lease.low_water and not lease.lock.locked():
                self._top_up(lease, amount, now)  # before it runs out, so no call waits for a refill
            return _new_tuple(Debit, (_OK, daily - lease.others - consumed + lease.refunded))
        if lease.ceiling is not None and not self._link.up:
            return self._outage_debit(lease, amount, daily, per_second, now)
        return None

    async def debit(self, api_key: str, amount: int, *, daily: int, per_second: int | None, now: float) -> Debit:
        lease = self._lease(api_key, now)
        lease.daily = daily
        while True:
            quick = self.try_debit(api_key, amount, daily=daily, per_second=per_second, now=now)
            if quick is not None:
                return quick
            async with lease.lock:
                if per_second is None and lease.free >= amount:
                    continue  # another call's refill covered this one too
                verdict = await self._exchange(lease, amount, mode=CREDIT, per_second=per_second, now=now)
                if verdict is None:  # Redis cannot be reached
                    if self._link.up:
                        continue  # one slow answer is not an outage: ask again (exchanges are idempotent)
                    if lease.ceiling is None:
                        lease.ceiling = outage_ceiling(lease, daily, fail_open=self._fail_open,
                                                       lease_max=self._lease_max)
                    return self._outage_debit(lease, amount, daily, per_second, now)
                if verdict is not Verdict.OK:
                    if lease.free > 0:  # what is left here cannot pay this call: let other replicas have it
                        await self._exchange(lease, 0, mode=GIVE_BACK, per_second=None, now=now)
                    return Debit(verdict, lease.remaining(daily))
                if lease.free >= amount:
                    lease.consumed += amount
                    return Debit(Verdict.OK, lease.remaining(daily))

    def _top_up(self, lease: KeyLease, amount: int, now: float) -> None:
        if lease.ceiling is not None or not self._link.up:
            return
        lease.low_water = 0  # one top-up per grant
        task = asyncio.get_running_loop().create_task(self._run_top_up(lease, amount, now))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_top_up(self, lease: KeyLease, amount: int, now: float) -> None:
        async with lease.lock:
            await self._exchange(lease, amount, mode=TOP_UP, per_second=None, now=now)

    def _outage_debit(self, lease: KeyLease, amount: int, daily: int, per_second: int | None, now: float) -> Debit:
        verdict = outage_verdict(lease, amount, daily, per_second, now)
        if verdict is Verdict.OK:
            lease.consumed += amount
            if per_second is not None:
                if lease.window_second != int(now):
                    lease.window_second, lease.window_used = int(now), 0
                lease.window_used += amount
            if lease.net > lease.allowance:
                lease.journaled = True
                self._journal.record(self.replica, lease)
            throttled.warning("outage", "credits: redis unavailable, debits decided in process and journaled")
        return Debit(verdict, lease.remaining(daily))

    async def refund(self, api_key: str, amount: int, *, now: float) -> None:
        lease = self._leases.get((int(now) // 86400, api_key))
        if lease is not None:  # the credits go back to this replica's lease, and with it to Redis
            lease.refunded += amount
            if lease.journaled:
                self._journal.record(self.replica, lease)

    async def used(self, api_key: str, *, now: float) -> int:
        lease = self._leases.get((int(now) // 86400, api_key))
        if lease is not None and (lease.known or lease.ceiling is not None):
            return lease.others + lease.net
        day = int(now) // 86400
        raw = await self._link.run("credits_read", lambda c: c.hget(ledger_key(api_key, day), "used"))
        if raw is None and not self._link.is_cluster:  # not yet taken over from an older release's name
            raw = await self._link.run("credits_read", lambda c: c.hget(untagged_ledger_key(api_key, day), "used"))
        return int(raw or 0)

    @property
    def settled(self) -> bool:
        """Every debit made without Redis has been written back to it."""
        return not any(lease.journaled or lease.ceiling is not None for lease in self._leases.values())

    # --- exchanges with Redis ----------------------------------------------------------------

    def _lease(self, api_key: str, now: float) -> KeyLease:
        day = int(now) // 86400
        lease = self._leases.get((day, api_key))
        if lease is None:
            lease = self._leases[(day, api_key)] = KeyLease(api_key, ledger_key(api_key, day))
        if day * 86400 > self._day_start:  # a new day: the hot path's leases are that day's
            self._day_start, self._day_end = day * 86400, (day + 1) * 86400
            self._today = {k: v for (d, k), v in self._leases.items() if d == day}
        elif day * 86400 == self._day_start:
            self._today[api_key] = lease
        return lease

    async def _exchange(
        self, lease: KeyLease, cost: int, *, mode: int, per_second: int | None, now: float,
    ) -> Verdict | None:
        """One run of the script; None when Redis cannot be reached. Callers hold `lease.lock`."""
        if mode == GIVE_BACK:
            lease.allowance = lease.net  # nothing more is spent from this lease meanwhile
            lease.returning = True
        args = [
            self.replica, next(self._seqs), lease.consumed, lease.refunded, cost, mode, lease.daily,
            self._lease_max, int(now), 3 * self._lease_seconds, per_second or 0, lease.allowance,
            lease.others + lease.allowance if lease.known else 0, DAY_TTL,
        ]
        keys = [lease.key, rate_key(lease.api_key, int(now))]
        if not self._link.is_cluster:  # no cluster held the untagged names: its keys need one slot
            keys.append(untagged_ledger_key(lease.api_key, int(now) // 86400))
        sent_consumed = lease.consumed
        try:
            reply = await self._link.run("credits_lease", lambda _c: self._script(keys=keys, args=args))
        except RedisUnavailable:
            return None
        code, allowance, used, active, restored = (int(v) for v in reply)
        if restored:
            log.warning("credits: a key's ledger entry was missing in Redis; restored from this replica's last "
                        "known usage")
        if allowance > lease.allowance and cost:
            lease.granted_at = self._mono()
            lease.low_water = (allowance - lease.net) // 4
        lease.allowance, lease.others, lease.active = allowance, used - allowance, active
        lease.known, lease.ceiling, lease.returning = True, None, False
        if lease.journaled and lease.consumed == sent_consumed:
            lease.journaled = False
            if not any(other.journaled for other in self._leases.values()):
                self._journal.clear()
        return _VERDICTS[code]

    async def sync(self, now: float) -> None:
        """One sweep: write journaled debits back, and give back leases that are old or idle."""
        mono = self._mono()
        today = int(now) // 86400
        for (day, _key), lease in list(self._leases.items()):
            if lease.lock.locked():
                continue
            stale = day != today
            if lease.consumed != lease.swept:  # spent since the last sweep: not idle
                lease.swept, lease.idle_since = lease.consumed, mono
            old = lease.free > 0 and (mono - lease.granted_at > self._lease_seconds
                                      or mono - lease.idle_since > self._lease_seconds / 2)
            if not (lease.journaled or lease.ceiling is not None or lease.returning or old or stale):
                continue
            if not self._link.up:
                return
            async with lease.lock:
                await self._exchange(lease, 0, mode=GIVE_BACK if old or stale or lease.returning else CREDIT,
                                     per_second=None,
                                     now=day * 86400 + 43200 if stale else now)
            if stale and not lease.journaled and not lease.returning:
                del self._leases[(day, _key)]

    async def run(self, clock: Callable[[], float], interval: float = 0.25) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sync(clock())
            except Exception:  # the sweeper must outlive any one fault
                log.exception("credits: lease sweep failed")

    async def close(self, now: float) -> None:
        """On shutdown: every lease goes back and every journaled debit is written, if Redis answers."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for lease in list(self._leases.values()):
            if lease.free > 0 or lease.journaled or lease.returning:
                async with lease.lock:
                    await self._exchange(lease, 0, mode=GIVE_BACK, per_second=None, now=now)
