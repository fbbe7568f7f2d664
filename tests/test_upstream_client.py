"""The upstream HTTP client (upstream/http_client.py) against a raw server on a free port: every way
a node may frame its answer, and every way it may fail to."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from proxy.upstream.http_client import ClientFault, HostPool, TooLarge, Unreadable
from tests.support import eventually

# A request's bytes -> the raw answer (b"" closes at once), or its parts (written apart).
Answer = Callable[[bytes], bytes | tuple[bytes, ...]]
BODY = b'{"jsonrpc":"2.0","id":1,"result":"0x1"}'
LIMIT = 1024 * 1024  # every post names its bound


def framed(body: bytes = BODY, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


class Node:
    def __init__(self) -> None:
        self.answer: Answer = lambda _request: framed()
        self.connections = 0
        self.close_after = False
        self.requests: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                answer = self.answer(request)
                for i, part in enumerate(answer if isinstance(answer, tuple) else (answer,)):
                    if i:
                        await asyncio.sleep(0.05)  # the parts apart on the wire (each its own read, mostly)
                    writer.write(part)
                    await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


@pytest.fixture
async def node() -> AsyncIterator[tuple[Node, str]]:
    served = Node()
    server = await asyncio.start_server(served.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield served, f"http://user:secret@127.0.0.1:{port}/path?k=1"
    server.close()
    await server.wait_closed()


def pool(url: str, connected: list[int] | None = None) -> HostPool:
    seen = connected if connected is not None else []
    return HostPool(url, limit=2, idle_timeout=30.0, on_connect=lambda _alone: seen.append(1))


async def test_answers_reuse_one_kept_alive_connection_and_each_new_one_is_reported(node: tuple[Node, str]) -> None:
    served, url = node
    connected: list[int] = []
    client = pool(url, connected)
    for _ in range(3):
        assert (await client.post(b"{}", 5, LIMIT)).body == BODY
    assert served.connections == 1 and len(connected) == 1
    assert served.requests[0].startswith(b"POST /path?k=1 HTTP/1.1\r\n")
    assert b"Authorization: Basic dXNlcjpzZWNyZXQ=\r\n" in served.requests[0]  # user:secret, as aiohttp sent it
    served.close_after = True  # and says so
    served.answer = lambda _r: framed(BODY, b"Connection: close\r\n")
    await client.post(b"{}", 5, LIMIT)
    await client.post(b"{}", 5, LIMIT)
    assert served.connections == 2 and len(connected) == 2
    client.close()


async def test_chunked_and_until_close_answers_are_read_whole(node: tuple[Node, str]) -> None:
    served, url = node
    client = pool(url)
    served.answer = lambda _r: (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n"
        + BODY[:5]
        + b"\r\n%x\r\n" % (len(BODY) - 5)
        + BODY[5:]
        + b"\r\n0\r\n\r\n"
    )
    assert (await client.post(b"{}", 5, LIMIT)).body == BODY
    served.answer = lambda _r: framed(BODY, b"Content-Encoding: identity\r\n")
    assert (await client.post(b"{}", 5, LIMIT)).body == BODY
    served.close_after = True
    served.answer = lambda _r: b"HTTP/1.0 200 OK\r\n\r\n" + BODY
    assert (await client.post(b"{}", 5, LIMIT)).body == BODY
    client.close()


async def test_only_identity_is_asked_and_an_encoded_answer_is_refused_at_its_headers(node: tuple[Node, str]) -> None:
    """The rule: the client asks `Accept-Encoding: identity` and never inflates; an answer in gzip or
    deflate (a few hundred KB may inflate to gigabytes) is refused, its connection dropped unread."""
    served, url = node
    connected: list[int] = []
    client = pool(url, connected)
    for encoding in (b"gzip", b"deflate", b"br"):
        served.answer = lambda _r, e=encoding: framed(gzip.compress(BODY), b"Content-Encoding: %s\r\n" % e)
        with pytest.raises(Unreadable):
            await client.post(b"{}", 5, LIMIT)
    assert b"\r\nAccept-Encoding: identity\r\n" in served.requests[0]
    assert len(connected) == 3  # each refused answer's connection was dropped
    client.close()


@pytest.mark.parametrize("apart", [False, True])
async def test_interim_1xx_answers_are_read_and_ignored_and_the_final_one_is_the_answer(
    node: tuple[Node, str], apart: bool
) -> None:
    """RFC 9110 15.2: a client parses and ignores the 1xx answers before the final one; its fields are
    not the answer's, and the connection, kept alive, holds no answer's bytes for the next post."""
    served, url = node
    connected: list[int] = []
    client = pool(url, connected)
    for n in range(3):
        body = b'{"jsonrpc":"2.0","id":1,"result":"0x%d"}' % n
        interim = (
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\nContent-Length: 99999999\r\n\r\n",
        )
        parts = (*interim, framed(body))
        served.answer = lambda _r, p=parts: p if apart else b"".join(p)
        response = await client.post(b"{}", 5, LIMIT)
        assert (response.status, response.body) == (200, body)
        assert response.headers.get("content-length") == str(len(body))
    assert served.connections == 1 and len(connected) == 1  # kept alive, each answer its own
    # A 1xx framed with a body (llhttp reads one past 103): none of it is the answer's, nor counted.
    for interim in (
        b"HTTP/1.1 199 X\r\nContent-Length: 5\r\n\r\nJUNK!",
        b"HTTP/1.1 150 X\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    ):
        served.answer = lambda _r, i=interim: (i, framed()) if apart else i + framed()
        response = await client.post(b"{}", 5, len(BODY))  # the interim's bytes would pass the limit
        assert (response.status, response.body) == (200, BODY)
    served.answer = lambda _r: (
        b"HTTP/1.1 199 X\r\nContent-Length: 4\r\n\r\n{}{}" + b"HTTP/1.1 500 E\r\nContent-Length: 0\r\n\r\n"
    )
    response = await client.post(b"{}", 5, LIMIT)
    assert (response.status, response.body) == (500, b"")
    client.close()


async def test_a_101_answer_ends_its_connection_without_an_asyncio_traceback(
    node: tuple[Node, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Rule: an upgrade never asked for is that call's answer (status 101: no JSON-RPC reply, judged
    a failure above), its connection dropped, and logged by no traceback of asyncio's ("Fatal error
    on transport", at ERROR, on every call before)."""
    served, url = node
    connected: list[int] = []
    client = pool(url, connected)
    served.answer = lambda _r: b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    assert (await client.post(b"{}", 5, LIMIT)).status == 101
    served.answer = lambda _r: framed()
    assert (await client.post(b"{}", 5, LIMIT)).body == BODY
    assert len(connected) == 2  # the upgraded connection was not kept
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.records
    client.close()


async def test_a_partial_answer_a_timeout_and_a_refused_connection_are_faults(node: tuple[Node, str]) -> None:
    served, url = node
    client = pool(url)
    served.close_after = True
    served.answer = lambda _r: framed()[:-5]  # the connection ends five bytes short
    with pytest.raises(ClientFault) as fault:
        await client.post(b"{}", 5, LIMIT)
    assert not fault.value.unsent
    served.answer = lambda _r: b""  # never answers (the connection stays open)
    served.close_after = False
    with pytest.raises(TimeoutError):
        await client.post(b"{}", 0.2, LIMIT)
    refused = pool("http://127.0.0.1:9/")
    with pytest.raises(ClientFault) as fault:
        await refused.post(b"{}", 5, LIMIT)
    assert fault.value.unsent
    client.close()


async def test_an_answer_over_the_limit_is_refused_declared_or_as_it_arrives(node: tuple[Node, str]) -> None:
    served, url = node
    client = pool(url)
    with pytest.raises(TooLarge):
        await client.post(b"{}", 5, limit=10)
    served.answer = lambda _r: (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n"
    )
    with pytest.raises(TooLarge):
        await client.post(b"{}", 5, limit=10)
    assert (await client.post(b"{}", 5, limit=len(BODY))).body == BODY
    served.answer = lambda _r: b"HTTP/1.1 200 OK\r\nX-Endless: " + b"a" * 200_000 + b"\r\n\r\n" + BODY
    with pytest.raises(TooLarge):  # a head that never ends counts against the bound too
        await client.post(b"{}", 5, limit=10)
    client.close()


async def test_a_connection_begun_beside_a_post_in_flight_is_not_alone_though_that_post_ends_first(
    node: tuple[Node, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rule: a new connection is a reconnect (identity checked again) only when no other post was
    in flight as it began; a post that ends while it connects leaves the pool growing, not reconnecting."""
    _, url = node
    alone: list[bool] = []
    client = HostPool(url, limit=2, idle_timeout=30.0, on_connect=alone.append)
    await client.post(b"{}", 5, LIMIT)  # the first connection, opened alone; idle now
    loop = asyncio.get_running_loop()
    connect, first_done = loop.create_connection, asyncio.Event()

    async def slow_connect(*args: Any, **kwargs: Any) -> Any:
        await first_done.wait()  # the second connection completes only after the first post ended
        return await connect(*args, **kwargs)

    monkeypatch.setattr(loop, "create_connection", slow_connect)
    first = asyncio.create_task(client.post(b"{}", 5, LIMIT))  # takes the idle connection
    second = asyncio.create_task(client.post(b"{}", 5, LIMIT))  # opens another beside it
    assert (await first).body == BODY
    first_done.set()
    assert (await second).body == BODY
    assert alone == [True, False]
    client.close()


class _Told:
    """A post's `late`: told whether a cancelled post's answer came."""

    def __init__(self) -> None:
        self.waits = False
        self.told: list[bool] = []

    def __call__(self, answered: bool) -> None:
        self.told.append(answered)


async def test_a_post_cancelled_once_sent_reads_its_answer_on_and_a_closed_pool_leaves_it() -> None:
    """A node works on a call whatever became of its caller: a post cancelled once sent keeps reading
    its answer (late.waits), tells `late` when it came and keeps the connection for the next post;
    a pool closed meanwhile drops such a read at once (told unanswered), its connection closed."""
    release = asyncio.Event()
    sent: list[int] = []
    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
                sent.append(1)
                await release.wait()
                writer.write(framed())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    hosts = pool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/")
    try:
        late = _Told()
        task = asyncio.create_task(hosts.post(b"{}", 5.0, LIMIT, late))
        await eventually(_at_least(sent, 1), 5, "the call to reach the node")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert late.waits and late.told == []  # still read: the node works on it
        release.set()
        await eventually(_at_least(late.told, 1), 5, "the late answer")
        assert late.told == [True]
        assert (await hosts.post(b"{}", 5.0, LIMIT)).body == BODY
        assert len(connections) == 1  # the late read left its connection reusable

        release.clear()
        closed = _Told()
        task = asyncio.create_task(hosts.post(b"{}", 60.0, LIMIT, closed))  # its deadline far off
        await eventually(_at_least(sent, 3), 5, "the second call to reach the node")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        hosts.close()
        await eventually(_at_least(closed.told, 1), 3, "the closed pool to drop the late read")
        assert closed.told == [False]
    finally:
        release.set()
        hosts.close()
        server.close()
        await server.wait_closed()


def _at_least(items: list[Any], n: int) -> Callable[[], Any]:
    async def check() -> bool:
        return len(items) >= n

    return check
