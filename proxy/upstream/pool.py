"""Upstream pool: one aiohttp session per network, timeouts, failover across URLs.

aiohttp's exceptions are mapped to JsonRpcError here and nowhere else. Upstream URLs may carry
a provider's secret, so errors, logs and metric labels name an upstream by its index only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Protocol, runtime_checkable

import aiohttp

from proxy.logs import Throttled
from proxy.metrics import Metrics
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import UPSTREAM_UNAVAILABLE, JsonRpcError
from proxy.rpc.methods import POLICIES, CacheClass, metric_label
from proxy.upstream.state import UpstreamStates

log = logging.getLogger("proxy.upstream")
throttled = Throttled(log)  # a node that is down fails every call: one line per interval says so

# Reads the cache fills, cheap and side-effect free: the calls worth sharing an HTTP round trip.
# eth_getLogs goes alone (its own deadline), as does everything forwarded.
BATCHABLE = frozenset(
    name for name, policy in POLICIES.items() if policy.cache is not CacheClass.NONE and not policy.limits_logs
)


@dataclass(frozen=True, slots=True)
class Answer:
    """A node's JSON-RPC answer: `payload` is the encoded result, or the encoded error object."""

    payload: bytes
    result: Any = None
    error: dict[str, Any] | None = None
    seconds: float = 0.0
    upstream: int = -1  # the index of the upstream that produced it; -1: not known (a stored answer)
    # The hash the same node gave, in the same batch, for the proof block the call was asked with
    # ("" when it had no such block; None when no proof was asked): see proven().
    proof: str | None = None

    @property
    def is_error(self) -> bool:
        return self.error is not None

    @property
    def error_code(self) -> int | None:
        code = self.error.get("code") if self.error else None
        return code if isinstance(code, int) else None

    @classmethod
    def stored(cls, payload: bytes, is_error: bool) -> Answer:
        """An answer another replica fetched and stored: only its encoded bytes are at hand."""
        return cls(payload, None, {"stored": True} if is_error else None)

    @classmethod
    def from_response(cls, obj: dict[str, Any], seconds: float = 0.0, upstream: int = -1) -> Answer:
        if "error" in obj and obj["error"] is not None:
            error = obj["error"] if isinstance(obj["error"], dict) else {"code": -32603, "message": str(obj["error"])}
            return cls(jsonrpc.dumps(error), None, error, seconds, upstream)
        result = obj.get("result")
        return cls(jsonrpc.dumps(result), result, None, seconds, upstream)


class Upstream(Protocol):
    """A network's node(s) as one JSON-RPC endpoint."""

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer: ...

    async def batch(self, calls: Sequence[tuple[str, Any]]) -> list[Answer]: ...

    async def close(self) -> None: ...


@runtime_checkable
class PerUpstream(Protocol):
    """A pool whose upstreams can also be asked one at a time, with what is known of each."""

    states: UpstreamStates

    async def ask(self, index: int, method: str, params: Any, *, timeout: float) -> Answer: ...

    async def proven(self, method: str, params: Any, block: str, *, index: int | None = None,
                     timeout: float | None = None) -> Answer: ...


def proof_call(block: str) -> tuple[str, list[Any]]:
    """The header asked beside a call, in the same batch, to show which chain the answering node is on."""
    return ("eth_getBlockByNumber", [block, False])


def proof_hash(header: Answer) -> str | None:
    """The hash in a proof header's answer; "" when the node has no such block, None when it failed."""
    if header.is_error:
        return None
    block = header.result
    value = block.get("hash") if isinstance(block, dict) else None
    return value.lower() if isinstance(value, str) else ""


Check = Callable[[Any], str | None]  # why a reply does not answer its request, or None


def _is_response(reply: Any) -> bool:
    return isinstance(reply, dict) and ("result" in reply or "error" in reply)


def single_problem(reply: Any, sent: int) -> str | None:
    """Why a reply does not answer the single call with id `sent`, or None when it does."""
    if not _is_response(reply):
        return "malformed reply"
    if reply.get("id") != sent or isinstance(reply.get("id"), bool):
        return "reply id differs from the request id"
    return None


def batch_problem(reply: Any, ids: range) -> str | None:
    """Why a batch reply does not answer the batch `ids` (each id exactly once, nothing else), or None.

    A single error object instead of a list is a node refusing batches: not a fault here.
    """
    if isinstance(reply, dict):
        return None if "error" in reply else "malformed batch reply"
    if not isinstance(reply, list) or not all(_is_response(item) for item in reply):
        return "malformed batch reply"
    seen = [item.get("id") for item in reply]
    if len(seen) != len(ids) or set(seen) != set(ids) or any(isinstance(i, bool) for i in seen):
        return "batch reply ids differ from the request ids"
    return None


# Failures after a node took the call: it may have run it (charging.py charges such calls).
REACHED_KINDS = frozenset({"timeout", "invalid", "mismatch"})


class _Failed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


_Queued = tuple[str, Any, "asyncio.Future[Answer]", str | None]  # method, params, waiter, proof block


class HttpUpstream:
    """Tries each URL in order (primary first); a URL that fails is skipped for `cooldown` seconds."""

    def __init__(
        self,
        network: str,
        urls: Sequence[str],
        *,
        timeout: float,
        metrics: Metrics,
        cooldown: float = 5.0,
        session: aiohttp.ClientSession | None = None,
        batch_max: int = 1,
        batch_max_bytes: int = 1024 * 1024,
        attempt_timeout: float | None = None,
    ) -> None:
        self.network = network
        self._urls = tuple(urls)
        self._timeout = timeout
        self._attempt_timeout = attempt_timeout
        self.states = UpstreamStates(len(self._urls))
        self._metrics = metrics
        self._cooldown = cooldown
        self._down_until = [0.0] * len(self._urls)
        self._inflight = [0] * len(self._urls)  # calls being posted, per upstream
        self._session = session
        self._next_id = 0
        self._batch_max = batch_max
        self._batch_max_bytes = batch_max_bytes
        self._queue: list[_Queued] = []
        self._flush_scheduled = False
        self._deliveries: set[asyncio.Task[None]] = set()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Connection loss is identity loss: a new connection (a silent keep-alive reconnect
            # included) may reach a restarted node, so its identity is checked again (state.py).
            traces = aiohttp.TraceConfig()
            traces.on_connection_create_end.append(self._connected)
            self._session = aiohttp.ClientSession(
                trace_configs=[traces],
                connector=aiohttp.TCPConnector(limit=256, limit_per_host=128, keepalive_timeout=30),
                headers={"Content-Type": "application/json"},
                # The proxy's own request timeouts apply; no environment proxies for node traffic.
                trust_env=False,
            )
        return self._session

    async def _connected(self, _session: aiohttp.ClientSession, context: SimpleNamespace, _params: object) -> None:
        index = context.trace_request_ctx.get("index") if isinstance(context.trace_request_ctx, dict) else None
        if isinstance(index, int) and self._inflight[index] <= 1:
            # Nothing else was in flight to it, so the pool held an idle connection unless it was
            # closed: this is a reconnect, not the pool growing under load.
            self.states.reconnected(index)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _order(self) -> list[int]:
        """Healthy upstreams first, then those cooling down; never one that serves another chain."""
        now = time.monotonic()
        serving = [i for i in range(len(self._urls)) if self.states.in_rotation(i)]
        healthy = [i for i in serving if self._down_until[i] <= now]
        cooling = sorted((i for i in serving if self._down_until[i] > now), key=lambda i: self._down_until[i])
        return healthy + cooling

    async def _post(self, index: int, body: bytes, timeout: float) -> Any:
        self._inflight[index] += 1
        try:
            return await self._post_counted(index, body, timeout)
        finally:
            self._inflight[index] -= 1

    async def _post_counted(self, index: int, body: bytes, timeout: float) -> Any:
        try:
            async with self._client().post(
                self._urls[index], data=body, timeout=aiohttp.ClientTimeout(total=timeout),
                trace_request_ctx={"index": index},
            ) as response:
                if response.status != 200:
                    raise _Failed("http", f"HTTP {response.status}")
                raw = await response.read()
        except TimeoutError:
            raise _Failed("timeout", "timed out") from None
        except aiohttp.ClientError as exc:
            raise _Failed("connect", type(exc).__name__) from None
        try:
            return jsonrpc.loads(raw)
        except jsonrpc.JSONDecodeError:
            raise _Failed("invalid", "reply is not JSON") from None

    async def _send(
        self, body: bytes, method_label: str | None, timeout: float | None, check: Check,
    ) -> tuple[Any, float, int]:
        """Post to the first upstream whose reply passes `check`; observe its latency under `method_label`."""
        budget = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        failures: list[str] = []
        last_kind = "connect"
        reached = False  # some node got the call before failing: it may have done the work
        order = self._order()
        for attempt, index in enumerate(order):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if attempt:
                self._metrics.upstream_failovers.labels(self.network).inc()
            started = time.perf_counter()
            try:
                reply = await self._post(index, body, self._attempt_budget(remaining, len(order) - attempt))
                problem = check(reply)
                if problem is not None:
                    # A reply that does not answer what was asked is a fault of that node.
                    raise _Failed("mismatch", problem)
            except _Failed as failure:
                if failure.kind == "connect":
                    self.states.lost(index)
                self._down_until[index] = time.monotonic() + self._cooldown
                self._metrics.upstream_errors.labels(self.network, str(index), failure.kind).inc()
                throttled.warning(f"{self.network}#{index}", "upstream %s#%d failed: %s", self.network, index,
                                  failure.detail)
                failures.append(f"upstream #{index}: {failure.detail}")
                last_kind = failure.kind
                reached = reached or failure.kind in REACHED_KINDS
                continue
            seconds = time.perf_counter() - started
            self._down_until[index] = 0.0
            if method_label is not None:
                self._metrics.child(self._metrics.upstream_seconds, self.network, method_label, str(index)
                                    ).observe(seconds)
            return reply, seconds, index
        if last_kind == "timeout":
            raise JsonRpcError(
                UPSTREAM_UNAVAILABLE, f"upstream timeout: network '{self.network}' did not answer in {budget:g}s",
                http_status=504, reached=reached,
            )
        raise JsonRpcError(
            UPSTREAM_UNAVAILABLE,
            f"upstream unavailable: network '{self.network}' "
            f"({'; '.join(failures) or 'no upstream serves the network chain'})",
            http_status=502, reached=reached,
        )

    def _attempt_budget(self, remaining: float, upstreams_left: int) -> float:
        """One attempt's share of the call's budget: a slow primary still leaves time for the backup."""
        if self._attempt_timeout is not None:
            return min(remaining, self._attempt_timeout)
        return remaining / upstreams_left

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer:
        if self._batch_max > 1 and timeout is None and method in BATCHABLE:
            return await self._enqueue(method, params)
        return await self._single(method, params, timeout)

    async def _single(self, method: str, params: Any, timeout: float | None) -> Answer:
        self._next_id += 1
        sent = self._next_id
        body = jsonrpc.dumps({"jsonrpc": "2.0", "id": sent, "method": method, "params": params})
        reply, seconds, index = await self._send(body, metric_label(method), timeout,
                                                 lambda r: single_problem(r, sent))
        return Answer.from_response(reply, seconds, index)

    async def ask(self, index: int, method: str, params: Any, *, timeout: float) -> Answer:
        """One call to upstream `index` alone, whatever its rotation state (identity probes, retries)."""
        self._next_id += 1
        sent = self._next_id
        body = jsonrpc.dumps({"jsonrpc": "2.0", "id": sent, "method": method, "params": params})
        started = time.perf_counter()
        try:
            reply = await self._post(index, body, timeout)
            problem = single_problem(reply, sent)
            if problem is not None:
                raise _Failed("mismatch", problem)
        except _Failed as failure:
            if failure.kind == "connect":
                self.states.lost(index)
            self._metrics.upstream_errors.labels(self.network, str(index), failure.kind).inc()
            raise JsonRpcError(UPSTREAM_UNAVAILABLE, f"upstream unavailable: network '{self.network}' "
                               f"(upstream #{index}: {failure.detail})", http_status=502) from None
        return Answer.from_response(reply, time.perf_counter() - started, index)

    # --- auto-batching -------------------------------------------------------------------
    # Cacheable reads that arrive in the same event-loop turn travel as one JSON-RPC batch: one
    # HTTP round trip instead of many. A lone call is sent alone, a turn later.

    async def _enqueue(self, method: str, params: Any, proof: str | None = None) -> Answer:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Answer] = loop.create_future()
        self._queue.append((method, params, waiter, proof))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await waiter

    def _flush(self) -> None:
        """Groups of at most `batch_max` calls and `batch_max_bytes` of params: one client's large
        call travels alone, never in a batch a node might refuse for its size."""
        self._flush_scheduled = False
        queue, self._queue = self._queue, []
        group: list[_Queued] = []
        size = 0
        for call in queue:
            cost = len(jsonrpc.dumps(call[1])) + len(call[0]) + 64  # params, method, envelope
            if group and (len(group) >= self._batch_max or size + cost > self._batch_max_bytes):
                self._start(group)
                group, size = [], 0
            group.append(call)
            size += cost
        if group:
            self._start(group)

    def _start(self, group: list[_Queued]) -> None:
        task = asyncio.create_task(self._deliver(group))
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

    async def _deliver(self, group: list[_Queued]) -> None:
        # Every waiter is answered whatever happens here, so no caller is left waiting forever.
        failure: Exception = JsonRpcError(
            UPSTREAM_UNAVAILABLE, f"upstream unavailable: network '{self.network}' (call abandoned)", http_status=502
        )
        try:
            if len(group) == 1:  # alone: a failure is its own, not the batch's
                method, params, _, block = group[0]
                answers = [await self._proven_alone(method, params, block)]
            else:
                try:
                    answers = await self._with_proofs([(m, p, b) for m, p, _, b in group])
                except JsonRpcError as error:
                    if error.http_status == 504:  # timed out: asking again, one by one, would only wait longer
                        raise
                    # The batch failed as a whole (a 413 for its size, a 5xx): each call is asked
                    # alone, so only a call that fails by itself fails.
                    await self._resend_singly(group)
                    return
            for (_, _, waiter, _), answer in zip(group, answers, strict=True):
                if not waiter.done():
                    waiter.set_result(answer)
        except Exception as error:  # the upstream's JsonRpcError, or a fault of ours: each caller hears it
            failure = error
        finally:
            for _, _, waiter, _ in group:
                if not waiter.done():
                    waiter.set_exception(failure)

    async def _resend_singly(self, group: list[_Queued]) -> None:
        # Alone means alone: a node that fails a call inside batches answers it, unproven (proof None).
        results = await asyncio.gather(*(self._single(m, p, None) for m, p, _, _ in group), return_exceptions=True)
        for (_, _, waiter, _), result in zip(group, results, strict=True):
            if waiter.done():
                continue
            if isinstance(result, BaseException):
                waiter.set_exception(result)
            else:
                waiter.set_result(result)

    async def _proven_alone(self, method: str, params: Any, block: str | None) -> Answer:
        if block is None:
            return await self._single(method, params, None)
        [answer] = await self._with_proofs([(method, params, block)])
        return answer

    async def _with_proofs(
        self, calls: Sequence[tuple[str, Any, str | None]], *, index: int | None = None,
        timeout: float | None = None,
    ) -> list[Answer]:
        """The calls and one header per distinct proof block in one batch, so one node answers all; each
        answer carries the hash that node gave for its proof block."""
        blocks = list(dict.fromkeys(b for _, _, b in calls if b is not None))
        sent = [(m, p) for m, p, _ in calls] + [proof_call(b) for b in blocks]
        if index is None:
            answers = await self._batch(sent, auto=True, timeout=timeout)  # observed per method, header too
        else:
            answers = await self._batch_to(index, sent, timeout or self._timeout)
        hashes = {b: proof_hash(a) for b, a in zip(blocks, answers[len(calls):], strict=True)}
        return [replace(a, proof=hashes[b]) if b is not None else a
                for (_, _, b), a in zip(calls, answers[:len(calls)], strict=True)]

    async def proven(self, method: str, params: Any, block: str, *, index: int | None = None,
                     timeout: float | None = None) -> Answer:
        """A call and the header of `block` (a number or "latest") in one batch to one node: its answer,
        with `proof` the hash that node has for `block`. Auto-batched with other reads when it can be."""
        if index is None and timeout is None and self._batch_max > 1 and method in BATCHABLE:
            return await self._enqueue(method, params, block)
        [answer] = await self._with_proofs([(method, params, block)], index=index, timeout=timeout)
        return answer

    async def _batch_to(self, index: int, calls: Sequence[tuple[str, Any]], timeout: float) -> list[Answer]:
        """One batch to upstream `index` alone (a retry elsewhere must still be one node's answers)."""
        base = self._next_id + 1
        self._next_id += len(calls)
        body = jsonrpc.dumps([
            {"jsonrpc": "2.0", "id": base + i, "method": m, "params": prm} for i, (m, prm) in enumerate(calls)
        ])
        ids = range(base, base + len(calls))
        started = time.perf_counter()
        try:
            reply = await self._post(index, body, timeout)
            problem = batch_problem(reply, ids)
            if problem is not None or not isinstance(reply, list):
                raise _Failed("mismatch", problem or "batch refused")
        except _Failed as failure:
            self._metrics.upstream_errors.labels(self.network, str(index), failure.kind).inc()
            raise JsonRpcError(UPSTREAM_UNAVAILABLE, f"upstream unavailable: network '{self.network}' "
                               f"(upstream #{index}: {failure.detail})", http_status=502) from None
        by_id = {item["id"]: item for item in reply}
        seconds = time.perf_counter() - started
        return [Answer.from_response(by_id[i], seconds, index) for i in ids]

    async def batch(self, calls: Sequence[tuple[str, Any]]) -> list[Answer]:
        return await self._batch(calls)

    async def _batch(
        self, calls: Sequence[tuple[str, Any]], *, auto: bool = False, timeout: float | None = None,
    ) -> list[Answer]:
        """One JSON-RPC batch. `auto`: an auto-batch of callers' reads, observed per call and split
        into single calls for a node that refuses batches; otherwise the tracker's own batch."""
        base = self._next_id + 1
        self._next_id += len(calls)
        body = jsonrpc.dumps([
            {"jsonrpc": "2.0", "id": base + i, "method": m, "params": prm} for i, (m, prm) in enumerate(calls)
        ])
        ids = range(base, base + len(calls))
        reply, seconds, index = await self._send(body, None if auto else "batch", timeout,
                                                 lambda r: batch_problem(r, ids))
        if not isinstance(reply, list):
            # A node that does not take batches answers with one error object: ask one by one.
            return list(await asyncio.gather(*(self._single(m, p, None) for m, p in calls)))
        by_id = {item["id"]: item for item in reply}
        answers = [Answer.from_response(by_id[i], seconds, index) for i in ids]
        if auto:  # each call's latency is its batch's, under its own method
            for method, _ in calls:
                self._metrics.child(self._metrics.upstream_seconds, self.network, metric_label(method), str(index)
                                    ).observe(seconds)
        return answers
