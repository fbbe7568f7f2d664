"""The memory tier counts what its entries really take (tracemalloc is the judge), on an injected clock."""

from __future__ import annotations

import gc
import math
import tracemalloc
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from proxy.cache.tiers import MemoryTier, TieredCache, allocated, cache_key, entry_cost
from proxy.metrics import Metrics
from proxy.rpc.jsonrpc import dumps
from tests.support import FakeClock

ADDRESS = "0x" + "ab" * 20


def storage_key(i: int) -> str:
    return cache_key("evm", "eth_getStorageAt", [ADDRESS, "0x" + format(i, "064x"), {"n": 123}])


def traced_growth(fill: Callable[[], None]) -> int:
    """Bytes still allocated after `fill` ran (what it left behind), as tracemalloc counts them."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fill()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


class TestAllocatorSizes:
    def test_small_objects_are_rounded_to_pymalloc_steps_of_16(self) -> None:
        assert [allocated(n) for n in (1, 16, 17, 512)] == [16, 16, 32, 512]

    def test_large_objects_carry_mallocs_header(self) -> None:
        assert allocated(513) == 528 and allocated(100_000) == 100_016


class TestTheCountIsTrue:
    def test_small_answers_are_counted_at_what_they_take(self) -> None:
        tier = MemoryTier(2**30, FakeClock())

        def fill() -> None:
            for i in range(20_000):  # payloads straight from orjson, as the upstream answers them
                tier.set(storage_key(i), (dumps("0x" + format(i, "064x")), False), 12.0 if i % 4 else math.inf)

        held = traced_growth(fill)
        assert held <= tier.bytes_used <= 1.15 * held
        assert len(tier) == 20_000

    def test_large_answers_are_held_at_their_own_length_not_orjsons_buffer(self) -> None:
        tier = MemoryTier(2**30, FakeClock())

        def fill() -> None:
            for i in range(40):  # orjson puts each of these in a buffer of about 1 MB
                tier.set(storage_key(i), (dumps(format(i, "064x") * 1_600), False), math.inf)

        held = traced_growth(fill)
        assert held <= tier.bytes_used <= 1.05 * held
        assert tier.bytes_used < 40 * 110_000

    def test_the_count_stays_true_through_evictions_replacements_and_expiry(self) -> None:
        clock = FakeClock()
        tier = MemoryTier(256 * 1024, clock)

        def churn() -> None:
            for i in range(5_000):
                ttl = 5.0 if i % 3 else math.inf
                tier.set(storage_key(i % 3_000), (dumps("0x" + format(i, "064x")), i % 7 == 0), ttl)
                clock.advance(0.01)
                tier.get(storage_key(i // 2))

        held = traced_growth(churn)
        assert held <= tier.bytes_used <= 256 * 1024


class TestTheBound:
    def test_bytes_used_never_passes_the_bound(self) -> None:
        tier = MemoryTier(64 * 1024, FakeClock())
        for i in range(2_000):
            tier.set(storage_key(i), (dumps("0x" + "11" * (i % 300)), False), math.inf)
            assert tier.bytes_used <= 64 * 1024
        assert 0 < len(tier) < 2_000

    def test_an_answer_larger_than_the_bound_is_not_kept(self) -> None:
        tier = MemoryTier(10_000, FakeClock())
        tier.set("small", (b"1", False), math.inf)
        used = tier.bytes_used
        tier.set("big", (b"x" * 10_000, False), math.inf)
        assert tier.get("big") is None and tier.get("small") is not None and tier.bytes_used == used

    def test_a_bound_below_the_empty_tables_keeps_nothing(self) -> None:
        tier = MemoryTier(1, FakeClock())
        tier.set("k", (b"1", False), math.inf)
        assert len(tier) == 0 and tier.get("k") is None

    def test_replacing_an_entry_counts_it_once(self) -> None:
        tier = MemoryTier(10_000, FakeClock())
        tier.set("k", (b"1" * 100, False), 5.0)
        once = tier.bytes_used
        tier.set("k", (b"1" * 100, False), 5.0)
        assert tier.bytes_used == once and len(tier) == 1

    def test_an_expired_entry_leaves_the_count_when_read(self) -> None:
        clock = FakeClock()
        tier = MemoryTier(10_000, clock)
        tier.set("k", (b"1" * 100, True), 5.0)
        with_entry = tier.bytes_used
        clock.advance(5.0)
        assert tier.get("k") is None and len(tier) == 0
        assert with_entry - tier.bytes_used >= entry_cost("k", b"1" * 100, expiring=True)

    def test_a_hit_returns_the_stored_pair(self) -> None:
        tier = MemoryTier(10_000, FakeClock())
        tier.set("k", (dumps({"code": 3}), True), math.inf)
        assert tier.get("k") == (b'{"code":3}', True)


class TestGauges:
    async def test_memory_bytes_and_entries_are_read_from_the_tier_when_scraped(self) -> None:
        registry = CollectorRegistry()
        tier = MemoryTier(32 * 1024, FakeClock())
        cache = TieredCache(tier, None, Metrics(registry))
        for i in range(500):  # far more than fit: most are evicted
            await cache.set(storage_key(i), (dumps("0x" + format(i, "064x")), False), math.inf)
        assert registry.get_sample_value("rpc_proxy_cache_entries") == len(tier) < 500
        assert registry.get_sample_value("rpc_proxy_cache_memory_bytes") == tier.bytes_used <= 32 * 1024
        tier.set("k", (b"1", False), math.inf)  # a fill from Redis, not through cache.set
        assert registry.get_sample_value("rpc_proxy_cache_entries") == len(tier)
