"""Solana pubsub over /ws/v3/<key>: relayed to the network's upstream WebSocket (the fake node's),
with the proxy's own subscription ids, the same per-connection limits, and a clear error without one."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time

import pytest

from proxy.credits.accounts import derived_name
from proxy.http.app_keys import LEDGER, STREAMS
from tests.fake_solana import FakeSolana, b58
from tests.support import Proxy, ProxyFactory, eventually
from tests.ws_client import Client, connect, frame

KEY = "7fUAJdStEuGbc3sM84cKRL6yYaaSstyLSU4ve5oovLS7"
SIGNATURE = "5" * 88


@pytest.fixture
async def relay_proxy(solana: FakeSolana, make_proxy: ProxyFactory) -> Proxy:
    return await make_proxy(SOLANA_UPSTREAM=solana.url, SOLANA_UPSTREAM_WS=solana.ws_url, WS_MAX_SUBSCRIPTIONS="3")


async def test_slot_notifications_are_relayed_under_the_proxys_own_id(solana: FakeSolana, relay_proxy: Proxy) -> None:
    client = await connect(relay_proxy)
    reply = await client.call("slotSubscribe")
    ours = reply["result"]
    assert isinstance(ours, int) and ours not in solana.subscriptions
    before = solana.slot
    await solana.advance_slot()
    (note,) = await client.notes_until(1)
    assert note["method"] == "slotNotification"
    # The node's slot as notified: the proxy's own slot polls move the fake node's on (a busy machine
    # may poll between the notification and this line).
    slot = note["params"]["result"]["slot"]
    assert before < slot <= solana.slot
    assert note["params"] == {"subscription": ours, "result": {"parent": slot - 1, "root": slot - 32, "slot": slot}}
    assert (await client.call("slotUnsubscribe", ours))["result"] is True
    assert solana.ws_calls["slotUnsubscribe"] == 1
    unknown = await client.call("slotUnsubscribe", ours)
    assert unknown["error"] == {"code": -32602, "message": "Invalid subscription id."}


async def test_account_logs_and_signature_subscriptions_are_relayed(solana: FakeSolana, relay_proxy: Proxy) -> None:
    client = await connect(relay_proxy)
    account = (await client.call("accountSubscribe", KEY, {"commitment": "confirmed", "encoding": "base64"}))["result"]
    logs = (await client.call("logsSubscribe", "all"))["result"]
    signature = (await client.call("signatureSubscribe", SIGNATURE, {"commitment": "confirmed"}))["result"]
    assert len({account, logs, signature}) == 3
    assert solana.subscriptions[max(solana.subscriptions)][1] == [SIGNATURE, {"commitment": "confirmed"}]
    await solana.set_account(KEY, 12345)
    await solana.emit_logs(SIGNATURE, ["Program log: hello"])
    await solana.confirm(SIGNATURE)
    notes = await client.notes_until(3)
    got = {n["params"]["subscription"]: n for n in notes}
    assert got[account]["method"] == "accountNotification"
    assert got[account]["params"]["result"]["value"]["lamports"] == 12345
    assert got[logs]["params"]["result"]["value"]["logs"] == ["Program log: hello"]
    assert got[signature]["params"]["result"]["value"] == {"err": None}
    # A signature subscription ends with its notification, on the node and here.
    assert (await client.call("signatureUnsubscribe", signature))["error"]["code"] == -32602


async def test_the_nodes_errors_pass_through_and_limits_apply(solana: FakeSolana, relay_proxy: Proxy) -> None:
    client = await connect(relay_proxy)
    refused = await client.call("accountSubscribe", "not-a-key")
    assert refused["error"] == {"code": -32602, "message": "Invalid param: Invalid"}
    for _ in range(3):
        assert "result" in await client.call("slotSubscribe")
    over = await client.call("slotSubscribe")
    assert over["error"]["code"] == -32005 and "WS_MAX_SUBSCRIPTIONS" in over["error"]["message"]


async def test_closing_the_socket_unsubscribes_on_the_node(solana: FakeSolana, relay_proxy: Proxy) -> None:
    client = await connect(relay_proxy)
    await client.call("slotSubscribe")
    assert len(solana.subscriptions) == 1
    await client.ws.close()

    async def gone() -> bool:
        return not solana.subscriptions

    await eventually(gone, 5, "the node-side subscription to end")


async def test_sockets_closed_while_their_subscribes_are_answered_leave_nothing_on_the_node(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule (docs/subscriptions.md: closing the socket ends its subscriptions, on the node too): a socket
    reset while its subscribes are being answered leaves none of them on the node. A subscribe the node
    had answered, whose caller went before it resumed, was routed for nobody and never cancelled
    (hundreds held on the node, opened again after every drop)."""
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, SOLANA_UPSTREAM_WS=solana.ws_url)
    loop = asyncio.get_running_loop()

    async def reset_after(index: int) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", proxy.server.port))
        await loop.sock_sendall(sock, upgrade(proxy.server.port))
        assert b" 101 " in await loop.sock_recv(sock, 1024)
        frames = b"".join(
            frame(json.dumps(account_subscribe(index, n)).encode()) for n in range(20)
        )  # distinct accounts: an id each on the node
        before = solana.ws_received["accountSubscribe"]
        await loop.sock_sendall(sock, frames)
        if index % 2:  # gone as soon as the node has one of them: while it answers the rest
            await reached(solana, "accountSubscribe", before + 1, at_least=True)
        else:  # gone at once, or a few ms later
            await asyncio.sleep(index % 10 / 1000)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset

    for _ in range(3):
        await asyncio.gather(*(reset_after(i) for i in range(40)))

    async def nothing_held() -> bool:
        return not solana.subscriptions and proxy.metric("rpc_proxy_subscriptions", kind="other") == 0

    await eventually(nothing_held, 20, "no subscription left on the node")


async def test_identical_subscriptions_sharing_the_nodes_id_are_each_notified_and_end_apart(
    solana: FakeSolana, relay_proxy: Proxy
) -> None:
    """Rule (docs/subscriptions.md): a node gives identical subscribes on its socket one id (Agave does);
    each subscriber gets every notification under its own id, one's unsubscribe ends its own alone, and
    the node's subscription is cancelled when the last leaves. Before, the second took the first's
    route: the first heard nothing, and the second's unsubscribe ended the first's on the node."""
    alice, bob = await connect(relay_proxy), await connect(relay_proxy)
    first, second = (await alice.call("slotSubscribe"))["result"], (await bob.call("slotSubscribe"))["result"]
    assert len(solana.subscriptions) == 1  # one id on the node for both
    await solana.advance_slot()
    ((note_a,), (note_b,)) = await alice.notes_until(1), await bob.notes_until(1)
    assert note_a["params"]["subscription"] == first and note_b["params"]["subscription"] == second
    assert (await bob.call("slotUnsubscribe", second))["result"] is True
    assert solana.ws_calls["slotUnsubscribe"] == 0 and len(solana.subscriptions) == 1  # alice's holds it
    await solana.advance_slot()
    assert len(await alice.notes_until(2)) == 2
    assert (await alice.call("slotUnsubscribe", first))["result"] is True

    async def cancelled() -> bool:
        return not solana.subscriptions and solana.ws_calls["slotUnsubscribe"] == 1

    await eventually(cancelled, 5, "the node's subscription to end with its last subscriber")


async def test_an_id_left_while_an_identical_subscribe_waits_is_cancelled_when_that_one_fails(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule (docs/subscriptions.md): the node's subscription is cancelled when its last subscriber leaves.
    One left while an identical subscribe waited is kept for it (the node may give it that id); when
    that subscribe timed out instead, and the node gave it an id of its own, the first stayed on the
    node for nobody, for the life of the socket."""
    solana.share_ids = False  # a node that gives each subscribe its own id
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, SOLANA_UPSTREAM_WS=solana.ws_url, UPSTREAM_TIMEOUT="1")
    alice, bob = await connect(proxy), await connect(proxy)
    first = (await alice.call("slotSubscribe"))["result"]
    solana.subscribe_delay = 2.5  # past UPSTREAM_TIMEOUT
    late = asyncio.ensure_future(bob.call("slotSubscribe"))

    await reached(solana, "slotSubscribe", 2)
    assert (await alice.call("slotUnsubscribe", first))["result"] is True
    assert (await late)["error"]["code"] == -32002  # timed out

    await none_held(solana, "slotSubscribe", 2)


async def test_a_subscription_ended_while_it_is_opened_again_is_cancelled_on_the_node(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule (docs/subscriptions.md: closing the socket ends its subscriptions, on the node too): one
    ended while the node's socket was being replaced (its subscribe sent again, not yet answered) is
    cancelled once the node grants it; it was routed again for nobody."""
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, SOLANA_UPSTREAM_WS=solana.ws_url, UPSTREAM_TIMEOUT="5")
    client = await connect(proxy)
    ours = (await client.call("slotSubscribe"))["result"]
    solana.subscribe_delay = 1.0
    await solana.drop_sockets()

    await reached(solana, "slotSubscribe", 2)
    assert (await client.call("slotUnsubscribe", ours))["result"] is True

    await none_held(solana, "slotSubscribe", 2)


async def test_a_received_signature_notice_is_not_the_end_of_its_subscription(
    solana: FakeSolana, relay_proxy: Proxy
) -> None:
    """Agave (enableReceivedNotification) sends `receivedSignature` first, then the processed result,
    which ends the subscription; the first was taken as the end: the result was never delivered and the
    node's subscription was left for nobody."""
    client = await connect(relay_proxy)
    options = {"commitment": "processed", "enableReceivedNotification": True}
    ours = (await client.call("signatureSubscribe", SIGNATURE, options))["result"]
    await solana.receive(SIGNATURE)
    await solana.confirm(SIGNATURE)
    first, last = await client.notes_until(2)
    assert first["params"]["subscription"] == ours and first["params"]["result"]["value"] == "receivedSignature"
    assert last["params"]["subscription"] == ours and last["params"]["result"]["value"] == {"err": None}
    assert not solana.subscriptions
    unknown = await client.call("signatureUnsubscribe", ours)  # ended by its result
    assert unknown["error"]["code"] == -32602


async def test_subscriptions_the_node_parses_as_one_share_its_id_however_written(
    solana: FakeSolana, relay_proxy: Proxy
) -> None:
    """Agave gives one id to params that parse alike (`[key]`, `[key, {"commitment": "finalized"}]`):
    the first's unsubscribe, while the second waited for that id, cancelled it on the node under the
    second, which then heard nothing."""
    alice, bob = await connect(relay_proxy), await connect(relay_proxy)
    first = (await alice.call("accountSubscribe", KEY))["result"]
    solana.subscribe_delay = 0.5
    second = asyncio.ensure_future(bob.call("accountSubscribe", KEY, {"commitment": "finalized"}))

    await reached(solana, "accountSubscribe", 2)
    assert (await alice.call("accountUnsubscribe", first))["result"] is True
    ours = (await second)["result"]
    assert len(solana.subscriptions) == 1
    await solana.set_account(KEY, 777)
    (note,) = await bob.notes_until(1)
    assert note["params"]["subscription"] == ours and note["params"]["result"]["value"]["lamports"] == 777


async def test_an_escaped_subscribe_method_name_is_a_subscribe(solana: FakeSolana, relay_proxy: Proxy) -> None:
    """JSON escapes in a method name name the same method: `slotS\\u0075bscribe` is slotSubscribe (it was
    answered -32601 "needs a WebSocket", over one), and its escaped unsubscribe ends it."""
    client = await connect(relay_proxy)
    await client.ws.send_str('{"jsonrpc":"2.0","id":7,"method":"slotS\\u0075bscribe"}')
    reply = await client.reply(7)
    assert isinstance(reply.get("result"), int), reply
    await client.ws.send_str(
        '{"jsonrpc":"2.0","id":8,"method":"slotUns\\u0075bscribe","params":[' + str(reply["result"]) + "]}"
    )
    assert (await client.reply(8))["result"] is True
    assert solana.ws_calls["slotSubscribe"] == 1 and solana.ws_calls["slotUnsubscribe"] == 1


def upgrade(port: int) -> bytes:
    return (
        f"GET /ws/v3/test-key HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


def account_subscribe(socket_index: int, n: int) -> dict[str, object]:
    account = b58(bytes((socket_index + 1, n + 1)) * 16)
    return {"jsonrpc": "2.0", "id": n, "method": "accountSubscribe", "params": [account, {"encoding": "base64"}]}


async def test_a_signature_subscription_ended_by_its_notification_is_never_opened_again(
    solana: FakeSolana, relay_proxy: Proxy
) -> None:
    """Rule (docs/subscriptions.md): a signatureSubscribe ends with its one notification, on the node
    (Agave drops it) and here: the node's socket dropping opens only what is still live again."""
    client = await connect(relay_proxy)
    for _ in range(2):  # WS_MAX_SUBSCRIPTIONS is 3 here
        assert "result" in await client.call("signatureSubscribe", SIGNATURE, {"commitment": "confirmed"})
    slot = (await client.call("slotSubscribe"))["result"]
    await solana.confirm(SIGNATURE)
    await client.notes_until(2)
    await solana.drop_sockets()
    socket = relay_proxy.app[STREAMS].relays["solana"]

    async def reopened() -> bool:
        return socket.resubscribed == 1

    await eventually(reopened, 10, "the live subscription opened again on the node")
    live = [method for method, *_ in solana.subscriptions.values()]
    assert solana.ws_calls["signatureSubscribe"] == 2 and live == ["slotSubscribe"], solana.subscriptions
    await solana.advance_slot()
    notes = await client.notes_until(3)  # the two signatures' and now the slot's
    assert notes[-1]["params"]["subscription"] == slot


async def test_a_subscription_survives_the_nodes_socket_closing(solana: FakeSolana, relay_proxy: Proxy) -> None:
    client = await connect(relay_proxy)
    ours = (await client.call("slotSubscribe"))["result"]
    await solana.drop_sockets()  # as a restarting node would; it takes connections again at once
    socket = relay_proxy.app[STREAMS].relays["solana"]

    async def reopened() -> bool:
        return socket.resubscribed == 1

    await eventually(reopened, 10, "the subscription opened again on the node")
    await solana.advance_slot()
    (note,) = await client.notes_until(1)
    assert note["params"]["subscription"] == ours and "result" in note["params"]  # the id it was given


async def test_subscribers_hear_when_no_node_takes_their_subscription_back(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, SOLANA_UPSTREAM_WS=solana.ws_url, UPSTREAM_TIMEOUT="1")
    client = await connect(proxy)
    ours = (await client.call("slotSubscribe"))["result"]
    solana.refuse_sockets = True
    await solana.drop_sockets()
    (note,) = await client.notes_until(1)  # within UPSTREAM_TIMEOUT of trying again
    assert note["params"]["subscription"] == ours and note["params"]["error"]["code"] == -32002
    solana.refuse_sockets = False
    again = (await client.call("slotSubscribe"))["result"]  # a new connection to the node is opened
    await solana.advance_slot()
    notes = await client.notes_until(2)
    assert notes[-1]["params"]["subscription"] == again


async def test_without_an_upstream_websocket_pubsub_gets_a_clear_error(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url)
    client = await connect(proxy)
    reply = await client.call("signatureSubscribe", SIGNATURE)
    assert reply["error"]["code"] == -32601 and "SOLANA_UPSTREAM_WS" in reply["error"]["message"]
    http = await proxy.call("slotSubscribe", [])
    assert http["error"]["code"] == -32601 and "WebSocket" in http["error"]["message"]


async def _charging(solana: FakeSolana, make_proxy: ProxyFactory) -> tuple[Proxy, Client]:
    """A keyed proxy over the fake node (2 credits a subscribe, 3 a slot notification), and alice's socket."""
    proxy = await make_proxy(
        SOLANA_UPSTREAM=solana.url,
        SOLANA_UPSTREAM_WS=solana.ws_url,
        API_KEYS="alice",
        SUBSCRIPTION_CREDITS="subscribe=2,slotSubscribe=3",
    )
    return proxy, await connect(proxy, "alice")


async def test_solana_subscriptions_are_charged_by_their_subscribe_method(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    proxy, client = await _charging(solana, make_proxy)
    await client.call("slotSubscribe")
    await solana.advance_slot()
    await solana.advance_slot()
    await client.notes_until(2)

    async def charged() -> bool:
        return proxy.metric("rpc_proxy_key_credits_charged_total", key=derived_name("alice")) == 2 + 2 * 3

    await eventually(charged, 5, "the subscription and its two notifications to be charged")


async def test_a_subscribe_the_node_refuses_is_not_charged(solana: FakeSolana, make_proxy: ProxyFactory) -> None:
    """Rule (docs/subscriptions.md, Credits): only an accepted subscription costs `subscribe`. One the
    node refuses (its -32602 passed through) is given back and never counted; an accepted one is."""
    proxy, client = await _charging(solana, make_proxy)
    for _ in range(3):
        refused = await client.call("accountSubscribe", "not-a-key")
        assert refused["error"] == {"code": -32602, "message": "Invalid param: Invalid"}
    assert "result" in await client.call("slotSubscribe")

    async def charged() -> bool:
        return proxy.metric("rpc_proxy_key_credits_charged_total", key=derived_name("alice")) == 2

    await eventually(charged, 5, "the accepted subscription alone to be charged")
    assert proxy.metric("rpc_proxy_credits_charged_total", method="accountSubscribe") == 0
    used = await proxy.app[LEDGER].used(derived_name("alice"), now=time.time())
    assert used == 2, used  # the ledger's own count: the refused three given back


async def test_a_refused_subscribe_gives_back_to_its_own_key_only(solana: FakeSolana, make_proxy: ProxyFactory) -> None:
    """Rule (docs/subscriptions.md, Credits): a refused subscribe is given back to the key that paid
    for it. Two keys interleaved on their own sockets: bob's accepted subscriptions stay charged while
    alice's refused ones come back, and neither key's count moves the other's."""
    proxy = await make_proxy(
        SOLANA_UPSTREAM=solana.url,
        SOLANA_UPSTREAM_WS=solana.ws_url,
        API_KEYS="alice,bob",
        SUBSCRIPTION_CREDITS="subscribe=2,slotSubscribe=3",
    )
    alice, bob = await connect(proxy, "alice"), await connect(proxy, "bob")
    for _ in range(3):
        refused, accepted = await asyncio.gather(alice.call("accountSubscribe", "not-a-key"), bob.call("slotSubscribe"))
        assert refused["error"]["code"] == -32602 and "result" in accepted
    ledger = proxy.app[LEDGER]
    assert await ledger.used(derived_name("alice"), now=time.time()) == 0
    assert await ledger.used(derived_name("bob"), now=time.time()) == 3 * 2

    async def counted() -> bool:
        return proxy.metric("rpc_proxy_key_credits_charged_total", key=derived_name("bob")) == 3 * 2

    await eventually(counted, 5, "bob's accepted subscriptions to be counted")
    assert proxy.metric("rpc_proxy_key_credits_charged_total", key=derived_name("alice")) == 0


async def test_an_unsubscribe_with_a_boolean_id_is_refused_and_ends_nothing(
    solana: FakeSolana, relay_proxy: Proxy
) -> None:
    """Rule: a subscription id is a number (Agave's u64) or a string (geth's), never a boolean (True == 1)."""
    client = await connect(relay_proxy)
    ours = (await client.call("slotSubscribe"))["result"]
    assert ours == 1  # the id `true` would equal
    for method in (
        "slotUnsubscribe",
        "accountUnsubscribe",
        "logsUnsubscribe",
        "signatureUnsubscribe",
        "eth_unsubscribe",
    ):
        reply = await client.call(method, True)
        assert reply["error"]["code"] == -32602 and "boolean" in reply["error"]["message"], (method, reply)
    assert len(solana.subscriptions) == 1
    await solana.advance_slot()
    (note,) = await client.notes_until(1)
    assert note["params"]["subscription"] == ours and "result" in note["params"]


async def test_a_subscribe_sent_as_a_notification_opens_nothing_and_charges_nothing(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule: a notification gets no reply (JSON-RPC 2.0), so a subscribe without an id opens and charges nothing."""
    proxy, client = await _charging(solana, make_proxy)
    for method in ("slotSubscribe", "eth_subscribe"):
        await client.ws.send_str(json.dumps({"jsonrpc": "2.0", "method": method, "params": []}))
    ours = (await client.call("slotSubscribe"))["result"]  # after them, on the same socket
    await solana.advance_slot()
    (note,) = await client.notes_until(1)
    assert note["params"]["subscription"] == ours
    assert len(solana.subscriptions) == 1 and solana.ws_calls["slotSubscribe"] == 1

    async def charged() -> bool:
        return proxy.metric("rpc_proxy_key_credits_charged_total", key=derived_name("alice")) == 2 + 3

    await eventually(charged, 5, "one subscription and its one notification to be charged")
    assert client.replies == {} and client.notes == [note]


async def reached(solana: FakeSolana, method: str, count: int, *, at_least: bool = False) -> None:
    """Until the node has received `count` calls of `method` (answered or not; `at_least`: or more)."""

    async def received() -> bool:
        return solana.ws_received[method] >= count if at_least else solana.ws_received[method] == count

    await eventually(received, 10, f"{count} {method} to reach the node")


async def none_held(solana: FakeSolana, method: str, answered: int) -> None:
    """Until the node has answered `answered` calls of `method` and holds no subscription."""

    async def nothing() -> bool:
        return solana.ws_calls[method] == answered and not solana.subscriptions

    await eventually(nothing, 10, "no subscription left on the node")
