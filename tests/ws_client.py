"""A WebSocket JSON-RPC client for subscription tests: replies and notifications kept apart."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp

from tests.support import Proxy


class Client:
    """A WebSocket client that keeps replies and notifications apart."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.replies: dict[Any, dict[str, Any]] = {}
        self.notes: list[dict[str, Any]] = []
        self._next = 0

    async def call(self, method: str, *params: Any) -> dict[str, Any]:
        self._next += 1
        rid = self._next
        await self.ws.send_str(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": list(params)}))
        return await self.reply(rid)

    async def reply(self, rid: Any) -> dict[str, Any]:
        """The reply to request `rid` (one `call` sent, or one sent by hand)."""
        while rid not in self.replies:
            await self._receive()
        return self.replies.pop(rid)

    async def subscribe(self, *params: Any) -> str:
        reply = await self.call("eth_subscribe", *params)
        assert "result" in reply, reply
        return str(reply["result"])

    async def _receive(self, timeout: float = 10) -> None:
        message = await self.ws.receive(timeout=timeout)
        assert message.type is aiohttp.WSMsgType.TEXT, message
        data = json.loads(message.data)
        if "id" in data:
            self.replies[data["id"]] = data
        else:
            self.notes.append(data)

    async def notes_until(self, count: int, timeout: float = 15) -> list[dict[str, Any]]:
        async with asyncio.timeout(timeout):
            while len(self.notes) < count:
                await self._receive(timeout)
        return self.notes

    def results(self, sub: str) -> list[Any]:
        mine = [n["params"] for n in self.notes if n["params"]["subscription"] == sub]
        return [p["result"] for p in mine if "result" in p]


async def connect(proxy: Proxy, key: str = "test-key", session: aiohttp.ClientSession | None = None) -> Client:
    return Client(await (session or proxy.session).ws_connect(proxy.ws_url(key)))


def frame(body: bytes) -> bytes:
    """A masked client text frame (mask key 0)."""
    size = len(body)
    if size < 126:
        header = bytes([0x81, 0x80 | size])
    elif size < 1 << 16:
        header = bytes([0x81, 0x80 | 126]) + size.to_bytes(2, "big")
    else:
        header = bytes([0x81, 0x80 | 127]) + size.to_bytes(8, "big")
    return header + b"\x00\x00\x00\x00" + body


async def silent_socket(port: int, key: str, subscriptions: int) -> socket.socket:
    """A raw WebSocket with a tiny receive window that subscribes to wildcard logs `subscriptions`
    times, then never reads."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(
        sock,
        f"GET /ws/v3/{key} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode(),
    )
    assert b" 101 " in await loop.sock_recv(sock, 1024)
    for rid in range(subscriptions):
        body = json.dumps({"jsonrpc": "2.0", "id": rid, "method": "eth_subscribe", "params": ["logs", {}]})
        await loop.sock_sendall(sock, frame(body.encode()))
    return sock
