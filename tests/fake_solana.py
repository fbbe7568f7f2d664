"""A small fake Solana JSON-RPC node (aiohttp) with the documented shapes and Agave's errors.

Accounts, blocks (every 7th slot skipped, slots past the commitment's -32004) and one known
transaction (SIGNATURE) answer as Agave does.

Its slot advances by one on every request, as a live cluster's would between calls, so a test can
tell a cached `context.slot` from a fresh one. Its WebSocket (`ws_url`) speaks the pubsub methods
(slot, account, signature and logs subscriptions); tests make it notify with `advance_slot`,
`set_account`, `confirm` and `emit_logs`; identical subscriptions on one socket share an id, as Agave's do.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from decimal import Decimal
from typing import Any

from aiohttp import WSMsgType, web

from tests.fake_node import FakeNode

API_VERSION = "2.0.15"
TOKEN_ACCOUNT = "7fUAJdStEuGbc3sM84cKRL6yYaaSstyLSU4ve5oovLS7"
SYSTEM_ACCOUNT = "4Nd1mBQtrMJVYVfKf2PJy9NZUZdTAsp7D4xWLs4gDB4T"  # exists, but is not a token account
MISSING_ACCOUNT = "8qbHbw2BbbTHBW1sbeqakYXVKRQM8Ne7pLK7m6CVfeR"
GENESIS_HASH = "EtWTRABZaYq6iMfeYKouRu166VU2xqa1wcaWoxPkrZBG"
EPOCH_SCHEDULE = {
    "firstNormalEpoch": 0,
    "firstNormalSlot": 0,
    "leaderScheduleSlotOffset": 432000,
    "slotsPerEpoch": 432000,
    "warmup": False,
}
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def b58(data: bytes) -> str:
    number, out = int.from_bytes(data, "big"), ""
    while number:
        number, digit = divmod(number, 58)
        out = _B58[digit] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


SIGNATURE = b58(bytes(range(1, 65)))  # a transaction the node knows, in slot 900
UNKNOWN_SIGNATURE = b58(bytes(range(2, 66)))
FINALIZED_LAG = 32  # the finalized slot trails the processed one by this much
LARGEST = [{"address": b58(bytes((i + 1,)) * 32), "lamports": 10**15 - i} for i in range(20)]


def _parsed(params: list[Any]) -> list[Any]:
    """A subscription's params as Agave compares them, defaults filled in: a config of defaults is none."""
    return [p for p in params if p not in ({}, {"commitment": "finalized"})]


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
        self.lamports: dict[str, int] = {}
        self.ws_calls: Counter[str] = Counter()
        self.ws_received: Counter[str] = Counter()  # as they arrive (ws_calls: as they are answered)
        self.share_ids = True  # identical subscriptions on a socket share an id (Agave); False: one each
        self.subscribe_delay = 0.0  # seconds a subscribe waits for its answer (the socket's later ones behind it)
        self.subscriptions: dict[int, tuple[str, list[Any], web.WebSocketResponse]] = {}
        self.sockets: set[web.WebSocketResponse] = set()
        self.refuse_sockets = False
        self._next_sub = 5000  # far from the proxy's own ids, so a test sees they are rewritten
        self.genesis: str | None = GENESIS_HASH  # another cluster's, or None: getGenesisHash fails
        self.largest = LARGEST
        self.results: dict[str, Any] = {}  # a method named here is answered with that result instead
        self.unhealthy: str | None = None  # Agave's -32005 message, given to every call but getSlot
        super().__init__()

    @property
    def ws_url(self) -> str:
        assert self.server is not None
        return f"ws://127.0.0.1:{self.server.port}/"

    def _routes(self, app: web.Application) -> None:
        app.router.add_get("/", self._pubsub)

    async def close(self) -> None:
        await self.drop_sockets()
        await super().close()

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
        lag = {"processed": 0, "confirmed": 1, "finalized": FINALIZED_LAG}[commitment]
        if self.unhealthy is not None and method not in ("getSlot", "getGenesisHash"):
            return _error(rid, -32005, self.unhealthy, {"numSlotsBehind": 42})
        if method in self.results:
            return {"jsonrpc": "2.0", "id": rid, "result": self.results[method]}
        if method == "getSlot":
            return {"jsonrpc": "2.0", "id": rid, "result": self.slot - lag}
        if method == "getBlockHeight":
            return {"jsonrpc": "2.0", "id": rid, "result": self.slot - lag - 100}
        if method == "getGenesisHash":
            if self.genesis is None:
                return _error(rid, -32603, "Internal error")
            return {"jsonrpc": "2.0", "id": rid, "result": self.genesis}
        if method == "getEpochSchedule":
            return {"jsonrpc": "2.0", "id": rid, "result": EPOCH_SCHEDULE}
        if method in ("getBalance", "getAccountInfo", "getMultipleAccounts"):
            return {"jsonrpc": "2.0", "id": rid, "result": self._accounts(method, params)}
        if method == "getBlock":
            return self._block(rid, params[0] if params else None, commitment, lag)
        if method == "getTransaction":
            found = params[:1] == [SIGNATURE]
            return {"jsonrpc": "2.0", "id": rid, "result": self._transaction() if found else None}
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
            written = format(Decimal(amount).scaleb(-decimals).normalize(), "f")  # Agave's trimmed string
            value = {"amount": amount, "decimals": decimals, "uiAmount": ui, "uiAmountString": written}
            return {"jsonrpc": "2.0", "id": rid, "result": {"context": self._context(), "value": value}}
        if method == "getLargestAccounts":
            accounts = self.largest
            if config.get("filter") == "nonCirculating":
                accounts = self.largest[:5]
            return {"jsonrpc": "2.0", "id": rid, "result": {"context": self._context(), "value": accounts}}
        return _error(rid, -32601, "Method not found")

    # --- accounts, blocks and transactions (Agave's shapes) ------------------------------------

    def _account(self, pubkey: str) -> dict[str, Any] | None:
        if pubkey == MISSING_ACCOUNT:
            return None
        return {
            "data": ["", "base64"],
            "executable": False,
            "lamports": self.lamports.get(pubkey, 1_000_000),
            "owner": "11111111111111111111111111111111",
            "rentEpoch": 18446744073709551615,
            "space": 0,
        }

    def _accounts(self, method: str, params: list[Any]) -> dict[str, Any]:
        if method == "getMultipleAccounts":
            value: Any = [self._account(k) for k in params[0]]
        elif method == "getAccountInfo":
            value = self._account(params[0])
        else:
            account = self._account(params[0])
            value = account["lamports"] if account else 0
        return {"context": self._context(), "value": value}

    def _block(self, rid: Any, slot: Any, commitment: str, lag: int) -> dict[str, Any]:
        if not isinstance(slot, int) or slot > self.slot - lag:
            return _error(rid, -32004, f"Block not available for slot {slot}")
        if slot % 7 == 0:
            return _error(rid, -32007, f"Slot {slot} was skipped, or missing due to ledger jump to recent snapshot")
        block = {
            "blockHeight": slot - 100,
            "blockTime": 1_700_000_000 + slot,
            "blockhash": b58(slot.to_bytes(32, "big")),
            "parentSlot": slot - 1,
            "previousBlockhash": b58((slot - 1).to_bytes(32, "big")),
            "transactions": [],
            "rewards": [],
        }
        return {"jsonrpc": "2.0", "id": rid, "result": block}

    def _transaction(self) -> dict[str, Any]:
        return {
            "slot": 900,
            "blockTime": 1_700_000_900,
            "version": "legacy",
            "meta": {
                "err": None,
                "fee": 5000,
                "preBalances": [10, 0],
                "postBalances": [5, 0],
                "innerInstructions": [],
                "logMessages": [],
                "status": {"Ok": None},
            },
            "transaction": {
                "signatures": [SIGNATURE],
                "message": {
                    "accountKeys": [SYSTEM_ACCOUNT, TOKEN_ACCOUNT],
                    "header": {
                        "numRequiredSignatures": 1,
                        "numReadonlySignedAccounts": 0,
                        "numReadonlyUnsignedAccounts": 1,
                    },
                    "instructions": [],
                    "recentBlockhash": GENESIS_HASH,
                },
            },
        }

    # --- pubsub ------------------------------------------------------------------------------

    async def _pubsub(self, request: web.Request) -> web.StreamResponse:
        if self.refuse_sockets:  # a node that is down: no new pubsub connection
            return web.Response(status=503)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.sockets.add(ws)
        try:
            async for message in ws:
                if message.type is WSMsgType.TEXT:
                    request = json.loads(message.data)
                    method = str(request.get("method"))
                    self.ws_received[method] += 1
                    if self.subscribe_delay and method.endswith("Subscribe"):
                        await asyncio.sleep(self.subscribe_delay)
                    await ws.send_json(self._pubsub_answer(request, ws))
        finally:
            self.sockets.discard(ws)
            for sub_id in [i for i, (_, _, sock) in self.subscriptions.items() if sock is ws]:
                del self.subscriptions[sub_id]
        return ws

    def _pubsub_answer(self, req: dict[str, Any], ws: web.WebSocketResponse) -> dict[str, Any]:
        rid, method, params = req.get("id"), str(req.get("method")), req.get("params", [])
        self.ws_calls[method] += 1
        if method in ("slotSubscribe", "accountSubscribe", "signatureSubscribe", "logsSubscribe"):
            if method == "accountSubscribe" and (not params or params[0] == "not-a-key"):
                return _error(rid, -32602, "Invalid param: Invalid")
            for sub_id, held in self.subscriptions.items():  # Agave: identical ones on a socket share an id
                if self.share_ids and (held[0], _parsed(held[1]), held[2]) == (method, _parsed(params), ws):
                    return {"jsonrpc": "2.0", "id": rid, "result": sub_id}
            self._next_sub += 1
            self.subscriptions[self._next_sub] = (method, params, ws)
            return {"jsonrpc": "2.0", "id": rid, "result": self._next_sub}
        if method.endswith("Unsubscribe"):
            sub_id = params[0] if params else None
            if sub_id not in self.subscriptions:
                return _error(rid, -32602, "Invalid subscription id.")
            del self.subscriptions[sub_id]
            return {"jsonrpc": "2.0", "id": rid, "result": True}
        return _error(rid, -32601, "Method not found")

    async def _notify(self, method: str, kind: str, result: Any, match: Any = None) -> int:
        """Send a notification to each subscription of `kind` whose first param is `match` (if given)."""
        sent = 0
        for sub_id, (sub_method, sub_params, ws) in list(self.subscriptions.items()):
            if sub_method != kind or (match is not None and (sub_params[:1] or [None])[0] != match):
                continue
            params = {"result": result, "subscription": sub_id}
            await ws.send_json({"jsonrpc": "2.0", "method": method, "params": params})
            sent += 1
            if kind == "signatureSubscribe" and result["value"] != "receivedSignature":  # ends with its result
                del self.subscriptions[sub_id]
        return sent

    async def advance_slot(self) -> int:
        self.slot += 1
        return await self._notify(
            "slotNotification", "slotSubscribe", {"parent": self.slot - 1, "root": self.slot - 32, "slot": self.slot}
        )

    async def set_account(self, pubkey: str, lamports: int) -> int:
        value = {
            "lamports": lamports,
            "data": ["", "base64"],
            "owner": "11111111111111111111111111111111",
            "executable": False,
            "rentEpoch": 0,
            "space": 0,
        }
        return await self._notify(
            "accountNotification", "accountSubscribe", {"context": {"slot": self.slot}, "value": value}, pubkey
        )

    async def confirm(self, signature: str) -> int:
        return await self._notify(
            "signatureNotification",
            "signatureSubscribe",
            {"context": {"slot": self.slot}, "value": {"err": None}},
            signature,
        )

    async def receive(self, signature: str) -> int:
        """Agave's notice that the transaction was received (enableReceivedNotification): not the end."""
        return await self._notify(
            "signatureNotification",
            "signatureSubscribe",
            {"context": {"slot": self.slot}, "value": "receivedSignature"},
            signature,
        )

    async def emit_logs(self, signature: str, logs: list[str]) -> int:
        return await self._notify(
            "logsNotification",
            "logsSubscribe",
            {"context": {"slot": self.slot}, "value": {"signature": signature, "err": None, "logs": logs}},
        )

    async def drop_sockets(self) -> None:
        """Close every pubsub connection, as a restarting node would."""
        for ws in list(self.sockets):
            await ws.close()
