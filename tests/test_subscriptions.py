"""eth_subscribe over /ws/v3/<key>: one head feed per network, fanned out; logs filtered in the proxy;
reorgs; limits; credits. Real Anvil, the proxy on a real port, a plain WebSocket client."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.config import Settings
from proxy.credits.accounts import derived_name
from proxy.http.app_keys import SERVICE, STREAMS
from proxy.rpc.params import Rules
from proxy.streams.subscription import LogFilter, subscription_call
from tests.support import Anvil, Proxy, ProxyFactory, eventually, selector, settings_for, word
from tests.ws_client import Client, connect

EMITTED = "0x" + __import__("eth_utils").keccak(text="Emitted(uint256)").hex()
ADDR = "0x" + "ab" * 20


def numbers(heads: list[dict[str, Any]]) -> list[int]:
    return [int(h["number"], 16) for h in heads]


class TestPureParts:
    def test_log_filter_matches_address_set_and_topic_positions(self) -> None:
        flt = LogFilter.parse(
            {"address": [ADDR], "topics": [EMITTED, None, ["0x" + "11" * 32, "0x" + "22" * 32]]}, Rules()
        )
        entry = {"address": ADDR.upper().replace("0X", "0x"), "topics": [EMITTED, "0x" + "00" * 32, "0x" + "22" * 32]}
        assert flt.matches(entry)
        assert not flt.matches({**entry, "address": "0x" + "cd" * 20})
        assert not flt.matches({**entry, "topics": [EMITTED]})
        assert LogFilter.parse(None, Rules()).matches({"address": ADDR, "topics": []})

    def test_a_logs_filter_with_a_block_hash_is_refused(self) -> None:
        with pytest.raises(Exception, match="blockHash"):
            LogFilter.parse({"blockHash": "0x" + "11" * 32}, Rules())

    def test_only_single_subscription_calls_leave_the_gateway(self) -> None:
        call = subscription_call('{"jsonrpc":"2.0","id":1,"method":"eth_subscribe","params":["newHeads"]}')
        assert call is not None and call.params == ["newHeads"]
        assert subscription_call(b'{"jsonrpc":"2.0","id":1,"method":"eth_chainId","params":[]}') is None
        assert subscription_call('[{"jsonrpc":"2.0","id":1,"method":"eth_subscribe","params":["newHeads"]}]') is None


async def test_new_heads_arrive_once_each_in_order_including_a_jump(anvil: Anvil, evm_proxy: Proxy) -> None:
    await evm_proxy.head_at(0)
    client = await connect(evm_proxy)
    sub = await client.subscribe("newHeads")
    start = anvil.block_number()
    anvil.mine(1)
    anvil.mine(1)
    anvil.mine(5)
    await client.notes_until(7)
    heads = client.results(sub)
    assert numbers(heads) == list(range(start + 1, start + 8))
    assert all(a["hash"] == b["parentHash"] for a, b in itertools.pairwise(heads))
    assert (
        "transactions" not in heads[0]
        and heads[0]["hash"] == anvil.rpc("eth_getBlockByNumber", hex(start + 1), False)["hash"]
    )


async def test_a_new_subscription_is_sent_no_block_the_node_had_before_it(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """geth: a subscription is sent the heads and logs of blocks imported after it. A block the node
    had before, which the proxy's head had not reached yet, came to a new subscription with its logs
    (an outside check against Anvil: the node sent nothing, the proxy the block and its two logs)."""
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, HEAD_POLL_INTERVAL="3600")  # polled here alone
    tracker = proxy.app[SERVICE].networks["evm"].tracker
    store = anvil.deploy_store()
    await tracker.poll()
    early = await connect(proxy)
    early_heads = await early.subscribe("newHeads")  # the feed runs
    anvil.send(store, selector("emitMany(uint256)") + word(2))  # mined before `late` subscribes, unseen
    before = anvil.block_number()
    late = await connect(proxy)
    heads = await late.subscribe("newHeads")
    logs = await late.subscribe("logs", {"address": store})
    anvil.send(store, selector("emitMany(uint256)") + word(1))
    await tracker.poll()
    await early.notes_until(2)
    assert numbers(early.results(early_heads)) == [before, before + 1]  # the feed's own subscriber: both
    await late.notes_until(2)
    assert numbers(late.results(heads)) == [before + 1]
    assert [int(entry["blockNumber"], 16) for entry in late.results(logs)] == [before + 1]


async def test_a_burst_of_subscribes_asks_the_node_for_its_head_once_at_a_time(anvil: Anvil, evm_proxy: Proxy) -> None:
    # Each new subscription is sent the blocks after the node's head: the subscribes made while one
    # ask runs share it, so a burst of them is not one call to the node each.
    await evm_proxy.head_at(0)
    clients = await asyncio.gather(*(connect(evm_proxy) for _ in range(30)))
    before = evm_proxy.upstreams["evm"].calls["eth_blockNumber"]
    subs = await asyncio.gather(*(client.subscribe("newHeads") for client in clients))
    assert evm_proxy.upstreams["evm"].calls["eth_blockNumber"] - before <= 5  # 30 before
    start = anvil.block_number()
    anvil.mine(1)
    for client, sub in zip(clients, subs, strict=True):  # and every one is sent the next block
        await client.notes_until(1)
        assert numbers(client.results(sub)) == [start + 1]


async def test_logs_are_filtered_by_address_and_topics_in_the_proxy(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    other = anvil.deploy_store()
    await evm_proxy.head_at(anvil.block_number())
    client = await connect(evm_proxy)
    mine = await client.subscribe("logs", {"address": store, "topics": [EMITTED, "0x" + word(1)]})
    every = await client.subscribe("logs", {})
    anvil.send(store, selector("emitMany(uint256)") + word(3))
    anvil.send(other, selector("emitMany(uint256)") + word(2))
    await client.notes_until(6)
    assert [(r["address"], r["topics"][1]) for r in client.results(mine)] == [(store, "0x" + word(1))]
    assert len(client.results(every)) == 5
    assert all(r["removed"] is False for r in client.results(every))


async def test_logs_are_delivered_only_within_the_filters_block_bounds(anvil: Anvil, evm_proxy: Proxy) -> None:
    # geth's filterLogs: a log is sent only when fromBlock <= its block <= toBlock, for bounds that are numbers.
    store, other = anvil.deploy_store(), anvil.deploy_store()
    head = anvil.block_number()
    await evm_proxy.head_at(head)
    client = await connect(evm_proxy)
    sentinel = await client.subscribe("logs", {"address": other})
    past = await client.subscribe("logs", {"address": store, "fromBlock": "0x0", "toBlock": hex(head)})
    one = await client.subscribe("logs", {"address": store, "fromBlock": hex(head + 1), "toBlock": hex(head + 1)})
    onward = await client.subscribe("logs", {"address": store, "fromBlock": hex(head + 2), "toBlock": "latest"})
    every = await client.subscribe("logs", {"address": store})
    for _ in range(3):  # one log in each of blocks head+1, head+2, head+3
        anvil.send(store, selector("emitMany(uint256)") + word(1))
    anvil.send(other, selector("emitMany(uint256)") + word(1))
    # A connection's blocks are matched in order: the sentinel's log comes after every earlier block's.
    await client.notes_until(1 + 2 + 3 + 1)
    assert client.notes[-1]["params"]["subscription"] == sentinel

    def blocks(sub: str) -> list[int]:
        return [int(r["blockNumber"], 16) for r in client.results(sub)]

    assert blocks(every) == [head + 1, head + 2, head + 3]
    assert (blocks(past), blocks(one), blocks(onward)) == ([], [head + 1], [head + 2, head + 3])


@pytest.mark.parametrize(
    "bounds",
    [
        {"fromBlock": "0x5", "toBlock": "0x2"},
        {"fromBlock": "latest", "toBlock": "0x2"},
        {"toBlock": "0x2"},
        {"fromBlock": "finalized"},
        {"fromBlock": "pending"},
        {"fromBlock": "0x1", "toBlock": "pending"},
    ],
)
async def test_a_logs_subscription_refuses_block_bounds_geth_refuses(evm_proxy: Proxy, bounds: dict[str, str]) -> None:
    # geth's SubscribeLogs: no pending logs; numbers with to >= from, or from a number to latest, else refused.
    client = await connect(evm_proxy)
    refused = await client.call("eth_subscribe", "logs", bounds)
    assert refused["error"]["code"] == -32602 and "filter" in refused["error"]["message"], refused
    for accepted in ({"fromBlock": "0x2", "toBlock": "0x2"}, {"fromBlock": "0x2"}, {"toBlock": "latest"}):
        assert "result" in await client.call("eth_subscribe", "logs", accepted)


async def test_a_reorg_delivers_the_replacement_heads_and_removed_logs(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    await evm_proxy.head_at(anvil.block_number())
    client = await connect(evm_proxy)
    heads = await client.subscribe("newHeads")
    logs = await client.subscribe("logs", {"address": store})
    receipt = anvil.send(store, selector("emitMany(uint256)") + word(2))
    await client.notes_until(3)  # the block and its two logs
    old_hash = receipt["blockHash"]

    anvil.rpc("anvil_reorg", 1, [])  # the block holding the logs is replaced by an empty one
    await client.notes_until(6)
    removed = [r for r in client.results(logs) if r["removed"]]
    expected = [(old_hash, "0x" + word(0)), (old_hash, "0x" + word(1))]
    assert [(r["blockHash"], r["topics"][1]) for r in removed] == expected
    replacement = client.results(heads)[-1]
    assert int(replacement["number"], 16) == int(receipt["blockNumber"], 16) and replacement["hash"] != old_hash
    assert replacement["hash"] == anvil.rpc("eth_getBlockByNumber", "latest", False)["hash"]


async def head_with(client: Client, sub: str, block_hash: str) -> None:
    """Notifications read until `sub` delivers the head `block_hash` (15 s at most)."""
    async with asyncio.timeout(15):
        while block_hash not in [h["hash"] for h in client.results(sub)]:
            await client.notes_until(len(client.notes) + 1)


@pytest.mark.parametrize(
    "mined, again",
    [(70, 75), (100, 3), (200, 250), (300, 1), (15, 200)],
    ids=["longer", "shorter", "more than a catch-up", "far shorter", "then a jump"],
)
async def test_a_reorg_below_the_trackers_window_delivers_the_new_chain_from_where_they_meet(
    anvil: Anvil, evm_proxy: Proxy, mined: int, again: int
) -> None:
    """Rule: every block is delivered once, in order, after a reorg too. One deeper than the tracker's
    window (a dev node's snapshot, `mined` blocks, revert, `again` new ones: past its finalized
    block) left the delivered chain and the node's apart for good: no head or log reached any
    subscriber of the network again, a new one included (an outside attack); then the new chain
    came from 64 blocks down, the blocks under it left at their replaced hashes, or (a shorter
    chain) not at all until it passed the old height, or (more than 128 blocks replaced) from 128
    blocks down, skipping the rest, or (far shorter, or a jump past the tracker's window right after)
    never (re-attacks)."""
    store = anvil.deploy_store()
    await evm_proxy.head_at(anvil.block_number())
    client = await connect(evm_proxy)
    heads = await client.subscribe("newHeads")
    logs = await client.subscribe("logs", {"address": store})
    snapshot, meeting = anvil.rpc("evm_snapshot"), anvil.block_number()
    anvil.mine(mined - 10)
    receipt = anvil.send(store, selector("emitMany(uint256)") + word(1))  # unfinalized at the revert
    anvil.mine(9)
    await head_with(client, heads, anvil.rpc("eth_getBlockByNumber", "latest", False)["hash"])
    assert anvil.rpc("evm_revert", snapshot) is True
    anvil.mine(again)
    later = await connect(evm_proxy)
    fresh = await later.subscribe("newHeads")
    anvil.mine(1)
    latest = anvil.rpc("eth_getBlockByNumber", "latest", False)
    await head_with(client, heads, latest["hash"])
    await head_with(later, fresh, latest["hash"])
    removed = [r for r in client.results(logs) if r["removed"]]
    assert [r["blockHash"] for r in removed] == [receipt["blockHash"]]
    delivered = client.results(heads)
    # The new chain's first block: the last delivered at the height after where the chains meet.
    first_new = max(i for i, h in enumerate(delivered) if int(h["number"], 16) == meeting + 1)
    new_chain = delivered[first_new:]  # from where the chains meet, each block once, each the last's child
    assert numbers(new_chain) == list(range(meeting + 1, anvil.block_number() + 1))
    assert all(b["parentHash"] == a["hash"] for a, b in itertools.pairwise(new_chain))


async def test_a_revert_past_every_block_remembered_goes_on_from_the_nodes_head(anvil: Anvil, evm_proxy: Proxy) -> None:
    """Rule: the feed remembers its last 512 blocks; a revert below all of them (a snapshot, 600
    blocks, revert) goes on from the node's head, each block after it delivered, each the last one's
    child. It failed one pass (`max()` of nothing) and dropped the next blocks and their logs (a
    re-attack)."""
    store = anvil.deploy_store()
    await evm_proxy.head_at(anvil.block_number())
    client = await connect(evm_proxy)
    heads = await client.subscribe("newHeads")
    logs = await client.subscribe("logs", {"address": store})
    snapshot = anvil.rpc("evm_snapshot")
    anvil.mine(600)
    await head_with(client, heads, anvil.rpc("eth_getBlockByNumber", "latest", False)["hash"])
    assert anvil.rpc("evm_revert", snapshot) is True
    reverted = anvil.rpc("eth_getBlockByNumber", "latest", False)["hash"]
    await eventually(lambda: _seen(evm_proxy, reverted), 15, "the tracker to take the reverted chain")
    receipt = anvil.send(store, selector("emitMany(uint256)") + word(1))
    anvil.mine(2)
    await head_with(client, heads, anvil.rpc("eth_getBlockByNumber", "latest", False)["hash"])
    after = [h for h in client.results(heads) if int(h["number"], 16) > int(receipt["blockNumber"], 16) - 1]
    after = after[[h["hash"] for h in after].index(receipt["blockHash"]) :]
    assert numbers(after) == list(range(int(receipt["blockNumber"], 16), anvil.block_number() + 1))
    assert all(b["parentHash"] == a["hash"] for a, b in itertools.pairwise(after))
    assert [r["blockHash"] for r in client.results(logs) if not r["removed"]] == [receipt["blockHash"]]


async def _seen(proxy: Proxy, block_hash: str) -> bool:
    head = proxy.app[SERVICE].networks["evm"].tracker.head
    return head is not None and head.latest_hash == block_hash


async def test_ids_are_unique_unknown_unsubscribe_is_false_and_unsubscribe_stops_delivery(
    anvil: Anvil,
    evm_proxy: Proxy,
) -> None:
    client = await connect(evm_proxy)
    first, second = await client.subscribe("newHeads"), await client.subscribe("newHeads")
    assert first != second
    assert (await client.call("eth_unsubscribe", "0x" + "00" * 16))["result"] is False
    assert (await client.call("eth_unsubscribe", first))["result"] is True
    assert (await client.call("eth_unsubscribe", first))["result"] is False
    anvil.mine(1)
    anvil.mine(1)
    await client.notes_until(2)
    assert {n["params"]["subscription"] for n in client.notes} == {second}


async def test_closing_the_socket_ends_its_subscriptions(evm_proxy: Proxy) -> None:
    client = await connect(evm_proxy)
    await client.subscribe("newHeads")
    await client.subscribe("logs")
    feed = evm_proxy.app[STREAMS].feeds["evm"]
    assert feed.active and evm_proxy.metric("rpc_proxy_subscriptions", kind="logs") == 1
    await client.ws.close()

    async def gone() -> bool:
        return not feed.active and evm_proxy.metric("rpc_proxy_subscriptions", kind="newHeads") == 0

    await eventually(gone, 5, "the feed to lose its subscribers")


async def test_subscriptions_per_connection_are_limited(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, WS_MAX_SUBSCRIPTIONS="2")
    client = await connect(proxy)
    await client.subscribe("newHeads")
    await client.subscribe("logs")
    refused = await client.call("eth_subscribe", "newHeads")
    assert refused["error"]["code"] == -32005 and "WS_MAX_SUBSCRIPTIONS" in refused["error"]["message"]
    other = await connect(proxy)  # the limit is per connection
    await other.subscribe("newHeads")


async def test_kinds_the_proxy_cannot_serve_get_a_clear_error(evm_proxy: Proxy) -> None:
    client = await connect(evm_proxy)
    pending = await client.call("eth_subscribe", "newPendingTransactions")
    assert pending["error"]["code"] == -32601 and "EVM_UPSTREAM_WS" in pending["error"]["message"]
    unknown = await client.call("eth_subscribe", "colours")
    assert unknown["error"]["code"] == -32602 and "colours" in unknown["error"]["message"]
    bad = await client.call("eth_subscribe", "logs", {"topics": ["nope"]})
    assert bad["error"]["code"] == -32602 and "filter.topics" in bad["error"]["message"]
    solana = await client.call("slotSubscribe")
    assert solana["error"]["code"] == -32601


async def test_eth_subscribe_over_http_says_it_needs_a_websocket(evm_proxy: Proxy) -> None:
    reply = await evm_proxy.call("eth_subscribe", ["newHeads"])
    assert reply["error"]["code"] == -32601 and "WebSocket" in reply["error"]["message"]


async def test_200_subscribers_share_one_head_stream_and_one_log_fetch_per_block(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url)
    clients: list[Client] = []
    unbounded = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))  # the default stops at 100
    try:
        store = anvil.deploy_store()
        await proxy.head_at(anvil.block_number())
        for _ in range(200):  # 200 subscribers, each to heads and logs
            client = await connect(proxy, session=unbounded)
            await client.subscribe("newHeads")
            await client.subscribe("logs", {"address": store})
            clients.append(client)
        counting = proxy.upstreams["evm"]
        counting.batched.clear()
        start = anvil.block_number()
        blocks = 4
        for _ in range(blocks):
            anvil.send(store, selector("emitMany(uint256)") + word(1))
        for client in clients:
            await client.notes_until(2 * blocks)
            assert numbers([n["params"]["result"] for n in client.notes if "number" in n["params"]["result"]]) == list(
                range(start + 1, start + blocks + 1)
            )
        # Whatever the number of subscribers: per block one header and one eth_getLogs, no eth_subscribe.
        assert counting.batched["eth_getLogs"] == blocks
        assert counting.batched["eth_getBlockByHash"] + counting.batched.get("eth_getBlockByNumber", 0) >= blocks
        polls = [b for b in counting.batches if [m for m, _ in b][:1] == ["eth_getBlockByNumber"]]
        assert counting.batched["eth_getBlockByHash"] == blocks
        assert len(polls) > 0
    finally:
        for client in clients:
            await client.ws.close()
        await unbounded.close()


async def test_a_consumer_that_stops_reading_is_disconnected_not_buffered(
    anvil: Anvil,
    caplog: pytest.LogCaptureFixture,
    make_proxy: ProxyFactory,
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, WS_SEND_BUFFER_BYTES="20000")
    await proxy.head_at(0)
    # A raw socket with a tiny receive window that never reads what it is sent.
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", proxy.server.port))
    await loop.sock_sendall(
        sock,
        b"GET /ws/v3/test-key HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n",
    )
    assert b" 101 " in await loop.sock_recv(sock, 1024)
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "eth_subscribe", "params": ["newHeads"]}).encode()
    await loop.sock_sendall(sock, bytes([0x81, 0x80 | len(body)]) + b"\x00\x00\x00\x00" + body)  # masked, key 0
    connections = proxy.metric("rpc_proxy_websocket_connections")
    assert connections == 1

    async def dropped() -> bool:
        if proxy.metric("rpc_proxy_websocket_connections") == 0:
            return True
        anvil.mine(20)
        await asyncio.sleep(0.05)
        return False

    await eventually(dropped, 60, "the slow consumer to be disconnected")
    assert "fell behind by more than 20000 bytes" in caplog.text
    assert proxy.metric("rpc_proxy_slow_consumer_disconnects_total") == 1
    sock.close()


def _keyed(anvil: Anvil, **extra: str) -> Settings:
    return settings_for(EVM_UPSTREAM=anvil.url, API_KEYS="alice", **extra)


async def test_subscribe_and_each_notification_are_charged_per_kind(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(_keyed(anvil, SUBSCRIPTION_CREDITS="subscribe=7,newHeads=11"))
    await proxy.head_at(0)
    client = await connect(proxy, "alice")
    await client.subscribe("newHeads")
    anvil.mine(1)
    anvil.mine(1)
    await client.notes_until(2)

    async def charged() -> bool:
        return proxy.metric("rpc_proxy_key_credits_charged_total", key=derived_name("alice")) == 7 + 2 * 11

    await eventually(charged, 5, "credits to be charged")
    assert proxy.metric("rpc_proxy_credits_charged_total", method="newHeads") == 22


async def test_an_exhausted_key_gets_an_error_on_each_subscription_and_they_close(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(_keyed(anvil, DAILY_CREDITS="120", SUBSCRIPTION_CREDITS="subscribe=10,newHeads=50"))
    await proxy.head_at(0)
    client = await connect(proxy, "alice")
    heads = await client.subscribe("newHeads")
    logs = await client.subscribe("logs")
    anvil.mine(1)  # 20 + 50 = 70
    anvil.mine(1)  # 120: the last one paid for
    anvil.mine(1)  # refused: both subscriptions end with an error
    await client.notes_until(4)
    assert numbers(client.results(heads)) == [1, 2]
    errors = [n["params"] for n in client.notes if "error" in n["params"]]
    assert sorted(e["subscription"] for e in errors) == sorted([heads, logs])
    assert all(e["error"]["code"] == -32005 and "daily credit limit" in e["error"]["message"] for e in errors)
    assert (await client.call("eth_unsubscribe", heads))["result"] is False  # already closed
    assert not proxy.app[STREAMS].feeds["evm"].active


async def test_notifications_held_past_ws_max_lag_by_the_keys_per_second_limit_end_its_subscriptions_not_the_connection(
    anvil: Anvil, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """Rule: a client that reads is never closed as a slow consumer for what its key's per-second
    limit holds back; past WS_MAX_LAG its subscriptions end with the limit's error (-32005) and the
    connection stays. Another key's subscriptions on the same proxy go on being served."""
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.alice]\nkey = "alice"\ncredits_per_second = 100\n\n[keys.bob]\nkey = "bob"\n')
    proxy = await make_proxy(
        settings_for(
            EVM_UPSTREAM=anvil.url,
            API_KEYS_FILE=str(keys),
            SUBSCRIPTION_CREDITS="subscribe=1,newHeads=50",
            WS_MAX_LAG="1",
        )
    )
    await proxy.head_at(0)
    client, other = await connect(proxy, "alice"), await connect(proxy, "bob")
    subs = [await client.subscribe("newHeads") for _ in range(4)]  # 200 credits a block, 100 a second
    others = await other.subscribe("newHeads")  # bob's key has no per-second limit
    reader = asyncio.create_task(client.notes_until(10**6, timeout=120))  # it reads all it is sent
    other_reader = asyncio.create_task(other.notes_until(10**6, timeout=120))

    def ended() -> set[str]:
        return {n["params"]["subscription"] for n in client.notes if "error" in n["params"]}

    async def all_ended() -> bool:
        assert not reader.done(), reader  # closed (1008 slow consumer) instead
        if ended() == set(subs):
            return True
        anvil.mine(1)
        return False

    try:
        await eventually(all_ended, 60, "every subscription to end with the limit's error")
        errors = [n["params"]["error"] for n in client.notes if "error" in n["params"]]
        assert len(errors) == len(subs)
        assert all(e["code"] == -32005 and "WS_MAX_LAG" in e["message"] for e in errors), errors
        top = anvil.block_number() + 1
        anvil.mine(1)

        async def other_got_it() -> bool:
            assert not other_reader.done(), other_reader
            return any(int(head["number"], 16) >= top for head in other.results(others))

        await eventually(other_got_it, 30, "the other key's subscription to go on")
        assert not any("error" in n["params"] for n in other.notes)
    finally:
        for task in (reader, other_reader):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert not client.ws.closed
    assert (await client.call("eth_unsubscribe", subs[0]))["result"] is False  # already ended
    assert proxy.metric("rpc_proxy_slow_consumer_disconnects_total") == 0
    assert (await other.call("eth_unsubscribe", others))["result"] is True
    assert not proxy.app[STREAMS].feeds["evm"].active


async def test_a_subscription_the_key_cannot_pay_for_is_refused(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(_keyed(anvil, DAILY_CREDITS="4"))  # eth_subscribe costs 5 by default
    client = await connect(proxy, "alice")
    asked = proxy.upstreams["evm"].calls["eth_blockNumber"]
    refused = await client.call("eth_subscribe", "newHeads")
    assert refused["error"]["code"] == -32005 and "daily credit limit" in refused["error"]["message"]
    assert not proxy.app[STREAMS].feeds["evm"].active
    assert proxy.upstreams["evm"].calls["eth_blockNumber"] == asked  # the node's head asked for none refused
