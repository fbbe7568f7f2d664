"""Every per-key and per-address limit is the host's, whatever WORKERS is: `python -m proxy` with
WORKERS=2 in front of a real Anvil, through a relay that counts what reaches the node, and clients
opening sockets, connections, filters and slow calls for one key over many connections (which the
kernel spreads over both workers). What the outside world counts equals the limit, not twice it."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support import Anvil, eventually, fake_server
from tests.test_workers import Running, _sample, _scrape, _start, _stop

KEY = "k1"


class CountingRelay:
    """Forwards to the node; counts every call by method, and the most of one method in flight at once.
    Methods in `slow` are held that many seconds before they are forwarded."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.calls: Counter[str] = Counter()
        self.in_flight: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.slow: dict[str, float] = {}
        self.url = ""
        self._server: TestServer | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> CountingRelay:
        self._session = aiohttp.ClientSession()
        app = web.Application(client_max_size=16 * 2**20)
        app.router.add_post("/", self._handle)
        self._server = await fake_server(app)
        self.url = f"http://127.0.0.1:{self._server.port}/"
        return self

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.Response:
        assert self._session is not None
        body = await request.read()
        payload = await request.json()
        methods = [str(c.get("method")) for c in (payload if isinstance(payload, list) else [payload])]
        self.calls.update(methods)
        self.in_flight.update(methods)
        for method in set(methods):
            self.most[method] = max(self.most[method], self.in_flight[method])
        try:
            delay = max((self.slow.get(m, 0.0) for m in methods), default=0.0)
            if delay:
                await asyncio.sleep(delay)
            async with self._session.post(self.target, data=body, headers={"Content-Type": "application/json"}) as up:
                return web.Response(body=await up.read(), content_type="application/json")
        finally:
            self.in_flight.subtract(methods)


@pytest.fixture
async def relay(anvil: Anvil) -> AsyncIterator[CountingRelay]:
    relay = await CountingRelay(anvil.url).start()
    yield relay
    await relay.close()


def _call(method: str, params: list[Any], id_: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id_, "method": method, "params": params}


async def _keyed(relay: CountingRelay, redis_url: str, **limits: str) -> Running:
    """Two workers serving API key k1, with the credit ledger (and cache) in a shared Redis."""
    running = _start(relay.url, 2, API_KEYS=KEY, REDIS_URL=redis_url, UPSTREAM_BATCH_MAX="1", **limits)
    running.url = f"http://127.0.0.1:{running.port}/v3/{KEY}"

    async def up() -> bool:
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(running.url, json=_call("eth_chainId", [])) as response:
                    if response.status != 200:
                        return False
                return _sample(await _scrape(session, running), "rpc_proxy_workers") == 2
        except aiohttp.ClientError:
            return False

    await eventually(up, 30, "both workers to answer")
    return running


async def _one_connection(running: Running, body: dict[str, Any]) -> dict[str, Any]:
    """`body` on a connection of its own (each new connection may reach either worker)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session, session.post(running.url, json=body) as response:
        return dict(await response.json())


async def test_ws_max_connections_per_key_counts_the_sockets_of_every_worker(
    relay: CountingRelay, redis_url: str
) -> None:
    running = await _keyed(relay, redis_url, WS_MAX_CONNECTIONS_PER_KEY="5")
    url = f"ws://127.0.0.1:{running.port}/ws/v3/{KEY}"
    try:
        async with aiohttp.ClientSession() as session:
            opened: list[aiohttp.ClientWebSocketResponse] = []
            refused = 0
            for _ in range(15):  # 15 handshakes, spread over both workers: each alone would take 5
                try:
                    opened.append(await session.ws_connect(url))
                except aiohttp.WSServerHandshakeError as error:
                    assert error.status == 429
                    refused += 1
            assert (len(opened), refused) == (5, 10)
            for ws in opened[:2]:
                await ws.close()

            async def two_more() -> bool:  # the closed sockets' places are given back, in whichever worker
                try:
                    opened.append(await session.ws_connect(url))
                except aiohttp.WSServerHandshakeError:
                    return False
                return len(opened) == 7

            await eventually(two_more, 10, "two sockets in the places of the closed ones")
            with pytest.raises(aiohttp.WSServerHandshakeError):
                await session.ws_connect(url)
            for ws in opened:
                await ws.close()
    finally:
        await _stop(running)


async def _hold_connections(port: int, count: int) -> tuple[list[asyncio.StreamWriter], int]:
    """`count` connections from 127.0.0.2, each asking one keep-alive request; the open ones that were
    answered 200 (held), and how many were refused 503."""
    held, refused = [], 0
    request = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    for _ in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        writer.write(request)
        status = await asyncio.wait_for(reader.readline(), 10)
        if b" 503 " in status:
            refused += 1
            writer.close()
        else:
            assert b" 200 " in status, status
            held.append(writer)
    return held, refused


async def test_max_connections_per_ip_counts_the_connections_of_every_worker(
    relay: CountingRelay, redis_url: str
) -> None:
    running = await _keyed(relay, redis_url, MAX_CONNECTIONS_PER_IP="10")
    try:
        held, refused = await _hold_connections(running.port, 30)
        assert (len(held), refused) == (10, 20)
        for writer in held[:4]:
            writer.close()
        more: list[asyncio.StreamWriter] = []

        async def four_more() -> bool:  # within SETTLE_SECONDS the closed ones leave every worker's count
            extra, _ = await _hold_connections(running.port, 1)
            more.extend(extra)
            assert len(more) <= 4  # never past the cap meanwhile
            return len(more) == 4

        await eventually(four_more, 10, "four connections in the places of the closed ones")
        _, refused = await _hold_connections(running.port, 6)
        assert refused == 6
        for writer in held + more:
            writer.close()
    finally:
        await _stop(running)


async def test_upstream_key_concurrency_is_the_most_calls_of_a_key_the_node_sees_at_once(
    relay: CountingRelay, redis_url: str
) -> None:
    running = await _keyed(relay, redis_url, UPSTREAM_KEY_CONCURRENCY="4")
    relay.slow["eth_getBalance"] = 0.4
    try:
        addresses = ["0x" + os.urandom(20).hex() for _ in range(16)]
        replies = await asyncio.gather(
            *(_one_connection(running, _call("eth_getBalance", [a, "latest"], i)) for i, a in enumerate(addresses))
        )
        assert all(r.get("result") == "0x0" for r in replies), replies
        assert relay.calls["eth_getBalance"] == 16
        assert relay.most["eth_getBalance"] == 4
    finally:
        await _stop(running)


async def test_max_filters_per_key_counts_the_filters_made_through_every_worker(
    relay: CountingRelay, redis_url: str
) -> None:
    running = await _keyed(relay, redis_url, MAX_FILTERS_PER_KEY="5")
    try:
        replies = [await _one_connection(running, _call("eth_newBlockFilter", [])) for _ in range(15)]
        made = [r["result"] for r in replies if "result" in r]
        assert len(made) == 5 and relay.calls["eth_newBlockFilter"] == 5
        assert all(r["error"]["code"] == -32005 for r in replies if "error" in r)
        # Polled and uninstalled through any worker: one filter, known to every worker.
        for own_id in made:
            for _ in range(3):
                polled = await _one_connection(running, _call("eth_getFilterChanges", [own_id]))
                assert isinstance(polled.get("result"), list), polled
        for own_id in made[:2]:
            assert (await _one_connection(running, _call("eth_uninstallFilter", [own_id])))["result"] is True
        replies = [await _one_connection(running, _call("eth_newBlockFilter", [])) for _ in range(6)]
        assert sum("result" in r for r in replies) == 2
        assert relay.calls["eth_newBlockFilter"] - relay.calls["eth_uninstallFilter"] == 5  # live on the node
    finally:
        await _stop(running)


async def test_cache_key_bytes_per_minute_is_what_all_workers_store_for_the_key(
    relay: CountingRelay, redis_url: str
) -> None:
    # Each answer is stored as its result `"0x0"`: 5 bytes, so 100 bytes a minute are 20 answers.
    running = await _keyed(relay, redis_url, CACHE_KEY_BYTES_PER_MINUTE="100")
    try:
        addresses = ["0x" + os.urandom(20).hex() for _ in range(60)]
        for i, address in enumerate(addresses):
            assert (await _one_connection(running, _call("eth_getBalance", [address, "0x0"], i)))["result"] == "0x0"
        async with aiohttp.ClientSession() as session:
            text = await _scrape(session, running)
        not_kept = _sample(text, "rpc_proxy_uncached_answers_total", network="any", reason="key_cache_share")
        assert not_kept == 40
    finally:
        await _stop(running)


async def test_two_replicas_sharing_redis_hold_one_count_per_key(relay: CountingRelay, redis_url: str) -> None:
    limits = {"WS_MAX_CONNECTIONS_PER_KEY": "5", "UPSTREAM_KEY_CONCURRENCY": "4", "MAX_FILTERS_PER_KEY": "5"}
    replicas = [await _keyed(relay, redis_url, **limits) for _ in range(2)]
    relay.slow["eth_getBalance"] = 0.4
    try:
        async with aiohttp.ClientSession() as session:
            opened, refused = [], 0
            for i in range(20):  # alternating replicas, each with its two workers
                try:
                    opened.append(await session.ws_connect(f"ws://127.0.0.1:{replicas[i % 2].port}/ws/v3/{KEY}"))
                except aiohttp.WSServerHandshakeError as error:
                    assert error.status == 429
                    refused += 1
            assert (len(opened), refused) == (5, 15)
            for ws in opened:
                await ws.close()
        addresses = ["0x" + os.urandom(20).hex() for _ in range(16)]
        replies = await asyncio.gather(
            *(
                _one_connection(replicas[i % 2], _call("eth_getBalance", [a, "latest"], i))
                for i, a in enumerate(addresses)
            )
        )
        assert all(r.get("result") == "0x0" for r in replies), replies
        assert relay.most["eth_getBalance"] == 4
        made = [await _one_connection(replicas[i % 2], _call("eth_newBlockFilter", [])) for i in range(12)]
        ids = [r["result"] for r in made if "result" in r]
        assert len(ids) == 5 and relay.calls["eth_newBlockFilter"] == 5
        for i, own_id in enumerate(ids):  # polled through the replica that did not make it, too
            polled = await _one_connection(replicas[i % 2], _call("eth_getFilterChanges", [own_id]))
            assert isinstance(polled.get("result"), list), polled
        assert (await _one_connection(replicas[1], _call("eth_uninstallFilter", [ids[0]])))["result"] is True
        assert "result" in await _one_connection(replicas[0], _call("eth_newBlockFilter", []))
        assert "error" in await _one_connection(replicas[1], _call("eth_newBlockFilter", []))
    finally:
        for running in replicas:
            await _stop(running)


async def test_what_one_replica_stored_for_a_key_this_minute_fills_the_others_share(
    relay: CountingRelay, redis_url: str
) -> None:
    first, second = [await _keyed(relay, redis_url, CACHE_KEY_BYTES_PER_MINUTE="1000") for _ in range(2)]
    try:
        minute = int(time.time() // 60)
        for _ in range(2):  # 200 answers of 5 bytes: the key's 1000 bytes this minute, all stored by the first
            batch = [_call("eth_getBalance", ["0x" + os.urandom(20).hex(), "0x0"], i) for i in range(100)]
            async with aiohttp.ClientSession() as session, session.post(first.url, json=batch) as response:
                assert all(r["result"] == "0x0" for r in await response.json())
        asked = [0]

        async def second_refuses() -> bool:
            asked[0] += 1
            address = "0x" + os.urandom(20).hex()
            assert (await _one_connection(second, _call("eth_getBalance", [address, "0x0"])))["result"] == "0x0"
            async with aiohttp.ClientSession() as session:
                text = await _scrape(session, second)
            return _sample(text, "rpc_proxy_uncached_answers_total", network="any", reason="key_cache_share") > 0

        await eventually(second_refuses, 30, "the second replica to refuse the key's answers")
        if int(time.time() // 60) == minute:  # else a new minute began: a new count
            # Refused once its workers read the deployment's total (each stores blind for at most
            # SYNC_SECONDS), long before its own host count alone (200 answers) would have.
            assert asked[0] < 100
    finally:
        await _stop(first)
        await _stop(second)
