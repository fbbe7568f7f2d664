"""The host-wide memory bounds are the host's, whatever WORKERS is: `python -m proxy` with WORKERS=2,
attacked from outside by raw sockets that stall or read nothing over many connections (which the
kernel spreads over both workers). What the host holds is what one process would allow, not twice it."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.fake_evm import FakeEvm
from tests.memory_fill import big_call
from tests.test_front import post
from tests.test_front_backpressure import unread_socket
from tests.test_workers import Running, _ready, _sample, _scrape, _start, _stop

MB = 1_000_000
ANSWER = MB  # bytes of each eth_call's result (hex)


@pytest.fixture
async def big_node() -> AsyncIterator[FakeEvm]:
    node = await FakeEvm(call_result_bytes=ANSWER).start()
    yield node
    await node.close()


async def _two_workers(node: FakeEvm, **env: str) -> Running:
    running = _start(node.url, 2, **env)
    if "API_KEYS" in env:
        running.url = f"http://127.0.0.1:{running.port}/v3/{env['API_KEYS']}"
    async with aiohttp.ClientSession() as session:
        await _ready(session, running, 2)
    return running


def _stalled_body(port: int, declared: int) -> socket.socket:
    """A client that declares a `declared`-byte body, sends 100 KB of it and stalls."""
    sock = socket.create_connection(("127.0.0.1", port))
    head = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    sock.sendall(head.encode() + b" " * 100_000)
    sock.setblocking(False)
    return sock


def _refused(sock: socket.socket) -> bool | None:
    """Whether the proxy answered 503 (True), something else (False), or nothing yet (None)."""
    try:
        status = sock.recv(64)
    except BlockingIOError:
        return None
    return b" 503 " in status.split(b"\r\n")[0]


async def test_max_inflight_body_bytes_is_what_the_bodies_of_every_worker_hold(big_node: FakeEvm) -> None:
    # MAX_INFLIGHT_BODY_BYTES, all clients together: 16 clients each declaring a 4 MB body and
    # stalling against a 10 MB bound. One process receives 2 and answers 14 with 503; each of two
    # workers counting alone received 2 of its own (4 bodies, 16 MB on the host).
    running = await _two_workers(
        big_node, MAX_INFLIGHT_BODY_BYTES="10000000", MAX_BODY_BYTES="5000000", BODY_TIMEOUT="60"
    )
    socks: list[socket.socket] = []
    try:
        socks = [_stalled_body(running.port, 4 * MB) for _ in range(16)]
        answers: dict[int, bool] = {}
        deadline = time.monotonic() + 10
        while len(answers) < 14 and time.monotonic() < deadline:
            for n, sock in enumerate(socks):
                if n not in answers and (refused := _refused(sock)) is not None:
                    answers[n] = refused
            await asyncio.sleep(0.02)
        assert all(answers.values()), answers
        assert len(answers) == 14, f"{16 - len(answers)} bodies being received, where 2 fit the bound"
        assert [_refused(sock) for n, sock in enumerate(socks) if n not in answers] == [None, None]
    finally:
        for sock in socks:
            sock.close()
        await _stop(running)


async def _pending(session: aiohttp.ClientSession, running: Running) -> tuple[float, float]:
    """Bytes of answers made and not yet taken, and requests waiting for room, on the whole host."""
    text = await _scrape(session, running)
    return _sample(text, "rpc_proxy_answer_bytes_pending"), _sample(text, "rpc_proxy_requests_waiting_for_room")


async def test_max_pending_answer_bytes_per_key_is_what_the_key_holds_in_every_worker(
    big_node: FakeEvm, redis_url: str
) -> None:
    # MAX_PENDING_ANSWER_BYTES_PER_KEY: six connections of one key, each pipelining 40 distinct 1 MB
    # answers and reading none. Each of two workers holds the key to half its 24 MB, so the host holds
    # the key's 24 MB (plus the first answers of its connections, reckoned before their size is known:
    # two each); each of two workers holding the whole bound held 24 MB of its own.
    per_key, connections = 24 * MB, 6
    running = await _two_workers(
        big_node,
        API_KEYS="attacker",
        REDIS_URL=redis_url,
        MAX_PENDING_ANSWER_BYTES=str(48 * MB),
        MAX_PENDING_ANSWER_BYTES_PER_KEY=str(per_key),
    )
    socks = [unread_socket(running.port) for _ in range(connections)]
    try:
        for n, sock in enumerate(socks):  # distinct misses on every connection (a few KB: sent at once)
            sock.sendall(
                b"".join(post(json.dumps(big_call(40 * n + i)).encode(), path="/v3/attacker") for i in range(40))
            )
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 30
            while (await _pending(session, running))[1] < connections:  # every connection waits for room
                assert time.monotonic() < deadline, "every attacking connection to wait for room"
                await asyncio.sleep(0.05)
            bound = per_key + 2 * connections * ANSWER
            held_until = time.monotonic() + 1
            while time.monotonic() < held_until:  # and the host stays within the key's bound meanwhile
                pending, _ = await _pending(session, running)
                assert pending <= bound, f"{pending:,.0f} bytes pending for one key, bound {per_key:,}"
                await asyncio.sleep(0.05)
            for sock in socks:
                sock.close()
            deadline = time.monotonic() + 10
            while await _pending(session, running) != (0, 0):  # closed connections leave every count
                assert time.monotonic() < deadline, "closed connections to leave the count"
                await asyncio.sleep(0.05)
    finally:
        for sock in socks:
            sock.close()
        await _stop(running)
