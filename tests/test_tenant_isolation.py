"""Tenant isolation (issue 19, items 1, 3, 4 and 7): two API keys on one proxy, a real Anvil and a
real Redis. The attacker key sends what once took the service from everyone; the victim key's
latency stays under a stated bound while it runs, and memory, Redis and upstream figures stay under
stated bounds, measured from outside the code that enforces them."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from proxy.http.app_keys import SERVICE
from proxy.values import Answer
from tests.fault_relay import FaultRelay
from tests.support import Anvil, CountingUpstream, Proxy, ProxyFactory, selector, settings_for, word

ATTACKER, VICTIM = "attacker-key", "victim-key"
KEYS = f"{ATTACKER},{VICTIM}"
BLOCKS_WITH_LOGS = 24
LOGS_PER_BLOCK = 100  # ~45 KB of eth_getLogs answer per block
VICTIM_BOUND = 1.0  # seconds: the victim's worst call while an attack runs (generous for a busy 2-core VM)
LOOP_LAG_BOUND = 0.1  # seconds: the longest the event loop was seen blocked while an attack runs


@dataclass
class Chain:
    anvil: Anvil
    store: str
    first: int  # the first block with logs
    last: int  # the last block with logs


@pytest.fixture(scope="module")
def chain() -> Iterator[Chain]:
    """A Store contract that logged LOGS_PER_BLOCK logs in each of BLOCKS_WITH_LOGS blocks, all final."""
    anvil = Anvil()
    try:
        store = anvil.deploy_store()
        blocks = [
            int(anvil.send(store, selector("emitMany(uint256)") + word(LOGS_PER_BLOCK))["blockNumber"], 16)
            for _ in range(BLOCKS_WITH_LOGS)
        ]
        anvil.mine(200)  # well past Anvil's finality depth
        yield Chain(anvil, store, blocks[0], blocks[-1])
    finally:
        anvil.stop()


async def proxy_for(
    make_proxy: ProxyFactory,
    chain: Chain,
    *,
    upstream: str | None = None,
    redis_url: str | None = None,
    upstream_class: type[CountingUpstream] = CountingUpstream,
    **overrides: str,
) -> Proxy:
    raw = {"EVM_UPSTREAM": upstream or chain.anvil.url, "API_KEYS": KEYS, **overrides}
    if redis_url:
        raw["REDIS_URL"] = redis_url
    proxy = await make_proxy(settings_for(**raw), upstream_class=upstream_class)
    await proxy.head_at(chain.anvil.block_number())
    head = proxy.app[SERVICE].networks["evm"].tracker.head
    assert head is not None and head.finalized >= chain.last
    return proxy


def logs_call(chain: Chain, first: int, last: int, rid: int = 1, address: str | None = None) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": rid,
        "method": "eth_getLogs",
        "params": [{"address": address or chain.store, "fromBlock": hex(first), "toBlock": hex(last)}],
    }


async def raw_post(proxy: Proxy, body: Any, key: str) -> tuple[bytes, Any]:
    """The body unparsed (a large answer is not decoded on the loop the proxy shares with the test)."""
    async with proxy.session.post(proxy.url(key), data=json.dumps(body)) as resp:
        return await resp.read(), resp.headers


class Probe:
    """Measures, from outside, what the victim sees while an attack runs: its calls' latencies and the
    event loop's lag (a 5 ms sleep that wakes late was kept waiting by a callback that long)."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.latencies: list[float] = []
        self.lag = 0.0
        self._stop = asyncio.Event()

    async def _lag(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            started = loop.time()
            await asyncio.sleep(0.005)
            self.lag = max(self.lag, loop.time() - started - 0.005)

    async def _victim(self, make_call: Any) -> None:
        n = 0
        while not self._stop.is_set():
            started = time.perf_counter()
            status, body, _ = await self.proxy.post(make_call(n), VICTIM)
            self.latencies.append(time.perf_counter() - started)
            assert status == 200 and "result" in body, body
            n += 1
            await asyncio.sleep(0.01)

    async def during(self, attack: Any, make_call: Any) -> Any:
        tasks = [asyncio.create_task(self._lag()), asyncio.create_task(self._victim(make_call))]
        try:
            return await attack
        finally:
            self._stop.set()
            await asyncio.gather(*tasks)


def chain_id(_n: int) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}


# --- item 1: no request blocks the loop; bounded response size ------------------------------


async def test_a_batch_of_large_cached_log_answers_is_cut_at_the_response_size_limit(
    chain: Chain,
    make_proxy: ProxyFactory,
) -> None:
    limit = 1024 * 1024
    proxy = await proxy_for(make_proxy, chain, GETLOGS_CHUNK_BLOCKS="10", MAX_RESPONSE_BYTES=str(limit))
    first, last = chain.first, chain.first + 11  # ~12 x 45 KB: one answer of ~540 KB, chunked
    warm, _ = await raw_post(proxy, logs_call(chain, first, last), ATTACKER)
    assert len(warm) > limit // 3
    batch = [logs_call(chain, first, last, rid) for rid in range(40)]  # ~21 MB without the limit
    probe = Probe(proxy)
    body, _ = await probe.during(raw_post(proxy, batch, ATTACKER), chain_id)
    assert len(body) <= limit + 64 * 1024
    answers = json.loads(body)
    cut = [a for a in answers if "error" in a]
    assert 30 <= len(cut) < 40
    assert all(a["error"]["code"] == -32005 and "MAX_RESPONSE_BYTES" in a["error"]["message"] for a in cut)
    assert max(probe.latencies) < VICTIM_BOUND, probe.latencies
    assert probe.lag < LOOP_LAG_BOUND, probe.lag


async def test_a_node_answer_past_the_response_size_limit_is_refused_unread(
    chain: Chain, make_proxy: ProxyFactory
) -> None:
    limit = 100_000
    primary = await FaultRelay(chain.anvil.url).start()
    backup = await FaultRelay(chain.anvil.url).start()
    try:
        proxy = await proxy_for(
            make_proxy,
            chain,
            upstream=f"{primary.url},{backup.url}",
            GETLOGS_CHUNK_BLOCKS="0",
            MAX_RESPONSE_BYTES=str(limit),
        )
        status, body, headers = await proxy.post(logs_call(chain, chain.first, chain.last), ATTACKER)  # ~1 MB
        assert status == 200 and body["error"]["code"] == -32005, body
        assert "MAX_RESPONSE_BYTES" in body["error"]["message"] and headers["X-Credits-Charged"] == "255"
        # Every node would answer the same: not asked of the backup, and the primary is not cooled.
        assert not [c for c in backup.calls if c.get("method") == "eth_getLogs"]
        assert proxy.metric("rpc_proxy_upstream_failovers_total", network="evm") == 0
    finally:
        await primary.close()
        await backup.close()


async def test_a_chunked_log_hit_is_one_lookup_like_a_plain_hit(chain: Chain, make_proxy: ProxyFactory) -> None:
    proxy = await proxy_for(make_proxy, chain, GETLOGS_CHUNK_BLOCKS="10")
    call = logs_call(chain, chain.first, chain.last)  # 3 chunks of 10 blocks, cut to the range
    first, headers = await raw_post(proxy, call, ATTACKER)
    assert headers["X-Cache"] == "MISS"
    lookups = proxy.metric("rpc_proxy_cache_lookups_total", tier="memory", result="hit")
    pieces = proxy.upstreams["evm"].calls["eth_getLogs"]
    for _ in range(20):
        again, headers = await raw_post(proxy, call, ATTACKER)
        assert again == first and headers["X-Cache"] == "HIT"
    # The merged answer is kept under the range's key: one lookup per call, as a plain hit; no piece
    # is looked up or merged again.
    assert proxy.metric("rpc_proxy_cache_lookups_total", tier="memory", result="hit") - lookups == 20
    assert proxy.upstreams["evm"].calls["eth_getLogs"] == pieces
    assert json.loads(first)["result"] == chain.anvil.rpc("eth_getLogs", call["params"][0])


# --- item 3: cache admission -------------------------------------------------------------------


def cache_bytes(client: redis.Redis) -> int:
    return sum(int(client.strlen(k)) for k in client.scan_iter("rcp:c:*"))


async def test_answers_computed_from_a_state_override_are_never_cached(
    chain: Chain,
    make_proxy: ProxyFactory,
    redis_url: str,
) -> None:
    proxy = await proxy_for(make_proxy, chain, redis_url=redis_url)
    client = redis.Redis.from_url(redis_url)
    target = "0x" + "ab" * 20
    code = "0x616000" + "6000f3"  # PUSH2 0x6000 PUSH1 0 RETURN: 24 KiB of zeros, as the client chose
    params = [{"to": target, "data": "0x"}, hex(chain.first), {target: {"code": code}}]
    memory = proxy.app[SERVICE]._cache.memory
    before_memory, before_redis = memory.bytes_used, cache_bytes(client)
    for _ in range(3):
        status, body, headers = await proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_call", "params": params}, ATTACKER
        )
        assert status == 200 and len(body["result"]) == 2 + 2 * 0x6000 and headers["X-Cache"] == "BYPASS"
    assert proxy.upstreams["evm"].calls["eth_call"] == 3
    assert memory.bytes_used == before_memory and cache_bytes(client) == before_redis


async def test_one_key_stores_at_most_its_share_per_minute_and_others_stay_warm(
    chain: Chain,
    make_proxy: ProxyFactory,
    redis_url: str,
) -> None:
    share = 128 * 1024
    proxy = await proxy_for(
        make_proxy,
        chain,
        redis_url=redis_url,
        GETLOGS_CHUNK_BLOCKS="0",
        CACHE_MEMORY_BYTES=str(1 << 20),
        CACHE_KEY_BYTES_PER_MINUTE=str(share),
    )
    client = redis.Redis.from_url(redis_url)

    def storage(n: int) -> dict[str, Any]:
        return {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "eth_getStorageAt",
            "params": [chain.store, hex(n % 50), hex(chain.first)],
        }

    for n in range(50):  # the victim's warm entries
        await proxy.post(storage(n), VICTIM)
    victim_bytes = cache_bytes(client)
    asked = proxy.upstreams["evm"].calls["eth_getStorageAt"]
    # ~4 MB of distinct answers, nearly four times the memory tier.
    attack = [raw_post(proxy, logs_call(chain, b, b + 3), ATTACKER) for b in range(chain.first, chain.last - 3)]
    bodies = await asyncio.gather(*attack)
    assert sum(len(b) for b, _ in bodies) > 3 << 20
    assert cache_bytes(client) - victim_bytes <= share  # the attacker's bytes in Redis
    redis_hits = proxy.metric("rpc_proxy_cache_lookups_total", tier="redis", result="hit")
    for n in range(50):
        _status, _body, headers = await proxy.post(storage(n), VICTIM)
        assert headers["X-Cache"] == "HIT"
    assert proxy.upstreams["evm"].calls["eth_getStorageAt"] == asked
    assert proxy.metric("rpc_proxy_cache_lookups_total", tier="redis", result="hit") == redis_hits  # from memory


# --- item 4: per-key upstream budget --------------------------------------------------------


class LogsInflight(CountingUpstream):
    """Counts the eth_getLogs calls in flight as the node sees them (only the attacker sends them)."""

    inflight = 0
    peak = 0

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer:
        if method != "eth_getLogs":
            return await super().request(method, params, timeout=timeout)
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            return await super().request(method, params, timeout=timeout)
        finally:
            self.inflight -= 1


async def test_one_keys_wide_log_batch_holds_at_most_its_upstream_slots_and_a_bounded_number_of_calls(
    chain: Chain,
    make_proxy: ProxyFactory,
) -> None:
    proxy = await proxy_for(
        make_proxy,
        chain,
        upstream_class=LogsInflight,
        GETLOGS_CHUNK_BLOCKS="2",
        GETLOGS_CHUNK_CONCURRENCY="8",
        UPSTREAM_KEY_CONCURRENCY="4",
    )
    # ~60 pieces each, cold, none shared (each filter names another address).
    batch = [logs_call(chain, 0, 120, i, address=f"0x{i + 1:040x}") for i in range(15)]

    def balance(n: int) -> dict[str, Any]:  # a miss each time
        return {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": [chain.store, hex(n % 150)]}

    probe = Probe(proxy)
    await probe.during(raw_post(proxy, batch, ATTACKER), balance)
    upstream = proxy.upstreams["evm"]
    assert isinstance(upstream, LogsInflight)
    # Each call asks at most 16 pieces one by one (plus those in flight then, and the rest at once),
    # not its ~60 chunks: 15 x (16 + 8 + 1) at most.
    assert 15 * 16 <= upstream.calls["eth_getLogs"] <= 15 * 25
    assert upstream.peak <= 4
    assert max(probe.latencies) < VICTIM_BOUND, probe.latencies


async def test_a_chunked_call_that_fails_part_way_is_charged(chain: Chain, make_proxy: ProxyFactory) -> None:
    relay = await FaultRelay(chain.anvil.url).start()
    try:
        proxy = await proxy_for(make_proxy, chain, upstream=relay.url, GETLOGS_CHUNK_BLOCKS="2")
        relay.inject("http429", method="eth_getLogs", delay=0.5)  # one chunk refused, after the others
        _status, body, headers = await proxy.post(logs_call(chain, chain.first, chain.last), ATTACKER)
        assert body["error"]["code"] == -32002, body
        assert sum(c.get("method") == "eth_getLogs" for c in relay.calls) > 5
        assert headers["X-Credits-Charged"] == "255"
    finally:
        await relay.close()


async def test_a_chunked_call_whose_first_piece_to_end_found_no_node_is_charged_for_the_others(
    chain: Chain,
    make_proxy: ProxyFactory,
) -> None:
    """charging.py: a chunked call is free only when no node answered any piece; a piece refused at
    once (HTTP 429) while the others are still with the node does not make their work free."""
    relay = await FaultRelay(chain.anvil.url).start()
    try:
        proxy = await proxy_for(make_proxy, chain, upstream=relay.url, GETLOGS_CHUNK_BLOCKS="2")
        relay.inject("http429", method="eth_getLogs", times=1)  # the first piece, refused at once...
        relay.inject("slow", method="eth_getLogs", delay=0.3)  # ...while the others are with the node
        _status, body, headers = await proxy.post(logs_call(chain, chain.first, chain.last), ATTACKER)
        assert body["error"]["code"] == -32002, body
        assert sum(c.get("method") == "eth_getLogs" for c in relay.calls) > 2
        assert headers["X-Credits-Charged"] == "255"
    finally:
        await relay.close()


# --- item 7: a request's own fault is not an upstream fault ----------------------------------


@pytest.mark.filterwarnings("ignore:Sending a large body:ResourceWarning")  # aiohttp's, on the 2.2 MB upstream call
async def test_a_request_the_node_cannot_read_cools_no_upstream(chain: Chain, make_proxy: ProxyFactory) -> None:
    primary = await FaultRelay(chain.anvil.url).start()
    backup = await FaultRelay(chain.anvil.url).start()
    try:
        proxy = await proxy_for(make_proxy, chain, upstream=f"{primary.url},{backup.url}", MAX_BODY_BYTES=str(4 << 20))
        huge = {"to": "0x" + "11" * 20, "data": "0x" + "00" * 1_100_000}  # 2.2 MB: Anvil answers id null
        raw = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "eth_call", "params": [huge, hex(chain.first)]})
        async with proxy.session.post(proxy.url(ATTACKER), data=io.BytesIO(raw.encode())) as resp:
            body = await resp.json()
        assert body["error"]["code"] == -32600, body  # the node's own answer
        assert not [c for c in backup.calls if c.get("method") == "eth_call"]  # not failed over either
        seen = len(primary.calls)
        for n in range(5):
            await proxy.post(
                {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": [chain.store, hex(chain.first + n)]},
                VICTIM,
            )
        assert not [c for c in backup.calls if c.get("method") == "eth_getBalance"]
        assert len(primary.calls) > seen
        assert proxy.metric("rpc_proxy_upstream_errors_total", network="evm", upstream="0", kind="mismatch") == 0
        # A 413 says the request is too large for that node: a batch's calls go alone (the read with
        # its proof header is one), and a call alone goes to the next node, which may take it; none is cooled.
        primary.inject("http413", method="eth_call", times=2)
        read_x = {"to": chain.store, "data": selector("x()")}
        reply = await proxy.call("eth_call", [read_x, hex(chain.first + 1)], ATTACKER)
        assert "result" in reply and [c for c in backup.calls if c.get("method") == "eth_call"]
        await proxy.call("eth_getBalance", [chain.store, hex(chain.first + 9)], VICTIM)
        assert not [c for c in backup.calls if c.get("method") == "eth_getBalance"]
    finally:
        await primary.close()
        await backup.close()
