"""Slow and abandoned clients: body deadlines, a bound on bodies in flight, a connection cap, quiet logs.

These run the app as `rpc-proxy` does (an AppRunner behind the capped site, handlers not cancelled
when a client leaves), not under aiohttp's test server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import uvloop
from aiohttp import web
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from proxy import redis_link
from proxy.app import create_app
from proxy.config import Settings
from proxy.http.listeners import BACKLOG, CappedSite, PeerCounts, backlog_for
from proxy.logs import Throttled
from proxy.metrics import Metrics
from proxy.redis_link import RedisLink, RedisUnavailable
from tests.support import Anvil, Proxy, ProxyFactory, eventually, free_port, settings_for, start_proxy

CHAIN_ID = b'{"jsonrpc":"2.0","id":1,"method":"eth_chainId","params":[]}'


@asynccontextmanager
async def served(settings: Settings) -> AsyncIterator[int]:
    """The proxy on a free port, served the way the CLI serves it."""
    # A short shutdown: aiohttp keeps reading (and dropping) an unread body for up to 10 s after answering.
    runner = web.AppRunner(create_app(settings, registry=CollectorRegistry()), access_log=None, shutdown_timeout=1)
    await runner.setup()
    port = free_port()
    await CappedSite(
        runner, "127.0.0.1", port, max_connections=settings.max_connections, per_ip=settings.max_connections_per_ip
    ).start()
    try:
        yield port
    finally:
        await runner.cleanup()


def head(port: int, length: int | str, path: str = "/v3/k") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def exchange(port: int, data: bytes) -> tuple[int, bytes]:
    """Send raw bytes, read until the server closes or answers one response; (status, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 30)
        headers = {}
        while (line := await asyncio.wait_for(reader.readline(), 30)) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.lower()] = value.strip()
        body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 30)
        return int(status_line.split()[1]), body
    finally:
        writer.close()


async def post(port: int, body: bytes = CHAIN_ID) -> tuple[int, bytes]:
    return await exchange(port, head(port, len(body)) + body)


async def test_a_stalled_body_is_answered_408_at_body_timeout_and_closed(anvil: Anvil) -> None:
    async with served(settings_for(EVM_UPSTREAM=anvil.url, BODY_TIMEOUT="0.3")) as port:
        status, body = await exchange(port, head(port, 100_000) + b'{"jsonrpc":')
        assert status == 408 and json.loads(body)["error"]["code"] == -32600
        assert (await post(port))[0] == 200


@pytest.mark.parametrize("start", ["POST /elsewhere HTTP/1.1", "GET /v3/k HTTP/1.1", "PUT /metrics HTTP/1.1"])
async def test_a_stalled_body_nothing_reads_is_answered_408_at_body_timeout_too(anvil: Anvil, start: str) -> None:
    """Rule (docs/security.md: a body is read within BODY_TIMEOUT): a request no route reads a body of
    (another path, another method) is held to it too; it was held open for ever (a slowloris)."""
    async with served(settings_for(EVM_UPSTREAM=anvil.url, BODY_TIMEOUT="0.3")) as port:
        stalled = f"{start}\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 100\r\n\r\n0123456789".encode()
        status, body = await exchange(port, stalled)
        assert status == 408 and json.loads(body)["error"]["code"] == -32600
        assert (await post(port))[0] == 200


async def test_a_declared_body_over_the_limit_is_413_before_any_of_it_is_read(anvil: Anvil) -> None:
    async with served(settings_for(EVM_UPSTREAM=anvil.url, MAX_BODY_BYTES="1000")) as port:
        status, body = await exchange(port, head(port, 50_000_000))
        assert status == 413 and json.loads(body)["error"]["code"] == -32600


async def test_the_declared_length_limit_holds_at_its_edge_and_through_leading_zeros(anvil: Anvil) -> None:
    async with served(settings_for(EVM_UPSTREAM=anvil.url, MAX_BODY_BYTES="1000")) as port:
        assert (await exchange(port, head(port, 1001)))[0] == 413  # as many digits as the limit, one over it
        assert (await exchange(port, head(port, "0000001001")))[0] == 413  # more digits, the same length
        at_limit = CHAIN_ID[:-1] + b" " * (1000 - len(CHAIN_ID)) + b"}"
        status, body = await exchange(port, head(port, "000" + str(len(at_limit))) + at_limit)
        assert status == 200 and json.loads(body)["result"] == "0x7a69"


async def test_bodies_beyond_the_in_flight_byte_budget_are_503_and_small_calls_still_served(anvil: Anvil) -> None:
    settings = settings_for(EVM_UPSTREAM=anvil.url, MAX_INFLIGHT_BODY_BYTES="200000")
    async with served(settings) as port:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head(port, 150_000) + b"[")  # holds 150,000 of the 200,000 bytes
        await writer.drain()
        try:
            await asyncio.sleep(0)  # no state to wait for: the next answer proves the budget is held

            async def refused() -> bool:
                return (await exchange(port, head(port, 150_000) + b"["))[0] == 503

            await eventually(refused, 10, "a second large body to be refused")
            assert (await post(port))[0] == 200
        finally:
            writer.close()


async def test_connections_over_max_connections_get_503_and_established_clients_are_still_served(anvil: Anvil) -> None:
    settings = settings_for(EVM_UPSTREAM=anvil.url, MAX_CONNECTIONS="4")
    async with served(settings) as port, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as client:
        url = f"http://127.0.0.1:{port}/v3/k"
        async with client.post(url, data=CHAIN_ID) as resp:
            assert resp.status == 200  # this client's connection is now established and kept alive
        idle = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(10)))
        reads = [asyncio.create_task(reader.read()) for reader, _ in idle]  # a refusal: to its close
        try:

            async def seven_answered() -> bool:
                return sum(r.done() for r in reads) >= 7

            await eventually(seven_answered, 10, "connections over the cap to be answered")
            # Three fit beside the client; the other seven were answered 503 and closed at once.
            answers = [r.result() for r in reads if r.done()]
            assert len(answers) == 7 and all(a.startswith(b"HTTP/1.1 503") for a in answers)
            # Every answer names its request, a refusal too: each its own X-Request-Id.
            ids = {re.search(rb"\r\nX-Request-Id: ([^\r]+)\r\n", a.split(b"\r\n\r\n")[0] + b"\r\n") for a in answers}
            assert None not in ids and len({m.group(1) for m in ids if m}) == 7
            async with client.post(url, data=CHAIN_ID) as resp:
                assert resp.status == 200
        finally:
            for read in reads:
                read.cancel()
            for _, writer in idle:
                writer.close()


async def test_the_probes_on_metrics_port_answer_while_max_connections_fill_the_public_port(anvil: Anvil) -> None:
    """An orchestrator's liveness probe must not fail in a connection flood (a restart drops every
    connection and the cache): METRICS_PORT answers /healthz and /readyz off the public port's cap."""
    metrics_port = free_port()
    settings = settings_for(EVM_UPSTREAM=anvil.url, MAX_CONNECTIONS="3", METRICS_PORT=str(metrics_port))
    async with served(settings) as port, aiohttp.ClientSession() as client:
        internal = f"http://127.0.0.1:{metrics_port}"

        async def ready() -> bool:
            async with client.get(internal + "/readyz") as resp:
                return resp.status == 200

        await eventually(ready, 10, "the network to be ready")
        idle = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(3)))
        try:

            async def public_full() -> bool:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = await reader.read()
                writer.close()
                return answer.startswith(b"HTTP/1.1 503")

            await eventually(public_full, 10, "the public port to be full")
            for path, body in (("/healthz", {"status": "ok"}), ("/readyz", None)):
                async with client.get(internal + path) as resp:
                    assert resp.status == 200, path
                    answer = await resp.json()
                    assert answer == body if body is not None else answer["status"] == "ready"
            async with client.get(internal + "/readyz?started") as resp:
                assert resp.status == 200
        finally:
            for _, writer in idle:
                writer.close()


@pytest.mark.parametrize("reset", [False, True])
async def test_a_client_that_aborts_mid_body_costs_a_debug_line_not_a_traceback(
    anvil: Anvil, caplog: pytest.LogCaptureFixture, reset: bool
) -> None:
    caplog.set_level(logging.DEBUG)
    async with served(settings_for(EVM_UPSTREAM=anvil.url)) as port:
        for _ in range(5):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(head(port, 100_000) + b"[" * 100)
            await asyncio.sleep(0.05)  # let the handler start reading the body
            if reset:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()

        async def all_logged() -> bool:
            return sum("before its request body arrived" in r.getMessage() for r in caplog.records) == 5

        await eventually(all_logged, 10, "five aborted bodies to be noticed")
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name != "proxy.chain"]
    assert loud == [] and not any(r.exc_info for r in caplog.records)


class TestThrottled:
    def test_a_repeated_warning_is_logged_once_per_interval_with_a_count(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        now = [0.0]
        throttled = Throttled(logging.getLogger("test.throttled"), interval=60, clock=lambda: now[0])
        for _ in range(1000):
            throttled.warning("k", "redis down")
        now[0] = 61
        throttled.warning("k", "redis down")
        throttled.warning("other", "upstream down")
        assert [r.getMessage() for r in caplog.records] == [
            "redis down",
            "redis down (999 more like this in the last 60s)",
            "upstream down",
        ]


async def test_a_redis_outage_logs_a_few_lines_not_one_per_request(
    anvil: Anvil, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.alice]\nkey = "sk-a"\n')
    settings = settings_for(
        EVM_UPSTREAM=anvil.url, API_KEYS_FILE=str(keys), REDIS_URL=f"redis://127.0.0.1:{free_port()}/0"
    )
    # Inline, not make_proxy: closed before the log lines are counted, those of the close included.
    proxy = await start_proxy(settings)
    try:
        for i in range(40):
            status, _, _ = await proxy.post({"jsonrpc": "2.0", "id": i, "method": "eth_chainId"}, key="sk-a")
            assert status == 200
    finally:
        await proxy.close()
    assert sum("credits: redis unavailable" in r.getMessage() for r in caplog.records) <= 1


async def test_a_flapping_redis_logs_its_returns_as_seldom_as_its_outages_and_ends_on_the_truth(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule (docs/operations.md, logs): an outage's WARNING is throttled, and the INFO saying Redis is
    back follows each outage logged, never one left out: a Redis failing every other command logged
    "redis is back" after each failure, and, throttled apart, a log could end on "unavailable" while
    Redis was up (outside attacks)."""
    caplog.set_level(logging.INFO, logger="proxy.redis")
    now = [0.0]
    monkeypatch.setattr(redis_link, "throttled", Throttled(logging.getLogger("proxy.redis"), clock=lambda: now[0]))
    link = RedisLink(object(), timeout=1.0, metrics=Metrics(CollectorRegistry()), min_backoff=0.0, max_backoff=0.0)

    async def fails(_: object) -> None:
        raise RedisError("busy")

    async def answers(_: object) -> str:
        return "PONG"

    async def flap(down: float, up: float, times: int = 1) -> list[str]:
        caplog.clear()
        for _ in range(times):
            now[0] = down
            with pytest.raises(RedisUnavailable):
                await link.run("get", fails)
            now[0] = up
            assert await link.run("get", answers) == "PONG"
        return [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "proxy.redis"]

    assert await flap(0.0, 0.0, 20) == ["redis unavailable", "redis is back"]
    assert await flap(30.0, 30.0, 5) == []  # within the minute: neither
    assert await flap(70.0, 120.0) == ["redis unavailable", "redis is back"]  # an outage of 50 s
    # Down a minute after the last outage logged, but within a minute of the last return logged.
    assert await flap(132.0, 133.0) == ["redis unavailable", "redis is back"]
    # Down again within the minute, and still down past it: logged then, once, and its return too.
    assert await flap(150.0, 150.0) == []
    now[0], tries = 150.0, []
    for at in (151.0, 191.0, 193.0, 197.0):
        now[0] = at
        with pytest.raises(RedisUnavailable):
            await link.run("get", fails)
        tries += [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "proxy.redis"]
        caplog.clear()
    assert tries == ["redis unavailable"]
    now[0] = 198.0
    assert await link.run("get", answers) == "PONG"
    assert [r.getMessage() for r in caplog.records if r.name == "proxy.redis"] == ["redis is back"]


async def test_metrics_port_serves_metrics_on_an_internal_listener_and_the_public_port_does_not(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    metrics_port = free_port()
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, METRICS_PORT=str(metrics_port))
    assert "result" in await proxy.call("eth_chainId", [])
    async with proxy.session.get(proxy.base + "/metrics") as resp:
        assert resp.status == 404
    async with proxy.session.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
        assert resp.status == 200 and "rpc_proxy_requests_total" in await resp.text()
    async with proxy.session.post(f"http://127.0.0.1:{metrics_port}/v3/k", data=CHAIN_ID) as resp:
        assert resp.status in (404, 405)  # the internal listener serves metrics only


# --- fair shares of the connection slots (issue 19, item 6) -------------------------------------


async def chain_id_from(port: int, local: str) -> tuple[int, float]:
    """key-b's eth_chainId over a fresh connection from the local address `local`: (status, seconds)."""
    started = time.perf_counter()
    connector = aiohttp.TCPConnector(local_addr=(local, 0), force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as client,
        client.post(f"http://127.0.0.1:{port}/v3/key-b", data=CHAIN_ID) as resp,
    ):
        await resp.read()
        return resp.status, time.perf_counter() - started


async def test_one_client_address_cannot_fill_max_connections(anvil: Anvil) -> None:
    # Item 6: 4,096 idle WebSockets that answer pings filled MAX_CONNECTIONS; every other key got 503.
    settings = settings_for(
        EVM_UPSTREAM=anvil.url,
        API_KEYS="key-a,key-b",
        MAX_CONNECTIONS="40",
        MAX_CONNECTIONS_PER_IP="10",
        WS_MAX_CONNECTIONS_PER_KEY="0",
    )
    async with served(settings) as port, aiohttp.ClientSession() as attacker:
        held, refused = [], 0
        for _ in range(40):  # idle WebSockets from 127.0.0.1, each answering pings
            try:
                held.append(await attacker.ws_connect(f"ws://127.0.0.1:{port}/ws/v3/key-a"))
            except aiohttp.WSServerHandshakeError as exc:
                assert exc.status == 503
                refused += 1
        try:
            assert len(held) == 10 and refused == 30
            status, seconds = await chain_id_from(port, "127.0.0.2")  # another client: still served
            assert status == 200 and seconds < 2.0
            await held.pop().close()

            async def a_slot_is_free_again() -> bool:
                with contextlib.suppress(aiohttp.WSServerHandshakeError):
                    held.append(await attacker.ws_connect(f"ws://127.0.0.1:{port}/ws/v3/key-a"))
                    return True
                return False

            await eventually(a_slot_is_free_again, 10, "the closed connection's slot to be given back")
        finally:
            for ws in held:
                await ws.close()


async def test_one_key_cannot_hold_more_than_its_websocket_share(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS="key-a,key-b", WS_MAX_CONNECTIONS_PER_KEY="3")
    held = [await proxy.session.ws_connect(proxy.ws_url("key-a")) for _ in range(3)]
    async with proxy.session.get(
        proxy.ws_url("key-a"),
        headers={
            "Upgrade": "websocket",
            "Connection": "Upgrade",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        },
    ) as resp:
        body = await resp.json()
        assert resp.status == 429 and resp.headers["X-Credits-Charged"] == "0"
        assert body["error"]["code"] == -32005 and "WS_MAX_CONNECTIONS_PER_KEY" in body["error"]["message"]
    other = await proxy.session.ws_connect(proxy.ws_url("key-b"))  # another key is not affected
    await other.send_json({"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []})
    assert (await other.receive_json(timeout=5))["result"] == "0x7a69"
    for ws in [*held, other]:
        await ws.close()


async def test_an_idle_websocket_is_closed_after_ws_idle_timeout(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS="key-a,key-b", WS_IDLE_TIMEOUT="1")
    idle = await proxy.session.ws_connect(proxy.ws_url("key-a"))  # answers pings, sends nothing
    subscribed = await proxy.session.ws_connect(proxy.ws_url("key-b"))
    await subscribed.send_json({"jsonrpc": "2.0", "id": 1, "method": "eth_subscribe", "params": ["newHeads"]})
    assert "result" in await subscribed.receive_json(timeout=5)
    calling = await proxy.session.ws_connect(proxy.ws_url("key-b"))
    started = time.monotonic()
    closing = asyncio.create_task(idle.receive(timeout=10))
    while not closing.done():  # a call every 0.3 s keeps this one open
        await calling.send_json({"jsonrpc": "2.0", "id": 2, "method": "eth_chainId", "params": []})
        assert (await calling.receive_json(timeout=5))["id"] == 2
        await asyncio.sleep(0.3)
    message = closing.result()
    assert message.type is aiohttp.WSMsgType.CLOSE and message.data == 1000, message
    assert "idle for 1s" in message.extra and 0.9 < time.monotonic() - started < 5
    assert not subscribed.closed and not calling.closed
    anvil.mine(1)
    assert (await subscribed.receive_json(timeout=5))["method"] == "eth_subscription"
    await subscribed.close()
    await calling.close()


class TestPeerCounts:
    def test_an_address_is_capped_until_one_of_its_connections_closes(self) -> None:
        peers, handlers = PeerCounts(2), [SimpleNamespace(transport=object()) for _ in range(3)]
        for handler in handlers[:2]:
            assert peers.admits("10.0.0.1")
            peers.add("10.0.0.1", handler)
        assert not peers.admits("10.0.0.1") and peers.admits("10.0.0.2")
        handlers[0].transport = None  # closed: aiohttp clears a handler's transport on connection_lost
        assert peers.admits("10.0.0.1")

    def test_closed_connections_of_many_addresses_are_swept(self) -> None:
        peers = PeerCounts(5)
        for n in range(5000):
            handler = SimpleNamespace(transport=object())
            peers.add(f"10.0.{n // 256}.{n % 256}", handler)
            handler.transport = None
        assert sum(len(held) for held in peers._open.values()) <= 1024
        assert PeerCounts(0).admits("10.0.0.1")  # 0: no cap


async def test_the_public_listeners_accept_queue_is_the_kernels_not_aiohttps_128(evm_proxy: Proxy) -> None:
    """A burst of 1,000 connections overflowed aiohttp's default accept queue of 128, and every client's
    next connection waited for SYN retransmits (1, 3, 7 s; an outside attack). The queue is asked of
    the kernel at BACKLOG (4096), which net.core.somaxconn caps; `ss` shows it as a listener's Send-Q."""
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    shown = subprocess.run(
        ["ss", "-Hltn", f"sport = :{evm_proxy.server.port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    expected = backlog_for(asyncio.get_running_loop(), 128)  # uvloop's (the default): asyncio keeps 128
    assert int(shown[2]) == min(expected, somaxconn), shown
    other = uvloop.new_event_loop()
    try:
        assert backlog_for(other, 128) == BACKLOG > 128
    finally:
        other.close()
