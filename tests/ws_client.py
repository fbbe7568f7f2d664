"""A WebSocket JSON-RPC client for subscription tests: replies and notifications kept apart."""

from __future__ import annotations

import asyncio
import json
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
