"""A relay in front of a real node that lies about final blocks while its head polls stay honest: a
call that names a block at or below `below` by number (or whose answer is about such a block) gets a
changed answer. Each lie is one a node could tell without breaking the JSON form:

- "storage": eth_getStorageAt's word has its last bit flipped, and so has every eth_getProof value;
- "droplog": the last log of eth_getLogs is left out, and the last log of eth_getBlockReceipts;
- "gas": a receipt's gasUsed is one more (eth_getBlockReceipts, eth_getTransactionReceipt);
- "nofields": eth_getBlockReceipts' receipts leave out from, to, transactionHash and
  effectiveGasPrice, and their logs transactionHash, blockHash, blockNumber and transactionIndex;
- "blobprice": eth_getBlockReceipts' receipts show a blobGasPrice of 0xdeadbeef;
- "timestamp": a block's timestamp is one more (eth_getBlockByNumber, eth_getBlockByHash);
- "proofnode": eth_getProof's last account proof node has a byte changed (the values left true);
- "newfield": a block shows a header field no fork has (`futureRoot`);
- "uncle": eth_getUncleByBlockHashAndIndex answers `uncle` (a real block's header) instead of null;
- "swap": a call whose method `swap` names is answered with the item given there (another final
  block, transaction or receipt, true of its own block) in place of the one asked for; with
  `swap_first` set, only a call whose first param is that one (the proxy's own calls stay honest);
- "genesis": a balance read by a block hash (EIP-1898) is one more, and eth_getBlockByHash of a block
  at or below `below` says it is block 0 from the second time that hash is asked on (the first, the
  proxy's own check of the hash, is answered honestly).
- "result": every answer (not an error) to a call of a method `results` names is that result instead,
  whatever block it is about: any JSON value, of the wrong shape for its method or nested deeper than
  orjson writes (the node's JSON valid all the same).

`lie = None` relays honestly. Tags ("latest", "finalized") are never lied about, so the tracker
follows the real chain; with `heads_honest`, neither is a batch of eth_getBlockByNumber calls alone
(the tracker's window walk, whose blocks by number must hash to their hashes: head_polls.made_up).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support import fake_server

LIES = (
    "storage",
    "droplog",
    "gas",
    "nofields",
    "blobprice",
    "timestamp",
    "proofnode",
    "newfield",
    "uncle",
    "swap",
    "genesis",
    "result",
)
_BLOCK_PARAM = {
    "eth_getStorageAt": 2,
    "eth_getProof": 2,
    "eth_getBalance": 1,
    "eth_getCode": 1,
    "eth_getBlockReceipts": 0,
    "eth_getBlockByNumber": 0,
}


def _number(value: Any) -> int | None:
    if isinstance(value, str) and value.startswith("0x") and len(value) < 20:
        return int(value, 16)
    return None


def _hash(param: Any) -> bool:
    """Whether a block param names its block by hash (EIP-1898 `{"blockHash": H}` too)."""
    return (isinstance(param, dict) and "blockHash" in param) or (isinstance(param, str) and len(param) == 66)


def _about(call: dict[str, Any], result: Any) -> int | None:
    """The block number a call (or, for a block named by hash, its answer) is about; None for a tag."""
    method, params = call.get("method"), call.get("params") or []
    param: Any = None
    if method in _BLOCK_PARAM and len(params) > _BLOCK_PARAM[method]:
        param = params[_BLOCK_PARAM[method]]
    elif method == "eth_getLogs" and params and isinstance(params[0], dict):
        log_filter = params[0]
        param = log_filter["blockHash"] if "blockHash" in log_filter else log_filter.get("toBlock", "latest")
    if param is not None and not _hash(param):
        return _number(param)  # a number, or a tag (None)
    item = result[0] if isinstance(result, list) and result else result
    if isinstance(item, dict):
        return _number(item.get("blockNumber", item.get("number")))
    return None


def nested(depth: int) -> Any:
    """`[[...]]`, `depth` arrays deep: valid JSON past the 255 levels orjson writes, for the "result" lie."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def _flip_word(word: str) -> str:
    return word[:-1] + format(int(word[-1], 16) ^ 1, "x")


def _lie(lie: str, method: str, result: Any) -> Any:
    if lie == "storage" and method == "eth_getStorageAt" and isinstance(result, str):
        return _flip_word(result)
    if lie == "storage" and method == "eth_getProof" and isinstance(result, dict):
        for entry in result.get("storageProof", []):
            entry["value"] = hex(int(entry["value"], 16) ^ 1)
    if lie == "droplog" and method == "eth_getLogs" and isinstance(result, list) and result:
        return result[:-1]
    if lie == "droplog" and method == "eth_getBlockReceipts" and isinstance(result, list):
        with_logs = [r for r in result if r.get("logs")]
        if with_logs:
            with_logs[-1]["logs"] = with_logs[-1]["logs"][:-1]
    if lie == "gas" and method in ("eth_getBlockReceipts", "eth_getTransactionReceipt"):
        for receipt in result if isinstance(result, list) else [result] if isinstance(result, dict) else []:
            receipt["gasUsed"] = hex(int(receipt["gasUsed"], 16) + 1)
    if lie == "nofields" and method == "eth_getBlockReceipts" and isinstance(result, list):
        for receipt in result:
            for name in ("from", "to", "transactionHash", "effectiveGasPrice"):
                receipt.pop(name, None)
            for log in receipt.get("logs", ()):
                for name in ("transactionHash", "blockHash", "blockNumber", "transactionIndex"):
                    log.pop(name, None)
    if lie == "blobprice" and method == "eth_getBlockReceipts" and isinstance(result, list):
        for receipt in result:
            receipt["blobGasPrice"] = "0xdeadbeef"
    if lie == "timestamp" and method in ("eth_getBlockByNumber", "eth_getBlockByHash") and isinstance(result, dict):
        result["timestamp"] = hex(int(result["timestamp"], 16) + 1)
    if lie == "proofnode" and method == "eth_getProof" and isinstance(result, dict) and result["accountProof"]:
        node = result["accountProof"][-1]
        result["accountProof"][-1] = node[:-2] + format(int(node[-2:], 16) ^ 1, "02x")
    if lie == "newfield" and method in ("eth_getBlockByNumber", "eth_getBlockByHash") and isinstance(result, dict):
        result["futureRoot"] = "0x" + "00" * 32
    return result


@dataclass
class LyingRelay:
    target: str
    lie: str | None = None
    below: int = 0  # lies about blocks up to this number
    lies_told: int = 0
    uncle: dict[str, Any] | None = None  # what the "uncle" lie answers
    swap: dict[str, Any] = field(default_factory=dict)  # method -> what the "swap" lie answers
    swap_first: Any = None  # the "swap" lie only for calls with this first param (None: every call)
    results: dict[str, Any] = field(default_factory=dict)  # method -> what the "result" lie answers
    heads_honest: bool = False  # a batch of eth_getBlockByNumber calls alone is relayed as it is
    calls: list[dict[str, Any]] = field(default_factory=list)  # every call relayed, batches unrolled
    hashes_asked: dict[str, int] = field(default_factory=dict)  # eth_getBlockByHash: times each hash was asked
    posts: list[list[dict[str, Any]]] = field(default_factory=list)  # each request's calls: a round trip each
    url: str = ""
    _server: TestServer | None = None
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> LyingRelay:
        self._session = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/", self._handle)
        self._server = await fake_server(app)
        self.url = f"http://127.0.0.1:{self._server.port}/"
        return self

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.Response:
        assert self._session is not None
        body = await request.read()
        payload = json.loads(body)
        calls = payload if isinstance(payload, list) else [payload]
        self.calls.extend(c for c in calls if isinstance(c, dict))
        self.posts.append([c for c in calls if isinstance(c, dict)])
        async with self._session.post(self.target, data=body, headers={"Content-Type": "application/json"}) as resp:
            reply = json.loads(await resp.read())
        items = reply if isinstance(reply, list) else [reply]
        if (
            self.heads_honest
            and isinstance(payload, list)
            and all(c.get("method") == "eth_getBlockByNumber" for c in calls)
        ):
            return web.json_response(reply)
        by_id = {c.get("id"): c for c in calls}
        for item in items:
            call = by_id.get(item.get("id"), {})
            result = item.get("result")
            number = _about(call, result)
            if self.lie == "uncle" and call.get("method") == "eth_getUncleByBlockHashAndIndex" and result is None:
                item["result"] = dict(self.uncle or {})  # by hash: no tag to keep honest
                self.lies_told += 1
            method = call.get("method")
            first = (call.get("params") or [None])[0]
            first = first.get("blockHash", first.get("blockNumber")) if isinstance(first, dict) else first
            swapped = method in self.swap and (self.swap_first is None or first == self.swap_first)
            about_below = number is not None and number <= self.below
            if self.lie == "result" and method in self.results and "result" in item:
                item["result"] = json.loads(json.dumps(self.results[method]))
                self.lies_told += 1
            elif self.lie == "swap" and swapped and (self.swap_first is not None or about_below):
                item["result"] = json.loads(json.dumps(self.swap[method]))
                self.lies_told += 1
            elif self.lie == "genesis" and result is not None:
                item["result"] = self._genesis(call, result, number)
            elif self.lie is not None and number is not None and number <= self.below and result is not None:
                item["result"] = _lie(self.lie, str(call.get("method")), result)
                self.lies_told += 1
        return web.json_response(reply)

    def _genesis(self, call: dict[str, Any], result: Any, number: int | None) -> Any:
        method, params = call.get("method"), call.get("params") or []
        if method == "eth_getBalance" and len(params) > 1 and isinstance(params[1], dict) and "blockHash" in params[1]:
            self.lies_told += 1
            return hex(int(result, 16) + 1)
        if method == "eth_getBlockByHash" and params and number is not None and 0 < number <= self.below:
            asked = self.hashes_asked[params[0]] = self.hashes_asked.get(params[0], 0) + 1
            if asked > 1:
                self.lies_told += 1
                return {**result, "number": "0x0"}
        return result
