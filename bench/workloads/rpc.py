"""A JSON-RPC client that records what it asked, what came back and how long each HTTP request took."""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

CallSpec = tuple[str, list[Any]]


@dataclass
class Phase:
    """What one stretch of a workload sent: calls per method and the latency of each HTTP request."""

    name: str
    calls: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    errors: int = 0


@dataclass
class Pair:
    """One call answered by the proxy and by the node at the same moment (tests compare them)."""

    method: str
    params: list[Any]
    proxy: Any
    node: Any


def comparable(answer: dict[str, Any]) -> Any:
    """The part of an answer two servers must agree on: the result, or the error code."""
    if "error" in answer:
        return {"error": answer["error"].get("code")}
    return {"result": answer.get("result")}


class Client:
    """Sends calls to `url` (batches the way ethers v6 does), counting them into the current phase.

    With `mirror` set, every request is sent again to the mirror right after and both answers are kept
    in `pairs`: the workloads run unchanged and each answer is checked against the node's.
    """

    _ids = itertools.count(1)

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        phase: Phase,
        mirror: str | None = None,
        pairs: list[Pair] | None = None,
    ) -> None:
        self.session = session
        self.url = url
        self.phase = phase
        self.mirror = mirror
        self.pairs: list[Pair] = pairs if pairs is not None else []

    async def _post(self, url: str, body: Any) -> Any:
        async with self.session.post(url, data=json.dumps(body), headers={"Content-Type": "application/json"}) as resp:
            return json.loads(await resp.read())

    async def batch(self, calls: list[CallSpec]) -> list[dict[str, Any]]:
        """One HTTP request: a single call alone (as ethers sends a lone call), else a JSON-RPC batch."""
        body: Any = [{"jsonrpc": "2.0", "id": next(self._ids), "method": m, "params": p} for m, p in calls]
        if len(body) == 1:
            body = body[0]
        started = time.perf_counter()
        reply = await self._post(self.url, body)
        phase = self.phase  # the phase the request started in
        phase.latencies.append(time.perf_counter() - started)
        phase.calls.update(method for method, _ in calls)
        answers = self._in_order(body, reply)
        phase.errors += sum("error" in a for a in answers)
        if self.mirror is not None:
            node = self._in_order(body, await self._post(self.mirror, body))
            self.pairs.extend(
                Pair(m, p, comparable(a), comparable(b)) for (m, p), a, b in zip(calls, answers, node, strict=True)
            )
        return answers

    async def call(self, method: str, params: list[Any]) -> dict[str, Any]:
        return (await self.batch([(method, params)]))[0]

    async def result(self, method: str, params: list[Any]) -> Any:
        answer = await self.call(method, params)
        if "error" in answer:
            raise RuntimeError(f"{method} {params}: {answer['error']}")
        return answer["result"]

    @staticmethod
    def _in_order(body: Any, reply: Any) -> list[dict[str, Any]]:
        """Batch answers may come in any order (JSON-RPC 2.0): match them to the calls by id."""
        if isinstance(body, dict):
            return [reply if isinstance(reply, dict) else {"error": {"code": None, "message": str(reply)}}]
        if not isinstance(reply, list):  # a whole-batch error
            return [reply for _ in body]
        by_id = {item.get("id"): item for item in reply if isinstance(item, dict)}
        return [by_id.get(call["id"], {"error": {"code": None, "message": "no answer"}}) for call in body]


class Target:
    """Where a workload sends its calls, and the phases it went through.

    `on_phase(name)` runs at every phase boundary and once at the end (`finish`): the bench snapshots the
    relay's counters there, the tests the proxy's upstream counters. `settle(head)` returns once the
    server answers for block `head` (the lockstep dapp waits on it after each mined block).
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        *,
        mirror: str | None = None,
        on_phase: Callable[[str], Awaitable[None]] | None = None,
        settle: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.session = session
        self.url = url
        self.mirror = mirror
        self.on_phase = on_phase
        self.settle = settle
        self.phases: list[Phase] = []
        self.pairs: list[Pair] = []

    async def begin(self, name: str) -> Phase:
        if self.on_phase is not None:
            await self.on_phase(name)
        self.phases.append(Phase(name))
        return self.phases[-1]

    async def finish(self) -> None:
        if self.on_phase is not None:
            await self.on_phase("")

    def client(self, phase: Phase) -> Client:
        return Client(self.session, self.url, phase, self.mirror, self.pairs)
