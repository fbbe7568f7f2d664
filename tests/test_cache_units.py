"""Pure parts of caching: decisions, keys, the memory tier, coalescing, and the head tracker."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.cache import policy as cp
from proxy.cache.planning import _doubted
from proxy.cache.tiers import Coalescer, MemoryTier, cache_key
from proxy.chain import heads
from proxy.chain.finality import Contested, FinalityWatch
from proxy.chain.head_polls import Behind, Head, Header, Resolved, TrackerError, note_orphans
from proxy.chain.heads import EvmHeadTracker
from proxy.metrics import Metrics
from proxy.rpc.jsonrpc import INVALID_REQUEST, JsonRpcError
from proxy.rpc.methods import CacheClass
from proxy.rpc.params import BlockRef
from proxy.upstream.standing import UpstreamStates
from proxy.values import Answer
from tests.fake_chain import FakeChain
from tests.support import FakeClock

TTLS = cp.Ttls(unfinalized=12, negative=2, largest_accounts=3600, token_balance=0.4)
HEAD = Head(
    latest=100,
    safe=68,
    finalized=36,
    latest_hash="0xaa",
    gas_limit=30_000_000,
    timestamp=0,
    hashes={n: f"0x{n:064x}" for n in range(37, 101)},
)


class TestDecide:
    def test_blocks_at_or_below_finalized_are_immutable(self) -> None:
        decision = cp.decide(CacheClass.BLOCK, [Resolved(36, None)], HEAD, TTLS)
        assert decision.mode is cp.Mode.IMMUTABLE and decision.ttl == math.inf

    def test_blocks_above_finalized_get_a_short_ttl_pinned_to_their_hash(self) -> None:
        decision = cp.decide(CacheClass.BLOCK, [Resolved(37, "0x25")], HEAD, TTLS)
        assert decision.mode is cp.Mode.TTL and decision.ttl == 12 and decision.pin_hashes

    def test_blocks_beyond_the_trackers_latest_are_never_cached(self) -> None:
        assert not cp.decide(CacheClass.BLOCK, [Resolved(101, None)], HEAD, TTLS).cacheable

    def test_pending_or_no_head_bypasses(self) -> None:
        assert not cp.decide(CacheClass.BLOCK, [None], HEAD, TTLS).cacheable
        assert not cp.decide(CacheClass.BLOCK, [Resolved(5, None)], None, TTLS).cacheable

    def test_a_log_range_reaching_above_finalized_gets_a_short_ttl(self) -> None:
        decision = cp.decide(CacheClass.LOGS, [Resolved(10, None), Resolved(50, "0x32")], HEAD, TTLS)
        assert decision.mode is cp.Mode.TTL
        final = cp.decide(CacheClass.LOGS, [Resolved(10, None), Resolved(36, None)], HEAD, TTLS)
        assert final.mode is cp.Mode.IMMUTABLE

    def test_hash_addressed_requests_are_content_addressed(self) -> None:
        assert cp.decide(CacheClass.BLOCK, [Resolved(None, "0xab")], HEAD, TTLS).mode is cp.Mode.IMMUTABLE
        assert cp.decide(CacheClass.CONTENT, [], None, TTLS).mode is cp.Mode.IMMUTABLE

    def test_solana_policies_use_their_ttls(self) -> None:
        assert cp.decide(CacheClass.LARGEST_ACCOUNTS, [], None, TTLS).ttl == 3600
        assert cp.decide(CacheClass.TOKEN_BALANCE, [], None, TTLS).ttl == 0.4


class TestStoreTtl:
    immutable = cp.Decision(cp.Mode.IMMUTABLE)
    short = cp.Decision(cp.Mode.TTL, 12, pin_hashes=True)

    def test_null_answers_get_at_most_the_negative_ttl(self) -> None:
        assert cp.store_ttl(self.immutable, CacheClass.CONTENT, "null", TTLS) == 2
        assert cp.store_ttl(cp.Decision(cp.Mode.TTL, 0.4), CacheClass.TOKEN_BALANCE, "null", TTLS) == 0.4

    def test_errors_are_never_stored(self) -> None:
        assert cp.store_ttl(self.immutable, CacheClass.BLOCK, "error", TTLS) is None

    def test_reverts_are_stored_only_at_final_blocks(self) -> None:
        assert cp.store_ttl(self.immutable, CacheClass.BLOCK, "revert", TTLS) == math.inf
        assert cp.store_ttl(self.short, CacheClass.BLOCK, "revert", TTLS) is None

    def test_answers_keep_their_decision(self) -> None:
        assert cp.store_ttl(self.short, CacheClass.BLOCK, "ok", TTLS) == 12
        assert cp.store_ttl(cp.BYPASS, CacheClass.BLOCK, "ok", TTLS) is None

    def test_answer_kind(self) -> None:
        assert cp.answer_kind(None, None, False, caches_reverts=True) == "null"
        # an empty log list is an answer, not a not-found
        assert cp.answer_kind([], None, False, caches_reverts=False) == "ok"
        assert cp.answer_kind(None, 3, True, caches_reverts=True) == "revert"
        assert cp.answer_kind(None, -32000, True, caches_reverts=True) == "error"

    def test_code_3_is_a_cacheable_revert_only_for_eth_call(self) -> None:
        assert cp.answer_kind(None, 3, True, caches_reverts=False) == "error"


class TestCacheKey:
    def test_object_key_order_does_not_matter(self) -> None:
        assert cache_key("evm", "m", [{"a": 1, "b": 2}]) == cache_key("evm", "m", [{"b": 2, "a": 1}])

    def test_network_method_and_params_all_separate_keys(self) -> None:
        keys = {
            cache_key("evm", "m", [1]),
            cache_key("evm2", "m", [1]),
            cache_key("evm", "n", [1]),
            cache_key("evm", "m", [2]),
            cache_key("evm", "m", ["1"]),
        }
        assert len(keys) == 5

    def test_long_keys_become_a_sha256_digest(self) -> None:
        key = cache_key("evm", "eth_getLogs", [{"address": ["0x" + "11" * 20] * 20}])
        assert key.startswith("v1#") and len(key) == 3 + 64


class TestMemoryTier:
    def test_entries_expire_on_the_injected_clock(self) -> None:
        clock = FakeClock()
        tier = MemoryTier(10_000, clock)
        tier.set("k", (b"v", False), 5)
        tier.set("forever", (b"v", False), math.inf)
        clock.advance(4.9)
        assert tier.get("k") is not None
        clock.advance(0.2)
        assert tier.get("k") is None and tier.get("forever") is not None

    def test_the_tier_is_bounded_in_bytes_least_recently_used_first(self) -> None:
        three = MemoryTier(10_000, FakeClock())
        for key in "abc":
            three.set(key, (b"x" * 100, False), math.inf)
        tier = MemoryTier(three.bytes_used, FakeClock())  # room for three such entries, not four
        for key in "abc":
            tier.set(key, (b"x" * 100, False), math.inf)
        tier.get("a")
        tier.set("d", (b"x" * 100, False), math.inf)
        assert tier.get("b") is None and tier.get("a") is not None and tier.get("d") is not None
        assert len(tier) == 3 and tier.bytes_used <= three.bytes_used


class TestCoalescer:
    async def test_identical_concurrent_calls_run_once(self) -> None:
        coalescer: Coalescer[int] = Coalescer()
        runs = 0
        gate = asyncio.Event()

        async def call() -> int:
            nonlocal runs
            runs += 1
            await gate.wait()
            return 42

        waiters = [asyncio.create_task(coalescer.run("k", call)) for _ in range(10)]
        await asyncio.sleep(0)
        gate.set()
        results = await asyncio.gather(*waiters)
        assert runs == 1 and [r for r, _ in results] == [42] * 10
        assert sum(joined for _, joined in results) == 9 and coalescer.inflight == 0

    async def test_a_caller_that_leaves_does_not_fail_the_call_for_others(self) -> None:
        """The first caller is cancelled mid-call: the callers waiting on it still get the answer,
        from one run again by the first of them (the others join it), never a CancelledError."""
        coalescer: Coalescer[int] = Coalescer()
        gate = asyncio.Event()
        runs = 0

        async def call() -> int:
            nonlocal runs
            runs += 1
            await gate.wait()
            return 7

        first = asyncio.create_task(coalescer.run("k", call))
        others = [asyncio.create_task(coalescer.run("k", call)) for _ in range(3)]
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        async with asyncio.timeout(5):
            while runs < 2:  # a waiting caller runs it again
                await asyncio.sleep(0)
        gate.set()
        results = await asyncio.gather(*others)
        assert [value for value, _ in results] == [7, 7, 7]
        assert runs == 2 and sum(joined for _, joined in results) == 2 and coalescer.inflight == 0

    async def test_a_joiner_that_leaves_cancels_nothing(self) -> None:
        coalescer: Coalescer[int] = Coalescer()
        gate = asyncio.Event()

        async def call() -> int:
            await gate.wait()
            return 7

        first = asyncio.create_task(coalescer.run("k", call))
        joiner = asyncio.create_task(coalescer.run("k", call))
        await asyncio.sleep(0)
        joiner.cancel()
        gate.set()
        assert (await first) == (7, False)
        assert joiner.cancelled()

    async def test_a_failure_reaches_every_caller_and_is_not_kept(self) -> None:
        coalescer: Coalescer[int] = Coalescer()
        gate = asyncio.Event()

        async def call() -> int:
            await gate.wait()
            raise ValueError("node down")

        callers = [asyncio.create_task(coalescer.run("k", call)) for _ in range(3)]
        await asyncio.sleep(0)
        gate.set()
        results = await asyncio.gather(*callers, return_exceptions=True)
        assert all(isinstance(r, ValueError) for r in results) and coalescer.inflight == 0


def shown(number: int, block_hash: str, upstream: int = 0) -> Behind:
    """What a poll answered below the head raises: the block its node `upstream` gave as latest."""
    return Behind.at(upstream, Header(number, block_hash, "", 0, 0), 105)


class Alternating(FakeChain):
    """A load balancer over two nodes of one chain, the second `behind` blocks behind: each batch
    goes to the other node in turn (a batch is never split)."""

    def __init__(self, latest: int, behind: int) -> None:
        super().__init__(latest)
        self.lagging = FakeChain(latest - behind)
        self.turns = 0

    async def batch(self, calls: Sequence[tuple[str, Any]]) -> list[Answer]:
        self.turns += 1
        node = self.lagging if self.turns % 2 == 0 else super()
        return [node.answer(m, p) for m, p in calls]


class AlternatingSingles(Alternating):
    """The same balancer refusing batches: the tracker asks call by call, each call to the next node."""

    async def batch(self, calls: Sequence[tuple[str, Any]]) -> list[Answer]:
        raise JsonRpcError(INVALID_REQUEST, "batches are not accepted")

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer:
        self.turns += 1
        return (self.lagging if self.turns % 2 == 0 else super()).answer(method, params)


class TestHeadTracker:
    def tracker(self, chain: FakeChain, depth: int = 64) -> tuple[EvmHeadTracker, Metrics]:
        metrics = Metrics(CollectorRegistry())
        return EvmHeadTracker("evm", chain, interval=1, finality_depth=depth, metrics=metrics), metrics

    async def test_tracks_latest_safe_finalized_and_gas_limit(self) -> None:
        tracker, metrics = self.tracker(FakeChain(100))
        head = await tracker.poll()
        assert (head.latest, head.safe, head.finalized, head.gas_limit) == (100, 68, 36, 30_000_000)
        assert set(head.hashes) == set(range(37, 101))
        assert metrics.registry.get_sample_value("rpc_proxy_head_block", {"network": "evm", "tag": "finalized"}) == 36

    def test_a_poll_below_the_head_that_shows_a_window_block_with_another_hash_makes_the_head_stale(self) -> None:
        # Rule (README: a replaced block is never served once a poll has seen it): a node behind on the
        # head's own chain leaves the head as it is; one showing another hash at a window height does not.
        watch = FinalityWatch("evm", None, Metrics(CollectorRegistry()))
        head = Head(105, 100, 90, "0xe", 1, 0, {103: "0xc", 104: "0xd", 105: "0xe"}, {})
        assert watch.doubted(head, head, shown(104, "0xd")) is head  # lagging on the same chain
        assert watch.doubted(head, head, shown(80, "0xf")) is head  # below the window: finality's to judge
        assert watch.doubted(head, head, Behind("syncing")) is head  # no block shown (a node still syncing)
        doubted = watch.doubted(head, head, shown(104, "0xother"))
        assert doubted is not None and doubted.stale and doubted.hashes == head.hashes and doubted.doubted == 104
        # A call naming any hash of the window is not cached (asked as is): the fork may lie below 104.
        doubted = replace(doubted, numbers={"0xc": 103, "0xd": 104, "0xe": 105})
        assert _doubted(["0xd"], doubted) and _doubted(["0xzz", "0xe"], doubted) and _doubted(["0xc"], doubted)
        assert not _doubted(["0xzz"], doubted) and not _doubted([], doubted)
        assert watch.doubted(doubted, doubted, shown(104, "0xother")) is doubted  # stale already
        newer = Head(106, 100, 90, "0xg", 1, 0, {})
        assert watch.doubted(head, newer, shown(104, "0xother")) is newer  # another poll moved the head since

    def test_the_hashes_of_a_chain_that_comes_back_are_no_longer_orphans(self) -> None:
        # Rule (docs/caching.md, a reorged-out hash): a hash is answered as the canonical node answers
        # it once its block was replaced, until a reorg brings its block back. Before, two forks each
        # the longest in turn left the returning chain's hashes orphans: reads naming them were
        # answered by a node without them (null, another fork's state) (an outside attack).
        orphans: dict[str, int] = {}
        note_orphans(orphans, [101, 102], {101: "0xa1", 102: "0xa2"}, {101: "0xb1", 102: "0xb2", 103: "0xb3"})
        assert orphans == {"0xa1": 101, "0xa2": 102}
        note_orphans(orphans, [101, 102, 103], {101: "0xb1", 102: "0xb2", 103: "0xb3"}, {101: "0xa1", 102: "0xa2"})
        assert orphans == {"0xb1": 101, "0xb2": 102, "0xb3": 103}

    def test_a_new_finalized_hash_adopted_since_is_no_contradiction_when_shown_again(self) -> None:
        # Rule (docs/caching.md: an upstream that showed a new hash of a finalized block, then the known
        # one again, contradicts itself). A restarted devnet's new genesis, shown by one poll then adopted
        # by the identity check, was shown again by the next poll and read as the upstream going back: it
        # left head tracking for 300 s (an outside attack, anvil_reset).
        states = UpstreamStates(1)
        states.judged(0, True)
        metrics = Metrics(CollectorRegistry())
        watch = FinalityWatch("evm", states, metrics)
        old, new, latest = Header(0, "0xold", "", 0, 0), Header(0, "0xnew", "", 0, 0), Header(5, "0x5", "", 0, 0)
        with pytest.raises(Contested):
            watch.violates(old, new, latest, 0)
        assert not watch.violates(new, new, latest, 0)  # the new chain adopted meanwhile: its own hash
        assert not states.flipped_until[0]  # still followed
        contradictions = {"network": "evm", "upstream": "0"}
        assert metrics.registry.get_sample_value("rpc_proxy_finality_contradictions_total", contradictions) in (None, 0)
        with pytest.raises(Contested):  # the known hash shown again after another is still a contradiction
            watch.violates(new, Header(0, "0xother", "", 0, 0), latest, 0)
        assert not watch.violates(new, new, latest, 0)
        assert states.flipped_until[0] > 0
        assert metrics.registry.get_sample_value("rpc_proxy_finality_contradictions_total", contradictions) == 1

    def test_a_node_behind_another_upstream_on_another_fork_leaves_the_head_fresh(self) -> None:
        # Rule (docs/caching.md, a backup on another fork): another hash shown by a node that another
        # upstream is known to be ahead of is that node's fork, not the chain gone shorter. Before, each
        # of its polls made the head stale, and reads went unpinned to whichever upstream was picked:
        # the backup's blocks, balances and receipts were served for the network's (an outside attack).
        states = UpstreamStates(2)
        for index in (0, 1):
            states.judged(index, True)
        states.observe_head(0, 105)
        states.observe_head(1, 104)
        watch = FinalityWatch("evm", states, Metrics(CollectorRegistry()))
        head = Head(105, 100, 90, "0xe", 1, 0, {103: "0xc", 104: "0xd", 105: "0xe"}, {})
        assert watch.doubted(head, head, shown(104, "0xother", upstream=1)) is head
        states.observe_head(0, 103)  # the network's furthest node went back too: the chain may be shorter
        doubted = watch.doubted(head, head, shown(104, "0xother", upstream=1))
        assert doubted is not None and doubted.stale

    async def test_a_block_shown_far_past_the_head_or_unreached_for_long_holds_latest_back_no_more(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Rule (docs/caching.md, read-your-writes, against a lying node): a block shown more than
        # SHOWN_AHEAD_MAX past the head is no floor (a poll, once an interval at most); one the head has
        # not reached in SHOWN_HOLD seconds, however many higher ones follow, no longer makes `latest` wait.
        tracker, _ = self.tracker(FakeChain(100))
        await tracker.poll()
        now = [heads.time.monotonic() + 1.0]
        monkeypatch.setattr(heads.time, "monotonic", lambda: now[0])
        tracker.hint(105)
        assert tracker.shown == 105 and tracker.behind()
        now[0] += heads.SHOWN_HOLD / 2
        tracker.hint(110)  # a higher number while the first is unreached: the hold runs on from the first
        assert tracker.shown == 110 and tracker.behind()
        # Past SHOWN_HOLD from the first (two half steps in floats can fall a hair short of it).
        now[0] += heads.SHOWN_HOLD / 2 + 0.001
        assert not tracker.behind()
        tracker.hint(100 + heads.SHOWN_AHEAD_MAX + 1)  # no floor: a poll now, which `latest` waits for
        assert tracker.shown == 110 and tracker.behind()
        asked = tracker._wrote_at
        now[0] += 0.5  # within one poll interval: no other poll for another far number
        tracker.hint(100 + heads.SHOWN_AHEAD_MAX + 2)
        assert tracker._wrote_at == asked

    async def test_without_a_finalized_tag_a_depth_below_latest_is_final(self) -> None:
        tracker, _ = self.tracker(FakeChain(100, finalized_tag=False), depth=10)
        head = await tracker.poll()
        assert head.finalized == 90 and head.safe == 95

    async def test_tags_resolve_to_numbers_and_unfinalized_numbers_carry_their_hash(self) -> None:
        chain = FakeChain(100)
        tracker, _ = self.tracker(chain)
        await tracker.poll()
        assert tracker.resolve(BlockRef(tag="latest")) == Resolved(100, chain.block_hash(100))
        assert tracker.resolve(BlockRef(tag="finalized")) == Resolved(36, None)
        assert tracker.resolve(BlockRef(tag="earliest")) == Resolved(0, None)
        assert tracker.resolve(BlockRef(tag="pending")) is None

    async def test_a_reorg_is_a_known_height_whose_hash_changed(self) -> None:
        chain = FakeChain(100)
        tracker, metrics = self.tracker(chain)
        seen: list[int] = []
        tracker.on_reorg.append(seen.append)
        await tracker.poll()
        old = chain.block_hash(98)
        chain.reorg(3)
        head = await tracker.poll()
        assert seen == [98] and head.hashes[98] == chain.block_hash(98) != old
        assert metrics.registry.get_sample_value("rpc_proxy_reorgs_total", {"network": "evm"}) == 1

    async def test_the_window_walk_is_asked_again_until_a_node_shows_the_polls_latest_block(self) -> None:
        """Rule: the window's blocks are asked beside the poll's latest block, and asked again when the
        node that answers does not show it (a balancer's member behind answers null for blocks it
        lacks): the head is the member ahead's, its window whole (before, every walk failed)."""
        chain = Alternating(100, behind=10)
        tracker, metrics = self.tracker(chain)
        head = await tracker.poll()
        assert head.latest == 100 and set(head.hashes) == set(range(37, 101))
        assert all(head.hashes[n] == chain.block_hash(n) for n in head.hashes)
        assert metrics.registry.get_sample_value("rpc_proxy_reorgs_total", {"network": "evm"}) in (None, 0)

    async def test_a_window_block_a_member_lacks_is_asked_again_alone_when_batches_are_refused(self) -> None:
        """Rule: a node that takes no batches is asked call by call, so the window's blocks may reach a
        balancer's member that lacks them (null): such a block is asked again alone until a node has
        it, and the head is the member ahead's (before, every walk failed and the head never came)."""
        chain = AlternatingSingles(100, behind=10)
        tracker, _ = self.tracker(chain)
        for _ in range(6):  # a poll whose `latest` reaches the member behind fails (Behind): the next
            with contextlib.suppress(TrackerError):
                await tracker.poll()
        head = tracker.head
        assert head is not None and head.latest == 100 and set(head.hashes) == set(range(37, 101))
        assert all(head.hashes[n] == chain.block_hash(n) for n in head.hashes)

    async def test_advancing_without_a_reorg_reports_none_and_reuses_known_hashes(self) -> None:
        chain = FakeChain(100)
        tracker, _ = self.tracker(chain)
        seen: list[int] = []
        tracker.on_reorg.append(seen.append)
        await tracker.poll()
        chain.mine(70)
        head = await tracker.poll()
        assert seen == [] and head.latest == 170 and set(head.hashes) == set(range(107, 171))

    async def test_a_poll_asks_only_the_blocks_new_since_the_last_head(self) -> None:
        """Rule (a node's calls are the operator's cost): three blocks mined between polls are three
        blocks asked by number beside the poll's own, where each poll asked a whole 32-block chunk
        (an outside attack counted 13 block calls per write on an automining devnet). A reorg under
        the new blocks is still walked down to where the chains meet."""
        chain = FakeChain(100)
        asked: list[Any] = []
        answer = chain.answer

        def counted(method: str, params: Any) -> Answer:
            asked.append(params[0])
            return answer(method, params)

        chain.answer = counted  # type: ignore[method-assign]
        tracker, _ = self.tracker(chain)
        await tracker.poll()
        chain.mine(3)
        asked.clear()
        head = await tracker.poll()
        assert head.latest == 103 and set(head.hashes) == set(range(40, 104))
        walked = sorted(
            int(tag, 16) for tag in asked if tag.startswith("0x") and int(tag, 16) > 36
        )  # 36: final's check
        assert walked == [101, 102, 103], asked  # 103: the poll's latest, asked beside them (the same node's)
        old = chain.block_hash(100)
        chain.reorg(5)
        chain.mine(2)
        seen: list[int] = []
        tracker.on_reorg.append(seen.append)
        head = await tracker.poll()
        assert seen == [99] and head.hashes[100] == chain.block_hash(100) != old


class TestMemo:
    def test_a_full_memo_starts_over_so_it_never_grows_past_its_size(self) -> None:
        from proxy.service import Memo

        memo: Memo[int, int] = Memo(3)
        for key in range(3):
            memo[key] = key
        memo[2] = 20  # replacing a key does not start over
        assert len(memo) == 3 and memo[2] == 20
        memo[3] = 3
        assert dict(memo) == {3: 3}
