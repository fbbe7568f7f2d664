"""Upstream pool: one aiohttp session per network, timeouts, failover across URLs.

aiohttp's exceptions are mapped to JsonRpcError here and nowhere else. Upstream URLs may carry
a provider's secret, so errors, logs and metric labels name an upstream by its index only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from email.utils import parsedate_to_datetime
from types import SimpleNamespace
from typing import Any, Protocol, runtime_checkable

import aiohttp

from proxy.config_files import Network
from proxy.logs import Throttled
from proxy.metrics import Metrics
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import EXECUTION_REVERTED, LIMIT_EXCEEDED, UPSTREAM_UNAVAILABLE, JsonRpcError
from proxy.rpc.methods import POLICIES, CacheClass, metric_label
from proxy.upstream.answer import Answer as Answer  # importers of the pool's Answer predate answer.py
from proxy.upstream.batching import AutoBatcher
from proxy.upstream.budget import Budget, Slot
from proxy.upstream.selection import Selector
from proxy.upstream.state import UpstreamStates

log = logging.getLogger("proxy.upstream")
throttled = Throttled(log)  # a node that is down fails every call: one line per interval says so

# Reads the cache fills, cheap and side-effect free: the calls worth sharing an HTTP round trip.
# eth_getLogs goes alone (its own deadline), as does everything forwarded.
BATCHABLE = frozenset(
    name for name, policy in POLICIES.items() if policy.cache is not CacheClass.NONE and not policy.limits_logs
)
# Reads worth hedging (sent to a second upstream when the first is slow): every cacheable read.
HEDGEABLE = frozenset(name for name, policy in POLICIES.items() if policy.cache is not CacheClass.NONE)
# Writes go to exactly one upstream: another is tried only when the first provably never got the
# call (its connection was refused), so a transaction is never sent twice.
WRITES = frozenset({"eth_sendRawTransaction", "eth_sendTransaction", "eth_sendRawTransactionConditional",
                    "sendTransaction"})
RETRY_AFTER_MAX = 300.0  # seconds: the longest Retry-After honoured (a provider's bad header cannot park it)
# Phrases of providers' rate-limit errors (Infura, Alchemy, QuickNode...) in an HTTP 200 reply.
RATE_LIMIT_PHRASES = ("rate limit", "request rate", "too many requests", "compute units per second",
                      "request limit reached", "rate exceeded")


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
    """Why a reply does not answer the single call with id `sent`, or None when it does.

    An error object with `id: null` is the node saying it could not read the call (JSON-RPC 2.0
    section 5: the id is null when it could not be determined): its answer to this request, about
    the request, not a fault of the node."""
    if not _is_response(reply):
        return "malformed reply"
    if reply.get("id") is None and reply.get("error") is not None:
        return None
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
# HTTP statuses that say the request itself is at fault (malformed, too large): the next upstream
# may still take it, but none is cooled down for everyone else because of one caller's request.
REQUEST_FAULT_STATUSES = frozenset({400, 413, 414, 431})


def rate_limited(reply: Any) -> str | None:
    """A reply that is a provider's rate-limit error rather than an answer, or None; a batch is when
    any of its answers is (it is asked again as a whole elsewhere)."""
    if isinstance(reply, list):
        return next((limited for item in reply if (limited := rate_limited(item)) is not None), None)
    error = reply.get("error") if isinstance(reply, dict) else None
    if not isinstance(error, dict) or error.get("code") == EXECUTION_REVERTED:
        return None  # a contract's revert reason is the contract's to word
    message = str(error.get("message", "")).lower()
    if message.startswith("execution reverted"):
        return None
    if error.get("code") == 429 or any(phrase in message for phrase in RATE_LIMIT_PHRASES):
        return "rate-limit error"
    return None


def retry_after(value: str | None) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP date (RFC 9110 10.2.3)."""
    if not value:
        return None
    try:
        return max(0.0, min(float(value), RETRY_AFTER_MAX))
    except ValueError:
        pass
    try:
        return max(0.0, min(parsedate_to_datetime(value).timestamp() - time.time(), RETRY_AFTER_MAX))
    except (TypeError, ValueError, OverflowError):
        return None


class _Failed(Exception):
    def __init__(self, kind: str, detail: str, *, unsent: bool = False, wait: float | None = None) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.unsent = unsent  # the connection was refused: the node never got the call
        self.wait = wait  # Retry-After of a rate limit


@dataclass(slots=True)
class _Attempts:
    """One call's tries across upstreams: what failed, and whether any node got the call."""

    failures: list[str] = field(default_factory=list)
    last_kind: str = "connect"
    reached: bool = False  # some node got the call before failing: it may have done the work


@dataclass(frozen=True, slots=True)
class Routing:
    """How a network's upstreams are chosen (NETWORKS_FILE): policy and weights, budgets, hedging."""

    selector: Selector | None = None
    budgets: tuple[Budget, ...] = ()
    hedge_after: float | None = None


def http_pool(upstream: object) -> HttpUpstream | None:
    """The HttpUpstream inside an upstream's wrappers (the per-key budget's, a test's counter), if any."""
    while not isinstance(upstream, HttpUpstream) and hasattr(upstream, "inner"):
        upstream = upstream.inner
    return upstream if isinstance(upstream, HttpUpstream) else None


def routing_of(network: Network, workers: int) -> Routing:
    """A network's NETWORKS_FILE selection, weights, budgets (each worker's share) and hedging."""
    options = [network.options_of(i) for i in range(len(network.upstreams))]
    return Routing(
        Selector(network.selection, [o.weight for o in options]),
        tuple(Budget(o.max_rps, o.max_concurrency, share=workers) for o in options),
        network.hedge_after,
    )




class HttpUpstream:
    """Asks the network's upstreams in the selection policy's order (priority: primary first); one
    that fails is skipped for `cooldown` seconds (a rate limit's Retry-After when it gives one)."""

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
        max_reply_bytes: int | None = None,
        routing: Routing = Routing(),
    ) -> None:
        self.network = network
        # A reply declared larger than this is not read: no client may be sent it (MAX_RESPONSE_BYTES).
        self._max_reply = max_reply_bytes
        self._urls = tuple(urls)
        self._timeout = timeout
        self._attempt_timeout = attempt_timeout
        self.states = UpstreamStates(len(self._urls))
        self._metrics = metrics
        self._cooldown = cooldown
        self._down_until = [0.0] * len(self._urls)
        self._unreachable = [False] * len(self._urls)  # its last attempt could not reach it (INFO when back)
        self._inflight = [0] * len(self._urls)  # calls being posted, per upstream
        self._session = session
        self._next_id = 0
        self._batch_max = batch_max
        self.reroute(routing)
        self._batcher = AutoBatcher(network, self._single, self._proven_alone, self._with_proofs,
                                    batch_max=batch_max, batch_max_bytes=batch_max_bytes)
        for index in range(len(self._urls)):
            metrics.upstream_head_lag.labels(network, str(index)).set_function(
                lambda i=index: float(self._head_lag(i)))  # type: ignore[misc]

    @property
    def urls(self) -> tuple[str, ...]:
        return self._urls

    def reroute(self, routing: Routing) -> None:
        """The selection policy, budgets and hedging to use from the next call on (start-up, a reload)."""
        self.selector = routing.selector or Selector("priority", [1.0] * len(self._urls))
        self.budgets = routing.budgets or tuple(Budget(None, None) for _ in self._urls)
        self._hedge_after = routing.hedge_after

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

    def _head_lag(self, index: int) -> int:
        latest = self.states.latest
        best = max(latest, default=-1)
        return best - latest[index] if latest[index] >= 0 else 0

    def _order(self) -> list[int]:
        """Healthy upstreams in the selection policy's order, then those cooling down; never one that
        serves another chain or is cordoned."""
        now = time.monotonic()
        serving = [i for i in range(len(self._urls)) if self.states.in_rotation(i)]
        healthy = self.selector.order([i for i in serving if self._down_until[i] <= now], self.states.latest, now)
        cooling = sorted((i for i in serving if self._down_until[i] > now), key=lambda i: self._down_until[i])
        return healthy + cooling

    async def _post(self, index: int, body: bytes, timeout: float, max_reply: int | None = None) -> Any:
        self._inflight[index] += 1
        try:
            return await self._post_counted(index, body, timeout, max_reply)
        finally:
            self._inflight[index] -= 1

    async def _post_counted(self, index: int, body: bytes, timeout: float, max_reply: int | None = None) -> Any:
        try:
            async with self._client().post(
                self._urls[index], data=body, timeout=aiohttp.ClientTimeout(total=timeout),
                trace_request_ctx={"index": index},
            ) as response:
                if response.status in REQUEST_FAULT_STATUSES:
                    raise _Failed("refused", f"HTTP {response.status}")
                if response.status == 429:
                    raise _Failed("rate_limited", "HTTP 429", wait=retry_after(response.headers.get("Retry-After")))
                if response.status != 200:
                    raise _Failed("http", f"HTTP {response.status}")
                size = response.content_length
                if max_reply is not None and size is not None and size > max_reply:
                    raise _Failed("too_large", f"a reply of {size} bytes")
                raw = await response.read()
        except TimeoutError:
            raise _Failed("timeout", "timed out") from None
        except aiohttp.ClientError as exc:
            self._unreachable[index] = True
            # A refused connection proves the node never got the call (a write may go elsewhere).
            raise _Failed("connect", type(exc).__name__,
                          unsent=isinstance(exc, aiohttp.ClientConnectorError)) from None
        if self._unreachable[index]:
            self._unreachable[index] = False
            log.info("upstream %s#%d is reachable again", self.network, index)  # by index: a URL may hold a key
        try:
            return jsonrpc.loads(raw)
        except jsonrpc.JSONDecodeError:
            raise _Failed("invalid", "reply is not JSON") from None

    def _failed(self, index: int, failure: _Failed, attempts: _Attempts) -> None:
        """Note a failed try: that upstream cools down (for a rate limit's Retry-After, if given),
        unless the request itself was at fault (too large or malformed for any node)."""
        if failure.kind == "too_large":
            return  # the call fails as a whole (_send): no node is at fault
        if failure.kind == "connect":
            self.states.lost(index)
        if failure.kind != "refused":  # a request too large or malformed cools no upstream down
            wait = failure.wait if failure.wait is not None else self._cooldown
            self._down_until[index] = time.monotonic() + wait
            self.selector.scores.observe(index, None, time.monotonic())
        if failure.kind == "rate_limited":
            self._metrics.upstream_rate_limited.labels(self.network, str(index)).inc()
        self._metrics.upstream_errors.labels(self.network, str(index), failure.kind).inc()
        throttled.warning(f"{self.network}#{index}", "upstream %s#%d failed: %s", self.network, index, failure.detail)
        attempts.failures.append(f"upstream #{index}: {failure.detail}")
        attempts.last_kind = failure.kind
        attempts.reached = attempts.reached or failure.kind in REACHED_KINDS

    async def _try(
        self, index: int, slot: Slot, body: bytes, timeout: float, check: Check, attempts: _Attempts,
        max_reply: int | None = None,
    ) -> tuple[Any, float]:
        """One upstream's try in the budget `slot` taken for it: the reply and its latency, or _Failed (noted)."""
        self._metrics.upstream_selected.labels(self.network, str(index)).inc()
        started = time.perf_counter()
        try:
            reply = await self._post(index, body, timeout, max_reply)
            problem = check(reply)
            if problem is not None:
                # A reply that does not answer what was asked is a fault of that node.
                raise _Failed("mismatch", problem)
            limited = rate_limited(reply)
            if limited is not None:
                raise _Failed("rate_limited", limited)
        except _Failed as failure:
            self._failed(index, failure, attempts)
            raise
        finally:
            slot.budget.release(slot)
        seconds = time.perf_counter() - started
        self._down_until[index] = 0.0
        self.selector.scores.observe(index, seconds, time.monotonic())
        return reply, seconds

    async def _next(self, pending: list[int], deadline: float) -> tuple[int, Slot] | None:
        """The first upstream in `pending` with budget now, and its slot; else wait for the first
        one's budget within the deadline. Removed from `pending`; None if no budget came in time."""
        for index in pending:
            slot = self.budgets[index].try_take()
            if slot is not None:
                pending.remove(index)
                return index, slot
        index = pending.pop(0)
        self._metrics.upstream_budget_waits.labels(self.network, str(index)).inc()
        loop = asyncio.get_running_loop()
        waited = await self.budgets[index].take(loop.time() + deadline - time.monotonic())
        return (index, waited) if waited is not None else None

    async def _hedged(
        self, first: int, slot: Slot, pending: list[int], body: bytes, timeout: float, check: Check,
        attempts: _Attempts, max_reply: int | None = None,
    ) -> tuple[Any, float, int] | None:
        """Ask `first`; without an answer after hedge_after, also the next upstream that has budget at
        once. The first valid answer wins and the other is cancelled; None if every one asked failed."""
        tasks = {asyncio.create_task(self._try(first, slot, body, timeout, check, attempts, max_reply)): first}
        hedged = False
        try:
            while tasks:
                wait = self._hedge_after if not hedged and pending else None
                done, _ = await asyncio.wait(tasks, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    hedged = True
                    second = next(((i, s) for i in pending if (s := self.budgets[i].try_take()) is not None), None)
                    if second is not None:
                        pending.remove(second[0])
                        self._metrics.upstream_hedged.labels(self.network).inc()
                        tried = self._try(second[0], second[1], body, timeout, check, attempts, max_reply)
                        tasks[asyncio.create_task(tried)] = second[0]
                    continue
                won = None
                for task in done:  # every finished try is looked at, so no failure goes unretrieved
                    index = tasks.pop(task)
                    failure = task.exception()
                    if isinstance(failure, _Failed) and failure.kind == "too_large":
                        raise failure  # the call's own answer is too large, whoever gives it
                    if failure is None and won is None:
                        won = (*task.result(), index)
                if won is not None:
                    if hedged:
                        self._metrics.upstream_hedge_wins.labels(self.network, str(won[2])).inc()
                    return won
            return None
        finally:
            for task in tasks:
                task.cancel()

    async def _send(
        self, body: bytes, method_label: str | None, timeout: float | None, check: Check,
        max_reply: int | None = None, *, hedge: bool = False, write: bool = False,
    ) -> tuple[Any, float, int]:
        """Post to upstreams in order until a reply passes `check`; observe its latency under
        `method_label`. `hedge`: a slow read is also sent to the next upstream. `write`: another
        upstream is tried only when the first provably never got the call."""
        budget = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        attempts = _Attempts()
        pending = self._order()
        tried = 0
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            chosen = await self._next(pending, deadline)
            if chosen is None:
                attempts.failures.append("no upstream had budget (max_rps, max_concurrency) in time")
                attempts.last_kind = "timeout"
                break
            index, slot = chosen
            if tried:
                self._metrics.upstream_failovers.labels(self.network).inc()
            tried += 1
            share = self._attempt_budget(deadline - time.monotonic(), len(pending) + 1)
            try:
                if hedge and self._hedge_after is not None and pending:
                    won = await self._hedged(index, slot, pending, body, share, check, attempts, max_reply)
                    if won is None:
                        continue
                    reply, seconds, index = won
                else:
                    reply, seconds = await self._try(index, slot, body, share, check, attempts, max_reply)
            except _Failed as failure:
                if failure.kind == "too_large":
                    # The answer the caller asked for is too large to send: every node would give it.
                    raise JsonRpcError(LIMIT_EXCEEDED, f"response size exceeded: the node's answer ({failure.detail})"
                                       f" would pass MAX_RESPONSE_BYTES ({self._max_reply} bytes); ask for less",
                                       reached=True) from None
                if write and not failure.unsent:
                    break  # the node may have taken the transaction: never send it to another
                continue
            if method_label is not None:
                self._metrics.child(self._metrics.upstream_seconds, self.network, method_label, str(index)
                                    ).observe(seconds)
            return reply, seconds, index
        if attempts.last_kind == "timeout":
            raise JsonRpcError(
                UPSTREAM_UNAVAILABLE, f"upstream timeout: network '{self.network}' did not answer in {budget:g}s",
                http_status=504, reached=attempts.reached,
            )
        raise JsonRpcError(
            UPSTREAM_UNAVAILABLE,
            f"upstream unavailable: network '{self.network}' "
            f"({'; '.join(attempts.failures) or 'no upstream serves the network chain'})",
            http_status=502, reached=attempts.reached,
        )

    def _attempt_budget(self, remaining: float, upstreams_left: int) -> float:
        """One attempt's share of the call's budget: a slow primary still leaves time for the backup."""
        if self._attempt_timeout is not None:
            return min(remaining, self._attempt_timeout)
        return max(remaining, 0.001) / upstreams_left

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer:
        if self._batch_max > 1 and timeout is None and method in BATCHABLE:
            return await self._batcher.enqueue(method, params)
        return await self._single(method, params, timeout)

    async def _single(self, method: str, params: Any, timeout: float | None) -> Answer:
        self._next_id += 1
        sent = self._next_id
        body = jsonrpc.dumps({"jsonrpc": "2.0", "id": sent, "method": method, "params": params})
        # One call's reply only: an auto-batch holds several callers' answers, none too large alone.
        reply, seconds, index = await self._send(body, metric_label(method), timeout,
                                                 lambda r: single_problem(r, sent), self._max_reply,
                                                 hedge=method in HEDGEABLE, write=method in WRITES)
        return Answer.from_response(reply, seconds, index)

    async def ask(self, index: int, method: str, params: Any, *, timeout: float) -> Answer:
        """One call to upstream `index` alone, whatever its rotation state or budget (identity probes,
        head polls, retries)."""
        self._next_id += 1
        sent = self._next_id
        body = jsonrpc.dumps({"jsonrpc": "2.0", "id": sent, "method": method, "params": params})
        started = time.perf_counter()
        budget = self.budgets[index]
        slot = await budget.take(asyncio.get_running_loop().time() + timeout)  # a provider counts these too
        if slot is None:
            raise JsonRpcError(UPSTREAM_UNAVAILABLE, f"upstream timeout: network '{self.network}' (upstream "
                               f"#{index}: no budget (max_rps, max_concurrency) in {timeout:g}s)", http_status=504)
        try:
            reply = await self._post(index, body, timeout)
            problem = single_problem(reply, sent)
            if problem is not None:
                raise _Failed("mismatch", problem)
        except _Failed as failure:
            if failure.kind == "connect":
                self.states.lost(index)
            self.selector.scores.observe(index, None, time.monotonic())
            self._metrics.upstream_errors.labels(self.network, str(index), failure.kind).inc()
            raise JsonRpcError(UPSTREAM_UNAVAILABLE, f"upstream unavailable: network '{self.network}' "
                               f"(upstream #{index}: {failure.detail})", http_status=502) from None
        finally:
            slot.budget.release(slot)
        seconds = time.perf_counter() - started
        self.selector.scores.observe(index, seconds, time.monotonic())
        return Answer.from_response(reply, seconds, index)

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
            return await self._batcher.enqueue(method, params, block)
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
        slot = await self.budgets[index].take(asyncio.get_running_loop().time() + timeout)
        if slot is None:
            raise JsonRpcError(UPSTREAM_UNAVAILABLE, f"upstream timeout: network '{self.network}' (upstream "
                               f"#{index}: no budget (max_rps, max_concurrency) in {timeout:g}s)", http_status=504)
        try:
            reply = await self._post(index, body, timeout)
            problem = batch_problem(reply, ids)
            if problem is not None or not isinstance(reply, list):
                raise _Failed("mismatch", problem or "batch refused")
        except _Failed as failure:
            self._metrics.upstream_errors.labels(self.network, str(index), failure.kind).inc()
            raise JsonRpcError(UPSTREAM_UNAVAILABLE, f"upstream unavailable: network '{self.network}' "
                               f"(upstream #{index}: {failure.detail})", http_status=502) from None
        finally:
            slot.budget.release(slot)
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
                                                 lambda r: batch_problem(r, ids), hedge=auto)
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
