"""A fault-injecting HTTP relay in front of a real node: wrong ids, duplicate ids, partial batches,
HTTP 500/413/429, slow answers, injected errors. Faults are queued and each applies to the next
requests that match it (by method, by batch or not), then runs out; `times=None` never runs out.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support import free_port

KINDS = (
    "http500",
    "http413",
    "http429",
    "slow",
    "wrong_id",
    "duplicate_id",
    "partial",
    "error3",
    "error",
    "ratelimit",
    "droplog",
)


@dataclass
class Fault:
    kind: str
    method: str | None = None  # only requests holding a call of this method; None: any
    batches_only: bool = False
    times: int | None = 1  # None: forever
    delay: float = 0.0
    retry_after: str | None = None  # an HTTP fault's Retry-After header

    def matches(self, calls: list[dict[str, Any]], is_batch: bool) -> bool:
        if self.batches_only and not is_batch:
            return False
        return self.method is None or any(c.get("method") == self.method for c in calls)


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
        self._server = TestServer(app, host="127.0.0.1", port=free_port())
        await self._server.start_server()
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

    async def _forward(self, body: bytes) -> Any:
        assert self._session is not None
        async with self._session.post(self.target, data=body, headers={"Content-Type": "application/json"}) as resp:
            return json.loads(await resp.read())

    async def _handle(self, request: web.Request) -> web.Response:
        arrived = time.monotonic()
        self.arrivals.append(arrived)
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
        if kind in ("http500", "http413", "http429"):
            headers = {"Retry-After": fault.retry_after} if fault is not None and fault.retry_after else None
            return web.Response(status=int(kind[4:]), text="injected", headers=headers)
        if kind in ("error3", "error", "ratelimit"):
            code = {"error3": 3, "error": -32000, "ratelimit": -32005}[kind]
            message = "project ID request rate exceeded" if kind == "ratelimit" else "injected"  # Infura's words
            errors = [{"jsonrpc": "2.0", "id": c.get("id"), "error": {"code": code, "message": message}} for c in calls]
            if kind == "error3" and is_batch and fault is not None and fault.method is not None:
                # An execution error is the call's own: the batch's other calls are answered.
                answered = await self._forward(body)
                errors = [
                    e if c.get("method") == fault.method else a for c, e, a in zip(calls, errors, answered, strict=True)
                ]
            return web.json_response(errors if is_batch else errors[0])
        reply = await self._forward(body)
        if kind == "wrong_id":
            items = reply if isinstance(reply, list) else [reply]
            items[-1]["id"] = (items[-1].get("id") or 0) + 1000
        elif kind == "duplicate_id" and isinstance(reply, list) and len(reply) > 1:
            reply[1]["id"] = reply[0]["id"]
        elif kind == "duplicate_id" and isinstance(reply, dict):
            reply = [reply, dict(reply)]
        elif kind == "partial" and isinstance(reply, list) and reply:
            reply = reply[:-1]
        elif kind == "droplog":  # a lying node: the last log of every eth_getLogs answer left out
            for item in reply if isinstance(reply, list) else [reply]:
                call = next((c for c in calls if c.get("id") == item.get("id")), {})
                if call.get("method") == "eth_getLogs" and isinstance(item.get("result"), list) and item["result"]:
                    item["result"] = item["result"][:-1]
        return web.json_response(reply)
