"""Request heads the fast server remembers (Front.learn): a read that starts at a message boundary
and is a head llhttp accepted before, followed by exactly as many body bytes, is answered without
the parser; it must be answered exactly as the parser's road answers it, and nothing else may be
taken for such a request. A head is remembered without the empty line that ends it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from proxy.http.endpoint import NO_CHARGE, error_reply
from proxy.http.front import MAX_HEADS, Front
from proxy.http.wire import RPC, Request
from proxy.rpc.jsonrpc import JsonRpcError
from tests.support import Anvil, MemoryTransport, Proxy, ProxyFactory, eventually, word
from tests.test_cache import finalized_store, storage
from tests.test_front import Answer, call, post, read_answer
from tests.test_front_door import NEW_ID
from tests.test_keyed_hits import ALICE, keyed, reload


@contextlib.contextmanager
def connection(front: Front, transport: MemoryTransport | None = None) -> Iterator[tuple[Any, MemoryTransport]]:
    """A fast connection fed by hand: each data_received call is one read, as the test cuts them."""
    protocol, transport = front.protocol(), transport or MemoryTransport()
    transport.protocol = protocol
    protocol.connection_made(transport)
    try:
        yield protocol, transport
    finally:
        transport.close()


def front_of(proxy: Proxy) -> Front:
    site = proxy.server.site
    assert site is not None and site.front is not None
    return site.front


async def one_by_one(port: int, requests: list[bytes]) -> list[Answer]:
    """Each request alone on one kept-alive connection, the next sent once the last is answered:
    each reaches the server as a read of its own, from a message boundary."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    answers = []
    try:
        for data in requests:
            writer.write(data)
            await writer.drain()
            answers.append(await read_answer(reader))
    finally:
        writer.close()
    return answers


def same_length(body: bytes, length: int) -> bytes:
    """`body` padded with JSON white space to `length` bytes: the same Content-Length, so the same head."""
    assert len(body) <= length
    return body + b" " * (length - len(body))


def comparable(answer: Answer) -> tuple[int, dict[str, str], Any]:
    status, headers, body = answer
    headers = {name: value for name, value in headers.items() if name not in ("date", "x-request-id")}  # each its own
    return status, headers, json.loads(body)


async def hit_request(anvil: Anvil, proxy: Proxy, rid: int = 1, key: str = "test-key") -> bytes:
    store, block = await finalized_store(anvil, proxy)
    body = json.dumps(storage(store, "0x0", hex(block), rid=rid)).encode()
    assert (await proxy.post(body, key=key))[0] == 200  # now in memory
    front_of(proxy).request_heads.clear()  # that miss taught the server its client's head: the tests teach their own
    return body


async def test_a_known_head_with_any_body_of_its_length_is_answered_as_the_parser_answers_it(
    anvil: Anvil,
    evm_proxy: Proxy,
) -> None:
    hit = await hit_request(anvil, evm_proxy, rid=10)
    length = len(hit)
    bodies = [
        hit.replace(b'"id": 10', b'"id": 11'),  # a hit with another id
        same_length(call("eth_chainId", [], 12), length),  # a miss
        same_length(b"[" + call("eth_chainId", [], 13) + b"]", length),  # a batch
        same_length(b'{"jsonrpc": "2.0", "id": 14, "method": "eth_nope", "params": []}', length),  # unknown method
        same_length(b'{"jsonrpc": "2.0", "id": 15', length),  # not JSON
        b"\x00" * length,
    ]
    requests = [post(hit), *(post(body) for body in bodies)]
    front = front_of(evm_proxy)
    replayed = await one_by_one(evm_proxy.server.port, requests)
    assert list(front.request_heads) == [post(hit)[: -length - 4]]  # learned from the first request alone
    parsed = []
    for data in requests:  # each on a connection of its own with nothing remembered: the parser's road
        front.request_heads.clear()
        parsed += await one_by_one(evm_proxy.server.port, [data])
    assert [comparable(a) for a in replayed] == [comparable(a) for a in parsed]
    assert [a[1].get("x-cache") for a in replayed[:2]] == ["HIT", "HIT"]
    assert json.loads(replayed[1][2])["id"] == 11


async def test_a_known_head_after_bytes_the_parser_holds_is_parsed_with_them(anvil: Anvil, evm_proxy: Proxy) -> None:
    hit = await hit_request(anvil, evm_proxy)
    front = front_of(evm_proxy)
    await one_by_one(evm_proxy.server.port, [post(hit)])
    assert front.request_heads
    with connection(front) as (protocol, transport):
        protocol.data_received(b"PO")  # no callback yet: only the parser knows a request has begun
        protocol.data_received(post(hit))  # so this is "POPOST ...": a bad request, not a hit
        assert transport.written.startswith(b"HTTP/1.1 400 ") and transport.closed


async def test_a_known_head_with_more_bytes_after_its_body_is_parsed(anvil: Anvil, evm_proxy: Proxy) -> None:
    hit = await hit_request(anvil, evm_proxy, rid=1)
    front = front_of(evm_proxy)
    await one_by_one(evm_proxy.server.port, [post(hit)])
    second = post(hit.replace(b'"id": 1', b'"id": 2'))
    with connection(front) as (protocol, transport):
        protocol.data_received(post(hit) + second[:20])  # the next request begins in the same read
        protocol.data_received(second[20:])
    answers = transport.written.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert [json.loads(answer.split(b"\r\n\r\n", 1)[1])["id"] for answer in answers] == [1, 2]


async def test_a_head_is_not_remembered_from_a_read_that_held_more_or_less_than_its_request(
    anvil: Anvil,
    evm_proxy: Proxy,
) -> None:
    hit = await hit_request(anvil, evm_proxy)
    front = front_of(evm_proxy)
    for reads in (
        [post(hit) + b"\r\n"],  # bytes after it (white space the parser skips)
        [post(hit) * 2],  # two requests
        [post(hit)[:30], post(hit)[30:]],  # a head in two reads
        [post(hit)[:-5], post(hit)[-5:]],
    ):  # a body in two reads
        with connection(front) as (protocol, transport):
            for data in reads:
                protocol.data_received(data)
        assert transport.written.count(b"X-Cache: HIT") == reads[0].count(b"POST")
        assert not front.request_heads, reads


async def test_chunked_bodies_and_expect_are_never_replayed(anvil: Anvil, evm_proxy: Proxy) -> None:
    hit = await hit_request(anvil, evm_proxy)
    head = b"POST /v3/k HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunked = head + b"%x\r\n%b\r\n0\r\n\r\n" % (len(hit), hit)
    expecting = post(hit, "Expect: 100-continue")
    front = front_of(evm_proxy)
    answers = await one_by_one(evm_proxy.server.port, [chunked, chunked])
    assert [a[1]["x-cache"] for a in answers] == ["HIT", "HIT"] and not front.request_heads
    with connection(front) as (protocol, transport):
        protocol.data_received(expecting)
        protocol.data_received(expecting)  # its interim answer each time, as the parser's road writes it
    assert transport.written.count(b"HTTP/1.1 100 Continue\r\n\r\n") == 2 and not front.request_heads


async def test_the_remembered_heads_are_bounded(anvil: Anvil, evm_proxy: Proxy) -> None:
    hit = await hit_request(anvil, evm_proxy)
    front = front_of(evm_proxy)
    with connection(front) as (protocol, transport):
        for n in range(MAX_HEADS + 50):  # a head of its own each: a client that varies a field
            protocol.data_received(post(hit, f"X-N: {n}"))
            assert len(front.request_heads) <= MAX_HEADS
    assert transport.written.count(b"X-Cache: HIT") == MAX_HEADS + 50


async def test_a_replayed_head_is_judged_by_the_keys_of_the_moment(
    anvil: Anvil, redis_url: str, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    path = tmp_path / "keys.toml"
    proxy = await keyed(make_proxy, anvil, redis_url, path, ALICE)
    hit = await hit_request(anvil, proxy, key="alice-secret")
    data = post(hit, path="/v3/alice-secret")
    first, second = await one_by_one(proxy.server.port, [data, data])
    assert [a[1]["x-cache"] for a in (first, second)] == ["HIT", "HIT"] and front_of(proxy).request_heads
    assert int(second[1]["x-credits-remaining"]) < int(first[1]["x-credits-remaining"])
    reload(proxy, path, '[keys.bob]\nkey = "bob-secret"\n')
    assert not front_of(proxy).request_heads  # heads with a key in them are forgotten with the keys
    [(status, _, body)] = await one_by_one(proxy.server.port, [data])
    assert status == 401 and json.loads(body)["error"]["code"] == -32001


class CountedParser:
    """llhttp's parser, its reads counted."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.fed = 0

    def feed_data(self, data: bytes) -> None:
        self.fed += 1
        self.parser.feed_data(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


async def test_a_request_of_a_known_head_is_answered_without_the_parser(anvil: Anvil, evm_proxy: Proxy) -> None:
    hit = await hit_request(anvil, evm_proxy, rid=1)
    with connection(front_of(evm_proxy)) as (protocol, transport):
        protocol.parser = parser = CountedParser(protocol.parser)
        for rid in range(1, 10):
            protocol.data_received(post(hit.replace(b'"id": 1', b'"id": %d' % rid)))
        assert parser.fed == 1  # the first alone: the others were its head again
    answers = transport.written.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert [json.loads(answer.split(b"\r\n\r\n", 1)[1])["id"] for answer in answers] == list(range(1, 10))


async def test_nothing_is_replayed_after_a_request_that_closes_the_connection(anvil: Anvil, evm_proxy: Proxy) -> None:
    hit = await hit_request(anvil, evm_proxy)
    front = front_of(evm_proxy)
    await one_by_one(evm_proxy.server.port, [post(hit), post(hit)])
    assert front.request_heads
    miss = call("eth_getBalance", ["0x" + "de" * 20, "latest"], 1)
    # A known head: replayed, were it read, and sent to the node (the answer is in no cache).
    after = post(same_length(call("eth_getCode", ["0x" + "de" * 20, "latest"], 2), len(hit)))
    for closing in (
        post(miss, "Connection: close"),
        b"POST /v3/k HTTP/1.0\r\nContent-Length: %d\r\n\r\n%b" % (len(miss), miss),
    ):
        with connection(front) as (protocol, transport):
            protocol.data_received(closing)  # a miss: its answer is still on its way...
            protocol.data_received(after)  # ...when more bytes come, which llhttp refuses (RFC 9112 9.6)

            async def closed() -> bool:
                return transport.closed

            await eventually(closed, 30, "the connection to close after its last answer")
        assert transport.written.count(b"HTTP/1.1 ") == 1 and b'"id":1,' in transport.written
        assert evm_proxy.upstreams["evm"].calls["eth_getCode"] == 0


async def test_a_key_that_churns_the_heads_changes_no_other_keys_answers_or_charges(
    anvil: Anvil,
    redis_url: str,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    path = tmp_path / "keys.toml"
    proxy = await keyed(make_proxy, anvil, redis_url, path, ALICE + '[keys.bob]\nkey = "bob-secret"\n')
    hit = await hit_request(anvil, proxy, key="bob-secret")
    bobs = post(hit, path="/v3/bob-secret")
    with connection(front_of(proxy)) as (attacker, transport):
        shown = []
        for n in range(MAX_HEADS + 50):  # alice: a new head on every request, the memo starting over
            attacker.data_received(post(hit, f"X-N: {n}", path="/v3/alice-secret"))
            if n % 100 == 0:
                [(status, headers, body)] = await one_by_one(proxy.server.port, [bobs])
                assert status == 200 and headers["x-cache"] == "HIT" and json.loads(body)["id"] == 1
                shown.append(int(headers["x-credits-remaining"]))
    assert transport.written.count(b"X-Cache: HIT") == MAX_HEADS + 50
    assert [a - b for a, b in itertools.pairwise(shown)] == [80] * (len(shown) - 1)  # once each, bob's alone


async def test_a_miss_teaches_its_head_and_misses_replayed_on_it_answer_in_order(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    """A miss's head is learned as a hit's is; reads replayed on it while earlier misses are still on
    their way are answered in request order, each as the parser's road answers it."""
    store, block = await finalized_store(anvil, evm_proxy)
    front = front_of(evm_proxy)
    front.request_heads.clear()
    bodies = [json.dumps(storage(store, hex(slot), hex(block), rid=slot)).encode() for slot in range(8)]
    with connection(front) as (protocol, transport):
        # One miss answered first: the connection's answers are then reckoned at their own size, so
        # the eight below are all made at once (MAX_PENDING_ANSWER_BYTES), none held for room.
        protocol.data_received(post(json.dumps(storage(store, hex(100), hex(block), rid=100)).encode()))

        async def warm() -> bool:
            return transport.written.count(b"HTTP/1.1 200 OK\r\n") == 1

        await eventually(warm, 30, "the first miss to be answered")
        front.request_heads.clear()
        protocol.parser = parser = CountedParser(protocol.parser)
        for body in bodies:  # each a read of its own, from a message boundary, none answered yet
            protocol.data_received(post(body))
        assert parser.fed == 1 and list(front.request_heads) == [post(bodies[0])[: -len(bodies[0]) - 4]]

        async def answered() -> bool:
            return transport.written.count(b"HTTP/1.1 200 OK\r\n") == 1 + len(bodies)

        await eventually(answered, 30, "every miss to be answered")
    answers = [json.loads(a.split(b"\r\n\r\n", 1)[1]) for a in transport.written.split(b"HTTP/1.1 200 OK\r\n")[2:]]
    assert [a["id"] for a in answers] == list(range(8))
    assert [a["result"] for a in answers] == ["0x" + word(7)] + ["0x" + word(0)] * 7
    assert transport.written.count(b"X-Cache: MISS") == 1 + len(bodies)
    again = await one_by_one(evm_proxy.server.port, [post(body) for body in bodies])  # now hits, replayed too
    assert [a[1]["x-cache"] for a in again] == ["HIT"] * len(bodies)
    assert [json.loads(a[2]) for a in again] == answers


async def test_a_cancelled_answer_is_written_only_while_its_client_is_there(anvil: Anvil, evm_proxy: Proxy) -> None:
    """A miss's task writes its own answer. Cancelled after its client left (Front.shutdown cancels
    those), nothing is written or logged; cancelled otherwise, it answers 500 and those behind it go."""
    front = front_of(evm_proxy)
    request = Request()
    request.kind, request.method = RPC, "POST"

    async def forever() -> Any:
        await asyncio.get_running_loop().create_future()

    async def answered() -> Any:
        return error_reply(JsonRpcError(-32000, "the second"), NO_CHARGE)

    with connection(front) as (protocol, transport):  # the client stays: the cancelled one answers 500
        protocol.pipeline.answer(request, forever())
        protocol.pipeline.answer(request, answered())
        first = protocol.pipeline.waiting[0][0]
        await asyncio.sleep(0)
        first.cancel()

        async def both() -> bool:
            return transport.written.count(b"HTTP/1.1 ") == 2

        await eventually(both, 10, "both answers, in order")
        assert transport.written.index(b"HTTP/1.1 500 ") < transport.written.index(b"the second")
    encoded = []
    with connection(front) as (protocol, transport):  # the client leaves, then shutdown cancels its answer
        protocol.encoded = lambda *args: encoded.append(args)
        protocol.pipeline.answer(request, forever())
        task = protocol.pipeline.waiting[0][0]
        await asyncio.sleep(0)
        transport.close()
        assert task in front.orphans
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert encoded == [] and transport.written == b"" and task not in front.orphans


async def test_a_replayed_hit_head_echoes_a_sane_request_id_and_gives_a_new_one_for_any_other(
    anvil: Anvil,
    evm_proxy: Proxy,
) -> None:
    # spec (front door): every answer names its request, the client's own X-Request-Id when it is
    # sane, else a new one; a head answered without the parser (read once: wire.Request.sent_id) too.
    hit = await hit_request(anvil, evm_proxy)
    sane_head, insane_head = post(hit, "X-Request-Id: trace-7.a:b_c"), post(hit, "X-Request-Id: bad id <x>")
    replayed = await one_by_one(evm_proxy.server.port, [sane_head] * 3 + [insane_head] * 3)
    assert [a[1]["x-cache"] for a in replayed] == ["HIT"] * 6
    assert [a[1]["x-request-id"] for a in replayed[:3]] == ["trace-7.a:b_c"] * 3
    new_ids = [a[1]["x-request-id"] for a in replayed[3:]]
    assert len(set(new_ids)) == 3 and all(NEW_ID.fullmatch(rid) for rid in new_ids)
    assert set(front_of(evm_proxy).request_heads) == {sane_head[: -len(hit) - 4], insane_head[: -len(hit) - 4]}
