"""The node's own WebSocket behind the proxy (EVM_UPSTREAM_WS, or ws:// upstreams in NETWORKS_FILE):
pushed heads reach subscribers without waiting for a poll, and kinds the proxy does not serve itself
(newPendingTransactions) are relayed to it, and opened again on the next upstream socket when theirs drops."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy import via
from proxy.config import ConfigError, build_settings
from proxy.http.app_keys import STREAMS
from proxy.upstream.ws import Route, RouteTable
from tests.support import (
    DEV_ACCOUNT,
    Anvil,
    Proxy,
    ProxyFactory,
    eventually,
    fake_server,
    free_port,
    selector,
    word,
)
from tests.test_front_door import _first_answer, _serving
from tests.ws_client import Client, connect

CHAIN_ID = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}


def ws_of(anvil: Anvil) -> str:
    return anvil.url.replace("http://", "ws://")


async def _pushed_heads_and_logs(anvil: Anvil, proxy: Proxy, store: str) -> tuple[Client, str, str]:
    """A client subscribed to newHeads and to the store's logs, once the feed has the node's pushed heads."""
    await proxy.head_at(anvil.block_number())
    client = await connect(proxy)
    heads = await client.subscribe("newHeads")
    logs = await client.subscribe("logs", {"address": store})
    feed = proxy.app[STREAMS].feeds["evm"]

    async def pushing() -> bool:
        return feed.push_live

    await eventually(pushing, 5, "the feed's push subscription on the node")
    return client, heads, logs


async def test_pushed_heads_and_their_logs_arrive_without_waiting_for_a_poll(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    store = anvil.deploy_store()
    # One poll at startup, the next a minute later: only the node's push can deliver these blocks.
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=ws_of(anvil), HEAD_POLL_INTERVAL="60")
    client, heads, logs = await _pushed_heads_and_logs(anvil, proxy, store)
    start = anvil.block_number()
    anvil.send(store, selector("emitMany(uint256)") + word(1))
    anvil.mine(1)
    await client.notes_until(3)
    assert [int(h["number"], 16) for h in client.results(heads)] == [start + 1, start + 2]
    assert [entry["blockNumber"] for entry in client.results(logs)] == [hex(start + 1)]


async def test_new_pending_transactions_are_relayed_to_the_nodes_websocket(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=ws_of(anvil))
    client = await connect(proxy)
    pending = await client.subscribe("newPendingTransactions")
    tx_hash = anvil.rpc("eth_sendTransaction", {"from": DEV_ACCOUNT, "to": DEV_ACCOUNT, "value": "0x1"})
    await client.notes_until(1)
    assert client.results(pending) == [tx_hash]
    assert (await client.call("eth_unsubscribe", pending))["result"] is True


async def test_a_websocket_upstream_of_another_chain_is_never_used(
    anvil: Anvil, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Rule (README, one chain per network): a WebSocket upstream is asked its chain identity on each
    connection and held to the network's, as the HTTP upstreams are; one of another chain carries no
    subscription (its pending transactions, heads and logs are another chain's)."""
    other = Anvil("--chain-id", "5")
    try:
        proxy = await make_proxy(EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=ws_of(other))
        await proxy.head_at(anvil.block_number())
        client = await connect(proxy)
        refused = await client.call("eth_subscribe", "newPendingTransactions")
        assert refused["error"]["code"] == -32002 and "serves chain id 5" in refused["error"]["message"], refused
        assert any("not used" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
        other.rpc("eth_sendTransaction", {"from": DEV_ACCOUNT, "to": DEV_ACCOUNT, "value": "0x1"})

        # The network's own node after it: taken, and only its transactions are relayed.
        both = await make_proxy(EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=f"{ws_of(other)},{ws_of(anvil)}")
        await both.head_at(anvil.block_number())
        relayed = await connect(both)
        pending = await relayed.subscribe("newPendingTransactions")
        other.rpc("eth_sendTransaction", {"from": DEV_ACCOUNT, "to": DEV_ACCOUNT, "value": "0x2"})
        tx_hash = anvil.rpc("eth_sendTransaction", {"from": DEV_ACCOUNT, "to": DEV_ACCOUNT, "value": "0x1"})
        await relayed.notes_until(1)
        assert relayed.results(pending) == [tx_hash]
    finally:
        other.stop()


def test_ws_upstreams_in_a_networks_file_are_the_nodes_websocket(tmp_path: Path) -> None:
    path = tmp_path / "networks.toml"
    path.write_text('[networks.main]\nfamily = "evm"\nupstreams = ["http://127.0.0.1:1", "ws://127.0.0.1:1"]\n')
    (network,) = build_settings({"NETWORKS_FILE": str(path)}).networks
    assert network.upstreams == ("http://127.0.0.1:1",) and network.ws_upstreams == ("ws://127.0.0.1:1",)


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"EVM_UPSTREAM": "http://x", "EVM_UPSTREAM_WS": "http://x"}, "EVM_UPSTREAM_WS: WebSocket upstream #0 is not"),
        ({"SOLANA_UPSTREAM": "http://x", "EVM_UPSTREAM_WS": "ws://x"}, "EVM_UPSTREAM_WS needs EVM_UPSTREAM"),
        ({"EVM_UPSTREAM": "http://x", "SUBSCRIPTION_CREDITS": "logs"}, "kind=credits pairs"),
        ({"EVM_UPSTREAM": "http://x", "SUBSCRIPTION_CREDITS": "logs=-1"}, "SUBSCRIPTION_CREDITS logs"),
    ],
)
def test_websocket_settings_are_checked_at_startup(raw: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        build_settings(raw)


class WsRelay:
    """A WebSocket relay to the node's WebSocket that a test can cut: every connection it holds is
    closed and no new one is taken."""

    def __init__(self, target: str, rewrite: Callable[[str], str] | None = None) -> None:
        self.target = target
        self.rewrite = rewrite  # applied to each of the node's messages on its way to the proxy
        self.sockets: list[web.WebSocketResponse] = []
        self.via: list[str | None] = []  # each handshake's Via
        self.cut = False
        self.methods: list[str] = []  # each call the proxy sent, by method
        self.hold: str | None = None  # a subscription kind whose subscribe is held until `released`
        self.released = asyncio.Event()
        self._server: TestServer | None = None
        self.url = ""

    async def start(self) -> WsRelay:
        app = web.Application()
        app.router.add_get("/", self._handle)
        self._server = await fake_server(app)
        self.url = f"ws://127.0.0.1:{self._server.port}/"
        return self

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.via.append(request.headers.get("Via"))
        if self.cut:
            return web.Response(status=503)
        client = web.WebSocketResponse()
        await client.prepare(request)
        self.sockets.append(client)
        async with aiohttp.ClientSession() as session, session.ws_connect(self.target) as node:

            async def to_client() -> None:
                async for message in node:
                    await client.send_str(self.rewrite(message.data) if self.rewrite else message.data)

            forward = asyncio.create_task(to_client())
            async for message in client:
                call = json.loads(message.data)
                self.methods.append(str(call.get("method")))
                if self.hold is not None and call.get("params", [None])[:1] == [self.hold]:
                    await self.released.wait()
                await node.send_str(message.data)
            forward.cancel()
        return client

    async def cut_all(self) -> None:
        self.cut = True
        for client in self.sockets:
            await client.close()

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()


async def test_a_relayed_subscription_keeps_delivering_after_its_upstream_socket_is_killed(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    relay = await WsRelay(ws_of(anvil)).start()
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=f"{relay.url},{ws_of(anvil)}")
    try:
        client = await connect(proxy)
        pending = await client.subscribe("newPendingTransactions")
        socket = proxy.app[STREAMS].relays["evm"]
        await relay.cut_all()  # the node's socket the subscription was on is gone

        async def reopened() -> bool:
            return socket.resubscribed == 1

        await eventually(reopened, 10, "the subscription opened again on the next upstream WebSocket")
        tx_hash = anvil.rpc("eth_sendTransaction", {"from": DEV_ACCOUNT, "to": DEV_ACCOUNT, "value": "0x1"})
        await client.notes_until(1)
        assert client.results(pending) == [tx_hash]  # under the id the client was given
        assert (await client.call("eth_unsubscribe", pending))["result"] is True
    finally:
        await relay.close()


async def test_new_heads_and_logs_deliver_every_block_once_across_an_upstream_socket_drop(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    store = anvil.deploy_store()
    emit = selector("emitMany(uint256)") + word(1)  # one log, in a block of its own (automining)
    relay = await WsRelay(ws_of(anvil)).start()
    # UPSTREAM_TIMEOUT=1: the drop outlasts the socket's attempts to open the feed's push again.
    proxy = await make_proxy(
        EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=relay.url, HEAD_POLL_INTERVAL="0.2", UPSTREAM_TIMEOUT="1"
    )
    try:
        client, heads, logs = await _pushed_heads_and_logs(anvil, proxy, store)
        feed = proxy.app[STREAMS].feeds["evm"]

        async def pushing(live: bool = True) -> bool:
            return feed.push_live is live

        start = anvil.block_number()
        anvil.send(store, emit)  # pushed
        await relay.cut_all()
        for _ in range(4):  # mined while the node's socket is down: polled
            anvil.send(store, emit)
        await eventually(lambda: pushing(False), 10, "the socket to give the push up")
        anvil.send(store, emit)
        relay.cut = False  # the node's socket is back
        await eventually(pushing, 10, "the feed's push subscription opened again")
        for _ in range(2):
            anvil.send(store, emit)
        expected = list(range(start + 1, start + 9))
        await client.notes_until(2 * len(expected))
        assert [int(h["number"], 16) for h in client.results(heads)] == expected
        assert [int(e["blockNumber"], 16) for e in client.results(logs)] == expected
        assert all(not e.get("removed") for e in client.results(logs))
        anvil.send(store, emit)  # one more: nothing was delivered twice before it
        await client.notes_until(2 * len(expected) + 2)
        assert [int(h["number"], 16) for h in client.results(heads)] == [*expected, start + 9]
        assert len(client.notes) == 2 * len(expected) + 2
    finally:
        await relay.close()


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        ({"error": {"code": -32000, "message": "BOTH a result and an error"}}, "both a result and an error"),
        ({"result": None}, "a subscription id that is no string or integer"),
        ({"result": {"a": 1}}, "a subscription id that is no string or integer"),
        ({"result": True}, "a subscription id that is no string or integer"),
    ],
)
async def test_a_subscribe_reply_that_is_no_answer_fails_that_call_alone(
    anvil: Anvil, make_proxy: ProxyFactory, reply: dict[str, Any], problem: str
) -> None:
    """JSON-RPC 2.0 allows a result or an error, never both (replies.py), and a subscription id must be
    a key its notifications can be routed by: the node's WebSocket reply otherwise is a failed
    subscription at once (-32002), neither its error nor its result passed on, and the socket's other
    subscriptions go on (an object id crashed the socket's reader, stalling every subscription)."""

    armed = False  # the proxy's own newHeads subscription and the first client's are answered as the node did

    def rewritten(text: str) -> str:
        message = json.loads(text)
        if armed and "id" in message and "result" in message:
            message.update(reply)
        return json.dumps(message)

    relay = await WsRelay(ws_of(anvil), rewrite=rewritten).start()
    try:
        proxy = await make_proxy(EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=relay.url)
        first = await connect(proxy)
        pending = await first.subscribe("newPendingTransactions")
        armed = True
        client = await connect(proxy)
        answer = await client.call("eth_subscribe", "newPendingTransactions")
        assert answer["error"]["code"] == -32002 and problem in answer["error"]["message"], answer
        armed = False
        tx_hash = anvil.rpc("eth_sendTransaction", {"from": DEV_ACCOUNT, "to": DEV_ACCOUNT, "value": "0x1"})
        await first.notes_until(1)
        assert first.results(pending) == [tx_hash]  # the first subscription went on
    finally:
        await relay.cut_all()  # its sockets closed first: a server closing with them open waits for them
        await relay.close()


async def test_the_handshake_to_a_websocket_upstream_carries_this_proxys_via(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """Rule (RFC 9110 7.6.3): a WebSocket upstream's handshake is marked as every upstream request is,
    so a WebSocket upstream that is this proxy refuses it (a loop) rather than serve itself."""
    relay = await WsRelay(ws_of(anvil)).start()
    try:
        proxy = await make_proxy(EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=relay.url)
        client = await connect(proxy)
        await client.subscribe("newPendingTransactions")  # relayed to the node's WebSocket

        async def handshaken() -> bool:
            return bool(relay.via)

        await eventually(handshaken, 10, "the feed's handshake")
        assert relay.via[0] == via.field(), relay.via
    finally:
        await relay.cut_all()  # its sockets closed first: a server closing with them open waits for them
        await relay.close()


async def test_a_relayed_subscription_passes_at_most_two_rpc_proxies(
    anvil: Anvil, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """Rule (via.py): a relayed subscription travels on a shared upstream socket whose handshake carries
    no subscriber's marks, so one that came through another rpc-proxy is refused at once (-32002, naming
    why) rather than relayed to an upstream WebSocket that is an rpc-proxy too (a loop of proxies that
    are each other's WebSocket upstreams held it for ever); one that came straight is relayed."""
    port = free_port()
    inner = _serving(port, anvil.url, tmp_path / "inner.log", EVM_UPSTREAM_WS=ws_of(anvil))
    try:
        async with aiohttp.ClientSession() as session:
            await _first_answer(
                session, f"http://127.0.0.1:{port}/v3/k", {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId"}
            )
        proxy = await make_proxy(EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=f"ws://127.0.0.1:{port}/ws/v3/k")
        assert await (await connect(proxy)).subscribe("newPendingTransactions")  # two rpc-proxies: relayed
        headers = {"Via": "1.1 rpc-proxy-0123456789abcdef"}
        marked = Client(await proxy.session.ws_connect(proxy.ws_url("test-key"), headers=headers))
        answer = await asyncio.wait_for(marked.call("eth_subscribe", "newPendingTransactions"), 10)
        assert answer["error"]["code"] == -32002 and "at most two rpc-proxies" in answer["error"]["message"], answer
    finally:
        inner.send_signal(signal.SIGTERM)
        await asyncio.to_thread(inner.wait, 30)


async def test_a_subscription_granted_after_its_caller_stopped_waiting_is_cancelled_on_the_node(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """Rule: a relayed subscribe that got no answer in time fails, and what the node grants for it
    later is nobody's: it is cancelled there, never held on the node (nor on an upstream proxy)."""
    relay = await WsRelay(ws_of(anvil)).start()
    relay.hold = "newPendingTransactions"
    try:
        proxy = await make_proxy(EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=relay.url, UPSTREAM_TIMEOUT="2")
        answer = await (await connect(proxy)).call("eth_subscribe", "newPendingTransactions")
        assert answer["error"]["code"] == -32002, answer
        relay.released.set()

        async def cancelled() -> bool:
            return "eth_unsubscribe" in relay.methods

        await eventually(cancelled, 10, "the late subscription to be cancelled on the node")
    finally:
        await relay.cut_all()
        await relay.close()


class TestSharedNodeIds:
    """The relay's table of the node's subscription ids (a node may give identical subscribes on its
    socket one id, as Agave does): the node's subscription is cancelled only when nobody holds it and
    no identical subscribe waits for an answer that may name it again."""

    @staticmethod
    def route(method: str = "slotSubscribe", params: Any = None) -> Route:
        return Route(lambda: None, lambda _m, _r: None, lambda: None, "slotUnsubscribe", method, params or [])

    async def test_the_last_of_an_ids_routes_leaving_cancels_it_and_not_before(self) -> None:
        table, first, second = RouteTable(), self.route(), self.route()
        for route in (first, second):
            route.upstream_id = 7
            table.add(route)
        assert table.by_id[7] == [first, second]
        assert not table.release(first, [])
        assert table.release(second, []) and 7 not in table.by_id
        assert not table.release(second, [])  # once

    async def test_an_id_left_while_an_identical_subscribe_waits_goes_to_it_or_is_cancelled_after(self) -> None:
        table, left, waiting, other = RouteTable(), self.route(), self.route(), self.route("accountSubscribe", ["k"])
        left.upstream_id = 7
        table.add(left)
        assert not table.release(left, [other, waiting])  # parked: the node may give `waiting` id 7
        waiting.upstream_id = 7
        table.add(waiting)  # it did: its own now
        assert table.settle(waiting, []) == [] and table.by_id[7] == [waiting]
        assert not table.release(waiting, [self.route()])  # parked again; the answer names another id
        assert table.settle(self.route(), []) == [("slotUnsubscribe", 7)]
        granted_to_nobody = self.route()
        granted_to_nobody.upstream_id = 9
        assert table.orphaned(granted_to_nobody, []) and not table.orphaned(granted_to_nobody, [self.route()])
