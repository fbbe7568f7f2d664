"""A fault-injecting HTTP relay in front of a real node: wrong ids, duplicate ids, partial batches,
HTTP 500/413/429/508, slow answers, injected errors, answers from another node (a URL over two forks),
a batch whose `latest` block and the block of another tag (`target`: "safe" or "finalized") trade places,
a batch whose `latest` block is edited (`target` "hash": its hash made its parent's, "hash+field": and a
field no fork has; "timestamp": one second later; "number": 1,000 higher),
a batch whose `safe` and `finalized` blocks are its `latest` block (a node that takes an unknown tag for latest).
Faults are queued and each applies to the next requests that match it (by method, by batch or not),
then runs out; `times=None` never runs out.

BombRelay is its hostile sibling on a raw socket (aiohttp's server cannot frame an answer that ends
with the connection): it relays like FaultRelay, and a bomb armed for matching requests answers
with a gzip bomb or hundreds of MB (chunked, until close, or declared), streamed lazily so the
test holds none of it, and stopped as soon as the proxy drops the connection.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support import fake_server

KINDS = (
    "http500",
    "http413",
    "http429",
    "http508",
    "slow",
    "wrong_id",
    "duplicate_id",
    "partial",
    "error3",
    "error",
    "ratelimit",
    "droplog",
    "fork",
    "crowded",
    "both",
    "tags",
    "made_up",
    "final_latest",
    "pruned",
)
CROWD = 400_000  # "crowded": each result an array of this many `{}` (1.2 MB, one container per 3 bytes)


@dataclass
class Fault:
    kind: str
    method: str | None = None  # only requests holding a call of this method; None: any
    batches_only: bool = False
    times: int | None = 1  # None: forever
    delay: float = 0.0
    retry_after: str | None = None  # an HTTP fault's Retry-After header
    target: str | None = (
        None  # "fork": the node that answers instead; "tags": the tag traded with latest; "made_up": what is edited
    )
    every: int = 1  # applies to every `every`-th matching request only
    only: bool = False  # matches only requests whose every call is of `method`
    where: Callable[[dict[str, Any]], bool] | None = None  # only requests holding a call it holds true of
    _matched: int = 0

    def matches(self, calls: list[dict[str, Any]], is_batch: bool) -> bool:
        if self.batches_only and not is_batch:
            return False
        if self.only and not all(c.get("method") == self.method for c in calls):
            return False
        if self.method is not None and not any(c.get("method") == self.method for c in calls):
            return False
        if self.where is not None and not any(self.where(c) for c in calls):
            return False
        self._matched += 1
        return self._matched % self.every == 0


@dataclass
class FaultRelay:
    target: str
    faults: list[Fault] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    requests: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)  # every call relayed, batches unrolled
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of each request's arrival
    timeline: list[tuple[float, list[str]]] = field(default_factory=list)  # each request's arrival, its methods
    in_flight: int = 0
    most_in_flight: int = 0
    request_headers: list[dict[str, str]] = field(default_factory=list)  # each request's, as it came
    url: str = ""
    _server: TestServer | None = None
    _session: aiohttp.ClientSession | None = None

    def inject(self, kind: str, **options: Any) -> Fault:
        assert kind in KINDS, kind
        fault = Fault(kind, **options)
        self.faults.append(fault)
        return fault

    def clear(self) -> None:
        self.faults.clear()

    def inject_random(self, rng: random.Random, rate: float) -> None:
        """A fault on the next request with probability `rate`, its kind drawn from `rng`."""
        if rng.random() < rate:
            self.inject(rng.choice(["http500", "wrong_id", "duplicate_id", "partial", "slow", "http413"]), delay=0.05)

    async def start(self) -> FaultRelay:
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

    def _take(self, calls: list[dict[str, Any]], is_batch: bool) -> Fault | None:
        for fault in self.faults:
            if fault.matches(calls, is_batch):
                if fault.times is not None:
                    fault.times -= 1
                    if fault.times <= 0:
                        self.faults.remove(fault)
                self.applied.append(fault.kind)
                return fault
        return None

    async def _forward(self, body: bytes, target: str | None = None) -> Any:
        assert self._session is not None
        async with self._session.post(
            target or self.target, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            return json.loads(await resp.read())

    async def _handle(self, request: web.Request) -> web.Response:
        arrived = time.monotonic()
        self.arrivals.append(arrived)
        self.request_headers.append(dict(request.headers))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self._answer(request, arrived)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request, arrived: float) -> web.Response:
        self.requests += 1
        body = await request.read()
        payload = json.loads(body)
        is_batch = isinstance(payload, list)
        calls = payload if is_batch else [payload]
        self.calls.extend(c for c in calls if isinstance(c, dict))
        self.timeline.append((arrived, [str(c.get("method")) for c in calls if isinstance(c, dict)]))
        fault = self._take(calls, is_batch)
        kind = fault.kind if fault else None
        if fault is not None and fault.delay:
            await asyncio.sleep(fault.delay)  # "slow" is only this; any other fault may come late too
        if kind in ("http500", "http413", "http429", "http508"):
            headers = {"Retry-After": fault.retry_after} if fault is not None and fault.retry_after else None
            return web.Response(status=int(kind[4:]), text="injected", headers=headers)
        if kind in ("error3", "error", "ratelimit", "pruned"):
            code = {"error3": 3, "error": -32000, "ratelimit": -32005, "pruned": 4444}[kind]
            message = {"ratelimit": "project ID request rate exceeded", "pruned": "pruned history unavailable"}.get(
                kind, "injected"
            )  # Infura's words; geth's for history it no longer keeps (EIP-4444)
            errors = [{"jsonrpc": "2.0", "id": c.get("id"), "error": {"code": code, "message": message}} for c in calls]
            if kind in ("error3", "pruned") and is_batch and fault is not None and fault.method is not None:
                # An execution error (or pruned history) is the call's own: the batch's other calls are answered.
                answered = await self._forward(body)
                errors = [
                    e if c.get("method") == fault.method else a for c, e, a in zip(calls, errors, answered, strict=True)
                ]
            return web.json_response(errors if is_batch else errors[0])
        reply = await self._forward(body, fault.target if fault is not None and kind == "fork" else None)
        if kind == "wrong_id":
            items = reply if isinstance(reply, list) else [reply]
            items[-1]["id"] = (items[-1].get("id") or 0) + 1000
        elif kind == "duplicate_id" and isinstance(reply, list) and len(reply) > 1:
            reply[1]["id"] = reply[0]["id"]
        elif kind == "duplicate_id" and isinstance(reply, dict):
            reply = [reply, dict(reply)]
        elif kind == "partial" and isinstance(reply, list) and reply:
            reply = reply[:-1]
        elif kind == "both":  # a result and an error in one answer (JSON-RPC 2.0 allows one of them)
            for item in reply if isinstance(reply, list) else [reply]:
                item["error"] = {"code": 3, "message": "injected"}  # an execution error: not asked again
        elif kind == "crowded":
            for item in reply if isinstance(reply, list) else [reply]:
                item["result"] = [{}] * CROWD
        elif kind == "tags" and fault is not None and isinstance(reply, list):
            _trade_tags(calls, reply, fault.target or "finalized")
        elif kind == "final_latest" and isinstance(reply, list):
            _trade_tags(calls, reply, "safe", copy=True)
            _trade_tags(calls, reply, "finalized", copy=True)
        elif kind == "made_up" and fault is not None and isinstance(reply, list):
            _edit_latest(calls, reply, fault.target or "hash")
        elif kind == "droplog":  # a lying node: the last log of every eth_getLogs answer left out
            for item in reply if isinstance(reply, list) else [reply]:
                call = next((c for c in calls if c.get("id") == item.get("id")), {})
                if call.get("method") == "eth_getLogs" and isinstance(item.get("result"), list) and item["result"]:
                    item["result"] = item["result"][:-1]
        return web.json_response(reply)


def _trade_tags(calls: list[dict[str, Any]], reply: list[dict[str, Any]], tag: str, copy: bool = False) -> None:
    """The results of a batch's eth_getBlockByNumber("latest") and ("<tag>") swapped: a node (or a relay)
    whose answers are each a true block, but not of the tags asked; `copy`: the tag's is latest's."""
    by_tag = {
        c["params"][0]: c.get("id") for c in calls if c.get("method") == "eth_getBlockByNumber" and c.get("params")
    }
    items = {item.get("id"): item for item in reply}
    latest, other = items.get(by_tag.get("latest")), items.get(by_tag.get(tag))
    if latest is not None and other is not None and copy:
        other["result"] = latest.get("result")
    elif latest is not None and other is not None:
        latest["result"], other["result"] = other.get("result"), latest.get("result")


def _edit_latest(calls: list[dict[str, Any]], reply: list[dict[str, Any]], what: str) -> None:
    """A batch's eth_getBlockByNumber("latest") answered with a block no chain has: its hash its
    parent's ("hash"), or its number 1,000 higher, given for "safe" and "finalized" too ("number")."""
    tags = {
        c.get("id"): c["params"][0]
        for c in calls
        if c.get("method") == "eth_getBlockByNumber"
        and c.get("params")
        and c["params"][0] in ("latest", "safe", "finalized")
    }
    items = {item.get("id"): item for item in reply}
    latest = next((items[i] for i, tag in tags.items() if tag == "latest" and i in items), None)
    if latest is None or not isinstance(latest.get("result"), dict):
        return
    block = dict(latest["result"])
    if what == "timestamp":  # its hash kept: the fields no longer hash to it
        block["timestamp"] = hex(int(block["timestamp"], 16) + 1)
        latest["result"] = block
        return
    if what.startswith("hash"):
        block["hash"] = block["parentHash"]
        if what == "hash+field":  # a field no fork has: its fields cannot be hashed to check it
            block["l1BlockNumber"] = "0x1"
        latest["result"] = block
        return
    block["number"] = hex(int(block["number"], 16) + 1000)
    for i in tags:
        if i in items:
            items[i]["result"] = block


BOMBS = ("gzip", "chunked", "close", "declared")
BOMB_BYTES = 300 * 2**20  # what a size bomb would send, were it read whole
GZIP_INFLATED = 400 * 2**20  # what the gzip bomb inflates to
STREAM_CHUNK = 256 * 1024
Calls = list[dict[str, Any]]


@functools.cache
def gzip_bomb() -> bytes:
    """About 400 KB of gzip that inflates to 400 MB of a JSON-RPC answer (made once, in ~2 s)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = b"0" * 2**20
    parts = [packer.compress(b'{"jsonrpc":"2.0","id":1,"result":"0x')]
    parts += [packer.compress(zeros) for _ in range(GZIP_INFLATED // len(zeros))]
    parts += [packer.compress(b'"}'), packer.flush()]
    return b"".join(parts)


@dataclass
class Bomb:
    kind: str  # one of BOMBS
    match: Callable[[Calls, bool], bool]  # (the request's calls, is it a batch) -> bomb it?
    times: int = 1


@dataclass
class Request:
    calls: Calls
    is_batch: bool
    arrived: float
    bomb: str | None = None  # the bomb that answered it
    bomb_sent: int = 0  # bytes of it written before the proxy dropped the connection
    exploded: bool = False  # the bomb is written, or the proxy dropped it: bomb_sent is final

    def has(self, method: str, first_param: Any = None) -> bool:
        return any(
            c.get("method") == method and (first_param is None or (c.get("params") or [None])[0] == first_param)
            for c in self.calls
        )


@dataclass
class BombRelay:
    target: str
    bombs: list[Bomb] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    url: str = ""
    _server: asyncio.Server | None = None
    _session: aiohttp.ClientSession | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    def arm(self, kind: str, match: Callable[[Calls, bool], bool], times: int = 1) -> None:
        assert kind in BOMBS, kind
        self.bombs.append(Bomb(kind, match, times))

    def bombed(self) -> list[Request]:
        return [r for r in self.requests if r.bomb is not None]

    def asking(self, method: str, first_param: Any = None) -> list[Request]:
        """The requests that held a call of `method` (with that first parameter, if given)."""
        return [r for r in self.requests if r.has(method, first_param)]

    async def start(self) -> BombRelay:
        self._session = aiohttp.ClientSession()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/"
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in self._writers:
                writer.close()
            await self._server.wait_closed()
        if self._session is not None:
            await self._session.close()

    def _take(self, calls: Calls, is_batch: bool) -> str | None:
        for bomb in self.bombs:
            if bomb.match(calls, is_batch):
                bomb.times -= 1
                if bomb.times <= 0:
                    self.bombs.remove(bomb)
                return bomb.kind
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                payload = json.loads(body)
                is_batch = isinstance(payload, list)
                calls = [c for c in (payload if is_batch else [payload]) if isinstance(c, dict)]
                request = Request(calls, is_batch, time.monotonic())
                self.requests.append(request)
                request.bomb = self._take(calls, is_batch)
                if request.bomb is not None:
                    request.bomb_sent = await self._explode(writer, request.bomb)
                    request.exploded = True
                    break
                assert self._session is not None
                async with self._session.post(
                    self.target, data=body, headers={"Content-Type": "application/json"}
                ) as response:
                    reply = await response.read()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(reply), reply)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _explode(self, writer: asyncio.StreamWriter, kind: str) -> int:
        """Write bomb `kind` until it is all sent or the proxy drops the connection: the bytes sent."""
        json_head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        if kind == "gzip":
            packed = gzip_bomb()
            writer.write(json_head + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(packed))
            return await self._stream(
                writer, [packed[i : i + STREAM_CHUNK] for i in range(0, len(packed), STREAM_CHUNK)]
            )
        framing = {
            "chunked": b"Transfer-Encoding: chunked\r\n",
            "close": b"Connection: close\r\n",
            "declared": b"Content-Length: %d\r\n" % BOMB_BYTES,
        }[kind]
        writer.write(json_head + framing + b"\r\n")
        zeros = b"0" * STREAM_CHUNK
        piece = b"%x\r\n%s\r\n" % (len(zeros), zeros) if kind == "chunked" else zeros
        return await self._stream(writer, (piece for _ in range(BOMB_BYTES // STREAM_CHUNK)))

    @staticmethod
    async def _stream(writer: asyncio.StreamWriter, pieces: Any) -> int:
        sent = 0
        try:
            for piece in pieces:
                if writer.is_closing():
                    break
                writer.write(piece)
                await writer.drain()
                sent += len(piece)
        except (ConnectionError, OSError):
            pass
        return sent
