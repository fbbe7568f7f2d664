"""Upstream pool: a connection pool per upstream (http_client.py), timeouts, failover across URLs.

The client's exceptions are mapped to JsonRpcError in sending.py and nowhere else. Upstream URLs may carry
a provider's secret, so errors, logs and metric labels name an upstream by its index only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Protocol, runtime_checkable

from proxy.config_files import Network, UpstreamOptions
from proxy.logs import Throttled
from proxy.metrics import Metrics
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import UPSTREAM_UNAVAILABLE, JsonRpcError
from proxy.rpc.methods import DEFAULT_ALLOWED_METHODS, DEFAULT_ALLOWED_NAMESPACES, POLICIES, CacheClass, metric_label
from proxy.upstream.batching import AutoBatcher
from proxy.upstream.budget import Budget, BudgetBook, Slot, UnitRate
from proxy.upstream.judging import BatchReply, batch_answers, single_answer
from proxy.upstream.posting import Failed
from proxy.upstream.replies import proof_call, proof_hash, proof_number
from proxy.upstream.selection import Selector
from proxy.upstream.sending import (
    DEFAULT_MAX_REPLY,
    DEFAULT_ROUTING,
    PROOF_HEADER_BYTES,
    Routing,
    Sender,
    too_large,
)
from proxy.upstream.standing import UpstreamStates
from proxy.values import Answer

log = logging.getLogger("proxy.upstream")
throttled = Throttled(log)  # a node that is down fails every call: one line per interval says so

# Reads whose cost is small and bounded (policy.batches: a slot, an account, a header, one
# transaction): the calls worth sharing an HTTP round trip. A batch is answered whole, so a call held
# past UPSTREAM_TIMEOUT would fail every read beside it: one whose cost its params do not bound (code
# run by eth_call, a block's receipts, a client's eth_getProof, eth_getLogs) goes alone, as does
# everything forwarded (docs/caching.md: only a call that fails by itself fails). The proxy's own proof
# calls ride in a read's batch (_with_proofs), never through this.
BATCHABLE = frozenset(name for name, policy in POLICIES.items() if policy.batches)
# ... and a block as a header only: with its full transactions it is as large as their data.
BLOCKS = frozenset({"eth_getBlockByNumber", "eth_getBlockByHash"})
# Reads worth hedging (sent to a second upstream when the first is slow): every cacheable read.
HEDGEABLE = frozenset(name for name, policy in POLICIES.items() if policy.cache is not CacheClass.NONE)
# Calls another upstream may be asked after one may have got them: the reads the proxy knows (those it
# serves by default, `net_` too). Any other method (a write, one ALLOW_METHODS opens:
# eth_sendRawTransactionSync, anvil_mine, a chain's own) goes to exactly one upstream, with the whole
# UPSTREAM_TIMEOUT: another is tried only when the first provably never got the call (its connection
# was refused), so a transaction is never sent twice.
WRITES = frozenset(
    {"eth_sendRawTransaction", "eth_sendTransaction", "eth_sendRawTransactionConditional", "sendTransaction"}
)
RETRIABLE = frozenset((DEFAULT_ALLOWED_METHODS | POLICIES.keys()) - WRITES - {"requestAirdrop"})


def _batchable(method: str, params: Any) -> bool:
    """A read that may share an upstream auto-batch: a bounded one, a block as a header only."""
    return method in BATCHABLE and (method not in BLOCKS or params[-1] is not True)


def _one_try(method: str) -> bool:
    """A call no other upstream is asked after one may have got it (RETRIABLE's rule)."""
    return method not in RETRIABLE and method.partition("_")[0] not in DEFAULT_ALLOWED_NAMESPACES


class Upstream(Protocol):
    """A network's node(s) as one JSON-RPC endpoint."""

    def request(self, method: str, params: Any, *, timeout: float | None = None) -> Awaitable[Answer]: ...

    async def batch(self, calls: Sequence[tuple[str, Any]]) -> list[Answer]: ...

    async def together(self, calls: Sequence[tuple[str, Any]]) -> list[Answer] | None:
        """One batch, so one node answers every call (None: the node refuses batches). Unlike `batch`,
        never split into calls asked alone, which a load balancer may send to different members."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class PerUpstream(Protocol):
    """A pool whose upstreams can also be asked one at a time, with what is known of each."""

    states: UpstreamStates

    async def ask(
        self, index: int, method: str, params: Any, *, timeout: float, budget_wait: float | None = None
    ) -> Answer: ...

    def proven(
        self, method: str, params: Any, block: str, *, index: int | None = None, timeout: float | None = None
    ) -> Awaitable[Answer]: ...

    async def ask_all(self, index: int, calls: Sequence[tuple[str, Any]], *, timeout: float) -> list[Answer]: ...


def http_pool(upstream: object) -> HttpUpstream | None:
    """The HttpUpstream inside an upstream's wrappers (the per-key budget's, a test's counter), if any."""
    while not isinstance(upstream, HttpUpstream) and hasattr(upstream, "inner"):
        upstream = upstream.inner
    return upstream if isinstance(upstream, HttpUpstream) else None


def routing_of(network: Network, budgets: BudgetBook | None = None) -> Routing:
    """A network's NETWORKS_FILE selection, weights, budgets and hedging; the budgets from `budgets`
    (the process's book: PartsBuilder gives every pool its own), else new ones."""
    options = [network.options_of(i) for i in range(len(network.upstreams))]
    return Routing(
        Selector(network.selection, [o.weight for o in options]),
        tuple(
            budgets.budget(network.name, url, o.max_rps, o.max_concurrency, _units(o))
            if budgets is not None
            else Budget(o.max_rps, o.max_concurrency, units=_units(o))
            for url, o in zip(network.upstreams, options, strict=True)
        ),
        network.hedge_after,
        tuple(o.recent_blocks for o in options),
        tuple(network.headers_of(i) for i in range(len(network.upstreams))),
    )


def _units(options: UpstreamOptions) -> UnitRate | None:
    """An upstream's compute-unit rate (max_units_per_second, method_costs, default_cost), if it has one."""
    if options.max_units_per_second is None:
        return None
    return UnitRate(options.max_units_per_second, dict(options.method_costs), options.default_cost)


class HttpUpstream(Sender):
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
        batch_max: int = 1,
        batch_max_bytes: int = 1024 * 1024,
        attempt_timeout: float | None = None,
        max_reply_bytes: int = DEFAULT_MAX_REPLY,
        routing: Routing = DEFAULT_ROUTING,
    ) -> None:
        super().__init__(
            network,
            tuple(urls),
            timeout=timeout,
            metrics=metrics,
            cooldown=cooldown,
            attempt_timeout=attempt_timeout,
            max_reply_bytes=max_reply_bytes,
            routing=routing,
        )
        self._next_id = 0
        self._batch_max = batch_max
        # The call that proves a read, to ask beside it in its batch (an eth_getProof for a state read
        # about a final block: chain/answer_proofs.proof_beside), or None; set where the network is
        # built, when its answers are verified.
        self.proof_beside: Callable[[str, Any], tuple[str, Any] | None] | None = None
        self._batcher = AutoBatcher(
            network,
            self._single,
            self._proven_alone,
            self._with_proofs,
            batch_max=batch_max,
            batch_max_bytes=batch_max_bytes,
            room=lambda: self.batch_room,
        )

    def request(self, method: str, params: Any, *, timeout: float | None = None) -> Awaitable[Answer]:
        # The coroutine that answers, returned rather than awaited here: a miss passes through no
        # layer that only hands on its call (so in the per-key budget and the asker too).
        if self._batch_max > 1 and timeout is None and _batchable(method, params):
            return self._batcher.enqueue(method, params)
        return self._single(method, params, timeout)

    async def _single(self, method: str, params: Any, timeout: float | None) -> Answer:
        self._next_id += 1
        sent = self._next_id
        body = jsonrpc.dumps({"jsonrpc": "2.0", "id": sent, "method": method, "params": params})
        # One call's reply only: an auto-batch holds several callers' answers, none too large alone.
        answer, _, _ = await self._send(
            body,
            metric_label(method),
            timeout,
            partial(single_answer, sent, method),
            self._max_reply,
            hedge=method in HEDGEABLE,
            write=_one_try(method),
            methods=(method,),
        )
        return answer

    async def ask(
        self, index: int, method: str, params: Any, *, timeout: float, budget_wait: float | None = None
    ) -> Answer:
        """One call to upstream `index` alone, whatever its rotation state (identity probes, head polls,
        retries), once its budget has a place: within `budget_wait` seconds if given, else `timeout`."""
        self._next_id += 1
        sent = self._next_id
        body = jsonrpc.dumps({"jsonrpc": "2.0", "id": sent, "method": method, "params": params})
        started = time.perf_counter()
        # A provider counts these too: a place in the budget first.
        slot = await self._place(index, timeout if budget_wait is None else budget_wait, (method,))
        try:
            reply = await self.links.post(slot, index, body, timeout, self._max_reply)
            answer = single_answer(sent, method, reply, time.perf_counter() - started, index)
        except Failed as failure:
            if failure.kind == "too_large":
                raise self.too_large_error(failure.detail) from None  # the call's fault, not the node's
            if failure.kind == "connect":
                self.states.lost(index)
            if failure.kind == "rate_limited":
                self._cool(index, failure)  # a head poll's 429 rests them too
            self.selector.scores.observe(index, None, time.monotonic())
            self._metrics.upstreams.errors.labels(self.network, str(index), failure.kind).inc()
            raise JsonRpcError(
                UPSTREAM_UNAVAILABLE,
                f"upstream unavailable: network '{self.network}' (upstream #{index}: {failure.detail})",
                http_status=502,
            ) from None
        self.selector.scores.observe(index, answer.seconds, time.monotonic())
        return answer

    async def _place(self, index: int, timeout: float, methods: Sequence[str]) -> Slot:
        """Places for a request of `methods` in upstream `index`'s budget within `timeout` seconds, or
        the call's 504."""
        slot = await self._budgeted(index, asyncio.get_running_loop().time() + timeout, methods)
        if slot is None:
            raise JsonRpcError(
                UPSTREAM_UNAVAILABLE,
                f"upstream timeout: network '{self.network}' (upstream "
                f"#{index}: no budget (max_rps, max_concurrency) in {timeout:g}s)",
                http_status=504,
            )
        return slot

    async def _proven_alone(self, method: str, params: Any, block: str | None) -> Answer:
        if block is None:
            return await self._single(method, params, None)
        try:
            [answer] = await self._with_proofs([(method, params, block)])
        except JsonRpcError as error:
            if error.http_status == 504 or too_large(error):
                raise  # timed out, asking again alone would only wait longer; too large, the node sends it again
            # A node that refuses batches (an HTTP 429 or 413 to them, an error reply) answers the
            # call alone, unproven (proof None), as the auto-batcher's groups do (batching.py).
            return await self._single(method, params, None)
        return answer

    async def _with_proofs(
        self,
        calls: Sequence[tuple[str, Any, str | None]],
        *,
        index: int | None = None,
        timeout: float | None = None,
    ) -> list[Answer]:
        """The calls and one header per distinct proof block in one batch, so one node answers all; each
        answer carries the hash that node gave for its proof block (a header is read for its hash
        alone: never encoded again, nor observed as a call of its own), or none if batches are refused.
        A read whose proof `proof_beside` names has it asked in the same batch too (one for the reads
        it proves alike), while the batch stays within UPSTREAM_BATCH_MAX calls and the budget's room
        (answer.state_proof), so proving it costs no second round trip."""
        # Loops, not comprehensions (a frame each): every proven miss passes here, most alone.
        sent: list[tuple[str, Any]] = []
        blocks: list[str] = []
        for method, params, block in calls:
            sent.append((method, params))
            if block is not None and block not in blocks:
                blocks.append(block)
        count = len(calls)
        for block in blocks:
            sent.append(proof_call(block))
        proved: list[tuple[int, int]] = []  # (a call, where its proof is in `sent`)
        if self.proof_beside is not None:
            room = self.batch_room
            # Within UPSTREAM_BATCH_MAX calls in all (a provider's cap on a batch), and the budget's room.
            most = self._batch_max if room is None else min(room, self._batch_max)
            proved = _proofs_beside(calls, sent, self.proof_beside, most)
        extras = len(sent) - count - len(blocks)
        bound = self._max_reply + (len(blocks) + extras) * PROOF_HEADER_BYTES  # the batch counted whole
        if index is None:
            judged = await self._batch_items(sent, auto=True, timeout=timeout, observed=count, bound=bound)
        else:
            judged = await self._batch_to(index, sent, timeout or self._timeout, bound, count)
        if judged is None:
            # A node that does not take batches: each call asked alone, unproven (proof None). A header
            # asked alone would prove nothing of the call: a load balancer may send them to different members.
            # Within the call's own timeout (a share of a read's time) if it has one.
            throttled.warning(
                f"batches {self.network}",
                "network %s: an upstream refused a JSON-RPC batch: its answers are served but never cached (an "
                "answer is kept only beside its block's header, in one batch); use a node that takes batches",
                self.network,
            )
            alone = await asyncio.gather(*(self._single(m, p, timeout) for m, p in sent[:count]))
            for answer in alone:
                answer.unbatched = True
            return alone
        items, answers = judged
        hashes: dict[str, str] = {}
        numbers: dict[str, int | None] = {}
        for block, item in zip(blocks, items[count : count + len(blocks)], strict=True):
            failed = item.get("error") is not None
            header = item.get("result")
            hashes[block] = proof_hash(header, failed)
            numbers[block] = proof_number(header, failed)
        for i, (_, _, block) in enumerate(calls):
            if block is not None:
                answers[i] = answers[i].with_proof(hashes[block], numbers[block])
        for i, at in proved:
            item = items[at]
            if item.get("error") is None:  # a node that could not prove it: verifying.py asks again
                answers[i].state_proof = (sent[at], item.get("result"))
        return answers

    def proven(
        self, method: str, params: Any, block: str, *, index: int | None = None, timeout: float | None = None
    ) -> Awaitable[Answer]:
        """A call and the header of `block` (a number or "latest") in one batch to one node: its answer,
        with `proof` the hash that node has for `block`. Auto-batched with other reads when it can be."""
        if index is None and timeout is None and self._batch_max > 1 and _batchable(method, params):
            return self._batcher.enqueue(method, params, block)
        return self._proven_to(method, params, block, index, timeout)

    async def ask_all(self, index: int, calls: Sequence[tuple[str, Any]], *, timeout: float) -> list[Answer]:
        """The calls in one batch to upstream `index` alone: one node answers them all (a proof's parts)."""
        return await self._with_proofs([(m, p, None) for m, p in calls], index=index, timeout=timeout)

    async def _proven_to(
        self, method: str, params: Any, block: str, index: int | None, timeout: float | None
    ) -> Answer:
        [answer] = await self._with_proofs([(method, params, block)], index=index, timeout=timeout)
        return answer

    async def _batch_to(
        self,
        index: int,
        calls: Sequence[tuple[str, Any]],
        timeout: float,
        bound: int,
        answered: int,
    ) -> BatchReply:
        """One batch to upstream `index` alone (a retry elsewhere must still be one node's answers):
        its reply items in the calls' order, with the first `answered` made answers; its reply read
        under `bound` bytes."""
        body, ids = self._batch_body(calls)
        started = time.perf_counter()
        methods = [m for m, _ in calls]
        # Each call a place, as the provider meters them.
        slot = await self._place(index, timeout, methods)
        try:
            reply = await self.links.post(slot, index, body, timeout, bound)
            judged = batch_answers(ids, methods, answered, reply, time.perf_counter() - started, index)
            if judged is None:
                raise Failed("mismatch", "batch refused")
        except Failed as failure:
            if failure.kind == "too_large":
                raise self.too_large_error(failure.detail) from None
            self._metrics.upstreams.errors.labels(self.network, str(index), failure.kind).inc()
            raise JsonRpcError(
                UPSTREAM_UNAVAILABLE,
                f"upstream unavailable: network '{self.network}' (upstream #{index}: {failure.detail})",
                http_status=502,
            ) from None
        return judged

    async def batch(self, calls: Sequence[tuple[str, Any]]) -> list[Answer]:
        """One JSON-RPC batch (the tracker's, the feed's), or its calls one by one from a node that
        refuses batches."""
        answers = await self.together(calls)
        if answers is None:
            return list(await asyncio.gather(*(self._single(m, p, None) for m, p in calls)))
        return answers

    async def together(self, calls: Sequence[tuple[str, Any]]) -> list[Answer] | None:
        judged = await self._batch_items(calls, auto=False, timeout=None, observed=len(calls), bound=self._max_reply)
        return None if judged is None else judged.answers

    async def _batch_items(
        self,
        calls: Sequence[tuple[str, Any]],
        *,
        auto: bool,
        timeout: float | None,
        observed: int,
        bound: int,
    ) -> BatchReply | None:
        """One batch's reply items in the calls' order, with the first `observed` calls' answers made
        (None: the node refused batches), from whichever upstream answered; its reply read under `bound`
        bytes, counted whole. `auto`: each of the first `observed` calls is observed under its own
        method, with its batch's latency."""
        body, ids = self._batch_body(calls)
        methods = [m for m, _ in calls]
        judged, seconds, index = await self._send(
            body,
            None if auto else "batch",
            timeout,
            partial(batch_answers, ids, methods, observed),
            bound,
            hedge=auto,
            methods=methods,
        )
        if judged is None:
            return None
        if auto:
            for method in methods[:observed]:
                self._metrics.child(
                    self._metrics.upstreams.seconds, self.network, metric_label(method), str(index)
                ).observe(seconds)
        return judged

    def _batch_body(self, calls: Sequence[tuple[str, Any]]) -> tuple[bytes, range]:
        base = self._next_id + 1
        self._next_id += len(calls)
        body = jsonrpc.dumps(
            [{"jsonrpc": "2.0", "id": base + i, "method": m, "params": prm} for i, (m, prm) in enumerate(calls)]
        )
        return body, range(base, base + len(calls))


def _proofs_beside(
    calls: Sequence[tuple[str, Any, str | None]],
    sent: list[tuple[str, Any]],
    beside: Callable[[str, Any], tuple[str, Any] | None],
    most: int,
) -> list[tuple[int, int]]:
    """The proofs of the proven calls added to `sent` while it holds fewer than `most` calls, one for
    the reads it proves alike (an account's balance, nonce and code at one block): (a call, where its
    proof is in `sent`)."""
    proved: list[tuple[int, int]] = []
    asked: dict[bytes, int] = {}
    for i, (method, params, block) in enumerate(calls):
        extra = beside(method, params) if block is not None else None
        if extra is None:
            continue
        same = jsonrpc.dumps(extra)
        at = asked.get(same)
        if at is None:
            if len(sent) >= most:
                continue
            at = asked[same] = len(sent)
            sent.append(extra)
        proved.append((i, at))
    return proved
