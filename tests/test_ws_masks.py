"""RFC 6455 section 5.1: a client masks every frame it sends; the server closes a connection that
sends one unmasked, with 1002 (protocol error), and answers nothing it sent after it."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from itertools import cycle

import aiohttp
import pytest
from aiohttp import web

from proxy.http.app_keys import FRONT
from proxy.http.ws_masks import MaskScan
from tests.fault_relay import FaultRelay
from tests.support import Anvil, Proxy, ProxyFactory, eventually

CHAIN_ID = b'{"jsonrpc":"2.0","id":1,"method":"eth_chainId","params":[]}'
ANSWER = {"jsonrpc": "2.0", "id": 1, "result": "0x7a69"}
KEY = b"\x37\xfa\x21\x3d"
CLOSES = "rpc_proxy_websocket_protocol_closes_total"


def client_frame(
    payload: bytes, *, masked: bool = True, opcode: int = 0x1, fin: bool = True, compressed: bool = False
) -> bytes:
    """A frame as a client sends it (final unless `fin` is False): masked with KEY (RFC 6455 section
    5.3), or not; `compressed` sets RSV1 (RFC 7692: the payload is left as given)."""
    size = len(payload)
    if size < 126:
        length = bytes((size,))
    elif size < 1 << 16:
        length = b"\x7e" + size.to_bytes(2, "big")
    else:
        length = b"\x7f" + size.to_bytes(8, "big")
    first = (0x80 if fin else 0) | (0x40 if compressed else 0) | opcode
    if not masked:
        return bytes((first,)) + length + payload
    body = bytes(b ^ k for b, k in zip(payload, cycle(KEY), strict=False))
    return bytes((first, 0x80 | length[0])) + length[1:] + KEY + body


def handshake(port: int) -> bytes:
    return (
        f"GET /ws/v3/test-key HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


@asynccontextmanager
async def upgraded(
    proxy: Proxy, first: bytes = b""
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A raw socket upgraded by hand; `first` sent with the upgrade request, before its 101 came."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    try:
        writer.write(handshake(proxy.server.port) + first)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 101 "), head
        yield reader, writer
    finally:
        writer.close()
        await writer.wait_closed()


async def server_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The next frame the server sends (unmasked): its opcode and payload."""
    async with asyncio.timeout(5):
        first, second = await reader.readexactly(2)
        size = second & 0x7F
        if size >= 126:
            size = int.from_bytes(await reader.readexactly(2 if size == 126 else 8), "big")
        return first & 0x0F, await reader.readexactly(size)


async def assert_closed_1002(reader: asyncio.StreamReader) -> None:
    """The next frame is a Close with 1002 and a reason, and the server closes the TCP connection."""
    opcode, payload = await server_frame(reader)
    assert opcode == 0x8, payload  # not an answer to the call
    assert int.from_bytes(payload[:2], "big") == aiohttp.WSCloseCode.PROTOCOL_ERROR
    assert b"not masked" in payload[2:]
    assert await asyncio.wait_for(reader.read(), 5) == b""


async def no_socket_left(proxy: Proxy) -> None:
    async def closed() -> bool:
        return proxy.metric("rpc_proxy_websocket_connections") == 0

    await eventually(closed, 5, "the WebSocket's handler to end")


async def test_an_unmasked_frame_closes_the_connection_with_1002_unanswered(
    evm_proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """RFC 6455 section 5.1: a client frame not masked; the call in it is never answered."""
    caplog.set_level(logging.DEBUG)
    async with upgraded(evm_proxy) as (reader, writer):
        writer.write(client_frame(CHAIN_ID, masked=False))
        await assert_closed_1002(reader)
    assert evm_proxy.metric(CLOSES, reason="unmasked") == 1
    await no_socket_left(evm_proxy)
    assert not any(r.exc_info for r in caplog.records)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING and r.name != "proxy.chain"] == []


async def test_an_unmasked_frame_after_masked_ones_closes_the_connection_with_1002(evm_proxy: Proxy) -> None:
    """RFC 6455 section 5.1: every frame is masked, not only a connection's first."""
    async with upgraded(evm_proxy) as (reader, writer):
        writer.write(client_frame(CHAIN_ID))
        assert json.loads((await server_frame(reader))[1]) == ANSWER
        writer.write(client_frame(CHAIN_ID, masked=False))
        await assert_closed_1002(reader)
    assert evm_proxy.metric(CLOSES, reason="unmasked") == 1


async def test_an_unmasked_frame_whose_header_is_split_across_reads_closes_with_1002(evm_proxy: Proxy) -> None:
    """RFC 6455 section 5.1, with the unmasked frame's header split between two TCP writes: the first
    ends one byte into it (before the mask bit) and is read, its masked call answered, before the rest is sent."""
    unmasked = client_frame(CHAIN_ID, masked=False)
    async with upgraded(evm_proxy) as (reader, writer):
        writer.write(client_frame(CHAIN_ID) + unmasked[:1])
        assert json.loads((await server_frame(reader))[1]) == ANSWER  # the first write was read
        writer.write(unmasked[1:])
        await assert_closed_1002(reader)


async def test_an_unmasked_frame_sent_before_the_101_closes_the_connection_with_1002(
    evm_proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """RFC 6455 section 5.1 for frames a client sent with its upgrade request, not waiting for the 101
    (aiohttp holds those until its reader starts: a change there fails this test)."""
    caplog.set_level(logging.DEBUG)
    async with upgraded(evm_proxy, client_frame(CHAIN_ID) + client_frame(CHAIN_ID, masked=False)) as (reader, _):
        await assert_closed_1002(reader)
    await no_socket_left(evm_proxy)
    assert evm_proxy.metric(CLOSES, reason="unmasked") == 1
    assert not any(r.exc_info for r in caplog.records)


async def test_masked_frames_are_answered_from_a_raw_socket_and_from_aiohttps_client(evm_proxy: Proxy) -> None:
    """RFC 6455 section 5.1: masked frames (every client's) are served as before, pings and their
    large calls included, whichever way their headers fall across reads."""
    large = json.dumps({"jsonrpc": "2.0", "id": "x" * 300, "method": "eth_chainId", "params": []})
    stream = client_frame(b"", opcode=0x9) + client_frame(CHAIN_ID) + client_frame(large.encode())
    async with upgraded(evm_proxy, stream[:3]) as (reader, writer):
        writer.write(stream[3:])
        assert (await server_frame(reader))[0] == 0xA  # the pong
        answers = [json.loads((await server_frame(reader))[1]) for _ in range(2)]
        assert sorted(len(str(a["id"])) for a in answers) == [1, 300] and {a["result"] for a in answers} == {"0x7a69"}
    async with evm_proxy.session.ws_connect(evm_proxy.ws_url()) as ws:
        await ws.send_bytes(CHAIN_ID)
        assert json.loads((await ws.receive(timeout=5)).data) == ANSWER
    assert evm_proxy.metric(CLOSES, reason="unmasked") == 0


def test_aiohttp_keeps_bytes_after_an_upgrade_request_where_the_mask_check_reads_them() -> None:
    """The one name of aiohttp's the check relies on (ws_masks.MaskedOnly.install): an upgrade of
    aiohttp cannot drop the check unnoticed."""
    assert "_message_tail" in web.RequestHandler.__slots__


class TestMaskScan:
    STREAM = (
        client_frame(CHAIN_ID)
        + client_frame(b"x" * 300)  # a 16-bit length
        + client_frame(b"", opcode=0x9)
        + client_frame(b"y" * 70_000, opcode=0x0)  # a 64-bit length (a continuation frame)
        + client_frame(CHAIN_ID)
    )

    def test_masked_frames_pass_however_the_stream_is_split(self) -> None:
        stream = self.STREAM
        for cut in (*range(0, 400), *range(len(stream) - 200, len(stream) + 1)):
            scan = MaskScan()
            assert scan.feed(stream[:cut]) and scan.feed(stream[cut:]), cut

    def test_an_unmasked_frame_is_found_however_the_stream_is_split(self) -> None:
        stream = self.STREAM + client_frame(CHAIN_ID, masked=False, opcode=0x0) + client_frame(CHAIN_ID)
        bad = len(self.STREAM) + 1  # the byte holding its mask bit
        for cut in (*range(0, 400), *range(len(self.STREAM) - 200, len(stream) + 1)):
            scan = MaskScan()
            assert scan.feed(stream[:cut]) is (cut <= bad), cut
            if cut <= bad:
                assert scan.feed(stream[cut:]) is False, cut

    def test_one_byte_at_a_time(self) -> None:
        scan = MaskScan()
        frames = client_frame(b"z" * 200) + client_frame(CHAIN_ID)
        assert all(scan.feed(frames[i : i + 1]) for i in range(len(frames)))
        assert scan.feed(b"\x81") and not scan.feed(b"\x05")

    def test_a_message_not_yet_whole_holds_what_has_come_of_it_however_the_stream_is_split(self) -> None:
        # A text message in two fragments with a ping between them, then a whole one. Counted as
        # declared, a frame's header alone (14 bytes) took 5 MB of the host's room.
        first = client_frame(b"a" * 300, fin=False)  # an 8-byte header: 2, a 16-bit length, the mask
        ping = client_frame(b"", opcode=0x9)
        last = client_frame(b"b" * 70_000, opcode=0x0)  # a 14-byte header: a 64-bit length
        stream = first + ping + last + client_frame(CHAIN_ID)  # a 6-byte header
        ends_first, ends_last = len(first), len(first) + len(ping) + len(last)
        starts_last = ends_last - len(last)
        for cut in (*range(0, 420), *range(starts_last, starts_last + 40), *range(ends_last - 50, len(stream) + 1)):
            scan = MaskScan()
            assert scan.feed(stream[:cut])
            if cut < ends_first:
                expected = max(0, cut - 8)
            elif cut < ends_last:
                expected = 300 + max(0, cut - starts_last - 14)
            elif cut < len(stream):
                expected = max(0, cut - ends_last - 6)  # the next message, begun
            else:
                expected = 0
            assert scan.message == expected, cut
            assert scan.feed(stream[cut:]) and scan.message == 0, cut

    def test_what_is_begun_and_not_whole_is_pending(self) -> None:
        frame, ping = client_frame(b"a" * 300), client_frame(b"p", opcode=0x9)
        for cut in range(len(frame) + 1):
            scan = MaskScan()
            scan.feed(frame[:cut])
            assert scan.pending is (0 < cut < len(frame)), cut
        scan = MaskScan()
        scan.feed(ping[:3])
        assert scan.pending  # a control frame cut by a read too
        scan.feed(ping[3:])
        assert not scan.pending

    def test_a_compressed_message_is_whole_at_its_last_frame(self) -> None:
        # RFC 7692: a compressed message's first frame sets RSV1. Its last was never seen as the
        # message's end: nothing was pending ever after, and the held count only grew.
        whole = client_frame(b"a" * 300, compressed=True)
        fragmented = client_frame(b"b" * 200, fin=False, compressed=True) + client_frame(b"c" * 100, opcode=0x0)
        for stream in (whole, fragmented, whole + fragmented + whole):
            scan = MaskScan()
            assert scan.feed(stream) and not scan.pending and scan.message == 0
        scan = MaskScan()
        assert scan.feed(fragmented[:-10]) and scan.pending and scan.message == 200 + 100 - 10

    def test_one_byte_at_a_time_holds_the_same(self) -> None:
        stream = client_frame(b"a" * 300, fin=False) + client_frame(b"b" * 200, opcode=0x0)
        scan = MaskScan()
        held = []
        for i in range(len(stream)):
            assert scan.feed(stream[i : i + 1])
            held.append(scan.message)
        assert held[8 + 299] == 300 and held[-1] == 0 and max(held) == 499, max(held)


@pytest.mark.parametrize("sent", [2000, 8, 3], ids=["part of its payload", "its header alone", "part of its header"])
async def test_a_message_not_finished_within_body_timeout_closes_its_connection_with_1008(
    anvil: Anvil, make_proxy: ProxyFactory, sent: int
) -> None:
    """A frame declaring 5 MB that stops short: aiohttp held it as long as the socket stayed open
    (250 such held 1.3 GB); BODY_TIMEOUT bounds it as it bounds an HTTP body, from its first byte (a
    header alone, holding no room, started no clock: the socket was held until WS_IDLE_TIMEOUT)."""
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, BODY_TIMEOUT="0.5")
    async with upgraded(proxy) as (reader, writer):
        writer.write(client_frame(b"x" * 5000)[:sent])
        opcode, payload = await server_frame(reader)
        assert opcode == 0x8 and int.from_bytes(payload[:2], "big") == aiohttp.WSCloseCode.POLICY_VIOLATION
        assert b"BODY_TIMEOUT" in payload[2:], payload
        assert await asyncio.wait_for(reader.read(), 5) == b""
    assert proxy.metric(CLOSES, reason="unfinished") == 1
    await no_socket_left(proxy)


async def test_compressed_messages_are_whole_at_their_last_frame_not_late_for_body_timeout(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """Rule (docs/security.md: BODY_TIMEOUT bounds a message not yet whole): a client that agreed
    permessage-deflate (browsers, `websockets`, aiohttp with `compress`) sends frames with RSV1 set,
    and their last was never seen as their message's end: the socket was closed 1008 BODY_TIMEOUT
    after its first message, every message answered, and its held room only grew."""
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, BODY_TIMEOUT="0.5")
    receiving = proxy.app[FRONT].endpoint.receiving
    url = f"ws://127.0.0.1:{proxy.server.port}/ws/v3/test-key"
    async with aiohttp.ClientSession() as session, session.ws_connect(url, compress=15) as ws:
        assert ws.compress == 15  # agreed: its frames go compressed
        for rid in range(3):
            padded = {"jsonrpc": "2.0", "id": rid, "method": "eth_chainId", "params": [], "pad": "p" * 5000}
            await ws.send_str(json.dumps(padded))
            answer = await ws.receive(timeout=10)
            assert answer.type == aiohttp.WSMsgType.TEXT and json.loads(answer.data)["id"] == rid, answer
            assert receiving.held == 0
            await asyncio.sleep(0.6)  # the client's own pause, past BODY_TIMEOUT
        assert not ws.closed
    assert proxy.metric(CLOSES, reason="unfinished") == 0


async def test_a_message_the_proxy_stopped_reading_is_not_late_for_body_timeout(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """BODY_TIMEOUT is the client's time to send a message, not the proxy's to read it: with its calls
    in flight at WS_MAX_INFLIGHT the proxy stops reading, and a message it had read part of was closed
    1008 as late, the client's earlier messages unanswered (an outside attack: 10 sockets of 64
    pipelined thousand-call batches, 412 of 640 lost once MAX_CALLS_IN_FLIGHT_PER_KEY queued them)."""
    relay = await FaultRelay(anvil.url).start()
    proxy = await make_proxy(EVM_UPSTREAM=relay.url, BODY_TIMEOUT="0.5", WS_MAX_INFLIGHT="4")
    try:
        relay.inject("slow", method="eth_getBalance", delay=2.0, times=None)
        slow = [
            json.dumps(
                {"jsonrpc": "2.0", "id": i, "method": "eth_getBalance", "params": ["0x" + f"{i:040x}", "latest"]}
            ).encode()
            for i in range(4)
        ]
        padded = [CHAIN_ID[:-1] + b',"pad":"' + b"p" * 300_000 + b'"}' for _ in range(3)]
        async with upgraded(proxy) as (reader, writer):
            writer.write(b"".join(client_frame(m) for m in slow + padded))  # the last read in part, then paused
            answers = []
            for _ in range(len(slow) + len(padded)):
                async with asyncio.timeout(30):
                    opcode, payload = await server_frame(reader)
                assert opcode == 0x1, payload  # never a Close
                answers.append(json.loads(payload)["id"])
            assert sorted(answers) == [0, 1, 1, 1, 1, 2, 3]
        assert proxy.metric(CLOSES, reason="unfinished") == 0
    finally:
        relay.clear()
        await relay.close()


async def test_messages_not_yet_whole_hold_room_among_the_hosts_bodies_and_give_it_back(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """MAX_INFLIGHT_BODY_BYTES counts a WebSocket message not yet whole by what has come of it: a
    second socket's read past the room is closed 1013, and the room comes back when the first
    message is whole or its socket closes."""
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, MAX_INFLIGHT_BODY_BYTES="100000")
    padded = CHAIN_ID[:-1] + b',"pad":"' + b"p" * 80_000 + b'"}'
    frame = client_frame(padded)
    receiving = proxy.app[FRONT].endpoint.receiving

    async def held(size: int) -> None:
        async def read() -> bool:
            return bool(receiving.held >= size)

        await eventually(read, 10, f"{size} bytes of a message held")

    async with upgraded(proxy) as (reader, writer):
        writer.write(frame[:-10])  # one message always fits a host holding none
        await held(80_000)
        async with upgraded(proxy) as (other, other_writer):
            other_writer.write(frame[:-10])
            opcode, payload = await server_frame(other)
            assert opcode == 0x8 and int.from_bytes(payload[:2], "big") == aiohttp.WSCloseCode.TRY_AGAIN_LATER
            assert b"MAX_INFLIGHT_BODY_BYTES" in payload[2:], payload
        assert proxy.metric(CLOSES, reason="no_room") == 1
        writer.write(frame[-10:])  # whole now: answered, and its room given back
        opcode, payload = await server_frame(reader)
        assert opcode == 0x1 and json.loads(payload)["id"] == 1, payload
        assert receiving.held == 0
        async with upgraded(proxy) as (other, other_writer):
            other_writer.write(frame[:-10])
            await held(80_000)
            async with upgraded(proxy) as (third, third_writer):
                third_writer.write(frame[:-10])
                opcode, _ = await server_frame(third)
                assert opcode == 0x8  # the second socket holds the room now
    async with upgraded(proxy) as (reader, writer):  # and gave it back as it closed
        writer.write(frame)
        opcode, payload = await server_frame(reader)
        assert opcode == 0x1 and json.loads(payload)["id"] == 1, payload
    # A header alone holds nothing of the host's room (sent with the upgrade, it is read before the 101).
    async with upgraded(proxy, frame[:14] + padded[:5]):
        assert receiving.held == 5
    assert proxy.metric(CLOSES, reason="no_room") == 2


@pytest.mark.parametrize(
    ("change", "status"),
    [
        ((b"Sec-WebSocket-Version: 13", b"Sec-WebSocket-Version: 8"), 426),
        ((b"Sec-WebSocket-Version: 13", b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Version: 8"), 426),
        ((b"HTTP/1.1", b"HTTP/1.0"), 400),
        ((b"Sec-WebSocket-Version: 13", b"Sec-WebSocket-Version: 13\r\nContent-Length: 5"), 400),
    ],
    ids=["version 8", "versions 13 and 8", "HTTP/1.0", "a body"],
)
async def test_an_upgrade_rfc_6455_does_not_allow_is_refused_not_opened(
    evm_proxy: Proxy, change: tuple[bytes, bytes], status: int
) -> None:
    """RFC 6455 4.2.2 (version 13 only, else 426 naming it), RFC 9110 7.8 (an HTTP/1.0 request's
    Upgrade is ignored), and no body: aiohttp opened each, and a body's bytes were read as frames."""
    reader, writer = await asyncio.open_connection("127.0.0.1", evm_proxy.server.port)
    try:
        writer.write(handshake(evm_proxy.server.port).replace(*change) + b"hello")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.split(b" ")[1] == str(status).encode(), head
        if status == 426:
            assert b"Sec-WebSocket-Version: 13" in head
    finally:
        writer.close()
    await no_socket_left(evm_proxy)


@pytest.mark.parametrize("field", [b"Content-Length: 5", b"Transfer-Encoding: chunked"])
async def test_an_upgrade_declaring_a_body_is_refused_at_its_head_and_closed(evm_proxy: Proxy, field: bytes) -> None:
    """An upgrade ends at its head for the parser: a body sent apart from it (a later packet) was read as
    the connection's next request, and the request after it was never answered. Refused at its head
    (400, closed), however the bytes are split."""
    reader, writer = await asyncio.open_connection("127.0.0.1", evm_proxy.server.port)
    try:
        writer.write(handshake(evm_proxy.server.port).replace(b"\r\n\r\n", b"\r\n" + field + b"\r\n\r\n", 1))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.split(b" ")[1] == b"400" and b"Connection: close" in head, head
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        assert b"carries no body" in await asyncio.wait_for(reader.readexactly(length), 5)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed: nothing after it is read as a request
    finally:
        writer.close()
    await no_socket_left(evm_proxy)
