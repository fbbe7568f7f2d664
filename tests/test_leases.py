"""Leased credits: the pure outage rules, and the lease script against a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from proxy.credits.journal import read_journals
from proxy.credits.key_lease import KeyLease
from proxy.credits.lease_exchange import ledger_key, untagged_ledger_key
from proxy.credits.leases import LeasedLedger, outage_ceiling, outage_shown, outage_verdict
from proxy.credits.ledger import Verdict
from proxy.metrics import Metrics
from proxy.redis_link import RedisLink
from tests.support import eventually

NOW = 1_800_000_000.0
Ledgers = Callable[..., LeasedLedger]


class TestOutageRules:
    def test_a_known_key_may_spend_its_lease_and_its_share_of_what_nobody_held(self) -> None:
        lease = KeyLease("k", "rcp:k", allowance=300, consumed=100, others=500, known=True, active=2)
        # 1000 - 500 held by others - 300 held here = 200 unheld; half of it is this replica's.
        assert outage_ceiling(lease, 1000, fail_open=True, lease_max=10_000) == 400

    def test_a_key_never_seen_is_served_up_to_one_largest_lease_when_failing_open(self) -> None:
        lease = KeyLease("k", "rcp:k")
        assert outage_ceiling(lease, 1000, fail_open=True, lease_max=300) == 300
        assert outage_ceiling(lease, 1000, fail_open=False, lease_max=300) == 0

    def test_a_key_never_seen_is_shared_by_a_hosts_workers_up_to_its_balance(self) -> None:
        # Each of two workers served an unseen key its whole balance (800) through a stall: 1,600.
        lease = KeyLease("k", "rcp:k")
        assert outage_ceiling(lease, 800, fail_open=True, lease_max=100_000, processes=2) == 400
        assert outage_ceiling(lease, 10**9, fail_open=True, lease_max=300, processes=2) == 150

    def test_a_hosts_workers_share_what_nobody_held_and_one_a_sibling_leased_gets_none_unseen(self) -> None:
        # One worker of two saw the key, alone active at its last reply; the other had not seen it. The
        # first took all that nobody held, the second half the balance: 1.5 times the balance a host
        # (3,840 served of 2,000 by two such hosts, an outside attack).
        lease = KeyLease("k", "rcp:k", allowance=300, consumed=100, others=0, known=True, active=1)
        assert outage_ceiling(lease, 1000, fail_open=True, lease_max=10_000, processes=2) == 300 + 700 // 2
        unseen = KeyLease("k", "rcp:k")
        assert outage_ceiling(unseen, 1000, fail_open=True, lease_max=10_000, processes=2, host_saw=True) == 0
        assert outage_ceiling(unseen, 1000, fail_open=True, lease_max=10_000, processes=2) == 500

    def test_beyond_the_ceiling_the_ledger_is_unavailable_and_beyond_the_balance_exhausted(self) -> None:
        lease = KeyLease("k", "rcp:k", allowance=0, consumed=0, others=900, known=True, ceiling=50)
        assert outage_verdict(lease, 40, 1000, None, NOW) is Verdict.OK
        assert outage_verdict(lease, 60, 1000, None, NOW) is Verdict.UNAVAILABLE
        assert outage_verdict(lease, 120, 1000, None, NOW) is Verdict.EXHAUSTED

    def test_the_balance_shown_counts_what_was_spent_and_the_outage_rule_what_is_leased(self) -> None:
        lease = KeyLease(
            "k", "rcp:k", allowance=300, consumed=100, refunded=20, others=500, others_spent=120, known=True
        )
        assert lease.remaining(1000) == 1000 - 120 - 80  # X-Credits-Remaining: spent, not leased
        assert lease.unheld(1000) == 1000 - 500 - 80  # what no replica may still spend

    def test_a_hit_spends_its_lease_directly_down_to_the_low_water_mark_and_no_further(self) -> None:
        lease = KeyLease(
            "k",
            "rcp:k",
            allowance=300,
            consumed=100,
            refunded=20,
            others_spent=50,
            low_water=40,
            daily=1000,
            day_start=NOW - 10,
            day_end=NOW + 10,
        )
        assert lease.spend(80, 1000, NOW) == 1000 - 50 - 180 + 20  # the balance shown, as remaining() says
        assert lease.spend(100, 1000, NOW) == 1000 - 50 - 280 + 20  # 320 held - 280 = 40: the mark itself
        assert lease.spend(1, 1000, NOW) is None and lease.consumed == 280  # past it: the ledger tops up
        assert lease.remaining(1000) == 1000 - 50 - 260

    def test_a_lease_spends_nothing_outside_its_own_utc_day(self) -> None:
        lease = KeyLease("k", "rcp:k", allowance=300, daily=1000, day_start=NOW, day_end=NOW + 86400)
        assert lease.spend(10, 1000, NOW - 0.5) is None and lease.spend(10, 1000, NOW + 86400) is None
        assert lease.consumed == 0 and lease.spend(10, 1000, NOW) == 990

    def test_a_lease_spends_nothing_under_a_balance_other_than_the_one_it_was_granted_for(self) -> None:
        lease = KeyLease("k", "rcp:k", allowance=300, daily=100_000, day_start=NOW, day_end=NOW + 86400)
        assert lease.spend(10, 400, NOW) is None and lease.consumed == 0  # a reload lowered it: the ledger decides
        assert KeyLease("", "").spend(0, 1000, NOW) is None  # a lease with no day (a tab's before the ledger's)

    def test_a_key_known_exhausted_elsewhere_is_refused_through_an_outage(self) -> None:
        lease = KeyLease("k", "rcp:k", ceiling=10_000)  # never seen here: failing open
        assert outage_verdict(lease, 80, 1000, None, NOW) is Verdict.OK
        assert outage_verdict(lease, 80, 1000, None, NOW, exhausted=True) is Verdict.EXHAUSTED

    def test_through_an_outage_the_balance_shown_is_the_last_view_less_spending_since_or_unknown(self) -> None:
        """docs/keys-and-credits.md: never more than before the outage, never more than a refusal implies."""
        seen = KeyLease("k", "rcp:k", allowance=100, consumed=30, others_spent=880, known=True)
        assert outage_shown(seen, 20, 1000, Verdict.OK, current=True) == 90  # 1000 - 880 - 30
        assert outage_shown(seen, 80, 1000, Verdict.EXHAUSTED, current=True) is None  # 90 would pay 80
        assert outage_shown(seen, 100, 1000, Verdict.EXHAUSTED, current=True) == 90
        assert outage_shown(seen, 20, 1000, Verdict.OK, current=False) is None  # older than the ledger's last word
        unseen = KeyLease("k", "rcp:k", consumed=80, ceiling=10_000)  # never answered for here: no view
        assert outage_shown(unseen, 80, 1000, Verdict.OK, current=True) is None
        assert outage_shown(unseen, 80, 1000, Verdict.EXHAUSTED, current=True) is None


@pytest.fixture
async def link(redis_url: str) -> AsyncIterator[RedisLink]:
    link = RedisLink(
        aioredis.Redis.from_url(redis_url), timeout=2.0, metrics=Metrics(CollectorRegistry()), report_up=False
    )
    yield link
    await link.close()


@pytest.fixture
async def ledger(link: RedisLink) -> AsyncIterator[Ledgers]:
    """Makes replicas' ledgers on one link; their background exchanges end before the link closes
    (a top-up still running when the test's loop closed left its connection to the next test)."""
    made: list[LeasedLedger] = []

    def make(lease_max: int = 100_000, **options: Any) -> LeasedLedger:
        made.append(LeasedLedger(link, lease_max=lease_max, lease_seconds=10.0, **options))
        return made[-1]

    yield make
    await background_done(*made)


async def debit(ledger: LeasedLedger, amount: int, daily: int) -> Verdict:
    return (await ledger.debit("k", amount, daily=daily, per_second=None, now=NOW)).verdict


async def background_done(*ledgers: LeasedLedger) -> None:
    """The ledgers' background exchanges (lease top-ups) finished."""
    await asyncio.gather(*(task for replica in ledgers for task in list(replica._tasks)))


class TestLeaseScript:
    @pytest.mark.parametrize(("later", "verdict"), [(1, Verdict.HELD), (100, Verdict.EXHAUSTED)])
    async def test_credit_an_active_replica_holds_is_asked_back_and_a_gone_ones_is_not(
        self, link: RedisLink, ledger: Ledgers, later: int, verdict: Verdict
    ) -> None:
        # A call the balance could pay but other replicas' leases hold is asked again (HELD) only
        # while a holder is active (it reported within 3 x CREDITS_LEASE_SECONDS); else it is the end.
        holder, spender = ledger(), ledger()

        async def at(replica: LeasedLedger, now: float) -> Verdict:
            return (await replica.debit("k", 80, daily=320, per_second=None, now=now)).verdict

        assert await at(holder, NOW) is Verdict.OK  # leased 160: one more call's credit
        assert [await at(spender, NOW + later) for _ in range(3)] == [Verdict.OK, Verdict.OK, verdict]

    async def test_every_want_of_held_credit_asks_the_holders_again_within_the_same_second(
        self, link: RedisLink, ledger: Ledgers
    ) -> None:
        # A holder heard a want as its second: a second replica refused in the second the holder already
        # heard of went unheard, and with four replicas calls were refused 402 "held by other replicas"
        # while the holders sat idle on the credit (an outside attack, 2 runs of 7).
        mono = [0.0]
        holder, first, second = ledger(monotonic=lambda: mono[0]), ledger(), ledger()

        async def at(replica: LeasedLedger, amount: int) -> Verdict:
            return (await replica.debit("k", amount, daily=2_000, per_second=None, now=NOW)).verdict

        async def report() -> None:  # the holder's sweeps a report interval later: it reports, then gives back
            for _ in range(2):
                mono[0] += 1.0
                await holder.sync(NOW)

        assert await at(holder, 100) is Verdict.OK
        await background_done(holder)
        assert await at(first, 1_900) is Verdict.HELD  # the holder's lease holds what it needs
        await report()
        assert await at(first, 1_200) is Verdict.OK
        assert await at(holder, 100) is Verdict.OK  # the holder leases again, the same second
        await background_done(holder, first)
        unleased = 2_000 - holder._today["k"].allowance - first._today["k"].allowance
        assert holder._today["k"].free > 0 and await at(second, unleased + 1) is Verdict.HELD
        await report()
        assert holder._today["k"].free == 0  # the second want was heard: the holder gave its lease back
        assert await at(second, unleased + 1) is Verdict.OK

    async def test_a_per_second_debit_reaching_redis_after_a_later_seconds_counts_in_that_second(
        self, link: RedisLink, ledger: Ledgers
    ) -> None:
        # Replicas' calls reach Redis out of order: one decided at second s after one at s + 1 is
        # counted in s + 1's window (rate_window.py), never judged against a full window.
        first, second = ledger(), ledger()

        async def at(replica: LeasedLedger, now: float, amount: int) -> Verdict:
            return (await replica.debit("k", amount, daily=80_000, per_second=100, now=now)).verdict

        assert await at(first, NOW + 1, 40) is Verdict.OK
        assert await at(second, NOW, 40) is Verdict.OK
        assert await at(second, NOW, 40) is Verdict.RATE_LIMITED  # 120 in second NOW + 1

    async def test_a_lease_covers_later_debits_without_a_round_trip(self, link: RedisLink, ledger: Ledgers) -> None:
        replica = ledger()
        assert await debit(replica, 80, 80_000) is Verdict.OK
        assert replica.try_debit("k", 80, daily=80_000, per_second=None, now=NOW) is not None

    async def test_the_hot_path_spends_only_what_the_lease_holds_and_shows_what_was_spent(
        self,
        link: RedisLink,
        ledger: Ledgers,
    ) -> None:
        replica = ledger(lease_max=400)
        assert await debit(replica, 80, 10**9) is Verdict.OK  # a lease of 480: this call and five more
        await background_done(replica)
        lease = replica._today["k"]
        held = lease.allowance - lease.net
        calls = held // 80
        spent = [replica.spend("k", 80, 10**9, NOW) for _ in range(calls + 1)]  # nothing awaited: no top-up lands
        # Exactly what the lease held, each call shown the balance less what was spent (never less
        # what is only leased); past it the ledger decides. A top-up was asked before it ran out.
        assert spent == [*(10**9 - 80 * (i + 2) for i in range(calls)), None]
        assert lease.consumed == lease.allowance and replica._tasks
        await background_done(replica)
        assert replica.spend("k", 80, 10**9, NOW) == 10**9 - 80 * (calls + 2)

    async def test_the_hot_path_leaves_other_days_and_unleased_keys_to_the_ledger(
        self,
        link: RedisLink,
        ledger: Ledgers,
    ) -> None:
        replica = ledger()
        assert replica.spend("k", 80, 80_000, NOW) is None  # no lease yet: `debit` asks Redis
        assert await debit(replica, 80, 80_000) is Verdict.OK
        assert replica.spend("k", 80, 80_000, NOW) == 80_000 - 160
        assert replica.spend("k", 80, 80_000, NOW + 86_400) is None  # the next UTC day opens its own lease
        assert replica.spend("other", 80, 80_000, NOW) is None

    async def test_a_lowered_balance_stops_a_key_though_a_grant_under_the_old_one_was_on_its_way(
        self,
        link: RedisLink,
        ledger: Ledgers,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        replica = ledger()
        run, gate = link.run, asyncio.Event()

        async def held(*args: Any, **kwargs: Any) -> Any:  # the first lease's round trip, held until released
            await gate.wait()
            return await run(*args, **kwargs)

        monkeypatch.setattr(link, "run", held)
        first = asyncio.create_task(debit(replica, 80, 100_000))  # leased under the old balance...

        async def asking() -> bool:
            return "k" in replica._today and replica._today["k"].lock.locked()

        await eventually(asking, 10, "the first lease's round trip")
        lowered = asyncio.create_task(debit(replica, 80, 240))  # ...a reload lowered it meanwhile
        await asyncio.sleep(0)
        monkeypatch.setattr(link, "run", run)
        gate.set()
        assert await first is Verdict.OK and await lowered is Verdict.OK
        assert await debit(replica, 80, 240) is Verdict.OK  # 3 x 80 = 240: the last credits, under the new balance
        assert replica.spend("k", 80, 240, NOW) is None and await debit(replica, 80, 240) is Verdict.EXHAUSTED

    async def test_leases_shrink_near_the_limit_so_the_last_credits_go_out_exactly(
        self,
        link: RedisLink,
        ledger: Ledgers,
    ) -> None:
        first, second = ledger(), ledger()
        served = 0
        for i in range(60):
            if await debit(first if i % 2 else second, 80, 80 * 25) is Verdict.OK:
                served += 1
        assert served == 25
        used = await link.client.hget(ledger_key("k", int(NOW) // 86400), "used")
        assert int(used) == 80 * 25

    async def test_a_lease_is_never_larger_than_the_largest_lease(self, link: RedisLink, ledger: Ledgers) -> None:
        replica = ledger(lease_max=400)
        await debit(replica, 80, 10**9)
        assert int(await link.client.hget(ledger_key("k", int(NOW) // 86400), "used")) == 480

    async def test_given_back_leases_leave_exactly_what_was_spent(self, link: RedisLink, ledger: Ledgers) -> None:
        replica = ledger()
        for _ in range(3):
            await debit(replica, 80, 80_000)
        await replica.close(NOW)
        assert int(await link.client.hget(ledger_key("k", int(NOW) // 86400), "used")) == 240

    async def test_a_lost_entry_is_restored_from_the_replicas_last_known_usage(
        self,
        link: RedisLink,
        ledger: Ledgers,
    ) -> None:
        replica = ledger()
        for _ in range(5):
            await debit(replica, 80, 800)
        before = await replica.used("k", now=NOW)
        await link.client.delete(ledger_key("k", int(NOW) // 86400))
        served = sum([await debit(replica, 80, 800) is Verdict.OK for _ in range(20)])
        assert before + served * 80 <= 800

    async def test_a_rebuilt_entry_holds_grants_until_its_owner_confirms_it(
        self,
        link: RedisLink,
        ledger: Ledgers,
    ) -> None:
        """After a lost entry, the first replica to ask rebuilds the other's from the last reply it saw,
        which may be short of what the other was granted since: no credit is granted (retry shortly)
        until the other confirms its entry, so no credit is spent twice and the balance goes out exactly."""
        first, second = ledger(), ledger()
        daily, served = 800, 0
        for replica in (first, second, first, first, first, first, first, second, second, second):
            served += await debit(replica, 80, daily) is Verdict.OK  # each has seen the other's lease
            await background_done(first, second)  # top-ups land in this order, not during the loss
        await link.client.delete(ledger_key("k", int(NOW) // 86400))
        verdicts = [await debit(first, 80, daily) for _ in range(8)]
        served += verdicts.count(Verdict.OK)
        assert Verdict.UNAVAILABLE in verdicts  # held: the other's rebuilt entry is not confirmed yet
        for _ in range(12):  # the other confirms with its own word; then the rest goes out, exactly
            served += await debit(second, 80, daily) is Verdict.OK
            served += await debit(first, 80, daily) is Verdict.OK
        assert served * 80 == daily
        assert int(await link.client.hget(ledger_key("k", int(NOW) // 86400), "used")) == daily

    async def test_usage_kept_under_the_untagged_name_of_an_older_release_still_counts(
        self,
        link: RedisLink,
        ledger: Ledgers,
    ) -> None:
        # An upgrade mid-day: the day's hash under the name used before hash tags is taken over.
        day = int(NOW) // 86400
        await link.client.hset(untagged_ledger_key("k", day), mapping={"used": 720, "a:old": 720, "t:old": 0})
        replica = ledger()
        served = sum([await debit(replica, 80, 800) is Verdict.OK for _ in range(5)])
        assert served == 1
        assert await link.client.exists(untagged_ledger_key("k", day)) == 0
        assert int(await link.client.hget(ledger_key("k", day), "used")) == 800

    async def test_refused_replicas_give_back_what_they_cannot_use(self, link: RedisLink, ledger: Ledgers) -> None:
        replica = ledger()
        assert await debit(replica, 300, 1000) is Verdict.OK  # leases 300 + whole calls of the rest
        assert await debit(replica, 900, 1000) is Verdict.EXHAUSTED
        key = ledger_key("k", int(NOW) // 86400)
        assert int(await link.client.hget(key, "used")) == 300


def test_journals_merge_by_max_so_a_line_read_twice_counts_once(tmp_path: Path) -> None:
    path = tmp_path / "r1.journal"
    path.write_text(
        '{"r":"r1","k":"rcp:x","c":160,"f":0}\n{"r":"r1","k":"rcp:x","c":240,"f":80}\n'
        '{"r":"r1","k":"rcp:x","c":240,"f":80}\n{"r":"r1","k":'
    )
    assert read_journals(str(tmp_path)) == {"rcp:x": {"r1": (240, 80)}}
