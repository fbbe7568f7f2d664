"""A client that does not read its answers (HTTP pipelining, WebSocket) costs the proxy a bounded
amount of memory: answers are made as it reads, a connection that reads nothing is dropped, and a
WebSocket that falls WS_SEND_BUFFER_BYTES behind is closed (1008). And what pipelining must not
break: many complete requests in one read are not one request head, a 100 Continue queued behind
an answer is still sent. Each found by an outside attack on the fast server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable

import pytest

from proxy.http import front, pipeline
from tests.fake_evm import FakeEvm
from tests.fault_relay import FaultRelay
from tests.memory_fill import big_call
from tests.support import MemoryTransport, Proxy, ProxyFactory, eventually
from tests.test_front import call, exchange, post, read_answer
from tests.test_replayed_heads import connection, front_of
from tests.ws_client import frame

ANSWER_BYTES = 1_000_000  # an eth_call result of 1 MB (hex): a quarter of what a socket's buffer may hold


@pytest.fixture
async def big_node() -> AsyncIterator[FakeEvm]:
    node = await FakeEvm(call_result_bytes=ANSWER_BYTES).start()
    yield node
    await node.close()


@pytest.fixture
async def proxy(big_node: FakeEvm, make_proxy: ProxyFactory) -> Proxy:
    """The proxy in front of the node of large answers, open mode, memory tier only."""
    return await make_proxy(EVM_UPSTREAM=big_node.url)


def made(proxy: Proxy, method: str = "eth_call") -> float:
    """Answers the proxy made for `method` (rpc_proxy_requests_total, every status)."""
    total = 0.0
    for family in proxy.registry.collect():
        for sample in family.samples:
            if sample.name == "rpc_proxy_requests_total" and sample.labels.get("method") == method:
                total += sample.value
    return total


async def until_async(check: Callable[[], bool], what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def unread_socket(port: int) -> socket.socket:
    """A client whose receive buffer is small: what the proxy writes stays in the proxy's buffers."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    return sock


def read_answers(sock: socket.socket, count: int) -> list[bytes]:
    """`count` HTTP answers' bodies, read in order from a blocking socket."""
    sock.settimeout(30)
    buffer = b""
    bodies: list[bytes] = []
    while len(bodies) < count:
        end = buffer.find(b"\r\n\r\n")
        if end >= 0:
            head = buffer[:end].decode("latin-1").lower()
            length = int(head.split("content-length:")[1].split("\r\n")[0])
            if len(buffer) >= end + 4 + length:
                bodies.append(buffer[end + 4 : end + 4 + length])
                buffer = buffer[end + 4 + length :]
                continue
        chunk = sock.recv(1 << 20)
        assert chunk, f"closed after {len(bodies)} answers of {count}"
        buffer += chunk
    return bodies


async def test_pipelined_hits_a_client_does_not_read_are_made_only_as_it_reads(proxy: Proxy) -> None:
    # The rule: a request read while the connection's answers cannot go out waits, unmade, until they
    # can. Before, llhttp went on through the rest of the read and every hit was made and buffered:
    # one read of 115 kB of requests held 500 MB of answers nobody read.
    body = json.dumps(big_call(1)).encode()
    status, _, _ = await proxy.post(body)
    assert status == 200  # now a memory hit of about 1 MB
    before = made(proxy)
    requests = 300
    data = b"".join(post(body.replace(b'"id": 1', b'"id": %d' % i)) for i in range(requests))
    loop = asyncio.get_running_loop()
    sock = unread_socket(proxy.server.port)
    try:
        await loop.run_in_executor(None, sock.sendall, data)
        await until_async(lambda: made(proxy) > before, "the first answer to be made")
        # One answer fills what the client's socket and the proxy's write buffer hold: the rest wait.
        assert made(proxy) - before <= 8
        bodies = await loop.run_in_executor(None, read_answers, sock, requests)
    finally:
        sock.close()
    assert [json.loads(b)["id"] for b in bodies] == list(range(requests))  # every one, in order
    assert all(len(b) > ANSWER_BYTES for b in bodies)


@pytest.mark.parametrize(
    "last",
    [
        b"GARBAGE / NOPE\r\n\r\n",  # 400
        b"POST /v3/k HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",  # 431
        b"POST /v3/k HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n",
    ],
)  # 413
async def test_answers_held_back_still_go_out_before_a_refusal_that_ends_the_connection(
    proxy: Proxy,
    last: bytes,
) -> None:
    # A refusal read after requests held back is the connection's last answer, after theirs: the
    # first form dropped them with it and the client waited for the keep-alive time (found by a
    # second outside attack).
    body = json.dumps(big_call(1)).encode()
    await proxy.post(body)
    before = made(proxy)
    requests = 10
    data = b"".join(post(body.replace(b'"id": 1', b'"id": %d' % i)) for i in range(requests)) + last
    loop = asyncio.get_running_loop()
    sock = unread_socket(proxy.server.port)
    try:
        await loop.run_in_executor(None, sock.sendall, data)
        await until_async(lambda: made(proxy) > before, "the first answer to be made")
        bodies = await loop.run_in_executor(None, read_answers, sock, requests + 1)
        assert await loop.run_in_executor(None, sock.recv, 1) == b""  # closed after the refusal
    finally:
        sock.close()
    assert [json.loads(b)["id"] for b in bodies[:requests]] == list(range(requests))
    assert json.loads(bodies[-1])["error"]["code"] == -32600


async def test_pipelined_misses_a_client_does_not_read_are_bounded_too(proxy: Proxy) -> None:
    requests = 400
    data = b"".join(post(json.dumps(big_call(i)).encode()) for i in range(requests))  # each a miss
    loop = asyncio.get_running_loop()
    sock = unread_socket(proxy.server.port)
    try:
        await loop.run_in_executor(None, sock.sendall, data)
        await until_async(lambda: made(proxy) >= 1, "misses to be answered")
        # At most MAX_WAITING are sent on ahead of a client that reads none of the answers (before,
        # every request of the read was, within the turn that read it).
        assert sum(upstream.calls["eth_call"] for upstream in proxy.upstreams.values()) <= pipeline.MAX_WAITING
        bodies = await loop.run_in_executor(None, read_answers, sock, requests)
    finally:
        sock.close()
    assert [json.loads(b)["id"] for b in bodies] == list(range(requests))


@pytest.fixture
async def short_keepalive(
    big_node: FakeEvm, monkeypatch: pytest.MonkeyPatch, make_proxy: ProxyFactory
) -> tuple[Proxy, bytes]:
    """A proxy whose keep-alive time is 0.5 s, and a request for its 1 MB memory hit."""
    monkeypatch.setattr(pipeline, "KEEPALIVE_TIMEOUT", 0.5)
    proxy = await make_proxy(EVM_UPSTREAM=big_node.url)
    body = json.dumps(big_call(1)).encode()
    await proxy.post(body)
    return proxy, body


async def test_a_client_that_reads_nothing_is_dropped_with_what_it_was_not_sent(
    short_keepalive: tuple[Proxy, bytes],
) -> None:
    # KEEPALIVE_TIMEOUT without reading: dropped (RST). A close would wait for it to read what was
    # written, which it may never do, and the connection and its buffer would stay for good.
    proxy, body = short_keepalive
    sock = unread_socket(proxy.server.port)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sock.sendall, post(body) * 10)

        def state() -> int:
            return int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0])

        await until_async(lambda: state() != 1, "the proxy to drop the connection")  # 1: ESTABLISHED
        with pytest.raises(ConnectionResetError):
            while sock.recv(1 << 20):  # what reached its buffer, then the reset: the rest was dropped
                pass
    finally:
        sock.close()


async def test_a_client_that_reads_slowly_is_not_dropped_while_it_reads(short_keepalive: tuple[Proxy, bytes]) -> None:
    # The other side of that rule: a client that reads a large answer slowly (here for several times
    # the keep-alive time) makes progress, so it is not idle, wherever the bytes wait: in the
    # transport's buffer or the kernel's.
    proxy, body = short_keepalive
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65_536)
    sock.connect(("127.0.0.1", proxy.server.port))
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_sendall(sock, post(body))
        received = b""
        started = time.monotonic()
        while not received.endswith(b'"}'):
            assert time.monotonic() - started < 60, "the answers never arrived"
            try:
                chunk = sock.recv(16_384)
            except BlockingIOError:
                chunk = b"-"
            except ConnectionResetError:
                chunk = b""
            assert chunk, f"the proxy dropped a client that was reading, after {len(received)} bytes"
            if chunk != b"-":
                received += chunk
            await asyncio.sleep(0.02)  # a slow reader: about 0.8 MB/s at most
        assert time.monotonic() - started > 1.0  # several keep-alive times long
    finally:
        sock.close()


async def test_many_complete_pipelined_requests_in_one_read_are_not_one_head(proxy: Proxy) -> None:
    # MAX_HEAD_BYTES counts one request head: before, a read of 64 kB of complete requests and the
    # start of another was refused 431 as if it were one head, and the connection closed.
    requests = [post(call("eth_chainId", [], i)) for i in range(700)]
    data = b"".join(requests)
    assert len(data) > front.MAX_HEAD_BYTES
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    try:
        last = post(call("eth_chainId", [], 700))
        writer.write(data + last[:20])
        await writer.drain()
        seen = [await read_answer(reader) for _ in requests]
        writer.write(last[20:])
        seen.append(await read_answer(reader))
    finally:
        writer.close()
    assert {status for status, _, _ in seen} == {200}
    assert [json.loads(body)["id"] for _, _, body in seen] == list(range(701))


async def test_a_large_body_and_the_start_of_the_next_head_in_one_read_are_not_one_head(proxy: Proxy) -> None:
    # The body of a request that began in the same read is not head either (found by a second
    # outside attack on the first form, which counted it).
    large = call("eth_call", [{"to": "0x" + "ab" * 20, "data": "0x" + "00" * 50_000}, "0x1"], 1)
    chunked = b"POST /v3/k HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        len(large),
        large,
    )
    for first in (post(large), chunked):
        last = post(call("eth_chainId", [], 2))
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        try:
            writer.write(first + last[:20])
            await writer.drain()
            seen = [await read_answer(reader)]
            writer.write(last[20:])
            seen.append(await read_answer(reader))
        finally:
            writer.close()
        assert [(status, json.loads(body)["id"]) for status, _, body in seen] == [(200, 1), (200, 2)]


async def test_heads_and_a_large_body_in_one_read_are_not_counted_as_the_next_head(proxy: Proxy) -> None:
    """Rule (docs/security.md: the 64 KiB head limit counts one head's bytes): the head begun at the
    end of a read starts after every head and body before it. Over 64 KiB of pipelined heads and then
    a body longer than all of them, in one read (one of 128 KiB or more), had those heads counted as
    the next head's (431). The read is fed by hand: a socket may cut it."""
    count = 800
    small = [post(call("eth_chainId", [], i)) for i in range(count)]
    large = call("eth_call", [{"to": "0x" + "ab" * 20, "data": "0x" + "00" * 40_000}, "0x1"], count)
    heads = sum(len(request) - len(call("eth_chainId", [], i)) for i, request in enumerate(small))
    assert heads > front.MAX_HEAD_BYTES and len(large) > heads
    last = post(call("eth_chainId", [], count + 1))
    with connection(front_of(proxy)) as (protocol, transport):
        protocol.data_received(b"".join(small) + post(large) + last[:20])
        protocol.data_received(last[20:])

        async def answered() -> bool:
            return transport.written.count(b"HTTP/1.1 ") == count + 2 or transport.closed

        await eventually(answered, 30, "every answer")
    answers = transport.written.split(b"HTTP/1.1 ")[1:]
    assert [answer[:3] for answer in answers] == [b"200"] * (count + 2), answers[-1][:300]


async def test_a_head_over_the_limit_after_heads_and_a_large_body_in_one_read_is_still_431(proxy: Proxy) -> None:
    """The other side of the rule above: the heads before it are not counted, the head's own bytes
    are. An unfinished field line of 70 KiB after them, in the same read, is refused (431) and closed."""
    small = [post(call("eth_chainId", [], i)) for i in range(800)]
    large = call("eth_call", [{"to": "0x" + "ab" * 20, "data": "0x" + "00" * 40_000}, "0x1"], 800)
    over = b"POST /v3/k HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 70_000
    with connection(front_of(proxy)) as (protocol, transport):
        protocol.data_received(b"".join(small) + post(large) + over)

        async def refused() -> bool:
            return transport.closed

        await eventually(refused, 30, "the refusal")
    answers = transport.written.split(b"HTTP/1.1 ")[1:]
    assert [answer[:3] for answer in answers] == [b"200"] * 801 + [b"431"]


async def test_a_100_continue_queued_behind_an_answer_is_sent_after_it(proxy: Proxy) -> None:
    # RFC 9110 10.1.1: a 100 or a final answer. Before, a head with Expect behind an answer being
    # made got neither, and a client waiting for the 100 timed out.
    miss = post(json.dumps(big_call(5)).encode())
    body = call("eth_chainId", [], 2)
    expecting = post(body, "Expect: 100-continue")
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    try:
        writer.write(miss + expecting[: -len(body)])
        await writer.drain()
        status, _, answer = await read_answer(reader)
        assert status == 200 and json.loads(answer)["id"] == 5
        assert await asyncio.wait_for(reader.readline(), 30) == b"HTTP/1.1 100 Continue\r\n"
        assert await asyncio.wait_for(reader.readline(), 30) == b"\r\n"
        writer.write(body)
        status, _, answer = await read_answer(reader)
        assert status == 200 and json.loads(answer) == {"jsonrpc": "2.0", "id": 2, "result": "0x7a69"}
    finally:
        writer.close()


async def test_a_head_over_its_limits_is_431_even_whole_in_one_read(proxy: Proxy) -> None:
    # A header name over the line limit, and fields over MAX_HEAD_BYTES in all, each within its own
    # limit: before, only a head still incomplete at the end of a read was measured.
    for extra in (["X" * 100_000 + ": a"], [f"X-{i}: " + "a" * 8000 for i in range(9)]):
        [(status, headers, body)] = await exchange(proxy.server.port, post(call("eth_chainId", [], 1), *extra))
        assert status == 431 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == -32600
    within = [f"X-{i}: " + "a" * 8000 for i in range(7)]
    [(status, _, _)] = await exchange(proxy.server.port, post(call("eth_chainId", [], 1), *within))
    assert status == 200  # 56 kB of fields: within it


async def test_a_websocket_that_reads_no_answers_is_closed_past_ws_send_buffer_bytes(
    big_node: FakeEvm, make_proxy: ProxyFactory
) -> None:
    # WS_SEND_BUFFER_BYTES (for WS_MAX_LAG) holds for calls' answers as for notifications: before, each
    # answer waited in the socket's buffer (one socket of 400 calls held 800 MB).
    proxy = await make_proxy(EVM_UPSTREAM=big_node.url, WS_SEND_BUFFER_BYTES="1000000", WS_MAX_LAG="0.5")
    closed_before = proxy.registry.get_sample_value("rpc_proxy_slow_consumer_disconnects_total") or 0.0
    async with proxy.session.ws_connect(proxy.ws_url(), max_msg_size=0) as ws:
        for i in range(60):
            await ws.send_str(json.dumps({**big_call(i % 3), "id": i}))

        def evicted() -> bool:
            value = proxy.registry.get_sample_value("rpc_proxy_slow_consumer_disconnects_total") or 0.0
            return value > closed_before

        await until_async(evicted, "the slow consumer to be closed")
        async for _ in ws:  # what was written before the close, then the close
            pass
        assert ws.close_code in (1008, 1006)  # 1006: its close frame could not get through either


async def test_a_websocket_that_takes_nothing_for_ws_max_lag_is_closed_within_ws_send_buffer_bytes(
    make_proxy: ProxyFactory,
) -> None:
    # WS_MAX_LAG is a time rule: 64 answers of 40 kB (WS_MAX_INFLIGHT) wait unread, within
    # WS_SEND_BUFFER_BYTES. Before, nothing looked at the time while sends were blocked: the socket
    # kept its slot, its tasks and its answers' bytes for ever (found by an outside attack).
    node = await FakeEvm(call_result_bytes=40_000).start()
    try:
        proxy = await make_proxy(EVM_UPSTREAM=node.url, WS_MAX_LAG="1")
        async with proxy.session.ws_connect(proxy.ws_url(), max_msg_size=0) as ws:
            for i in range(200):
                await ws.send_str(json.dumps({**big_call(i), "id": i}))

            def evicted() -> bool:
                closed = proxy.metric("rpc_proxy_slow_consumer_disconnects_total") == 1
                return closed and proxy.metric("rpc_proxy_websocket_connections") == 0

            await until_async(evicted, "the socket that takes nothing to be closed")
            async for _ in ws:  # what was written before the close, then the close
                pass
            assert ws.close_code in (1008, 1006)  # 1006: its close frame could not get through either
    finally:
        await node.close()


def server_frames(data: bytes) -> tuple[list[int], int]:
    """The opcodes of the complete (unmasked) server frames at the start of `data`, and their bytes."""
    opcodes, at = [], 0
    while len(data) >= at + 2:
        size, start = data[at + 1] & 0x7F, at + 2
        if size >= 126:
            width = 2 if size == 126 else 8
            if len(data) < start + width:
                break
            size, start = int.from_bytes(data[start : start + width], "big"), start + width
        if len(data) < start + size:
            break
        opcodes.append(data[at] & 0x0F)
        at = start + size
    return opcodes, at


async def read_websocket_slowly(port: int, calls: list[dict[str, object]], rate: float) -> list[int]:
    """The opcodes of the frames a raw WebSocket client with a small receive window, reading at most
    `rate` bytes a second, gets for `calls` sent at once: until every answer came, a close or EOF."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65_536)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(
            sock,
            b"GET /ws/v3/test-key HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        )
        pending = await loop.sock_recv(sock, 1024)
        assert b" 101 " in pending
        pending = pending.split(b"\r\n\r\n", 1)[1]
        await loop.sock_sendall(sock, b"".join(frame(json.dumps(c).encode()) for c in calls))
        opcodes: list[int] = []
        started, taken, deadline = time.monotonic(), 0, time.monotonic() + 60
        while len(opcodes) < len(calls) and 8 not in opcodes:
            assert time.monotonic() < deadline, "the answers never arrived"
            async with asyncio.timeout(30):
                chunk = await loop.sock_recv(sock, 16_384)
            if not chunk:
                break
            taken += len(chunk)
            more, used = server_frames(pending + chunk)
            opcodes, pending = opcodes + more, (pending + chunk)[used:]
            await asyncio.sleep(max(0.0, started + taken / rate - time.monotonic()))  # the reading rate
        return opcodes
    finally:
        sock.close()


async def test_a_websocket_reading_one_answer_slowly_is_served_it_whole(make_proxy: ProxyFactory) -> None:
    # A reader making its way through one answer of 6 MB, more than the kernel's buffers and
    # WS_SEND_BUFFER_BYTES hold, at 2 MB/s (three times WS_MAX_LAG) is not behind: one oversized answer
    # goes out when nothing else waits, and only a socket that takes nothing is closed by time. The
    # first timer closed it at its first look, the answer owed past the byte bound (found by an
    # outside attack: 21.7 MB at 4 MB/s).
    node = await FakeEvm(call_result_bytes=6_000_000).start()
    try:
        proxy = await make_proxy(EVM_UPSTREAM=node.url, WS_SEND_BUFFER_BYTES="200000", WS_MAX_LAG="1")
        assert await read_websocket_slowly(proxy.server.port, [big_call(1)], 2_000_000) == [1]
        assert not proxy.metric("rpc_proxy_slow_consumer_disconnects_total")
    finally:
        await node.close()
    assert not proxy.metric("rpc_proxy_slow_consumer_disconnects_total")


async def test_a_websocket_reading_many_answers_slowly_is_served_them_all(make_proxy: ProxyFactory) -> None:
    # A steady reader of 120 pipelined answers of 50 kB (more than the kernel's buffers hold) at 1 MB/s
    # takes bytes out of the kernel's buffers while the transport's buffer stays the same size (the
    # kernel wakes a writer only once a third of its buffer is free, here longer than WS_MAX_LAG): it
    # takes bytes, so it is not closed as one that took nothing (found by an outside attack reading
    # 100 answers at 0.1 MB/s).
    node = await FakeEvm(call_result_bytes=50_000).start()
    try:
        proxy = await make_proxy(EVM_UPSTREAM=node.url, WS_MAX_LAG="0.5")
        calls = [{**big_call(i), "id": i} for i in range(120)]
        assert await read_websocket_slowly(proxy.server.port, calls, 1_000_000) == [1] * 120
        assert not proxy.metric("rpc_proxy_slow_consumer_disconnects_total")
    finally:
        await node.close()


async def test_a_websocket_that_reads_nothing_is_closed_however_many_pings_it_sends(
    make_proxy: ProxyFactory,
) -> None:
    # The proxy's pongs to a client's own pings are no sign that it takes anything: a client that
    # reads nothing and sends pings of 125 bytes four at a time kept its socket, slot and unread
    # answers for ever, the pongs taken for data written after a drain (found by an outside attack).
    node = await FakeEvm(call_result_bytes=40_000).start()
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        proxy = await make_proxy(EVM_UPSTREAM=node.url, WS_MAX_LAG="1")
        await loop.sock_connect(sock, ("127.0.0.1", proxy.server.port))
        await loop.sock_sendall(
            sock,
            b"GET /ws/v3/test-key HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        )
        calls = b"".join(frame(json.dumps({**big_call(i), "id": i}).encode()) for i in range(60))
        await loop.sock_sendall(sock, calls)
        ping = bytes([0x89, 0x80 | 125]) + b"\x00\x00\x00\x00" + b"p" * 125  # masked, key 0
        deadline = time.monotonic() + 30
        while proxy.metric("rpc_proxy_slow_consumer_disconnects_total") < 1:
            assert time.monotonic() < deadline, "a client that reads nothing but pings was never closed"
            with contextlib.suppress(OSError):  # the proxy may have closed it between two looks
                await loop.sock_sendall(sock, ping * 4)
            await asyncio.sleep(0.1)
    finally:
        sock.close()
        await node.close()


async def test_a_websocket_client_reset_mid_answer_is_no_internal_error(
    proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    # A client going away is not an internal error: aiohttp's drain raises a plain ConnectionError
    # ("Connection lost"), which was logged with its traceback, then escaped the task answering it
    # (found by an outside attack resetting sockets mid-answer).
    loop = asyncio.get_running_loop()
    for _ in range(3):
        with unread_socket(proxy.server.port) as sock:  # closed however the test ends
            sock.setblocking(False)
            await loop.sock_sendall(
                sock,
                b"GET /ws/v3/test-key HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
            )
            assert b" 101 " in await loop.sock_recv(sock, 1024)
            before = made(proxy)
            await loop.sock_sendall(sock, b"".join(frame(json.dumps(big_call(i)).encode()) for i in range(10)))
            await until_async(lambda: made(proxy) >= before + 2, "answers being written")  # noqa: B023
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset, with answers half written
            await until_async(lambda: proxy.metric("rpc_proxy_websocket_connections") == 0, "the socket to be gone")
    await asyncio.sleep(0)
    gc.collect()  # a task whose exception nobody retrieved says so when collected
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


async def test_connect_is_a_json_rpc_error_and_the_connection_closes(proxy: Proxy) -> None:
    # llhttp reads CONNECT as an upgrade: it was handed to aiohttp, which answered a plain-text 404.
    for target in (b"rpc.example:443", b"/v3/k"):
        data = b"CONNECT %s HTTP/1.1\r\nHost: rpc.example:443\r\n\r\n" % target
        [(status, headers, body)] = await exchange(proxy.server.port, data)
        assert status in (404, 405) and headers["content-type"].startswith("application/json")
        assert json.loads(body)["error"]["code"] == -32600 and headers["connection"] == "close"
        assert "server" not in headers


async def test_a_websocket_that_reads_is_served_answers_larger_than_ws_send_buffer_bytes(
    big_node: FakeEvm, make_proxy: ProxyFactory
) -> None:
    # The other side: the bound is on what waits unread, not on an answer's size, so a client that
    # reads gets every answer, one or several in flight (the first form closed such a client 1008:
    # found by a second outside attack).
    proxy = await make_proxy(EVM_UPSTREAM=big_node.url, WS_SEND_BUFFER_BYTES="300000", WS_MAX_LAG="5")
    async with proxy.session.ws_connect(proxy.ws_url(), max_msg_size=0) as ws:
        for i in range(6):  # misses of distinct answers, then hits of the first
            await ws.send_str(json.dumps({**big_call(i % 3), "id": i}))
        ids = sorted([json.loads((await ws.receive(timeout=30)).data)["id"] for _ in range(6)])
        assert ids == list(range(6)) and not ws.closed
    assert not proxy.registry.get_sample_value("rpc_proxy_slow_consumer_disconnects_total")


async def test_a_websocket_upgrade_behind_a_large_answer_is_answered_after_it(
    proxy: Proxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Handed to aiohttp while the transport's writing is paused (the answer before it filled the
    # buffer): the 101 follows the answer, and nothing is logged. (aiohttp's protocol, told of no
    # pause, failed an assertion on the transport's resume_writing in an outside attack's runs; it is
    # told of the pause now. This test did not reproduce that failure here.)
    body = json.dumps(big_call(1)).encode()
    await proxy.post(body)
    upgrade = (
        b"GET /ws/v3/k HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    loop = asyncio.get_running_loop()
    sock = unread_socket(proxy.server.port)
    try:
        await loop.run_in_executor(None, sock.sendall, post(body) + upgrade)  # the answer pauses writing
        await until_async(lambda: made(proxy) >= 2, "the answer to be made")
        sock.settimeout(30)
        stream = b""
        while b"HTTP/1.1 101" not in stream or not stream.endswith(b"\r\n\r\n"):
            chunk = await loop.run_in_executor(None, sock.recv, 1 << 20)
            assert chunk, "closed before the upgrade was answered"
            stream += chunk
        assert stream.count(b"HTTP/1.1 200 OK") == 1 and stream.index(b"HTTP/1.1 101") > stream.rindex(b"200 OK")
    finally:
        sock.close()
    assert "resume_writing" not in caplog.text


async def test_answers_of_a_connection_whose_transport_is_closing_are_not_written(
    relays: list[FaultRelay], make_proxy: ProxyFactory
) -> None:
    # Rule: once its transport is closing (its client reset it: asyncio closes it at the failed send,
    # and connection_lost comes a loop turn later), no answer is written to it. They were: each write
    # from the fifth logged asyncio's "socket.send() raised exception." warning, so clients that left
    # with answers queued could fill the log at will (an outside attack: 171 lines for 20 clients).
    proxy = await make_proxy(EVM_UPSTREAM=relays[0].url)
    relays[0].inject("slow", method="eth_getBalance", delay=0.3, times=None)  # made together, answered together

    class Gone(MemoryTransport):
        after = 0  # writes once it was closing

        def is_closing(self) -> bool:
            return self.closed or bool(self.written)

        def write(self, data: bytes | bytearray | memoryview) -> None:
            self.after += self.is_closing()
            super().write(data)

    data = b"".join(post(call("eth_getBalance", [f"0x{i + 1:040x}", "latest"], i)) for i in range(8))
    with connection(front_of(proxy), Gone(keep=True)) as (protocol, transport):
        protocol.data_received(data)

        async def answered() -> bool:
            return not protocol.pipeline.waiting or not any(
                isinstance(item, asyncio.Task) and not item.done() for item, _ in protocol.pipeline.waiting
            )

        await eventually(answered, 30, "the eight answers to be made")
        assert transport.written.count(b"HTTP/1.1 200") >= 1 and transport.after == 0
