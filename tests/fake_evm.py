"""A fast fake EVM node over HTTP: FakeChain's blocks plus instant, distinct storage and call answers.

For filling the cache with many distinct finalized answers quickly (Anvil answers a few thousand
calls a second): `eth_getStorageAt` returns a 32-byte word derived from the slot, and `eth_call`
returns `call_result_bytes` of hex derived from the call data. Batches are answered as batches.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from aiohttp import web

from tests.fake_chain import FakeChain
from tests.fake_node import FakeNode


def storage_word(slot: str) -> str:
    """The fake's answer to eth_getStorageAt at `slot`: distinct for every slot."""
    return "0x" + hashlib.sha256(slot.encode()).hexdigest()


def call_result(data: str, size: int) -> str:
    """The fake's answer to eth_call with `data`: `size` characters of hex, distinct for every `data`."""
    seed = hashlib.sha256(data.encode()).hexdigest()
    return "0x" + (seed * (size // 64 + 1))[: max(size - 2, 0)]


class FakeEvm(FakeNode):
    """Blocks 0..latest with finalized = latest - 2, so answers at block 1 are final from the start."""

    client_max_size = 64 * 1024**2

    def __init__(self, latest: int = 100, call_result_bytes: int = 100_000) -> None:
        self.chain = FakeChain(latest, depth=2)
        self.call_result_bytes = call_result_bytes
        super().__init__()

    def _answer(self, call: dict[str, Any]) -> dict[str, Any]:
        method, params = call.get("method"), call.get("params") or []
        reply: dict[str, Any] = {"jsonrpc": "2.0", "id": call.get("id")}
        if method == "eth_getStorageAt":
            reply["result"] = storage_word(params[1])
        elif method == "eth_call":
            reply["result"] = call_result(params[0].get("data", ""), self.call_result_bytes)
        elif method == "eth_chainId":
            reply["result"] = "0x7a69"
        else:
            answer = self.chain.answer(str(method), params)
            if answer.is_error:
                reply["error"] = answer.error
            else:
                reply["result"] = answer.result
        return reply

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        reply = [self._answer(c) for c in body] if isinstance(body, list) else self._answer(body)
        return web.Response(body=json.dumps(reply).encode(), content_type="application/json")
