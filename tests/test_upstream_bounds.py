"""Every upstream reply is read under a byte bound (MAX_RESPONSE_BYTES; a batch counted whole).

A hostile upstream (tests/fault_relay.BombRelay, in front of a FakeEvm) answers with a gzip bomb
(about 400 KB inflating to 400 MB), 300 MB chunked, 300 MB until the connection closes, or a
declared Content-Length of 300 MB. The rules checked:

- the reply is refused unread past its bound (the connection dropped: the relay sent little of it),
  an encoded one at its headers (only identity is asked, nothing is inflated);
- the caller hears a clear JSON-RPC error: -32005 "response size exceeded" for a size, -32002 (502)
  for an encoding, never a 500 nor a hang;
- the node is asked once: an over-large call is never asked again alone, nor of the same node. (A
  batch answered in an encoding is a batch refused, as a garbled one: its calls go alone, unproven
  and never kept, as to a node that refuses batches. The bomb itself is never read.)
- nothing is kept: the same call asked again goes upstream again;
- the proxy process (`python -m proxy`) grows by less than 160 MB of RSS over all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.metrics import Metrics
from proxy.rpc.jsonrpc import LIMIT_EXCEEDED, UPSTREAM_UNAVAILABLE, JsonRpcError
from proxy.streams.head_feed import FeedError, FeedReads
from proxy.upstream.pool import HttpUpstream, Upstream
from proxy.upstream.ws import UpstreamSocket
from proxy.values import Answer
from tests.fake_evm import FakeEvm
from tests.fault_relay import BOMB_BYTES, BOMBS, BombRelay, Calls, gzip_bomb
from tests.memory_fill import ProxyProcess, rss_bytes
from tests.support import fake_server

ADDRESS = "0x" + "ab" * 20
FINAL = "0x1"  # final from the start on a FakeEvm
MAX_REPLY = 32 * 2**20  # MAX_RESPONSE_BYTES' default
RSS_GROWTH_MAX = 160 * 2**20
# What the relay may write before the proxy drops it: the bound, its wire slack, and the socket
# buffers of both ends (a few MB on loopback). Far below the bomb's 300 MB.
SENT_MAX = MAX_REPLY + MAX_REPLY // 16 + 16 * 2**20


def anything(_calls: Calls, _is_batch: bool) -> bool:
    return True


def expected_code(bomb: str) -> int:
    return UPSTREAM_UNAVAILABLE if bomb == "gzip" else LIMIT_EXCEEDED


@pytest.fixture
async def relay() -> AsyncIterator[BombRelay]:
    gzip_bomb()  # made once, before any deadline runs
    node = await FakeEvm().start()
    hostile = await BombRelay(node.url).start()
    yield hostile
    await hostile.close()
    await node.close()


# --- the pool's every way of reading a reply, in process -------------------------------------


def storage(slot: int) -> tuple[str, list[Any]]:
    return "eth_getStorageAt", [ADDRESS, hex(slot), FINAL]


def paths(pool: HttpUpstream) -> dict[str, Callable[[], Awaitable[Any]]]:
    """Each way the pool reads a reply: a call alone, an auto-batch of client reads, a proven read
    (its header in the same batch), one to a chosen upstream, ask() (identity probes, head polls),
    and the tracker's and feed's batches."""
    return {
        "single": lambda: pool.request("eth_estimateGas", [{"to": ADDRESS}]),
        "auto_batch": lambda: asyncio.gather(*(pool.request(*storage(i)) for i in range(3))),
        "proven": lambda: pool.proven(*storage(7), FINAL),
        "proven_to": lambda: pool.proven(*storage(8), FINAL, index=0, timeout=10),
        "ask": lambda: pool.ask(0, "eth_blockNumber", [], timeout=10),
        "batch": lambda: pool.batch([("eth_getLogs", [{"blockHash": "0x" + "11" * 32}]), storage(9)]),
        "together": lambda: pool.together([storage(10), ("eth_getBlockByNumber", ["latest", False])]),
    }


@pytest.mark.parametrize("bomb", BOMBS)
async def test_every_pool_path_refuses_a_bomb_once_and_unread_past_its_bound(relay: BombRelay, bomb: str) -> None:
    pool = HttpUpstream(
        "evm", [relay.url], timeout=20, metrics=Metrics(CollectorRegistry()), batch_max=50, max_reply_bytes=MAX_REPLY
    )
    try:
        for name, read in paths(pool).items():
            before = len(relay.requests)
            relay.arm(bomb, anything)
            started = time.monotonic()
            try:
                await read()
            except JsonRpcError as refused:
                assert refused.code == expected_code(bomb), (name, refused.message)
                assert refused.http_status != 500
            else:  # only a refused batch's calls, asked alone
                assert bomb == "gzip" and name in ("auto_batch", "proven"), name
            assert time.monotonic() - started < 10, name  # refused at once, never read to its end
            asked = relay.requests[before:]
            assert asked[0].bomb == bomb and not any(r.bomb for r in asked[1:])
            shown = [(r.is_batch, [c["method"] for c in r.calls]) for r in asked]
            assert len(asked) == 1 or (bomb == "gzip" and not any(r.is_batch for r in asked[1:])), (name, shown)
            await until(lambda r=asked[0]: r.exploded, "the relay to stop writing its bomb")
            assert asked[0].bomb_sent < (len(gzip_bomb()) + 1 if bomb == "gzip" else SENT_MAX), name
            await read()  # the node answers again: the pool and its connections still serve
    finally:
        await pool.close()


async def test_a_batch_is_bounded_as_a_whole_and_its_calls_are_not_asked_again_alone(relay: BombRelay) -> None:
    """Each answer small, together past the bound: the batch is refused and none of its calls is
    asked again alone (the node would send them all once more)."""
    pool = HttpUpstream(
        "evm", [relay.url], timeout=20, metrics=Metrics(CollectorRegistry()), batch_max=50, max_reply_bytes=256 * 1024
    )
    try:
        calls = [("eth_call", [{"to": ADDRESS, "data": hex(i)}, FINAL]) for i in range(3)]  # 100 KB each
        assert len(await pool.batch(calls[:1])) == 1
        before = len(relay.requests)
        with pytest.raises(JsonRpcError) as refused:
            await pool.batch(calls)
        assert refused.value.code == LIMIT_EXCEEDED
        assert len(relay.requests) == before + 1
    finally:
        await pool.close()


# --- the proxy process, from its clients -------------------------------------------------------


@pytest.fixture
async def proxy(relay: BombRelay) -> AsyncIterator[ProxyProcess]:
    process = ProxyProcess(relay.url, 64 * 2**20)
    yield process
    process.stop()


def call(method: str, params: list[Any], rid: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}


def storage_call(slot: int, rid: int = 1) -> dict[str, Any]:
    return call(*storage(slot), rid)


async def post(session: aiohttp.ClientSession, proxy: ProxyProcess, body: Any) -> tuple[int, Any, str]:
    async with session.post(proxy.url, json=body, timeout=aiohttp.ClientTimeout(total=30)) as response:
        return response.status, await response.json(content_type=None), response.headers.get("X-Cache", "")


async def until_head(session: aiohttp.ClientSession, proxy: ProxyProcess) -> None:
    """Until the tracker has polled: a final read is then a MISS or a HIT (proven), not a BYPASS."""
    deadline = time.monotonic() + 30
    while True:
        status, _, cache = await post(session, proxy, storage_call(0))
        if status == 200 and cache in ("MISS", "HIT"):
            return
        assert time.monotonic() < deadline, "the proxy's head tracker never polled"
        await asyncio.sleep(0.05)


def errors_of(reply: Any) -> list[dict[str, Any]]:
    return [item.get("error") or {} for item in (reply if isinstance(reply, list) else [reply])]


async def refused_once(
    session: aiohttp.ClientSession,
    proxy: ProxyProcess,
    relay: BombRelay,
    bomb: str,
    body: Any,
    match: Callable[[Calls, bool], bool],
) -> None:
    """`body` meets `bomb`: a clear error, the node asked once; asked again, it goes upstream again."""
    before = len(relay.requests)
    relay.arm(bomb, match)
    status, reply, _ = await post(session, proxy, body)
    assert status in (200, 502), (status, reply)
    asked = [r for r in relay.requests[before:] if match(r.calls, r.is_batch)]
    shown = [(r.is_batch, [c["method"] for c in r.calls]) for r in asked]
    assert asked and asked[0].bomb == bomb and not any(r.bomb for r in asked[1:]), (shown, reply)
    if bomb == "gzip" and asked[0].is_batch and len(asked) > 1:  # a refused batch: its calls went alone
        assert not any(r.is_batch for r in asked[1:]), shown
    else:
        assert len(asked) == 1, shown
        assert [e.get("code") for e in errors_of(reply)] == [expected_code(bomb)] * len(errors_of(reply)), reply
    again = len(relay.requests)
    status, reply, cache = await post(session, proxy, body)  # nothing was kept: the node is asked again
    assert status == 200 and not {e.get("code") for e in errors_of(reply)} & {LIMIT_EXCEEDED, UPSTREAM_UNAVAILABLE}, (
        reply
    )  # the node's own answer (the fake has no eth_estimateGas: its error)
    assert cache != "HIT" and any(match(r.calls, r.is_batch) for r in relay.requests[again:])


def asks_slot(slot: int) -> Callable[[Calls, bool], bool]:
    return lambda calls, _batch: any(
        c.get("method") == "eth_getStorageAt" and int(c["params"][1], 16) == slot for c in calls
    )  # the proxy may send the slot as a 32-byte word


def asks_estimate(calls: Calls, _is_batch: bool) -> bool:
    return any(c.get("method") == "eth_estimateGas" for c in calls)


def head_poll(calls: Calls, _is_batch: bool) -> bool:
    """The tracker's poll: the only request that asks the `safe` block."""
    return any(c.get("method") == "eth_getBlockByNumber" and c["params"][0] == "safe" for c in calls)


@pytest.mark.slow
async def test_bombs_to_every_client_path_and_the_head_poll_leave_the_proxy_process_small(
    relay: BombRelay,
    proxy: ProxyProcess,
) -> None:
    async with aiohttp.ClientSession() as session:
        await until_head(session, proxy)
        for warm in range(3):  # the paths' code and buffers are in use once before the baseline
            await post(session, proxy, [storage_call(1000 + warm * 10 + i, i) for i in range(3)])
        baseline = rss_bytes(proxy.proc.pid)
        growth: dict[str, int] = {}
        slot = 100
        for bomb in BOMBS:
            slot += 10
            # A call alone (forwarded, never cached).
            await refused_once(session, proxy, relay, bomb, call("eth_estimateGas", [{"to": ADDRESS}]), asks_estimate)
            growth[f"{bomb} single"] = rss_bytes(proxy.proc.pid) - baseline
            # A proven read: a final block's storage, its header in the same batch.
            await refused_once(session, proxy, relay, bomb, storage_call(slot), asks_slot(slot))
            growth[f"{bomb} proven"] = rss_bytes(proxy.proc.pid) - baseline
            # A client's batch: its reads auto-batched into one upstream batch, with one header.
            batch = [storage_call(slot + i, i) for i in range(1, 4)]
            await refused_once(session, proxy, relay, bomb, batch, asks_slot(slot + 1))
            growth[f"{bomb} batch"] = rss_bytes(proxy.proc.pid) - baseline
            # The tracker's head poll: it fails, and is not asked again call by call.
            before = len(relay.requests)
            relay.arm(bomb, head_poll)
            await until(lambda b=before: any(r.bomb for r in relay.requests[b:]), "the head poll to be bombed")
            polled = len(relay.requests)

            def next_poll(p: int = polled) -> bool:
                return any(head_poll(r.calls, r.is_batch) for r in relay.requests[p:])

            await until(next_poll, "the next head poll")
            following = next(r for r in relay.requests[polled:] if head_poll(r.calls, r.is_batch))
            assert following.is_batch and len(following.calls) >= 3  # still one batch, not its calls alone
            growth[f"{bomb} head poll"] = rss_bytes(proxy.proc.pid) - baseline
        assert proxy.proc.poll() is None
        status, reply, _ = await post(session, proxy, storage_call(1))
        assert status == 200 and "result" in reply
    print(
        "\nRSS growth of the proxy process over its baseline (MB): "
        + ", ".join(f"{name} {value / 2**20:.0f}" for name, value in growth.items())
    )
    assert max(growth.values()) < RSS_GROWTH_MAX, growth


async def until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_the_bombs_are_what_they_claim() -> None:
    """The gzip bomb is small on the wire and inflates to hundreds of MB (checked by streaming)."""
    packed = gzip_bomb()
    assert len(packed) < 512 * 1024
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    size = 0
    for i in range(0, len(packed), 4096):
        size += len(inflater.decompress(packed[i : i + 4096]))
    assert size >= 400 * 2**20 and BOMB_BYTES == 300 * 2**20


async def test_an_upstream_websocket_message_over_the_bound_is_not_read_and_the_socket_moves_on() -> None:
    """The rule: a node's WebSocket message is read up to MAX_RESPONSE_BYTES; a larger one closes that
    socket at its frame header, and the subscriptions it carried are opened again."""
    connections: list[int] = []

    async def node(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        connections.append(1)
        async for message in ws:
            asked = json.loads(message.data)
            await ws.send_str(json.dumps({"jsonrpc": "2.0", "id": asked["id"], "result": "0xsub"}))
            note = {"jsonrpc": "2.0", "method": "eth_subscription", "params": {"subscription": "0xsub"}}
            await ws.send_str(json.dumps({**note, "params": {**note["params"], "result": "small"}}))
            if len(connections) == 1:  # the first connection only: a message of 1 MB, past the 64 KB bound
                with contextlib.suppress(ConnectionError):
                    await ws.send_str(json.dumps({**note, "params": {**note["params"], "result": "0" * 2**20}}))
        return ws

    app = web.Application()
    app.router.add_get("/", node)
    server = await fake_server(app)
    socket = UpstreamSocket("evm", [f"ws://127.0.0.1:{server.port}/"], timeout=5, max_message=64 * 1024)
    notes: list[Any] = []
    try:
        await socket.subscribe(
            "eth_subscribe",
            ["newPendingTransactions"],
            on_ok=lambda: None,
            on_notify=lambda _m, result: notes.append(result),
            on_lost=lambda: None,
        )
        await until(lambda: socket.resubscribed >= 1 and len(notes) >= 2, "the subscription opened again")
        assert notes == ["small", "small"] and len(connections) == 2
    finally:
        await socket.close()
        await server.close()


class LogsOverTwoBlocks:
    """An upstream whose batch of logs passes the bound when it holds more than two blocks, or block 0xbad."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    async def batch(self, calls: Sequence[tuple[str, Any]]) -> list[Answer]:
        hashes = [params[0]["blockHash"] for _, params in calls]
        self.batches.append(hashes)
        if len(calls) > 2 or "0xbad" in hashes:
            raise JsonRpcError(LIMIT_EXCEEDED, "response size exceeded: the node's answer (a reply of over 32 bytes)")
        return [Answer(b"[]", [{"blockHash": h}]) for h in hashes]


async def test_the_feeds_catch_up_too_large_as_a_whole_is_read_in_halves_and_a_block_too_large_alone_fails() -> None:
    upstream = LogsOverTwoBlocks()
    reads = FeedReads(cast(Upstream, upstream))
    hashes = [f"0x{i}" for i in range(5)]
    logs = await reads.logs(hashes)
    assert [entries[0]["blockHash"] for entries in logs] == hashes  # in order, all of them
    assert upstream.batches == [hashes, hashes[:2], hashes[2:], hashes[2:3], hashes[3:]]
    with pytest.raises(FeedError, match="raise MAX_RESPONSE_BYTES"):
        await reads.logs(["0xbad"])
