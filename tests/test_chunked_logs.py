"""Chunked eth_getLogs through HTTP against Anvil: ranges are asked in aligned chunks that later
overlapping, extending and inner ranges share; answers equal the node's (across a reorg too); the
spec's limits hold over the merged answer; X-Cache says whether any chunk went upstream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxy.http.app_keys import SERVICE
from tests.fault_relay import FaultRelay
from tests.support import Anvil, Proxy, ProxyFactory, eventually, selector, word

CHUNK = 100  # GETLOGS_CHUNK_BLOCKS in these tests: small chunks of 10 near finality


@dataclass
class Chain:
    anvil: Anvil
    proxy: Proxy
    store: str
    finalized: int  # the tracker's finalized block when the test starts


def emit(anvil: Anvil, store: str, count: int) -> dict[str, Any]:
    return anvil.send(store, selector("emitMany(uint256)") + word(count))


async def build(anvil: Anvil, proxy: Proxy, events: int = 30, gap: int = 9) -> Chain:
    """A Store contract emitting 2 logs every `gap + 1` blocks, then enough blocks that they are final."""
    store = anvil.deploy_store()
    for _ in range(events):
        emit(anvil, store, 2)
        anvil.mine(gap)
    latest = anvil.mine(120)
    await proxy.head_at(latest)
    head = proxy.app[SERVICE].networks["evm"].tracker.head
    assert head is not None
    return Chain(anvil, proxy, store, head.finalized)


@pytest.fixture
async def chain(anvil: Anvil, make_proxy: ProxyFactory) -> AsyncIterator[Chain]:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, GETLOGS_CHUNK_BLOCKS=str(CHUNK))
    yield await build(anvil, proxy)


def logs_filter(chain: Chain, first: int | str, last: int | str) -> dict[str, Any]:
    return {
        "address": chain.store,
        "fromBlock": first if isinstance(first, str) else hex(first),
        "toBlock": last if isinstance(last, str) else hex(last),
    }


async def get_logs(chain: Chain, log_filter: dict[str, Any]) -> tuple[Any, str]:
    """The proxy's answer and X-Cache, after checking it equals the node's."""
    status, body, headers = await chain.proxy.post(
        {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [log_filter]}
    )
    assert status == 200 and "result" in body, body
    node = chain.anvil.rpc("eth_getLogs", log_filter)
    assert body["result"] == node
    return body["result"], headers["X-Cache"]


def asked(chain: Chain) -> list[tuple[int, int]]:
    """The block ranges of every eth_getLogs sent upstream so far."""
    return [
        (int(p[0]["fromBlock"], 16), int(p[0]["toBlock"], 16)) if "fromBlock" in p[0] else (-1, -1)
        for m, p in chain.proxy.upstreams["evm"].params
        if m == "eth_getLogs"
    ]


async def test_overlapping_extending_and_inner_windows_cost_the_upstream_only_new_chunks(chain: Chain) -> None:
    assert chain.finalized >= 3 * CHUNK  # the windows below are final
    logs, cache = await get_logs(chain, logs_filter(chain, 50, 149))
    assert len(logs) > 0 and cache == "MISS"
    assert asked(chain) == [(0, 99), (100, 199)]  # whole aligned chunks, cut to the window
    _, cache = await get_logs(chain, logs_filter(chain, 100, 249))  # overlaps by half, extends by a chunk
    assert cache == "PARTIAL" and asked(chain)[2:] == [(200, 299)]
    _, cache = await get_logs(chain, logs_filter(chain, 120, 180))  # inside a held chunk
    assert cache == "HIT" and len(asked(chain)) == 3
    _, cache = await get_logs(chain, logs_filter(chain, 0, 299))
    assert cache == "HIT" and len(asked(chain)) == 3


async def test_the_same_address_with_other_topics_is_another_chunk(chain: Chain) -> None:
    await get_logs(chain, logs_filter(chain, 0, 199))
    topic = "0x" + word(1)
    signature = chain.anvil.rpc("eth_getLogs", logs_filter(chain, 0, 199))[0]["topics"][0]
    _, cache = await get_logs(chain, {**logs_filter(chain, 0, 199), "topics": [signature, topic]})
    assert cache == "MISS"  # the canonical filter is part of every chunk's key


async def test_zero_to_latest_again_after_a_new_block_asks_only_the_part_near_the_head(chain: Chain) -> None:
    _, cache = await get_logs(chain, logs_filter(chain, "0x0", "latest"))
    assert cache == "MISS"
    before = len(asked(chain))
    emit(chain.anvil, chain.store, 1)
    await chain.proxy.head_at(chain.anvil.block_number())
    _, cache = await get_logs(chain, logs_filter(chain, "0x0", "latest"))
    assert cache == "PARTIAL"
    new = asked(chain)[before:]
    # Only small chunks that just became final, and the tail above them, went upstream again.
    assert 1 <= len(new) <= 2 and all(start > chain.finalized - CHUNK // 10 for start, _ in new), new


async def test_a_reorg_never_leaves_a_removed_log_in_a_chunked_answer(chain: Chain) -> None:
    emit(chain.anvil, chain.store, 3)  # logs in the blocks the reorg replaces
    emit(chain.anvil, chain.store, 3)
    latest = chain.anvil.block_number()
    await chain.proxy.head_at(latest)
    everything = logs_filter(chain, "0x0", "latest")
    before, _ = await get_logs(chain, everything)
    chain.anvil.rpc("anvil_reorg", 2, [])  # the two blocks are replaced by empty ones
    tracker = chain.proxy.app[SERVICE].networks["evm"].tracker

    async def reorg_seen() -> bool:
        return (
            chain.proxy.metric("rpc_proxy_reorgs_total", network="evm") >= 1
            and tracker.head is not None
            and tracker.head.latest_hash == chain.anvil.rpc("eth_getBlockByNumber", "latest", False)["hash"]
        )

    await eventually(reorg_seen, 10, "the tracker to see the reorg")
    after, cache = await get_logs(chain, everything)  # equal to the node's: the removed logs are gone
    assert len(after) == len(before) - 6 and cache == "PARTIAL"
    _, cache = await get_logs(chain, logs_filter(chain, 0, chain.finalized - chain.finalized % CHUNK - 1))
    assert cache == "HIT"  # the final chunks were kept


async def test_more_than_the_limit_over_the_merged_answer_is_minus_32005_with_nothing_partial(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, GETLOGS_CHUNK_BLOCKS=str(CHUNK), GETLOGS_MAX_RESULTS="30")
    chain = await build(anvil, proxy)  # 2 logs every 10 blocks: 20 per chunk, each under the limit
    too_many = logs_filter(chain, 0, 299)
    for _ in range(2):
        status, body, _ = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [too_many]})
        assert status == 200 and "result" not in body
        assert body["error"]["code"] == -32005
        assert body["error"] == {"code": -32005, "message": "query returned more than 30 results"}  # no data
    assert proxy.metric("rpc_proxy_getlogs_limit_rejections_total", reason="results") == 2
    past_limit = int(chain.anvil.rpc("eth_getLogs", too_many)[30]["blockNumber"], 16)
    logs, cache = await get_logs(chain, logs_filter(chain, 0, past_limit - 1))  # a range within the limit
    assert 0 < len(logs) <= 30 and cache == "HIT"  # its chunks were held


async def test_a_chunk_past_the_limit_is_never_kept_for_a_call_of_exactly_its_range(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """Rule: a piece is asked without the result limit (the merged call counts its own), so one past
    it is never kept: a later call of exactly its range was served it from the cache, 27,000 logs
    past a 10,000 limit (an outside attack)."""
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, GETLOGS_CHUNK_BLOCKS=str(CHUNK), GETLOGS_MAX_RESULTS="15")
    chain = await build(anvil, proxy)  # 2 logs every 10 blocks: 20 in the chunk [0, 99]
    assert len(chain.anvil.rpc("eth_getLogs", logs_filter(chain, 0, CHUNK - 1))) > 15
    for first, last in ((0, 150), (0, CHUNK - 1), (0, CHUNK - 1)):  # a chunked call asks the chunk [0, 99] whole
        call = {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [logs_filter(chain, first, last)]}
        status, body, _ = await proxy.post(call)
        assert status == 200 and body.get("error") == {"code": -32005, "message": "query returned more than 15 results"}
    assert proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason="too_many_results") >= 1
    within = logs_filter(chain, 0, 49)  # a range within the limit, cut from that chunk: the node's answer
    for _ in range(2):
        logs, _ = await get_logs(chain, within)
        assert logs == chain.anvil.rpc("eth_getLogs", within) and 0 < len(logs) <= 15


async def test_a_slow_chunk_makes_the_whole_call_hit_the_time_limit(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    relay = await FaultRelay(anvil.url).start()
    proxy = await make_proxy(EVM_UPSTREAM=relay.url, GETLOGS_CHUNK_BLOCKS=str(CHUNK), GETLOGS_TIMEOUT="1")
    try:
        chain = await build(anvil, proxy)
        await get_logs(chain, logs_filter(chain, 0, 99))  # one chunk held: the next call is partly cached
        relay.inject("slow", method="eth_getLogs", delay=3.0)  # the first chunk that goes upstream
        status, body, _ = await proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [logs_filter(chain, 0, 299)]}
        )
        assert status == 200 and "result" not in body
        assert body["error"] == {"code": -32005, "message": "query timeout exceeded"}
        assert proxy.metric("rpc_proxy_getlogs_limit_rejections_total", reason="timeout") == 1
    finally:
        await relay.close()


async def test_calls_of_one_key_waiting_for_a_merge_end_by_their_own_time_limit(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    """Rule (spec: an eth_getLogs query runs 10 s at most): the time a call waits for one of its key's
    merges (two at once) counts. Each waiting call started its 10 s when it got one: 12 calls of a
    key answered -32005 in pairs after 10, 20 ... 60 s (an outside attack). Here 8, limit 1 s: all by
    about 1 s."""
    keys = tmp_path / "keys.toml"
    keys.write_text("[keys.alice]\ndaily_credits = 100000\n")
    relay = await FaultRelay(anvil.url).start()
    proxy = await make_proxy(
        EVM_UPSTREAM=relay.url, API_KEYS_FILE=str(keys), GETLOGS_CHUNK_BLOCKS=str(CHUNK), GETLOGS_TIMEOUT="1"
    )
    try:
        chain = await build(anvil, proxy, events=3)
        relay.inject("slow", method="eth_getLogs", delay=10.0, times=None)
        loop = asyncio.get_running_loop()
        started = loop.time()
        answers = await asyncio.gather(
            *(
                proxy.post(
                    {"jsonrpc": "2.0", "id": i, "method": "eth_getLogs", "params": [logs_filter(chain, i, i)]},
                    key="alice",
                )
                for i in range(8)  # one block each, of one final chunk: each its own merge
            )
        )
        took = loop.time() - started
        for status, body, _ in answers:
            assert status == 200 and body["error"] == {"code": -32005, "message": "query timeout exceeded"}, body
        assert took < 3, took  # the last pair after 4 s before (the load's margin: 2 s)
        assert proxy.metric("rpc_proxy_getlogs_limit_rejections_total", reason="timeout") == 8
    finally:
        relay.clear()
        await relay.close()


async def test_a_keys_calls_filling_its_merge_places_never_delay_another_keys_merge(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    """Rule (spec: limits are per key): a key has two merge places (memory per key), and its calls that
    wait for one wait in its own queue. Alice's two merges hang on a slow node and four more of hers
    wait; Bob's merge, of another chunk, is answered meanwhile, equal to the node's."""
    keys = tmp_path / "keys.toml"
    keys.write_text("[keys.alice]\ndaily_credits = 100000\n[keys.bob]\ndaily_credits = 100000\n")
    relay = await FaultRelay(anvil.url).start()
    proxy = await make_proxy(
        EVM_UPSTREAM=relay.url, API_KEYS_FILE=str(keys), GETLOGS_CHUNK_BLOCKS=str(CHUNK), GETLOGS_TIMEOUT="5"
    )
    try:
        chain = await build(anvil, proxy, events=20)
        assert chain.finalized > 2 * CHUNK
        bobs = logs_filter(chain, CHUNK + 50, CHUNK + 60)  # a final range of the second chunk
        relay.inject(
            "slow",
            method="eth_getLogs",
            delay=10.0,
            times=None,
            where=lambda call: call.get("method") == "eth_getLogs" and int(call["params"][0]["fromBlock"], 16) < CHUNK,
        )

        def alice(i: int) -> asyncio.Task[tuple[int, Any, Any]]:
            payload = {"jsonrpc": "2.0", "id": i, "method": "eth_getLogs", "params": [logs_filter(chain, i, i)]}
            return asyncio.create_task(proxy.post(payload, key="alice"))

        queues = proxy.app[SERVICE]._merge_slots._queues  # one key's so far: alice's

        def in_queue(held: int, users: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                queue = next(iter(queues.values()), None)
                return queue is not None and 2 - queue.slots._value == held and queue.users == users

            return check

        alices = [alice(i) for i in range(2)]
        await eventually(in_queue(2, 2), what="alice's two merges in flight")
        alices += [alice(i) for i in range(2, 6)]
        await eventually(in_queue(2, 6), what="four more of alice's calls waiting")
        status, body, _ = await proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [bobs]}, key="bob"
        )
        assert status == 200 and body.get("result") == anvil.rpc("eth_getLogs", bobs), body
        assert not any(task.done() for task in alices)  # all six still waiting: bob waited behind none
        for status, body, _ in await asyncio.gather(*alices):
            assert status == 200 and body["error"]["code"] == -32005, body
    finally:
        relay.clear()
        await relay.close()


async def test_a_few_blocks_whose_receipts_are_held_are_answered_from_them(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, GETLOGS_CHUNK_BLOCKS="0")
    chain = await build(anvil, proxy, events=3)
    for _ in range(3):  # logs in unfinalized blocks too
        emit(anvil, chain.store, 2)
    latest = anvil.block_number()
    await proxy.head_at(latest)
    head = proxy.app[SERVICE].networks["evm"].tracker.head
    assert head is not None
    first, last = head.finalized - 5, head.finalized + 5  # final blocks, and unfinalized ones by hash
    for number in [*range(first, last + 1), latest - 1, latest]:
        assert (await proxy.call("eth_getBlockReceipts", [hex(number)]))["result"] is not None
    before = proxy.upstreams["evm"].calls["eth_getLogs"]
    signature = anvil.rpc("eth_getLogs", logs_filter(chain, latest, latest))[0]["topics"][0]
    for log_filter in (
        logs_filter(chain, first, last),
        logs_filter(chain, latest - 1, latest),
        {**logs_filter(chain, latest - 1, latest), "topics": [signature, "0x" + word(1)]},
    ):
        logs, cache = await get_logs(chain, log_filter)  # equal to the node's
        assert cache == "HIT"
    assert len(logs) == 2 and proxy.upstreams["evm"].calls["eth_getLogs"] == before
    _, cache = await get_logs(chain, logs_filter(chain, first - 1, last))  # no receipts held for first-1
    assert cache == "MISS" and proxy.upstreams["evm"].calls["eth_getLogs"] == before + 1


async def test_a_chunked_call_costs_the_client_the_spec_price_once(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text("[keys.alice]\ndaily_credits = 10000\n")
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=str(keys), GETLOGS_CHUNK_BLOCKS=str(CHUNK))
    chain = await build(anvil, proxy, events=5, gap=49)
    for expected in ("MISS", "HIT"):  # three chunks upstream, then none: 255 credits either way
        _, _, headers = await proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [logs_filter(chain, 0, 299)]},
            key="alice",
        )
        assert (headers["X-Cache"], headers["X-Credits-Charged"]) == (expected, "255")
    assert proxy.metric("rpc_proxy_upstream_credits_saved_total", network="evm", method="eth_getLogs") == 255


async def test_chunking_can_be_turned_off(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, GETLOGS_CHUNK_BLOCKS="0")
    chain = await build(anvil, proxy, events=3)
    await get_logs(chain, logs_filter(chain, 0, 99))
    assert asked(chain) == [(0, 99)]
