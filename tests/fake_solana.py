"""A small fake Solana JSON-RPC node (aiohttp) with the documented shapes and Agave's errors.

Its slot advances by one on every request, as a live cluster's would between calls, so a test can
tell a cached `context.slot` from a fresh one.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from aiohttp import web

from tests.fake_node import FakeNode

API_VERSION = "2.0.15"
TOKEN_ACCOUNT = "7fUAJdStEuGbc3sM84cKRL6yYaaSstyLSU4ve5oovLS7"
SYSTEM_ACCOUNT = "4Nd1mBQtrMJVYVfKf2PJy9NZUZdTAsp7D4xWLs4gDB4T"  # exists, but is not a token account
MISSING_ACCOUNT = "8qbHbw2BbbTHBW1sbeqakYXVKRQM8Ne7pLK7m6CVfeR"
LARGEST = [
    {"address": f"{i + 1}1111111111111111111111111111111111111111"[:44], "lamports": 10**15 - i}
    for i in range(20)
]


def _error(rid: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": rid, "error": error}


class FakeSolana(FakeNode):
    def __init__(self) -> None:
        self.slot = 1000
        self.calls: Counter[str] = Counter()
        self.balances = {TOKEN_ACCOUNT: ("9864", 2)}
        super().__init__()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        if isinstance(body, list):
            return web.json_response([self._answer(item) for item in body])
        return web.json_response(self._answer(body))

    def _context(self) -> dict[str, Any]:
        return {"apiVersion": API_VERSION, "slot": self.slot}

    def _answer(self, req: dict[str, Any]) -> dict[str, Any]:
        rid, method, params = req.get("id"), req.get("method"), req.get("params", [])
        self.calls[str(method)] += 1
        self.slot += 1
        config = next((p for p in params if isinstance(p, dict)), {})
        if "minContextSlot" in config and config["minContextSlot"] > self.slot:
            return _error(rid, -32016, "Minimum context slot has not been reached", {"contextSlot": self.slot})
        commitment = config.get("commitment", "finalized")
        if commitment not in ("finalized", "confirmed", "processed"):
            return _error(rid, -32602, f"Invalid params: unknown variant `{commitment}`.")
        if method == "getSlot":
            lag = {"processed": 0, "confirmed": 1, "finalized": 32}[commitment]
            return {"jsonrpc": "2.0", "id": rid, "result": self.slot - lag}
        if method == "getHealth":
            return {"jsonrpc": "2.0", "id": rid, "result": "ok"}
        if method == "getVersion":
            return {"jsonrpc": "2.0", "id": rid, "result": {"solana-core": API_VERSION, "feature-set": 1}}
        if method == "getTokenAccountBalance":
            address = params[0] if params else None
            if address == SYSTEM_ACCOUNT:
                return _error(rid, -32602, "Invalid param: not a Token account")
            if address not in self.balances:
                return _error(rid, -32602, "Invalid param: could not find account")
            amount, decimals = self.balances[address]
            ui = int(amount) / 10**decimals
            value = {"amount": amount, "decimals": decimals, "uiAmount": ui, "uiAmountString": json.dumps(ui)}
            return {"jsonrpc": "2.0", "id": rid, "result": {"context": self._context(), "value": value}}
        if method == "getLargestAccounts":
            accounts = LARGEST
            if config.get("filter") == "nonCirculating":
                accounts = LARGEST[:5]
            return {"jsonrpc": "2.0", "id": rid, "result": {"context": self._context(), "value": accounts}}
        return _error(rid, -32601, "Method not found")
