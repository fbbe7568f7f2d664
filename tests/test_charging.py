"""Which calls are charged: a node reached is charged, no node reached is free (charging.py)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from proxy.credits.charging import refunded, refunded_unanswered
from proxy.credits.prices import METHOD_CREDITS
from proxy.rpc.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, UPSTREAM_UNAVAILABLE, JsonRpcError
from tests.fake_evm import FakeEvm
from tests.support import Anvil, Proxy, ProxyFactory, eventually, fake_server, serving
from tests.test_credits import keys_file, storage


class TestChargingRule:
    def test_no_node_reached_is_refunded(self) -> None:
        assert refunded(JsonRpcError(UPSTREAM_UNAVAILABLE, "down", http_status=502))

    def test_a_node_reached_that_then_timed_out_is_charged(self) -> None:
        assert not refunded(JsonRpcError(UPSTREAM_UNAVAILABLE, "timeout", http_status=504, reached=True))

    def test_the_proxys_own_refusal_of_a_call_after_its_debit_is_refunded(self) -> None:
        assert refunded(
            JsonRpcError(INVALID_PARAMS, "invalid params: filter: fromBlock 0x10 is greater than toBlock 0x5")
        )

    def test_answers_and_other_errors_are_charged(self) -> None:
        assert not refunded(None)
        assert not refunded(JsonRpcError(INTERNAL_ERROR, "internal error", http_status=500))

    def test_a_call_left_before_its_answer_is_given_back_only_if_nothing_was_sent_for_it(self) -> None:
        assert refunded_unanswered(sent=False)
        assert not refunded_unanswered(sent=True)


@asynccontextmanager
async def dropping_relay(target: str, position: str) -> AsyncIterator[str]:
    """A node that leaves the storage read of `position` out of its batch replies."""
    session = aiohttp.ClientSession()

    async def handle(request: web.Request) -> web.Response:
        payload = json.loads(await request.read())
        async with session.post(target, json=payload) as resp:
            reply = await resp.json()
        if isinstance(payload, list):
            dropped = {p["id"] for p in payload if p["method"] == "eth_getStorageAt" and p["params"][1] == position}
            reply = [item for item in reply if item["id"] not in dropped]
        return web.json_response(reply)

    try:
        async with serving(handle) as url:
            yield url
    finally:
        await session.close()


async def test_a_call_left_out_of_a_batch_reply_is_asked_again_alone_and_charged_as_answered(
    anvil: Anvil,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    # A batch reply without one of its ids is an upstream fault (issue 9): nothing of it is kept,
    # and its calls are asked again one by one (issue 10), so every caller gets the node's answer
    # and pays for that answer only.
    path = keys_file(tmp_path, alice={"daily_credits": 10_000})
    async with dropping_relay(anvil.url, "0x" + "0" * 63 + "2") as url:
        proxy = await make_proxy(EVM_UPSTREAM=url, API_KEYS_FILE=path)
        await proxy.head_at(0)
        batch = [storage(i, hex(i)) for i in range(1, 4)]  # three misses: one upstream batch
        status, body, headers = await proxy.post(batch, key="alice")
        assert status == 200
        assert [item["id"] for item in body if "result" in item] == [1, 2, 3], body
        assert headers["X-Credits-Charged"] == "240" and headers["X-Credits-Remaining"] == str(10_000 - 240)
        assert proxy.metric("rpc_proxy_upstream_errors_total", network="evm", upstream="0", kind="mismatch") >= 1


async def test_a_call_that_reached_a_node_and_timed_out_is_charged(tmp_path: Path, make_proxy: ProxyFactory) -> None:
    path = keys_file(tmp_path, alice={"daily_credits": 10_000})
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        await release.wait()  # the node is busy with it (an eth_estimateGas, say) past the timeout
        return web.json_response({"jsonrpc": "2.0", "id": 1, "result": "0x5208"})

    app = web.Application()
    app.router.add_post("/", slow)
    node = await fake_server(app)
    proxy = await make_proxy(EVM_UPSTREAM=f"http://127.0.0.1:{node.port}/", API_KEYS_FILE=path, UPSTREAM_TIMEOUT="0.3")
    try:
        call = {"jsonrpc": "2.0", "id": 7, "method": "eth_estimateGas", "params": [{"from": "0x" + "11" * 20}]}
        status, reply, headers = await proxy.post(call, key="alice")
        assert status == 504 and reply["error"]["code"] == -32002
        cost = METHOD_CREDITS["eth_estimateGas"]  # the credits table (docs/keys-and-credits.md)
        assert headers["X-Credits-Charged"] == str(cost) and headers["X-Credits-Remaining"] == str(10_000 - cost)
        assert proxy.metric("rpc_proxy_credits_charged_total", method="eth_estimateGas") == cost
    finally:
        release.set()
        await node.close()


REVERSED = (  # reversed once their tags are resolved, after the debit: FakeEvm's head 100, safe 99, finalized 98
    {"fromBlock": "0x10", "toBlock": "0x5"},
    {"fromBlock": "latest", "toBlock": "0x5"},
    {"fromBlock": "0x5", "toBlock": "earliest"},
    {"fromBlock": "safe", "toBlock": "finalized"},
)


async def test_an_eth_get_logs_range_refused_as_reversed_before_forwarding_is_free_over_http_batch_and_websocket(
    tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    # Refused locally (-32602), never forwarded, yet it was charged its 255 credits: the reversed
    # check runs once the tags are resolved, after the debit, and only -32002 was given back.
    node = await FakeEvm().start()
    proxy = await make_proxy(EVM_UPSTREAM=node.url, API_KEYS_FILE=keys_file(tmp_path, alice={"daily_credits": 10_000}))
    try:
        await proxy.head_at(100)
        calls = [{"jsonrpc": "2.0", "id": i, "method": "eth_getLogs", "params": [f]} for i, f in enumerate(REVERSED)]
        for call in calls:
            _, reply, headers = await proxy.post(call, key="alice")
            assert reply["error"]["code"] == -32602 and "greater than toBlock" in reply["error"]["message"], reply
            assert headers["X-Credits-Charged"] == "0" and headers["X-Credits-Remaining"] == "10000"
        number = {"jsonrpc": "2.0", "id": 9, "method": "eth_blockNumber", "params": []}
        _, replies, headers = await proxy.post([*calls, number], key="alice")
        assert [r["error"]["code"] for r in replies[:-1]] == [-32602] * len(calls) and "result" in replies[-1]
        assert headers["X-Credits-Charged"] == str(METHOD_CREDITS["eth_blockNumber"])
        async with proxy.session.ws_connect(proxy.ws_url("alice")) as ws:
            for call in calls:
                await ws.send_json(call)
                assert (await ws.receive_json(timeout=10))["error"]["code"] == -32602
        _, _, headers = await proxy.post(number, key="alice")
        assert headers["X-Credits-Remaining"] == str(10_000 - 2 * METHOD_CREDITS["eth_blockNumber"])
        assert proxy.metric("rpc_proxy_credits_charged_total", method="eth_getLogs") == 0
    finally:
        await node.close()


# --- calls whose caller left before their answer ---------------------------------------------

DAILY = 10_000
STORAGE = 80  # eth_getStorageAt, as the interface contract fixes it
FREE_PROBE = {"jsonrpc": "2.0", "id": 0, "method": "eth_getStorageAt", "params": ["not an address"]}  # invalid: free


class HoldingNode:
    """Anvil behind a relay that holds every request carrying an eth_getStorageAt until `release` is
    set, and counts the storage reads that reached it (and every method's calls, in `seen`)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.release = asyncio.Event()
        self.storage_reads = 0
        self.seen: Counter[str] = Counter()
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        payload = json.loads(await request.read())
        calls = payload if isinstance(payload, list) else [payload]
        self.seen.update(call["method"] for call in calls)
        reads = sum(call["method"] == "eth_getStorageAt" for call in calls)
        if reads:
            self.storage_reads += reads
            await self.release.wait()
        async with aiohttp.ClientSession() as session, session.post(self.target, json=payload) as resp:
            return web.json_response(await resp.json())


@asynccontextmanager
async def holding_node(target: str) -> AsyncIterator[HoldingNode]:
    node = HoldingNode(target)
    async with serving(node.handle) as url:
        node.url = url
        try:
            yield node
        finally:
            node.release.set()  # before the server closes: it waits for the requests it holds


@asynccontextmanager
async def keyed_behind_holding_node(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory, keys: tuple[str, ...] = ("alice",), **settings: str
) -> AsyncIterator[tuple[HoldingNode, Proxy]]:
    """A proxy with `keys` (DAILY credits each) in front of a node that holds storage reads; its head known."""
    path = keys_file(tmp_path, **{key: {"daily_credits": DAILY} for key in keys})
    async with holding_node(anvil.url) as node:
        proxy = await make_proxy(EVM_UPSTREAM=node.url, API_KEYS_FILE=path, **settings)
        await proxy.head_at(0)
        yield node, proxy


async def spent(proxy: Proxy, key: str) -> int:
    """The key's credits spent today, from outside: a free call's X-Credits-Remaining."""
    _, _, headers = await proxy.post(FREE_PROBE, key=key)
    assert headers["X-Credits-Charged"] == "0"
    return DAILY - int(headers["X-Credits-Remaining"])


async def spending_reaches(proxy: Proxy, key: str, credits: int) -> None:
    seen: list[int] = []

    async def reached() -> bool:
        seen.append(await spent(proxy, key))
        return seen[-1] == credits

    try:
        await eventually(reached, 5, f"{key}'s spending at {credits} credits")
    except TimeoutError as exc:
        raise AssertionError(f"{key} spent {seen[-1]} credits, not {credits}") from exc


async def node_reads(node: HoldingNode, count: int) -> None:
    async def reached() -> bool:
        return node.storage_reads == count

    await eventually(reached, 5, f"{count} storage reads with the node")


async def unsent_calls_of_a_closed_socket_are_given_back(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory, **ledger: str
) -> None:
    async with keyed_behind_holding_node(anvil, tmp_path, make_proxy, UPSTREAM_KEY_CONCURRENCY="1", **ledger) as (
        node,
        proxy,
    ):
        async with proxy.session.ws_connect(proxy.ws_url("alice")) as ws:
            for i in range(2):  # (a socket makes two answers at once while it knows none's size)
                await ws.send_str(json.dumps(storage(i, hex(100 + i))))  # two misses: 160 credits
            await spending_reaches(proxy, "alice", 2 * STORAGE)
            await node_reads(node, 1)  # one with the node; the other waits for the key's one upstream slot
        # The socket closed: the read the node works on stays charged, the one never sent is free.
        await spending_reaches(proxy, "alice", STORAGE)
        assert node.storage_reads == 1


async def test_calls_a_closed_websocket_left_unsent_are_given_back_and_the_one_sent_is_charged(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    # "A call is charged when it was forwarded to a node or served from cache" (charging.py): the
    # calls still waiting for the key's upstream slot when the socket closed were neither.
    await unsent_calls_of_a_closed_socket_are_given_back(anvil, tmp_path, make_proxy)


async def test_calls_a_closed_websocket_left_unsent_are_given_back_with_the_ledger_in_redis(
    anvil: Anvil, redis_url: str, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    await unsent_calls_of_a_closed_socket_are_given_back(anvil, tmp_path, make_proxy, REDIS_URL=redis_url)


async def test_calls_sent_in_one_upstream_batch_stay_charged_when_their_socket_closes(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    # Auto-batching sends several callers' reads from one task: each read in it was forwarded.
    async with keyed_behind_holding_node(anvil, tmp_path, make_proxy, UPSTREAM_KEY_CONCURRENCY="2") as (node, proxy):
        async with proxy.session.ws_connect(proxy.ws_url("alice")) as ws:
            await ws.send_str(json.dumps([storage(i, hex(300 + i)) for i in range(3)]))
            await spending_reaches(proxy, "alice", 3 * STORAGE)
            await node_reads(node, 2)  # two in one upstream batch; the third waits for a slot
        await spending_reaches(proxy, "alice", 2 * STORAGE)
        assert node.storage_reads == 2


async def test_calls_a_closed_websocket_left_in_an_upstream_batch_waiting_for_the_providers_budget_are_never_sent(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    # "Charged only if a request made for it was written to a node": an auto-batch waiting for the
    # upstream's max_concurrency places when its callers leave is sent without them, so never here.
    async with holding_node(anvil.url) as node:
        networks = tmp_path / "networks.toml"
        upstream = f'{{url = "{node.url}", max_concurrency = 4}}'
        networks.write_text(f'[networks.evm]\nfamily = "evm"\nupstreams = [{upstream}]\n')
        path = keys_file(tmp_path, alice={"daily_credits": DAILY}, bob={"daily_credits": DAILY})
        proxy = await make_proxy(NETWORKS_FILE=str(networks), API_KEYS_FILE=path)
        await proxy.head_at(0)
        held = asyncio.create_task(proxy.post([storage(1, "0x1"), storage(2, "0x2")], key="bob"))
        await node_reads(node, 2)  # bob's two reads and their header: three of the node's four places
        balances = [
            {"jsonrpc": "2.0", "id": i, "method": "eth_getBalance", "params": [f"0x{i + 1:040x}", "0x0"]}
            for i in range(4)
        ]
        async with proxy.session.ws_connect(proxy.ws_url("alice")) as ws:
            await ws.send_str(json.dumps(balances))  # upstream batches of two, each waiting for three places
            await spending_reaches(proxy, "alice", 4 * METHOD_CREDITS["eth_getBalance"])
        await spending_reaches(proxy, "alice", 0)  # closed: none was sent, all given back
        node.release.set()
        status, _, _ = await held
        assert status == 200
        # A later read takes the places after whatever the proxy still had to send.
        assert await proxy.result("eth_getBalance", [f"0x{99:040x}", "0x0"], key="bob") == "0x0"
        assert node.seen["eth_getBalance"] == 1
        assert await spent(proxy, "alice") == 0


async def test_a_call_that_left_while_sharing_another_callers_request_is_given_back(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    # A coalesced call that leaves before the answer was neither forwarded nor served: the node's
    # work is charged to the call that sent the request, which stays charged.
    async with keyed_behind_holding_node(anvil, tmp_path, make_proxy, ("alice", "bob")) as (node, proxy):
        read: dict[str, Any] = storage(1, "0x7")
        async with proxy.session.ws_connect(proxy.ws_url("alice")) as sender:
            await sender.send_str(json.dumps(read))
            await node_reads(node, 1)
            async with proxy.session.ws_connect(proxy.ws_url("bob")) as joiner:
                await joiner.send_str(json.dumps(read))  # the same read: it waits for alice's answer
                await spending_reaches(proxy, "bob", STORAGE)
            await spending_reaches(proxy, "bob", 0)
            node.release.set()
            assert json.loads((await sender.receive(timeout=5)).data)["result"] == "0x" + "0" * 64
        assert node.storage_reads == 1
        assert await spent(proxy, "alice") == STORAGE


async def test_http_calls_whose_client_disconnected_are_still_forwarded_and_charged(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    # Over HTTP a client that goes away does not cancel its calls: each is forwarded, and charged.
    async with keyed_behind_holding_node(anvil, tmp_path, make_proxy, UPSTREAM_KEY_CONCURRENCY="1") as (node, proxy):
        clients = [aiohttp.ClientSession() for _ in range(2)]
        try:
            posts = [
                asyncio.create_task(client.post(proxy.url("alice"), json=storage(i, hex(200 + i))))
                for i, client in enumerate(clients)
            ]
            await spending_reaches(proxy, "alice", 2 * STORAGE)
            await node_reads(node, 1)
            for post in posts:
                post.cancel()
            await asyncio.gather(*posts, return_exceptions=True)
        finally:
            for client in clients:
                await client.close()  # the connections close with them
        node.release.set()
        await node_reads(node, 2)  # the call that waited for the key's slot went on to the node
        await spending_reaches(proxy, "alice", 2 * STORAGE)
