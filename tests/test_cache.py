"""The read-through cache through HTTP, with real Anvil, real Redis and the fake Solana node."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis

from proxy.http.app_keys import SERVICE
from proxy.values import Answer
from tests.fake_solana import SYSTEM_ACCOUNT, TOKEN_ACCOUNT, FakeSolana
from tests.support import (
    DEV_ACCOUNT,
    Anvil,
    CountingUpstream,
    FakeClock,
    Proxy,
    ProxyFactory,
    RedisServer,
    eventually,
    mapping_slot,
    selector,
    settings_for,
    word,
)

FINALITY = 64  # anvil: finalized = latest - 64


async def finalized_store(anvil: Anvil, proxy: Proxy) -> tuple[str, int]:
    """A Store contract deployed in a block that is already final, and that block's number."""
    store = anvil.deploy_store()
    block = anvil.block_number()
    await proxy.head_at(anvil.mine(FINALITY + 2))
    return store, block


def storage(store: str, position: str, block: str, rid: Any = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": "eth_getStorageAt", "params": [store, position, block]}


async def test_finalized_storage_is_served_from_cache(anvil: Anvil, evm_proxy: Proxy) -> None:
    store, block = await finalized_store(anvil, evm_proxy)
    _, first, h1 = await evm_proxy.post(storage(store, "0x0", hex(block)))
    _, second, h2 = await evm_proxy.post(storage(store, "0x0", hex(block), rid="again"))
    assert (h1["X-Cache"], h2["X-Cache"]) == ("MISS", "HIT")
    assert first["result"] == second["result"] == "0x" + word(7) and second["id"] == "again"
    assert evm_proxy.upstreams["evm"].calls["eth_getStorageAt"] == 1


async def test_finalized_receipts_logs_and_calls_are_served_from_cache(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    receipt = anvil.send(store, selector("emitMany(uint256)") + word(4))
    block = receipt["blockNumber"]
    await evm_proxy.head_at(anvil.mine(FINALITY + 2))
    requests = [
        ("eth_getBlockReceipts", [block]),
        ("eth_getLogs", [{"address": store, "fromBlock": "0x0", "toBlock": block}]),
        ("eth_call", [{"from": DEV_ACCOUNT, "to": store, "data": selector("x()")}, block]),
        ("eth_call", [{"from": DEV_ACCOUNT, "to": store, "data": selector("x()")}, "finalized"]),
    ]
    for method, params in requests:
        _, first, h1 = await evm_proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
        _, second, h2 = await evm_proxy.post({"jsonrpc": "2.0", "id": 2, "method": method, "params": params})
        assert (h1["X-Cache"], h2["X-Cache"]) == ("MISS", "HIT"), method
        assert first["result"] == second["result"]
    calls = evm_proxy.upstreams["evm"].calls
    # One upstream call per distinct request: the two eth_calls name different blocks.
    assert (calls["eth_getBlockReceipts"], calls["eth_getLogs"], calls["eth_call"]) == (1, 1, 2)


async def test_equivalent_requests_share_an_entry_and_different_ones_do_not(anvil: Anvil, evm_proxy: Proxy) -> None:
    store, block = await finalized_store(anvil, evm_proxy)
    checksum = "0x" + "".join(c.upper() if i % 2 else c for i, c in enumerate(store[2:]))
    await evm_proxy.post(storage(store, "0x0", hex(block)))
    _, reply, headers = await evm_proxy.post(storage(checksum, "0x00", "0x" + format(block, "04x")))
    assert headers["X-Cache"] == "HIT" and reply["result"] == "0x" + word(7)
    _, reply, headers = await evm_proxy.post(storage(store, "0x" + "0" * 64, hex(block)))
    assert headers["X-Cache"] == "HIT"
    _, reply, headers = await evm_proxy.post(storage(store, mapping_slot(DEV_ACCOUNT, 1), hex(block)))
    assert headers["X-Cache"] == "MISS" and reply["result"] == "0x" + word(42)
    _, _, headers = await evm_proxy.post(storage(store, "0x0", hex(block - 1)))
    assert headers["X-Cache"] == "MISS"


async def test_the_request_sent_upstream_carries_the_resolved_number(anvil: Anvil, evm_proxy: Proxy) -> None:
    store, _ = await finalized_store(anvil, evm_proxy)
    await evm_proxy.post(storage(store, "0x0", "finalized"))
    method, params = evm_proxy.upstreams["evm"].params[-1]
    assert method == "eth_getStorageAt" and params[2].startswith("0x") and params[2] != "finalized"


async def test_latest_answers_change_once_a_block_is_mined(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    await evm_proxy.head_at(anvil.block_number())
    assert (await evm_proxy.result("eth_getStorageAt", [store, "0x0", "latest"])) == "0x" + word(7)
    _, _, headers = await evm_proxy.post(storage(store, "0x0", "latest"))
    assert headers["X-Cache"] == "HIT"
    receipt = anvil.send(store, selector("setX(uint256)") + word(8))
    await evm_proxy.head_at(int(receipt["blockNumber"], 16))
    assert (await evm_proxy.result("eth_getStorageAt", [store, "0x0", "latest"])) == "0x" + word(8)


async def test_an_unfinalized_entry_is_not_served_after_a_reorg_replaces_its_block(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    anvil.mine(5)
    store = anvil.deploy_store()
    deploy_block = anvil.block_number()
    await evm_proxy.head_at(deploy_block)
    for block in ("latest", hex(deploy_block)):
        assert (await evm_proxy.result("eth_getStorageAt", [store, "0x0", block])) == "0x" + word(7)
        assert (await evm_proxy.post(storage(store, "0x0", block)))[2]["X-Cache"] == "HIT"

    anvil.rpc("anvil_reorg", 1, [])  # the deploy block is replaced by an empty one at the same height

    async def reorg_seen() -> bool:
        return evm_proxy.metric("rpc_proxy_reorgs_total", network="evm") >= 1

    await eventually(reorg_seen, 10, "the tracker to see the reorg")
    _, reply, headers = await evm_proxy.post(storage(store, "0x0", hex(deploy_block)))
    assert headers["X-Cache"] == "MISS" and reply["result"] == "0x" + word(0)  # gone with its block
    # `latest` is the same height with the new hash: it shares the new entry, never the old one.
    assert (await evm_proxy.result("eth_getStorageAt", [store, "0x0", "latest"])) == "0x" + word(0)


async def test_a_null_answer_for_a_future_block_is_not_kept_once_the_block_exists(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    store = anvil.deploy_store()
    future = anvil.block_number() + 1
    await evm_proxy.head_at(future - 1)
    assert (await evm_proxy.result("eth_getBlockReceipts", [hex(future)])) is None
    receipt = anvil.send(store, selector("setX(uint256)") + word(3))
    assert int(receipt["blockNumber"], 16) == future
    await evm_proxy.head_at(future)
    receipts = await evm_proxy.result("eth_getBlockReceipts", [hex(future)])
    assert [r["transactionHash"] for r in receipts] == [receipt["transactionHash"]]


async def test_reverts_at_final_blocks_are_cached_and_other_errors_are_not(anvil: Anvil, evm_proxy: Proxy) -> None:
    store, block = await finalized_store(anvil, evm_proxy)
    boom = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "eth_call",
        "params": [{"from": DEV_ACCOUNT, "to": store, "data": selector("boom()")}, hex(block)],
    }
    _, first, _ = await evm_proxy.post(boom)
    _, second, headers = await evm_proxy.post(boom)
    assert headers["X-Cache"] == "HIT" and second["error"] == first["error"] and first["error"]["code"] == 3
    at_latest = {**boom, "params": [boom["params"][0], "latest"]}
    await evm_proxy.post(at_latest)
    _, reply, headers = await evm_proxy.post(at_latest)
    assert headers["X-Cache"] == "MISS" and reply["error"]["code"] == 3
    assert evm_proxy.upstreams["evm"].calls["eth_call"] == 3


async def test_pending_is_not_cached_and_single_responses_say_bypass(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    for _ in range(2):
        _, reply, headers = await evm_proxy.post(storage(store, "0x0", "pending"))
        assert headers["X-Cache"] == "BYPASS" and reply["result"] == "0x" + word(7)
    assert (await evm_proxy.post({"jsonrpc": "2.0", "id": 1, "method": "web3_clientVersion"}))[2]["X-Cache"] == "BYPASS"


async def test_blocks_addressed_by_hash_are_content_addressed(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    receipt = anvil.send(store, selector("setX(uint256)") + word(3))
    for _ in range(2):
        await evm_proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_getBlockReceipts", "params": [receipt["blockHash"]]}
        )
    assert evm_proxy.upstreams["evm"].calls["eth_getBlockReceipts"] == 1


class SlowUpstream(CountingUpstream):
    """A pass-through that holds each call long enough for concurrent misses to overlap."""

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer:
        await asyncio.sleep(0.2)
        return await super().request(method, params, timeout=timeout)

    async def proven(
        self, method: str, params: Any, block: str, *, index: int | None = None, timeout: float | None = None
    ) -> Answer:
        await asyncio.sleep(0.2)  # a final read goes with its proof header (proofs.py)
        return await super().proven(method, params, block, index=index, timeout=timeout)

    async def batch(self, calls: Sequence[tuple[str, Any]]) -> list[Answer]:
        return await super().batch(calls)


async def test_fifty_concurrent_identical_misses_make_one_upstream_call(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    # Each on a new connection: a key's answers of connections that have had none are made at most
    # twice UPSTREAM_KEY_CONCURRENCY at once (first_answers.py); past that they would wait for the
    # first answer and be memory hits, not coalesced calls.
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, UPSTREAM_KEY_CONCURRENCY="25", upstream_class=SlowUpstream)
    store, block = await finalized_store(anvil, proxy)
    replies = await asyncio.gather(*(proxy.post(storage(store, "0x0", hex(block), rid=i)) for i in range(50)))
    assert sorted(body["id"] for _, body, _ in replies) == list(range(50))
    assert all(body["result"] == "0x" + word(7) for _, body, _ in replies)
    assert proxy.upstreams["evm"].calls["eth_getStorageAt"] == 1
    assert proxy.metric("rpc_proxy_coalesced_requests_total", network="evm", method="eth_getStorageAt") == 49


# --- the Redis tier ------------------------------------------------------------------------


async def replicas(
    make_proxy: ProxyFactory,
    anvil: Anvil,
    redis_url: str,
    upstream_class: type[CountingUpstream] = CountingUpstream,
    **overrides: str,
) -> tuple[Proxy, Proxy]:
    """Two proxies on one Redis, as two replicas of one deployment."""
    settings = settings_for(EVM_UPSTREAM=anvil.url, REDIS_URL=redis_url, **overrides)
    first = await make_proxy(settings, upstream_class=upstream_class)
    second = await make_proxy(settings, upstream_class=upstream_class)
    return first, second


@pytest.fixture
async def two_replicas(anvil: Anvil, redis_url: str, make_proxy: ProxyFactory) -> tuple[Proxy, Proxy]:
    return await replicas(make_proxy, anvil, redis_url)


async def one_space(*proxies: Proxy) -> None:
    """Every replica names the shared key space (on a busy machine a replica's first read of the
    space's records may come late: until then it keeps a space of its own, and shares nothing)."""

    async def shared() -> bool:
        heads = [proxy.app[SERVICE].networks["evm"].tracker.head for proxy in proxies]
        spaces = {head.space if head is not None else None for head in heads}
        return len(spaces) == 1 and None not in spaces

    await eventually(shared, 20, "the replicas in one key space")


async def shared_through_redis(anvil: Anvil, first: Proxy, second: Proxy) -> tuple[str, int]:
    """A final entry stored by the first replica is a Redis hit on the second; returns (store, block)."""
    store, block = await finalized_store(anvil, first)
    await second.head_at(anvil.block_number())
    await one_space(first, second)
    _, _, headers = await first.post(storage(store, "0x0", hex(block)))
    assert headers["X-Cache"] == "MISS"
    _, reply, headers = await second.post(storage(store, "0x0", hex(block)))
    assert headers["X-Cache"] == "HIT" and reply["result"] == "0x" + word(7)
    assert second.upstreams["evm"].calls["eth_getStorageAt"] == 0
    assert second.metric("rpc_proxy_cache_lookups_total", tier="redis", result="hit") == 1
    return store, block


async def test_two_replicas_on_one_redis_share_entries(anvil: Anvil, two_replicas: tuple[Proxy, Proxy]) -> None:
    first, second = two_replicas
    store, block = await shared_through_redis(anvil, first, second)
    # The Redis hit filled the second replica's memory tier.
    await second.post(storage(store, "0x0", hex(block)))
    assert second.metric("rpc_proxy_cache_lookups_total", tier="memory", result="hit") == 1


async def test_a_logs_answer_another_replica_kept_past_this_ones_limit_is_refused_as_its_miss_would_be(
    anvil: Anvil, redis_url: str, make_proxy: ProxyFactory
) -> None:
    """Rule: the result limit holds over a cached answer too: one kept by a replica with a higher
    GETLOGS_MAX_RESULTS (or before the limit was lowered) was served past this one's (an outside attack)."""
    store = anvil.deploy_store()
    block = int(anvil.send(store, selector("emitMany(uint256)") + word(6))["blockNumber"], 16)
    anvil.mine(70)
    roomy = await make_proxy(settings_for(EVM_UPSTREAM=anvil.url, REDIS_URL=redis_url))
    tight = await make_proxy(settings_for(EVM_UPSTREAM=anvil.url, REDIS_URL=redis_url, GETLOGS_MAX_RESULTS="4"))
    for proxy in (roomy, tight):
        await proxy.head_at(anvil.block_number())
    await one_space(roomy, tight)
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "eth_getLogs",
        "params": [{"fromBlock": hex(block), "toBlock": hex(block)}],
    }
    _, body, headers = await roomy.post(call)
    assert len(body["result"]) == 6 and headers["X-Cache"] == "MISS"
    for _ in range(2):
        status, body, _ = await tight.post(call)
        assert status == 200 and body.get("error") == {"code": -32005, "message": "query returned more than 4 results"}
    assert tight.metric("rpc_proxy_getlogs_limit_rejections_total", reason="results") == 2


async def test_requests_are_answered_while_redis_is_down_and_redis_is_used_again_after(
    anvil: Anvil, redis_server: RedisServer, two_replicas: tuple[Proxy, Proxy]
) -> None:
    first, _ = two_replicas
    store, block = await finalized_store(anvil, first)
    assert (await first.post(storage(store, "0x0", hex(block))))[0] == 200
    redis_server.stop()
    for position in ("0x0", "0x1", "0x2"):
        status, reply, _ = await first.post(storage(store, position, hex(block - 1)))
        assert status == 200 and "result" in reply
    status, reply, headers = await first.post(storage(store, "0x0", hex(block)))
    assert status == 200 and headers["X-Cache"] == "HIT"  # the memory tier still serves
    assert first.metric("rpc_proxy_redis_errors_total", operation="cache_get") >= 1

    redis_server.start()
    client = aioredis.Redis.from_url(redis_server.url)
    position = iter(range(3, 10_000))

    async def redis_written_again() -> bool:
        await first.post(storage(store, hex(next(position)), hex(block)))
        return bool(await client.keys("rcp:c:*"))

    try:
        await eventually(redis_written_again, 15, "the proxy to use Redis again")
    finally:
        await client.aclose()


# --- Solana ----------------------------------------------------------------------------------


async def test_largest_accounts_are_cached_within_their_ttl_and_not_beyond(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    clock = FakeClock()
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, SOLANA_LARGEST_ACCOUNTS_TTL="3600", clock=clock)
    first = await proxy.result("getLargestAccounts", [])
    clock.advance(3599)
    assert (await proxy.result("getLargestAccounts", [{"commitment": "finalized"}])) == first
    assert solana.calls["getLargestAccounts"] == 1
    await proxy.result("getLargestAccounts", [{"filter": "circulating"}])  # another key
    assert solana.calls["getLargestAccounts"] == 2
    clock.advance(2)
    assert (await proxy.result("getLargestAccounts", []))["context"]["slot"] != first["context"]["slot"]
    assert solana.calls["getLargestAccounts"] == 3


async def test_largest_accounts_with_a_second_param_not_a_filter_name_is_refused_by_its_arity(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    # Its one config object, or solana-py's filter name second: `[{}, {}]` was refused as a bad
    # `config.filter`, a field the client never sent.
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url)
    error = (await proxy.call("getLargestAccounts", [{}, {}]))["error"]
    assert error["code"] == -32602 and error["message"].startswith("invalid params: params: expected at most 1 ")
    assert "config.filter" not in error["message"]
    assert "result" in await proxy.call("getLargestAccounts", [{}, "circulating"])  # solana-py's form
    assert solana.calls["getLargestAccounts"] == 1


async def test_token_balance_has_bounded_staleness_and_keeps_its_context_slot(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    clock = FakeClock()
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, SOLANA_BALANCE_MAX_AGE="0.4", clock=clock)
    first = await proxy.result("getTokenAccountBalance", [TOKEN_ACCOUNT])
    clock.advance(0.3)
    again = await proxy.result("getTokenAccountBalance", [TOKEN_ACCOUNT, {"commitment": "finalized"}])
    assert again == first  # context.slot as it was, though the node has moved on
    await proxy.result("getTokenAccountBalance", [TOKEN_ACCOUNT, {"commitment": "confirmed"}])
    assert solana.calls["getTokenAccountBalance"] == 2  # per commitment
    clock.advance(0.2)
    later = await proxy.result("getTokenAccountBalance", [TOKEN_ACCOUNT])
    assert later["context"]["slot"] > first["context"]["slot"]
    for _ in range(2):
        assert "error" in await proxy.call("getTokenAccountBalance", [SYSTEM_ACCOUNT])
    assert solana.calls["getTokenAccountBalance"] == 5  # errors are never cached


class LaggingUpstream(CountingUpstream):
    """A node behind the tracker: it does not know any block asked for by number or hash yet."""

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer:
        if method == "eth_getStorageAt" and (isinstance(params[2], dict) or str(params[2]).startswith("0x")):
            self.calls[method] += 1
            return Answer.from_response({"error": {"code": -32000, "message": "header not found"}}, upstream=0)
        return await super().request(method, params, timeout=timeout)


async def test_when_the_node_lacks_the_resolved_block_the_tag_is_retried_and_nothing_cached(
    anvil: Anvil,
    make_proxy: ProxyFactory,
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, upstream_class=LaggingUpstream)
    store = anvil.deploy_store()
    await proxy.head_at(anvil.block_number())
    for _ in range(2):
        assert (await proxy.result("eth_getStorageAt", [store, "0x0", "latest"])) == "0x" + word(7)
    sent = [params[2] for method, params in proxy.upstreams["evm"].params if method == "eth_getStorageAt"]
    assert sent == ["latest", "latest"]  # each retried with the tag after the numbered try failed
    assert proxy.upstreams["evm"].calls["eth_getStorageAt"] == 4  # nothing was cached


async def test_identical_misses_on_two_replicas_make_one_upstream_call(
    anvil: Anvil, redis_url: str, make_proxy: ProxyFactory
) -> None:
    first, second = await replicas(make_proxy, anvil, redis_url, SlowUpstream)
    store, block = await finalized_store(anvil, first)
    await second.head_at(anvil.block_number())
    replies = await asyncio.gather(
        *((first if i % 2 else second).post(storage(store, "0x0", hex(block), rid=i)) for i in range(20))
    )
    assert sorted(body["id"] for _, body, _ in replies) == list(range(20))
    assert all(body["result"] == "0x" + word(7) for _, body, _ in replies)
    calls = [p.upstreams["evm"].calls["eth_getStorageAt"] for p in (first, second)]
    assert sum(calls) == 1


async def test_cross_replica_coalescing_can_be_turned_off(
    anvil: Anvil, redis_url: str, make_proxy: ProxyFactory
) -> None:
    first, second = await replicas(make_proxy, anvil, redis_url, SlowUpstream, COALESCE_WAIT="0")
    store, block = await finalized_store(anvil, first)
    await second.head_at(anvil.block_number())
    request = storage(store, "0x0", hex(block))
    await asyncio.gather(first.post(request), second.post(request))
    assert [p.upstreams["evm"].calls["eth_getStorageAt"] for p in (first, second)] == [1, 1]


async def test_a_replica_waiting_on_an_uncacheable_answer_fetches_it_itself(
    anvil: Anvil, redis_url: str, make_proxy: ProxyFactory
) -> None:
    first, second = await replicas(make_proxy, anvil, redis_url, SlowUpstream)
    store = anvil.deploy_store()
    await first.head_at(anvil.block_number())
    await second.head_at(anvil.block_number())
    boom = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "eth_call",
        "params": [{"from": DEV_ACCOUNT, "to": store, "data": selector("boom()")}, "latest"],
    }
    (_, a, _), (_, b, _) = await asyncio.gather(first.post(boom), second.post(boom))
    assert a["error"]["code"] == b["error"]["code"] == 3  # a revert above finality is never stored
    assert [p.upstreams["evm"].calls["eth_call"] for p in (first, second)] == [1, 1]
