"""The process's life through the real CLI: one drain within SHUTDOWN_TIMEOUT for HTTP and WebSocket
calls together, each call cut off at its end answered with an error; during the drain a request
already read is answered and a connection's last answer says Connection: close (RFC 9112 9.6); a
SIGHUP while the proxy starts is held until it serves, not its default action (exit)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support import Anvil, eventually, free_port, healthy, serving

SHUTDOWN_TIMEOUT = 2.0


@dataclass
class HeldRelay:
    """A relay to Anvil that holds every request with an eth_call (or every request, `all`) until
    released; `held` counts the calls (the proxy may send several in one batch)."""

    target: str
    all: bool = False
    held: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if self.all or b'"eth_call"' in body:
            self.held += max(1, body.count(b'"eth_call"'))
            await self.released.wait()
        headers = {"Content-Type": "application/json"}
        async with aiohttp.ClientSession() as session, session.post(self.target, data=body, headers=headers) as resp:
            return web.Response(body=await resp.read(), content_type="application/json")


@pytest.fixture
async def relay(anvil: Anvil) -> AsyncIterator[HeldRelay]:
    held = HeldRelay(anvil.url)
    async with serving(held.handle) as url:
        held.url = url
        yield held
        held.released.set()


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def said(self, text: str) -> bool:
        return text in self.log.read_text()


def _start(relay: HeldRelay, **env: str) -> Running:
    port = free_port()
    environ = {
        **os.environ,
        "EVM_UPSTREAM": relay.url,
        "PROXY_PORT": str(port),
        "SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT),
        "HEAD_POLL_INTERVAL": "0.2",
        **env,
    }
    log = Path(tempfile.mkstemp(prefix="rpc-proxy-drain-", suffix=".log")[1])
    with log.open("wb") as handle:  # a file: a pipe nobody reads could fill and block the proxy
        proc = subprocess.Popen([sys.executable, "-m", "proxy"], env=environ, stdout=subprocess.DEVNULL, stderr=handle)
    return Running(proc, port, log)


async def _serving(running: Running) -> None:
    async def up() -> bool:
        assert running.proc.poll() is None, running.log.read_text()
        return await asyncio.to_thread(healthy, running.port)

    await eventually(up, 30, "the proxy to serve")


async def _exit_code(running: Running) -> int:
    return await asyncio.to_thread(running.proc.wait, 30)


def _end(running: Running) -> None:
    """Whatever the test's outcome: the process gone, its log removed."""
    if running.proc.poll() is None:
        running.proc.kill()
    running.proc.wait(10)
    running.log.unlink()


def _call(rid: int) -> bytes:
    """An eth_call of its own (no cache hit): the relay holds it."""
    params: list[Any] = [{"to": "0x" + "11" * 20, "data": f"0x{rid:08x}"}, "latest"]
    return json.dumps({"jsonrpc": "2.0", "id": rid, "method": "eth_call", "params": params}).encode()


def _post(body: bytes) -> bytes:
    head = b"POST /v3/any HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    return head % len(body) + body


def _answers(data: bytes) -> list[tuple[list[bytes], dict[str, Any]]]:
    """The HTTP answers in `data`, read to the connection's end: each one's header lines and body."""
    answers = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length"))
        answers.append((lines, json.loads(rest[:length])))
        data = rest[length:]
    return answers


def _to_the_end(sock: socket.socket) -> bytes:
    sock.settimeout(20)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


async def test_one_drain_within_shutdown_timeout_answers_cut_off_http_and_websocket_calls_with_errors(
    relay: HeldRelay,
) -> None:
    running = _start(relay)
    try:
        await _serving(running)
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{running.port}/v3/any"
            http_call = asyncio.create_task(session.post(url, data=_call(1)))
            ws = await session.ws_connect(f"ws://127.0.0.1:{running.port}/ws/v3/any")
            await ws.send_bytes(_call(2))

            async def both_held() -> bool:
                return relay.held == 2

            await eventually(both_held, 10, "the HTTP and the WebSocket call to reach the upstream")
            stopped_at = time.monotonic()
            running.proc.send_signal(signal.SIGTERM)
            response = await http_call
            assert response.status == 503 and response.headers["Connection"] == "close"
            error = (await response.json())["error"]
            assert error["code"] == -32603 and "SHUTDOWN_TIMEOUT" in error["message"]
            answer = await ws.receive(timeout=10)
            assert answer.type == aiohttp.WSMsgType.TEXT, answer
            assert json.loads(answer.data)["id"] == 2 and json.loads(answer.data)["error"]["code"] == -32603
            closing = await ws.receive(timeout=10)
            assert closing.type == aiohttp.WSMsgType.CLOSE and closing.data == 1001
        assert await _exit_code(running) == 0
        # One drain: SHUTDOWN_TIMEOUT for both transports together, not one after the other.
        assert time.monotonic() - stopped_at < SHUTDOWN_TIMEOUT + 1.5
    finally:
        _end(running)


async def test_during_the_drain_a_request_read_is_answered_and_the_last_answer_says_connection_close(
    relay: HeldRelay,
) -> None:
    running = _start(relay, SHUTDOWN_TIMEOUT="10")
    try:
        await _serving(running)
        first = socket.create_connection(("127.0.0.1", running.port))
        second = socket.create_connection(("127.0.0.1", running.port))
        with first, second:
            first.sendall(_post(_call(1)))
            second.sendall(_post(_call(2)))

            async def held(count: int) -> bool:
                return relay.held == count

            await eventually(lambda: held(2), 10, "both calls to reach the upstream")
            running.proc.send_signal(signal.SIGTERM)
            await eventually(lambda: asyncio.to_thread(running.said, "SIGTERM received"), 10, "the drain to begin")
            first.sendall(_post(_call(3)))  # on a connection kept alive, while its first answer is made
            await eventually(lambda: held(3), 10, "the request sent during the drain to be read")
            relay.released.set()
            one, three = _answers(await asyncio.to_thread(_to_the_end, first))
            (two,) = _answers(await asyncio.to_thread(_to_the_end, second))
        assert one[1]["id"] == 1 and b"Connection: close" not in one[0]  # another answer follows it
        assert three[1] == {"jsonrpc": "2.0", "id": 3, "result": "0x"} and b"Connection: close" in three[0]
        assert two[1]["id"] == 2 and b"Connection: close" in two[0]
        assert await _exit_code(running) == 0
    finally:
        _end(running)


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_a_sighup_while_the_proxy_starts_is_held_until_it_serves(relay: HeldRelay, workers: str) -> None:
    relay.all = True  # the start waits on the upstream's first answers
    running = _start(relay, WORKERS=workers)
    try:

        async def starting() -> bool:
            return relay.held > 0

        await eventually(starting, 30, "the proxy to ask its upstream while it starts")
        running.proc.send_signal(signal.SIGHUP)  # the supervisor forwards it to its starting workers
        relay.released.set()
        await _serving(running)
        await eventually(
            lambda: asyncio.to_thread(running.said, "key(s) reloaded"), 10, "the held SIGHUP's reload once serving"
        )
        running.proc.send_signal(signal.SIGTERM)
        assert await _exit_code(running) == 0
        assert "exited with code" not in running.log.read_text()  # no worker killed by it, none restarted
    finally:
        _end(running)
