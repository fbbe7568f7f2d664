"""The process's life through the real CLI: one drain within SHUTDOWN_TIMEOUT for HTTP and WebSocket
calls together, each call cut off at its end answered with an error; during the drain a request
already read is answered and a connection's last answer says Connection: close (RFC 9112 9.6); a
SIGHUP while the proxy starts is held until it serves, not its default action (exit)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import time
import tomllib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support import Anvil, eventually, free_port, healthy, serving

SHUTDOWN_TIMEOUT = 2.0
TCP_CLOSE = 7  # a socket's state once its peer reset it (linux/tcp_states.h)


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


def _start(relay: HeldRelay, argv: tuple[str, ...] = ("-m", "proxy"), **env: str) -> Running:
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
        proc = subprocess.Popen([sys.executable, *argv], env=environ, stdout=subprocess.DEVNULL, stderr=handle)
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


def _chain_id(rid: int) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": rid, "method": "eth_chainId", "params": []}).encode()


def _unsent(sock: socket.socket) -> int:
    """Bytes written to `sock` its peer has not yet taken (SIOCOUTQ): 0 once they are in its kernel."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])


def _reset(sock: socket.socket) -> bool:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == TCP_CLOSE


@pytest.mark.parametrize("cut_off", [False, True])
async def test_a_request_sent_before_the_last_answer_of_a_drain_is_answered_last_and_the_close_is_staged(
    relay: HeldRelay, cut_off: bool
) -> None:
    # Three requests ahead of it: the third waits, unmade, for room for its answer (answer_bytes.py),
    # reading paused, so the one sent during the drain lies unread in the kernel when the third is made.
    running = _start(relay, SHUTDOWN_TIMEOUT=str(SHUTDOWN_TIMEOUT if cut_off else 10))
    try:
        await _serving(running)
        with socket.create_connection(("127.0.0.1", running.port)) as sock:
            sock.sendall(_post(_call(1)) + _post(_chain_id(2)) + _post(_chain_id(3)))

            async def held() -> bool:
                return relay.held == 1

            await eventually(held, 10, "the call to reach the upstream")
            running.proc.send_signal(signal.SIGTERM)
            await eventually(lambda: asyncio.to_thread(running.said, "SIGTERM received"), 10, "the drain to begin")
            sock.sendall(_post(_chain_id(99)))  # while request 1 is still being answered

            async def taken() -> bool:
                return _unsent(sock) == 0

            await eventually(taken, 10, "the request to reach the proxy's side of the connection")
            if not cut_off:
                relay.released.set()
            answers = _answers(await asyncio.to_thread(_to_the_end, sock))
            if not cut_off:  # after the last answer what the client still sends is read and dropped: no reset
                sock.sendall(_post(_chain_id(100)))
                assert not _reset(sock) and sock.recv(65536) == b""
        # Cut off at SHUTDOWN_TIMEOUT, a request not yet made is answered with the cut-off error, in order.
        for (_, answer), rid in zip(answers, [1, 2, 3, 99], strict=True):
            assert answer["id"] == rid or (cut_off and answer["error"]["code"] == -32603), answer
        assert [b"Connection: close" in lines for lines, _ in answers] == [False, False, False, True]
        assert await _exit_code(running) == 0
    finally:
        _end(running)


@pytest.mark.parametrize("transport", ["http", "websocket"])
async def test_at_shutdown_timeout_a_batch_answers_what_it_made_and_cuts_off_only_the_calls_being_made(
    relay: HeldRelay, transport: str, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.alice]\nkey = "alicekey"\ndaily_credits = 100000\n')
    running = _start(relay, API_KEYS_FILE=str(keys))
    batch = b"[" + _call(1) + b"," + _chain_id(2) + b"]"  # eth_call 80 credits (held), eth_chainId 5
    try:
        await _serving(running)
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{running.port}/v3/alicekey"
            ws = await session.ws_connect(f"ws://127.0.0.1:{running.port}/ws/v3/alicekey")
            if transport == "http":
                posted = asyncio.create_task(session.post(url, data=batch))
            else:
                await ws.send_bytes(batch)

            async def held() -> bool:
                return relay.held == 1

            await eventually(held, 10, "the eth_call to reach the upstream")
            running.proc.send_signal(signal.SIGTERM)
            if transport == "http":
                response = await posted
                answers, charged = await response.json(), response.headers["X-Credits-Charged"]
                # Charged as a call whose caller left: the eth_call's request was written to the node.
                assert charged == "85"
            else:
                message = await ws.receive(timeout=10)
                assert message.type == aiohttp.WSMsgType.TEXT, message
                answers = json.loads(message.data)
        assert answers[0]["id"] == 1 and "SHUTDOWN_TIMEOUT" in answers[0]["error"]["message"]
        assert answers[1] == {"jsonrpc": "2.0", "id": 2, "result": "0x7a69"}
        assert await _exit_code(running) == 0
    finally:
        _end(running)


def _catches_sighup(pid: int) -> bool:
    """Whether the process has a handler for SIGHUP (SigCgt in /proc/PID/status)."""
    caught = re.search(r"^SigCgt:\s+([0-9a-f]+)$", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    return caught is not None and bool(int(caught.group(1), 16) & 1 << (signal.SIGHUP - 1))


@pytest.mark.parametrize("after", [0.0, 0.05])
async def test_a_sighup_in_the_console_scripts_first_moment_is_held(relay: HeldRelay, after: float) -> None:
    # The entry point pyproject.toml names for rpc-proxy (the Docker image's ENTRYPOINT), run as its script runs it.
    # From the moment the interpreter has started (nothing holds a signal before): the first thing it
    # does. It was sent at a fixed 0.1 s, which a busy machine's interpreter start outlasted.
    scripts = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts["rpc-proxy"].split(":")
    running = _start(relay, argv=("-c", f"import sys; from {module} import {function}; sys.exit({function}())"))
    try:
        pid = running.proc.pid
        await eventually(lambda: asyncio.to_thread(_catches_sighup, pid), 30, "the interpreter to start")
        await asyncio.sleep(after)  # the moment under test, not a wait for state
        running.proc.send_signal(signal.SIGHUP)
        await _serving(running)
        running.proc.send_signal(signal.SIGTERM)
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
