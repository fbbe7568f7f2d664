"""The fast server (http/front.py) on a real socket: pipelining order, limits it enforces itself
(head size, chunked bodies, Content-Encoding), requests split across packets, Expect, HTTP/1.0, and
a WebSocket upgrade handed to aiohttp in the middle of a connection."""

from __future__ import annotations

import asyncio
import errno
import gzip
import json
import logging
import socket
import time
import zlib
from email.utils import parsedate_to_datetime
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from proxy.http.compression import MAX_GZIP_MEMBERS, UnsupportedCoding, decoded_body
from proxy.http.front_routes import FrontRoutes, request_path
from proxy.http.pipeline import KEEPALIVE_TIMEOUT, IdleDeadline
from proxy.http.wire import PIECE, SPLIT_FROM, Request, encoded_answer, out_size
from proxy.values import Reply
from tests.fault_relay import FaultRelay
from tests.support import Anvil, MemoryTransport, Proxy, ProxyFactory, eventually
from tests.test_cache import finalized_store, storage

Answer = tuple[int, dict[str, str], bytes]


def call(method: str, params: list[Any], rid: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}).encode()


def post(body: bytes, *extra: str, path: str = "/v3/k") -> bytes:
    head = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    status_line = await asyncio.wait_for(reader.readline(), 30)
    assert status_line, "the connection was closed"
    headers: dict[str, str] = {}
    while (line := await asyncio.wait_for(reader.readline(), 30)) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 30)
    return int(status_line.split()[1]), headers, body


async def exchange(port: int, data: bytes, answers: int = 1) -> list[Answer]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return [await read_answer(reader) for _ in range(answers)]
    finally:
        writer.close()


class TestPureParts:
    def test_the_request_path_is_decoded_and_cut_at_the_query(self) -> None:
        assert request_path(b"/v3/a%2Db?x=1") == "/v3/a-b"
        assert request_path(b"http://rpc.example:8545/evm/v3/k") == "/evm/v3/k"
        assert request_path(b"*") == "/"

    def test_rpc_paths_read_as_aiohttps_routes_read_them(self) -> None:
        target = FrontRoutes.rpc_target
        assert target("/v3/k") == (None, "k") and target("/v3/v3") == (None, "v3")
        assert target("/evm/v3/k") == ("evm", "k") and target("/evm/v3") == ("evm", None)
        assert target("/v3/") == (None, "") and target("/ws/v3/k") == ("ws", "k")
        assert target("/healthz") is None and target("/a/b/v3/k") is None
        assert target("/") is None and target("/", True) == (None, None)  # the root: open mode's only

    def test_a_compressed_body_is_decoded_within_its_limit(self) -> None:
        body = b'{"jsonrpc":"2.0"}'
        assert decoded_body(gzip.compress(body), "gzip", 100) == body
        assert decoded_body(gzip.compress(b" " * 10_000), "gzip", 1000) is None  # never inflated past it
        assert decoded_body(body, None, 100) == body and decoded_body(body, "identity", 100) == body

    def test_a_compressed_body_cut_short_or_with_bytes_after_its_end_is_not_decodable(self) -> None:
        packed = gzip.compress(b'{"jsonrpc":"2.0"}')
        for broken in (packed[:-4], packed[:-1], packed + b"trailing", packed + gzip.compress(b"[]")[:-1]):
            with pytest.raises(zlib.error):
                decoded_body(broken, "gzip", 100)
        with pytest.raises(zlib.error):  # a deflate stream has one end
            decoded_body(zlib.compress(b"[]") + zlib.compress(b"[]"), "deflate", 100)

    def test_a_gzip_body_of_several_members_is_their_bodies_in_order_within_the_limit_together(self) -> None:
        # RFC 1952 section 2.2: a gzip file is a series of members (as `gzip -c a b` writes them).
        assert decoded_body(gzip.compress(b'{"a":') + gzip.compress(b"1}"), "gzip", 100) == b'{"a":1}'
        assert decoded_body(gzip.compress(b" " * 600) + gzip.compress(b" " * 600), "gzip", 1000) is None
        assert decoded_body(gzip.compress(b" " * 500) + gzip.compress(b" " * 500), "gzip", 1000) == b" " * 1000

    def test_a_gzip_body_of_more_members_than_max_gzip_members_is_not_decodable(self) -> None:
        # Each member's rest was copied once per member: 262,000 empty members (5 MB, under
        # MAX_BODY_BYTES) stopped the event loop 15.6 s before any key was read (an outside attack).
        empty = gzip.compress(b"")
        allowed = empty * (MAX_GZIP_MEMBERS - 1) + gzip.compress(b"[]")
        assert decoded_body(allowed, "gzip", 100) == b"[]"
        with pytest.raises(zlib.error, match=f"over {MAX_GZIP_MEMBERS} gzip members"):  # said in the 400
            decoded_body(empty * MAX_GZIP_MEMBERS + gzip.compress(b"[]"), "gzip", 100)
        with pytest.raises(zlib.error):  # refused after MAX_GZIP_MEMBERS members, the rest never decoded
            decoded_body(empty * 262_000, "gzip", 10_000_000)

    def test_stacked_codings_are_decoded_last_applied_first_and_others_are_unsupported(self) -> None:
        body = b'{"jsonrpc":"2.0"}'
        assert decoded_body(zlib.compress(gzip.compress(body)), "gzip, identity, deflate", 100) == body
        assert decoded_body(gzip.compress(gzip.compress(b" " * 10_000)), "gzip, gzip", 1000) is None
        for unsupported in ("br", "gzip, zstd", ", ".join(["gzip"] * 6)):
            with pytest.raises(UnsupportedCoding):
                decoded_body(body, unsupported, 100)


async def test_pipelined_hits_and_misses_are_answered_in_request_order(anvil: Anvil, evm_proxy: Proxy) -> None:
    store, block = await finalized_store(anvil, evm_proxy)
    hit = json.dumps(storage(store, "0x0", hex(block), rid=0)).encode()
    await evm_proxy.post(hit)  # now in memory
    bodies = [
        call("eth_getBalance", [store, "latest"], 1),
        json.dumps(storage(store, "0x0", hex(block), rid=2)),
        call("eth_blockNumber", [], 3),
        json.dumps(storage(store, "0x0", hex(block), rid=4)),
        call("eth_getCode", [store, "latest"], 5),
    ]
    data = b"".join(post(b if isinstance(b, bytes) else b.encode()) for b in bodies)
    answers = await exchange(evm_proxy.server.port, data, len(bodies))
    assert [json.loads(body)["id"] for _, _, body in answers] == [1, 2, 3, 4, 5]
    assert [headers.get("x-cache") for _, headers, _ in answers][1::2] == ["HIT", "HIT"]


async def test_a_hits_date_is_the_second_it_was_answered_in_and_moves_on_with_the_clock(
    anvil: Anvil,
    evm_proxy: Proxy,
) -> None:
    store, block = await finalized_store(anvil, evm_proxy)
    hit = json.dumps(storage(store, "0x0", hex(block), rid=0)).encode()
    await evm_proxy.post(hit)  # now in memory: answered after a pre-built head, its Date renewed each second
    seen: set[float] = set()
    deadline = time.monotonic() + 10
    while len(seen) < 2:  # two different seconds: the head was made again when the clock moved on
        assert time.monotonic() < deadline, f"Date never moved on: {seen}"
        before = int(time.time())
        [(status, headers, _)] = await exchange(evm_proxy.server.port, post(hit))
        after = time.time()
        shown = parsedate_to_datetime(headers["date"]).timestamp()
        assert status == 200 and headers["x-cache"] == "HIT" and before <= shown <= after
        seen.add(shown)


async def test_a_request_split_byte_by_byte_across_packets_is_answered(evm_proxy: Proxy) -> None:
    data = post(call("eth_chainId", [], 7))
    reader, writer = await asyncio.open_connection("127.0.0.1", evm_proxy.server.port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        for i in range(len(data)):
            writer.write(data[i : i + 1])
            await writer.drain()
        status, _, body = await read_answer(reader)
        assert status == 200 and json.loads(body) == {"jsonrpc": "2.0", "id": 7, "result": "0x7a69"}
    finally:
        writer.close()


async def test_a_header_over_the_limit_is_431_and_closed(evm_proxy: Proxy) -> None:
    [(status, headers, body)] = await exchange(
        evm_proxy.server.port, post(call("eth_chainId", [], 1), "X-Big: " + "a" * 9000)
    )
    assert status == 431 and headers["connection"] == "close" and json.loads(body)["error"]["code"] == -32600


async def test_a_chunked_body_over_max_body_bytes_is_413(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, MAX_BODY_BYTES="1000")
    head = b"POST /v3/k HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"[" + b" " * 599
    data = head + b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2 + b"0\r\n\r\n"
    [(status, headers, body)] = await exchange(proxy.server.port, data)
    assert status == 413 and headers["connection"] == "close" and json.loads(body)["error"]["code"] == -32600
    small = b'{"jsonrpc":"2.0","id":1,"method":"eth_chainId","params":[]}'
    chunked = head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(small), small)
    [(status, _, body)] = await exchange(proxy.server.port, chunked)
    assert status == 200 and json.loads(body)["result"] == "0x7a69"


async def test_an_http_1_0_request_with_a_transfer_encoding_is_400_and_closed(evm_proxy: Proxy) -> None:
    # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing (it was served).
    body = call("eth_chainId", [], 7)
    data = b"POST /v3/k HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        len(body),
        body,
    )
    [(status, _, answer)] = await exchange(evm_proxy.server.port, data)
    assert status == 400 and "HTTP/1.0" in json.loads(answer)["error"]["message"], answer


async def test_a_major_http_version_but_1_is_505_and_closed(evm_proxy: Proxy) -> None:
    # RFC 9110 15.6.6: llhttp reads an HTTP/2.0 head, which was answered as HTTP/1.1.
    body = call("eth_chainId", [], 7)
    data = b"POST /v3/k HTTP/2.0\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    [(status, headers, answer)] = await exchange(evm_proxy.server.port, data)
    assert status == 505 and "HTTP/2.0" in json.loads(answer)["error"]["message"], answer
    assert headers["connection"] == "close"


@pytest.mark.parametrize("target", [b"*", b"v3/k", b"rpc.example:8545"])
async def test_a_request_target_not_a_path_is_400_and_star_is_for_options_alone(
    evm_proxy: Proxy, target: bytes
) -> None:
    # RFC 9112 3.2: origin form (a path) or absolute form; * for OPTIONS alone. Any other target was
    # read as the root, a JSON-RPC endpoint in open mode (POST * was served).
    body = call("eth_chainId", [], 7)
    data = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (target, len(body), body)
    [(status, _, answer)] = await exchange(evm_proxy.server.port, data)
    assert status == 400 and "error" in json.loads(answer), answer  # llhttp refuses the last two itself
    [(status, _, _)] = await exchange(evm_proxy.server.port, b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 204


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"deflate,chunked", b"gzip\r\nTransfer-Encoding: chunked"])
async def test_a_transfer_coding_other_than_chunked_is_501_and_closed(evm_proxy: Proxy, coding: bytes) -> None:
    # RFC 9112 6.1: llhttp framed `gzip, chunked` as chunked and the gzip was never undone (a plain
    # body was served; a front that decoded it would have read another body than this proxy).
    body = call("eth_chainId", [], 7)
    data = b"POST /v3/k HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: %s\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        coding,
        len(body),
        body,
    )
    [(status, headers, answer)] = await exchange(evm_proxy.server.port, data)
    assert status == 501 and headers["connection"] == "close", answer
    assert "only chunked" in json.loads(answer)["error"]["message"]


async def test_trailer_fields_after_a_chunked_body_are_not_read_as_headers(evm_proxy: Proxy) -> None:
    # RFC 9110 6.5.1: trailers are not header fields, so none may set the encoding, a key or an origin.
    body = call("eth_chainId", [], 7)
    data = (
        b"POST /v3/k HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n"
        b"Content-Encoding: gzip\r\nOrigin: http://page.example\r\n\r\n" % (len(body), body)
    )
    [(status, headers, answer)] = await exchange(evm_proxy.server.port, data)
    assert status == 200 and json.loads(answer)["result"] == "0x7a69"
    assert not any(name.startswith("access-control-") for name in headers)


async def test_a_gzip_body_is_decoded_and_one_inflating_past_the_limit_is_413(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, MAX_BODY_BYTES="1000")
    packed = gzip.compress(call("eth_chainId", [], 1))
    [(status, _, body)] = await exchange(proxy.server.port, post(packed, "Content-Encoding: gzip"))
    assert status == 200 and json.loads(body)["result"] == "0x7a69"
    bomb = gzip.compress(b" " * 100_000)
    [(status, _, _)] = await exchange(proxy.server.port, post(bomb, "Content-Encoding: gzip"))
    assert status == 413
    # A body of two gzip members (RFC 1952 2.2) is both, in order; members past the limit together, 413.
    whole = call("eth_chainId", [], 2)
    members = gzip.compress(whole[:9]) + gzip.compress(whole[9:])
    [(status, _, body)] = await exchange(proxy.server.port, post(members, "Content-Encoding: gzip"))
    assert status == 200 and json.loads(body) == {"jsonrpc": "2.0", "id": 2, "result": "0x7a69"}
    members = gzip.compress(whole + b" " * 600) + gzip.compress(b" " * 600)
    [(status, _, _)] = await exchange(proxy.server.port, post(members, "Content-Encoding: gzip"))
    assert status == 413
    # More than MAX_GZIP_MEMBERS members: 400, saying so.
    members = gzip.compress(b"") * MAX_GZIP_MEMBERS + gzip.compress(whole)
    [(status, _, body)] = await exchange(proxy.server.port, post(members, "Content-Encoding: gzip"))
    assert status == 400 and f"over {MAX_GZIP_MEMBERS} gzip members" in json.loads(body)["error"]["message"]


async def continued(port: int, path: str = "/v3/k") -> Answer:
    """A chainId call's head with Expect: 100-continue, its 100 read before its body is sent; its answer."""
    body = call("eth_chainId", [], 1)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(post(body, "Expect: 100-continue", path=path)[: -len(body)])
        await writer.drain()
        assert await asyncio.wait_for(reader.readline(), 30) == b"HTTP/1.1 100 Continue\r\n"
        assert await asyncio.wait_for(reader.readline(), 30) == b"\r\n"
        writer.write(body)
        return await read_answer(reader)
    finally:
        writer.close()


async def test_expect_100_continue_gets_its_interim_answer_before_the_body(evm_proxy: Proxy) -> None:
    status, _, answer = await continued(evm_proxy.server.port)
    assert status == 200 and json.loads(answer)["result"] == "0x7a69"


async def test_expect_100_continue_with_an_unknown_key_is_refused_before_its_body_is_asked_for(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """RFC 9110 10.1.1: a final answer instead of 100 Continue; a known key still gets its 100."""
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS="alice")
    body = call("eth_chainId", [], 1)
    for path, extra in (("/v3/mallory", ()), ("/v3", ("X-Api-Key: mallory",)), ("/v3", ())):
        data = post(body, "Expect: 100-continue", *extra, path=path)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        try:
            writer.write(data[: -len(body)])  # the head alone: the body waits for a 100 that never comes
            await writer.drain()
            status, headers, answer = await read_answer(reader)
            assert status == 401 and json.loads(answer)["error"]["code"] == -32001, (path, answer)
            assert headers["connection"] == "close" and await asyncio.wait_for(reader.read(), 30) == b""
        finally:
            writer.close()
    status, _, answer = await continued(proxy.server.port, "/v3/alice")
    assert status == 200 and json.loads(answer)["result"] == "0x7a69"


async def test_expect_100_continue_elsewhere_gets_its_100_and_http_1_0_none(evm_proxy: Proxy) -> None:
    """RFC 9110 10.1.1: a request no route reads a body of is sent 100 too (it got neither a 100 nor an
    answer until its body came); 15.2: an HTTP/1.0 client's expectation is ignored, never a 1xx to it."""
    assert (await continued(evm_proxy.server.port, "/elsewhere"))[0] == 404
    body = call("eth_chainId", [], 1)
    http10 = post(body, "Expect: 100-continue", "Connection: keep-alive").replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    [(status, _, answer)] = await exchange(evm_proxy.server.port, http10)  # its first line is the final one
    assert status == 200 and json.loads(answer)["result"] == "0x7a69"


async def test_clients_gone_during_a_body_nothing_reads_leave_nothing_in_flight(evm_proxy: Proxy) -> None:
    """Rule (docs/operations.md: rpc_proxy_inflight_requests counts requests being served): a request
    whose body no route reads, counted while it arrives, is let go when its client leaves; it stayed
    counted for good (any client could grow the gauge without bound)."""
    stalled = b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab"
    connections = [await asyncio.open_connection("127.0.0.1", evm_proxy.server.port) for _ in range(4)]
    for _, writer in connections:
        writer.write(stalled)
        await writer.drain()

    async def counted(n: int) -> bool:
        return evm_proxy.metric("rpc_proxy_inflight_requests") == n

    await eventually(lambda: counted(4), 10, "the four bodies to be awaited")
    for _, writer in connections:
        writer.close()
    await eventually(lambda: counted(0), 10, "nothing in flight once their clients left")


async def test_a_body_nothing_reads_is_not_late_while_the_proxy_reads_none_of_it(
    relays: list[FaultRelay], make_proxy: ProxyFactory
) -> None:
    """Rule (docs/security.md: BODY_TIMEOUT): time the proxy spends not reading a connection (its answers
    before it still being made) is not the client's: a body no route reads got 408 behind slow misses."""
    relay = relays[0]
    relay.inject("slow", method="eth_getBalance", times=None, delay=2.5)
    proxy = await make_proxy(EVM_UPSTREAM=relay.url, BODY_TIMEOUT="1")
    misses = b"".join(post(call("eth_getBalance", ["0x" + f"{n:040x}", "latest"], n)) for n in range(3))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    try:
        writer.write(misses + b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nab")
        await writer.drain()
        await asyncio.sleep(1.5)  # the client's own pause, past BODY_TIMEOUT, while the misses are made
        writer.write(b"cde")
        statuses = [(await read_answer(reader))[0] for _ in range(4)]
        assert statuses == [200, 200, 200, 200]
    finally:
        writer.close()


async def test_a_head_after_a_large_body_nothing_reads_is_not_counted_with_that_body(evm_proxy: Proxy) -> None:
    """Rule (docs/security.md: the 64 KiB head limit counts one head's bytes): a body no route reads, in
    the read where the next head begins, was counted as that head's (431), had the head come split."""
    first = b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 70000\r\n\r\n" + b"a" * 70000
    second = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", evm_proxy.server.port)
    try:
        writer.write(first + second[:1])
        await writer.drain()
        assert (await read_answer(reader))[0] == 200  # the first read whole: the second's head begun
        writer.write(second[1:])
        assert (await read_answer(reader))[0] == 200
    finally:
        writer.close()


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_an_upgrade_to_another_protocol_is_served_as_a_plain_request_with_those_after_it(
    evm_proxy: Proxy, method: str
) -> None:
    """RFC 9110 7.8 (an Upgrade may be ignored): `Upgrade: h2c` (curl --http2 over http://) is served as
    HTTP/1.1 here, its body and the requests pipelined after it included. aiohttp, handed its head,
    dropped them and held the connection 75 s."""
    body = call("eth_chainId", [], 1) if method == "POST" else b""
    upgrade = (
        f"{method} /v3/k HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        f"HTTP2-Settings: AAMAAABkAAQAAP__\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    answers = await exchange(evm_proxy.server.port, upgrade + post(call("eth_chainId", [], 2)), answers=2)
    assert [status for status, _, _ in answers] == [200 if method == "POST" else 405, 200], answers
    assert json.loads(answers[1][2])["result"] == "0x7a69"
    if method == "POST":
        assert json.loads(answers[0][2])["result"] == "0x7a69"


async def test_an_h2c_upgrade_with_an_unknown_key_and_expect_is_refused_before_its_100(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """The fast path's checks hold for an upgrade it answers itself: 401 instead of 100 Continue."""
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS="alice")
    head = (
        b"POST /v3/mallory HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n"
        b"Expect: 100-continue\r\nContent-Length: 0\r\n\r\n"
    )
    [(status, headers, _)] = await exchange(proxy.server.port, head)
    assert status == 401 and headers["connection"] == "close"


async def test_http_1_0_without_keep_alive_is_closed_after_its_answer(evm_proxy: Proxy) -> None:
    body = call("eth_chainId", [], 1)
    data = (b"POST /v3/k HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
    reader, writer = await asyncio.open_connection("127.0.0.1", evm_proxy.server.port)
    try:
        writer.write(data)
        status, headers, _ = await read_answer(reader)
        assert status == 200 and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 30) == b""
    finally:
        writer.close()


async def test_a_client_that_half_closes_after_its_requests_gets_every_answer_then_the_close(
    relays: list[FaultRelay], make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # Rule (RFC 9112 9.6): a client that shuts down its sending side once its requests are out (as
    # `nc -N` and socat do) is answered each request it sent whole, in order, and then the connection
    # closes. Those still being made were dropped when its end was read: only an answer written at
    # once (a memory hit) reached it. A request cut short by the end is not answered.
    proxy = await make_proxy(EVM_UPSTREAM=relays[0].url)
    relays[0].inject("slow", method="eth_getBalance", delay=0.5)  # made after the client's end is read
    balance = call("eth_getBalance", ["0x" + "11" * 20, "latest"], 1)
    data = post(balance) + post(call("eth_chainId", [], 2)) + post(call("eth_blockNumber", [], 3))
    for chunks in ([data], [data, post(call("eth_chainId", [], 4))[:-5]]):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        try:
            for chunk in chunks:
                writer.write(chunk)
            writer.write_eof()
            answers = [await read_answer(reader) for _ in range(3)]
            assert [(status, json.loads(body)["id"]) for status, _, body in answers] == [(200, 1), (200, 2), (200, 3)]
            assert json.loads(answers[0][2])["result"] == "0x0"
            assert await asyncio.wait_for(reader.read(), 30) == b""  # closed after the last
        finally:
            writer.close()
    assert relays[0].applied == ["slow"]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


async def test_a_half_closed_clients_held_requests_are_made_together_once_it_takes_an_answer(
    relays: list[FaultRelay], make_proxy: ProxyFactory
) -> None:
    # Rule: requests held back (a new connection makes two at once until it knows its answers' size)
    # are made one at a time once its client has sent its last byte, until an answer written after it
    # is acknowledged: the client half-closed and waits, and the rest are made as any connection's.
    # Made one at a time to the end, a client pipelining 100 calls to a node taking 0.3 s each waited
    # 30 s for what took 0.9 s without its half-close (an outside attack).
    proxy = await make_proxy(EVM_UPSTREAM=relays[0].url)
    relays[0].inject("slow", method="eth_getBalance", delay=0.5, times=None)  # one at a time: 0.5 s apart at least
    count = 8
    data = b"".join(post(call("eth_getBalance", [f"0x{i + 1:040x}", "latest"], i)) for i in range(count))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    try:
        writer.write(data)
        writer.write_eof()
        answers = [await read_answer(reader) for _ in range(count)]
        assert [json.loads(body)["id"] for _, _, body in answers] == list(range(count))
        assert await asyncio.wait_for(reader.read(), 30) == b""
    finally:
        writer.close()
    arrivals = sorted(t for t, methods in relays[0].timeline for m in methods if m == "eth_getBalance")
    assert len(arrivals) == count
    # The first two are made at once; of the six held, the last ones go to the node together.
    assert arrivals[-1] - arrivals[-2] < 0.5, [round(t - arrivals[0], 3) for t in arrivals]


class TcpInfo:
    """A socket's tcp_info as getsockopt gives it: ESTABLISHED, and `acked` bytes acknowledged."""

    def __init__(self, acked: int) -> None:
        self.acked = acked

    def fileno(self) -> int:
        return -1  # no send queue to ask the kernel for: the transport's buffer is all that waits

    def getsockopt(self, level: int, option: int, size: int) -> bytes:
        info = bytearray(size)
        info[0] = 1
        info[120:128] = self.acked.to_bytes(8, "little")
        return bytes(info)

    def setsockopt(self, level: int, option: int, value: bytes) -> None:
        pass  # a drop's SO_LINGER


class Stuck(MemoryTransport):
    """A transport whose buffer never shrinks (answers written as fast as its client takes bytes)."""

    aborted = False

    def __init__(self, sock: TcpInfo | None = None) -> None:
        super().__init__()
        self.sock = sock

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sock if name == "socket" else super().get_extra_info(name, default)

    def get_write_buffer_size(self) -> int:
        return 3_866_624

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.parametrize("reads", [False, True])
def test_a_client_is_dropped_at_the_first_idle_look_unless_it_took_bytes_since_its_writes_paused(reads: bool) -> None:
    # Rule: a connection whose client took nothing of what it was sent for the keep-alive time is
    # dropped (reset); one whose client took bytes (TCP acknowledged them) is not, whatever waits
    # unsent. The bytes acknowledged when its writes paused are the mark: without one, the first look
    # counted as progress, and a client that took nothing was dropped at the second, after twice the
    # keep-alive time (150 s); measured by fewer bytes waiting unsent, a client reading 20 KB/s while
    # answers were written as it read looked idle and was dropped (both outside attacks).

    class Clock:
        def __init__(self) -> None:
            self.now = 0.0
            self.later: list[float] = []

        def time(self) -> float:
            return self.now

        def call_later(self, delay: float, callback: Any) -> None:
            self.later.append(delay)

    sock = TcpInfo(acked=1_000_000)
    transport, clock = Stuck(sock), Clock()
    pipeline = SimpleNamespace(transport=transport, active_at=0.0, write_paused=True, waiting=[], done=False, held=[])
    pipeline.clear_held = pipeline.held.clear
    deadline = IdleDeadline(pipeline, SimpleNamespace(request=None), clock)  # type: ignore[arg-type]
    deadline.writes_paused()
    clock.now = KEEPALIVE_TIMEOUT + 1  # the first look
    sock.acked += 20_000 if reads else 0
    deadline.fire()
    if reads:
        assert not transport.aborted and clock.later == [KEEPALIVE_TIMEOUT]
        clock.now += KEEPALIVE_TIMEOUT  # the next look, nothing more taken
        deadline.fire()
    assert transport.aborted and pipeline.done


async def test_a_last_answers_linger_closes_a_connection_its_client_reset_meanwhile_and_raises_nothing() -> None:
    # Rule: the write side is shut after a connection's last answer; where its client has reset it
    # meanwhile, asyncio's transport raises ENOTCONN there (its uvloop twin does not), and the
    # connection is closed at once instead. It was raised from the callback that woke the connection
    # for room, logged as an error (found once the FIN of a client that closed no longer closed it).

    class ResetTransport(MemoryTransport):
        aborted = False

        def can_write_eof(self) -> bool:
            return True

        def write_eof(self) -> None:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

        def abort(self) -> None:
            self.aborted = True

    pipeline = SimpleNamespace(done=False, read_paused=True)
    deadline = IdleDeadline(pipeline, None, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport = ResetTransport()
    deadline.linger(transport)
    assert transport.aborted and pipeline.done and deadline.timer is None


async def test_requests_after_one_that_closes_the_connection_are_dropped_quietly(
    anvil: Anvil, evm_proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    # Rule: what follows a request that says Connection: close is not read as a request, and nothing
    # is written after that request's answer. Answered at once (a memory hit), its answer shut the
    # write side; llhttp's "Data after Connection: close" was then answered too, and the write after
    # the shutdown raised, logged as a fatal transport error (an outside attack).
    store, block = await finalized_store(anvil, evm_proxy)
    body = json.dumps(storage(store, "0x0", hex(block), rid=1)).encode()
    await evm_proxy.post(body)  # now in memory
    data = post(body, "Connection: close") + post(call("eth_chainId", [], 2))
    for _ in range(3):
        reader, writer = await asyncio.open_connection("127.0.0.1", evm_proxy.server.port)
        try:
            writer.write(data)
            status, headers, answer = await read_answer(reader)
            assert status == 200 and headers["connection"] == "close" and json.loads(answer)["id"] == 1
            assert await asyncio.wait_for(reader.read(), 30) == b""
        finally:
            writer.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


async def test_an_http_1_0_keep_alive_hit_is_answered_with_its_connection_header(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    store, block = await finalized_store(anvil, evm_proxy)
    body = json.dumps(storage(store, "0x0", hex(block), rid=3)).encode()
    await evm_proxy.post(body)  # now in memory: the next one is a hit, whose head is otherwise pre-built
    data = (b"POST /v3/k HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
    answers = await exchange(evm_proxy.server.port, data + data, 2)
    assert [(status, headers["connection"], headers["x-cache"]) for status, headers, _ in answers] == [
        (200, "keep-alive", "HIT")
    ] * 2


async def test_a_websocket_upgrade_after_posts_on_one_connection_is_served(evm_proxy: Proxy) -> None:
    connector = aiohttp.TCPConnector(limit=1)  # one connection: the upgrade follows the POSTs on it
    async with aiohttp.ClientSession(connector=connector) as session:
        for rid in range(3):
            async with session.post(evm_proxy.url(), data=call("eth_chainId", [], rid)) as resp:
                assert (await resp.json())["id"] == rid
        async with session.ws_connect(evm_proxy.ws_url()) as ws:
            await ws.send_str(call("eth_chainId", [], 9).decode())
            assert json.loads(await ws.receive_str(timeout=30))["result"] == "0x7a69"


async def test_other_routes_answer_on_a_connection_that_posted(evm_proxy: Proxy) -> None:
    data = (
        post(call("eth_chainId", [], 1))
        + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        + b"OPTIONS /v3/k HTTP/1.1\r\nHost: x\r\nOrigin: https://app.example\r\n\r\n"
        + b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"
        + b"GET /v3/k HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    answers = await exchange(evm_proxy.server.port, data, 5)
    assert [status for status, _, _ in answers] == [200, 200, 204, 404, 405]
    assert answers[1][2] == b'{"status": "ok"}'
    assert answers[2][1]["access-control-allow-origin"] == "*"


_WS_UPGRADE = (
    "Upgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
)
# An upgrade the route does not make (no key to answer): the head is handed to aiohttp all the same.
_NO_KEY = "Upgrade: websocket\r\nConnection: Upgrade\r\n"
_NOT_ONE_HOST = {
    "missing": "",
    "two field lines": "Host: a.example\r\nHost: b.example\r\n",
    "a list": "Host: a.example, b.example\r\n",
}


@pytest.mark.parametrize("hosts", list(_NOT_ONE_HOST.values()), ids=list(_NOT_ONE_HOST))
async def test_an_http_1_1_request_without_exactly_one_valid_host_is_400_on_every_path(
    evm_proxy: Proxy, hosts: str
) -> None:
    """RFC 9112 section 3.2: a server MUST answer 400 (Bad Request) to an HTTP/1.1 request that lacks a
    Host field, and to any request with more than one Host field line or an invalid Host value."""
    body = call("eth_chainId", [], 1).decode()
    heads = [
        f"POST /v3/k HTTP/1.1\r\n{hosts}Content-Length: {len(body)}\r\n\r\n{body}",
        f"GET /ws/v3/k HTTP/1.1\r\n{hosts}{_WS_UPGRADE}\r\n",
        f"GET /healthz HTTP/1.1\r\n{hosts}\r\n",
    ]
    for data in heads:
        [(status, headers, answer)] = await exchange(evm_proxy.server.port, data.encode())
        error = json.loads(answer)["error"]
        assert (status, headers["connection"], error["code"]) == (400, "close", -32600), data
        assert "Host" in error["message"] and "RFC 9112" in error["message"]


async def test_the_host_rule_holds_on_a_connection_handed_to_aiohttp(evm_proxy: Proxy) -> None:
    """RFC 9112 section 3.2 on every path: a head asking for an upgrade the route does not make is
    handed to aiohttp, which serves that connection from then on; a later request there whose Host is
    a list or not a host gets the front's 400 -32600, and the connection is closed (it was served)."""
    body = call("eth_chainId", [], 1).decode()
    handed = f"GET /healthz HTTP/1.1\r\nHost: a\r\n{_NO_KEY}\r\n"
    for host in ("a.example, b.example", "a b c"):
        then = f"POST /v3/k HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        answers = await exchange(evm_proxy.server.port, (handed + then).encode(), 2)
        (first, _, _), (status, headers, answer) = answers
        error = json.loads(answer)["error"]
        assert (first, status, headers["connection"], error["code"]) == (200, 400, "close", -32600), answers
        assert "RFC 9112" in error["message"]


async def test_whitespace_around_a_host_value_is_not_part_of_it(evm_proxy: Proxy) -> None:
    """RFC 9110 section 5.5: a field value's leading and trailing whitespace is not part of it, so a
    Host of one host with a space or a tab after it is served."""
    body = call("eth_chainId", [], 1)
    for host in (b"rpc.example ", b"rpc.example\t", b" rpc.example"):
        data = b"POST /v3/k HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n%s" % (host, len(body), body)
        [(status, _, answer)] = await exchange(evm_proxy.server.port, data)
        assert status == 200 and json.loads(answer)["result"] == "0x7a69", (host, answer)


async def test_an_http_1_0_request_may_omit_host_but_not_repeat_it(evm_proxy: Proxy) -> None:
    """RFC 9112 section 3.2: Host is required of HTTP/1.1 only; more than one Host line is 400 in any version."""
    body = call("eth_chainId", [], 1)
    [(status, _, answer)] = await exchange(
        evm_proxy.server.port, b"POST /v3/k HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert status == 200 and json.loads(answer)["result"] == "0x7a69"
    twice = b"POST /v3/k HTTP/1.0\r\nHost: a\r\nHost: b\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    [(status, _, answer)] = await exchange(evm_proxy.server.port, twice)
    assert status == 400 and json.loads(answer)["error"]["code"] == -32600


async def test_a_request_with_exactly_one_host_is_still_a_fast_path_hit(anvil: Anvil, evm_proxy: Proxy) -> None:
    """RFC 9112 section 3.2's check leaves a well-formed request's hit as it was: answered from memory,
    its head replayed without the parser on the same connection."""
    store, block = await finalized_store(anvil, evm_proxy)
    hit = json.dumps(storage(store, "0x0", hex(block), rid=0)).encode()
    await evm_proxy.post(hit)  # now in memory
    reader, writer = await asyncio.open_connection("127.0.0.1", evm_proxy.server.port)
    try:
        for _ in range(3):  # one at a time: the second and third heads are replays of the first
            writer.write(post(hit))
            status, headers, _ = await read_answer(reader)
            assert (status, headers["x-cache"]) == (200, "HIT")
    finally:
        writer.close()


@pytest.mark.parametrize("coding", ["br", "zstd", "compress", "gzip, br", "x-unknown"])
async def test_a_body_in_a_content_coding_the_proxy_does_not_decode_is_415(evm_proxy: Proxy, coding: str) -> None:
    """RFC 9110 section 15.5.16: content in an unsupported content coding gets 415 (Unsupported Media
    Type), with Accept-Encoding naming the codings that would have been accepted (section 12.5.3)."""
    body = call("eth_chainId", [], 1)  # plain JSON under a coding it is not in: never parsed as sent
    [(status, headers, answer)] = await exchange(evm_proxy.server.port, post(body, f"Content-Encoding: {coding}"))
    error = json.loads(answer)["error"]
    assert (status, error["code"], headers["accept-encoding"]) == (415, -32600, "gzip, deflate"), answer
    assert "Content-Encoding" in error["message"]


async def test_a_body_in_stacked_codings_is_decoded_layer_by_layer_within_the_limit(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """RFC 9110 section 8.4: codings are listed in the order applied, and one Content-Encoding may be
    given over several field lines; every layer is decoded, each held to MAX_BODY_BYTES."""
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, MAX_BODY_BYTES="1000")
    twice = gzip.compress(gzip.compress(call("eth_chainId", [], 1)))
    for fields in (("Content-Encoding: gzip, gzip",), ("Content-Encoding: gzip", "Content-Encoding: gzip")):
        [(status, _, answer)] = await exchange(proxy.server.port, post(twice, *fields))
        assert status == 200 and json.loads(answer)["result"] == "0x7a69", answer
    identity = call("eth_chainId", [], 2)
    [(status, _, answer)] = await exchange(proxy.server.port, post(identity, "Content-Encoding: identity"))
    assert status == 200 and json.loads(answer)["result"] == "0x7a69"
    bomb = gzip.compress(gzip.compress(b" " * 10_000_000))  # small outside, 10 MB inside
    [(status, _, answer)] = await exchange(proxy.server.port, post(bomb, "Content-Encoding: gzip, gzip"))
    assert status == 413 and json.loads(answer)["error"]["code"] == -32600


async def test_a_connection_handed_to_aiohttp_decodes_bodies_by_the_same_rules(evm_proxy: Proxy) -> None:
    """RFC 9110 sections 8.4 and 15.5.16 after an upgrade aiohttp refused (aiohttp serves the rest of
    the connection): stacked codings are decoded, an unsupported one is 415."""
    refused = f"GET /ws/v3/k HTTP/1.1\r\nHost: x\r\n{_WS_UPGRADE.replace('dGhlIHNhbXBsZSBub25jZQ==', 'bad')}\r\n"
    twice = gzip.compress(gzip.compress(call("eth_chainId", [], 1)))
    data = refused.encode() + post(twice, "Content-Encoding: gzip, gzip") + post(b"{}", "Content-Encoding: br")
    [(upgrade, _, _), (status, _, answer), (unsupported, headers, _)] = await exchange(evm_proxy.server.port, data, 3)
    assert upgrade == 400 and status == 200 and json.loads(answer)["result"] == "0x7a69", answer
    assert (unsupported, headers["accept-encoding"]) == (415, "gzip, deflate")


def test_a_large_answer_is_written_after_its_head_and_never_copied_behind_it() -> None:
    # Rule: from SPLIT_FROM bytes an answer's body is written as it is, after its head,
    # not joined behind it: 20 keys each sent one batch of 30 MB answers, and reading none, made 818
    # MB of RSS before, 678 MB after (an outside attack's script, the answers' count at 272 MB).
    request = Request()
    small, large = b"x" * (SPLIT_FROM - 1), b"y" * SPLIT_FROM
    out, close = encoded_answer(Reply(small), request, b"Date: now\r\n", "id-1")
    assert isinstance(out, bytes) and out.endswith(b"\r\n\r\n" + small) and not close
    out, _ = encoded_answer(Reply(large), request, b"Date: now\r\n", "id-2")
    assert isinstance(out, list) and out[1] is large and out_size(out) == len(out[0]) + len(large)
    assert out[0].endswith(b"Content-Length: %d\r\nDate: now\r\n\r\n" % len(large)) and b"id-2" in out[0]
    request.method = "HEAD"
    out, _ = encoded_answer(Reply(large), request, b"Date: now\r\n", "id-3")
    assert isinstance(out, bytes) and out.endswith(b"\r\n\r\n")  # a HEAD answer has no body


def test_a_bodys_small_pieces_are_joined_as_they_come() -> None:
    # Rule: a body's pieces under PIECE bytes are joined as they come, so its memory is about its bytes
    # (kept apart, each a bytes object and a list slot: 600 bodies in 2-byte chunks held 203 MB with 8
    # MiB counted, an outside attack); a large piece is kept as it came, never copied, and the body
    # comes out whole and as bytes.
    request = Request()
    for i in range(100_000):
        request.add(b"%02d" % (i % 100))
    assert len(request.parts) <= 100_000 * 2 // PIECE + 1
    big = b"x" * PIECE
    request.add(big)
    assert request.parts[-1] is big
    body = request.body()
    assert type(body) is bytes and body == b"".join(b"%02d" % (i % 100) for i in range(100_000)) + big
    one = Request()
    one.add(b'{"jsonrpc":"2.0"}')
    assert one.body() == b'{"jsonrpc":"2.0"}' and type(one.body()) is bytes  # one piece: as it came
