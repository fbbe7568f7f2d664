"""The floor of a miss: the least a Python relay on this stack (uvloop, httptools) adds to a node's latency.

    .venv/bin/python -m bench.floor_relay PORT NODE_URL

Each POST's body goes to the node as it came, on one kept-alive connection, and the node's body
comes back as the answer: no validation, no cache, no accounting, no checks. bench.miss_latency
`--floor` runs it beside the proxy, so a figure for the proxy's miss has the stack's own floor next
to it, measured in the same rounds. Not a server to run: it trusts its client and its node.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from urllib.parse import urlsplit

import httptools

try:
    import uvloop
except ImportError:  # pragma: no cover - the floor is then asyncio's
    uvloop = None  # type: ignore[assignment]


class _Bodies(asyncio.Protocol):
    """One connection whose messages (requests or answers) httptools reads, each body handed to `whole`."""

    def __init__(self, parser: type[httptools.HttpRequestParser] | type[httptools.HttpResponseParser]) -> None:
        self.parser = parser(self)
        self.transport: asyncio.Transport | None = None
        self.body = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        body, self.body = bytes(self.body), bytearray()
        self.whole(body)

    def whole(self, body: bytes) -> None:
        raise NotImplementedError


class Node(_Bodies):
    """One kept-alive connection to the node; calls are pipelined on it, answered in order."""

    def __init__(self, host: str) -> None:
        super().__init__(httptools.HttpResponseParser)
        self.head = f"POST / HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: ".encode()
        self.waiters: deque[asyncio.Future[bytes]] = deque()

    def whole(self, body: bytes) -> None:
        waiter = self.waiters.popleft()
        if not waiter.done():
            waiter.set_result(body)

    def ask(self, body: bytes) -> asyncio.Future[bytes]:
        assert self.transport is not None
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        self.transport.write(b"%s%d\r\n\r\n%s" % (self.head, len(body), body))
        return waiter


class Front(_Bodies):
    def __init__(self, node: Node) -> None:
        super().__init__(httptools.HttpRequestParser)
        self.node = node

    def whole(self, body: bytes) -> None:
        self.node.ask(body).add_done_callback(self._answer)

    def _answer(self, future: asyncio.Future[bytes]) -> None:
        answer = future.result()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(answer), answer)
            )


async def serve(port: int, node_url: str) -> None:
    loop = asyncio.get_running_loop()
    parts = urlsplit(node_url)
    _, node = await loop.create_connection(lambda: Node(parts.netloc), parts.hostname, parts.port or 80)
    server = await loop.create_server(lambda: Front(node), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    with asyncio.Runner(loop_factory=uvloop.new_event_loop if uvloop is not None else None) as runner:
        runner.run(serve(int(sys.argv[1]), sys.argv[2]))
