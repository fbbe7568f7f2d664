"""A Solana network's cache keys name its cluster (the genesis hash): two clusters behind one Redis
share nothing, and nothing is cached before the cluster is known."""

from __future__ import annotations

from typing import Any

from proxy.chain.slots import SolanaSlotTracker
from proxy.http.app_keys import SERVICE
from tests.fake_solana import LARGEST, FakeSolana, b58
from tests.support import Proxy, ProxyFactory, eventually, settings_for, start_proxy

OTHER_GENESIS = b58(bytes(range(100, 132)))


async def call(proxy: Proxy, method: str, params: list[Any]) -> tuple[Any, str]:
    _, body, headers = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    return body["result"], headers["X-Cache"]


async def test_a_proxy_on_another_cluster_never_serves_the_first_clusters_entries(
    redis_url: str, solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule: a Solana cache key carries the cluster's genesis hash, so clusters sharing a Redis share no entry."""
    other = await FakeSolana().start()
    try:
        other.genesis, other.largest = OTHER_GENESIS, LARGEST[5:]
        # Inline, not make_proxy: closed (its writes done) before the proxy on the other cluster starts.
        first = await start_proxy(settings_for(SOLANA_UPSTREAM=solana.url, REDIS_URL=redis_url))
        try:
            for expected in ("MISS", "HIT"):
                result, cache = await call(first, "getLargestAccounts", [])
                assert cache == expected and result["value"] == LARGEST
        finally:
            await first.close()
        second = await make_proxy(SOLANA_UPSTREAM=other.url, REDIS_URL=redis_url)
        result, cache = await call(second, "getLargestAccounts", [])
        assert cache == "MISS" and result["value"] == LARGEST[5:]
        assert await call(second, "getGenesisHash", []) == (OTHER_GENESIS, "MISS")
    finally:
        await other.close()


async def test_nothing_is_cached_before_the_cluster_is_known(
    redis_url: str, solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule: until the genesis hash is known no key can name the cluster: its answers are neither read nor kept."""
    solana.genesis = None
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, REDIS_URL=redis_url)
    tracker = proxy.app[SERVICE].networks["solana"].tracker
    assert isinstance(tracker, SolanaSlotTracker)
    for _ in range(2):
        assert (await call(proxy, "getLargestAccounts", []))[1] == "BYPASS"
    assert solana.calls["getLargestAccounts"] == 2
    solana.genesis = OTHER_GENESIS

    async def known() -> bool:
        return tracker.space is not None

    await eventually(known, 10, "the cluster's genesis hash")
    assert [(await call(proxy, "getLargestAccounts", []))[1] for _ in range(2)] == ["MISS", "HIT"]
