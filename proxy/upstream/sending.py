"""Sending one call or batch to a network's upstreams: the order the selection policy gives,
provider budgets, hedging, failover within the call's budget, and what a failure cools down. The
HTTP side (connections, a post and its reply) is posting.py's; upstreams are named by index, never
by URL (a URL may hold a key)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from proxy.forwarded import Abandoned
from proxy.logs import Throttled
from proxy.metrics import Metrics
from proxy.rpc.jsonrpc import LIMIT_EXCEEDED, UPSTREAM_UNAVAILABLE, JsonRpcError
from proxy.upstream.budget import ONE_CALL, Budget, Slot, take_first
from proxy.upstream.posting import Failed, UpstreamLinks
from proxy.upstream.replies import REACHED_KINDS, rate_limited, unhealthy
from proxy.upstream.selection import Selector
from proxy.upstream.standing import UpstreamStates

log = logging.getLogger("proxy.upstream")
throttled = Throttled(log)  # a node that is down fails every call: one line per interval says so
T = TypeVar("T")
# A reply made into what its caller takes, given its latency and the upstream that sent it; Failed
# (kind "mismatch") when it does not answer its request: that try fails, as a node's failure (judging.py).
Judge = Callable[[Any, float, int], T]
DEFAULT_MAX_REPLY = 32 * 1024 * 1024  # MAX_RESPONSE_BYTES' default: a pool built without settings is bounded too
# A proof header (eth_getBlockByNumber, transaction hashes only) beside a call: room for one in its
# batch's bound, beyond the call's own. A header of 1 MiB lists some 15,000 transactions.
PROOF_HEADER_BYTES = 1024 * 1024


TOO_LARGE = "response size exceeded: the node's answer"  # how Sender.too_large_error begins


def too_large(error: JsonRpcError) -> bool:
    """An upstream call refused because its reply passed its bound (Sender.too_large_error). Never
    asked again, alone or of another upstream: every node would send it again, and none may be read.
    (The pool's other -32005, eth_getLogs' query timeout, is told apart by its words.)"""
    return error.code == LIMIT_EXCEEDED and error.message.startswith(TOO_LARGE)


def upstream_timeout(network: str, budget: float, *, reached: bool = False) -> JsonRpcError:
    """A call no upstream answered within its budget (UPSTREAM_TIMEOUT): 504, -32002."""
    return JsonRpcError(
        UPSTREAM_UNAVAILABLE,
        f"upstream timeout: network '{network}' did not answer in {budget:g}s",
        http_status=504,
        reached=reached,
    )


def attempt_share(remaining: float, attempts_left: int, attempt_timeout: float | None) -> float:
    """One attempt's share of what is left of a call's budget (UPSTREAM_TIMEOUT): split evenly over the
    attempts left to make, or UPSTREAM_ATTEMPT_TIMEOUT, so a slow primary still leaves time for the backup."""
    if attempt_timeout is not None:
        return min(remaining, attempt_timeout)
    return max(remaining, 0.001) / max(attempts_left, 1)


@dataclass(slots=True)
class Attempts:
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
    recent_blocks: tuple[int | None, ...] = ()  # per upstream: the state window it keeps (None: archive)
    # Per upstream: NETWORKS_FILE `headers` sent with every request to it (secrets: never logged).
    # A change rebuilds the network's pool (network_set.STRUCTURE): a live pool keeps its own.
    headers: tuple[tuple[tuple[str, str], ...], ...] = field(default=(), repr=False)


DEFAULT_ROUTING = Routing()  # priority order, no budgets, no hedging


# Why a call reached no upstream at all: every one was out of rotation (a connection lost is a restart,
# maybe of another chain, until the identity check says otherwise: upstream/standing.py).
NONE_IN_ROTATION = (
    "no upstream in rotation: each is cooling down after a failure, catching up, cordoned, or waiting "
    "for its chain identity to be checked again after a lost connection"
)


class UpstreamOrder:
    """The order a call's tries take through a network's upstreams, and each one's cool-down after
    a failure: healthy upstreams in the selection policy's order, then those cooling down (the
    soonest back first), then those catching up."""

    def __init__(self, states: UpstreamStates, cooldown: float) -> None:
        self.states = states
        self._cooldown = cooldown
        self.down_until = [0.0] * states.size

    def up(self, index: int) -> bool:
        """In rotation and not cooling down (rpc_proxy_upstream_up): what `tries` puts first."""
        return self.states.in_rotation(index) and self.down_until[index] <= time.monotonic()

    def tries(self, selector: Selector) -> list[int]:
        """Healthy upstreams in the selection policy's order, then those cooling down; never one that
        serves another chain or is cordoned."""
        if len(self.down_until) == 1:  # one upstream: its order whatever its state
            return [0] if self.states.in_rotation(0) else []
        now = time.monotonic()
        states = self.states
        serving = [i for i in range(len(self.down_until)) if states.in_rotation(i)]
        # One still syncing or far behind comes last: its `latest` is an old block, its state old state.
        catching_up = [i for i in serving if states.catching_up(i)]
        if catching_up:
            serving = [i for i in serving if i not in catching_up]
        healthy = selector.order([i for i in serving if self.down_until[i] <= now], states.latest, now)
        cooling = sorted((i for i in serving if self.down_until[i] > now), key=lambda i: self.down_until[i])
        return healthy + cooling + catching_up if catching_up else healthy + cooling

    def cool(self, index: int, wait: float | None = None) -> float:
        """Upstream `index` cools down for `wait` seconds (None: the network's cooldown); when it ends."""
        until = time.monotonic() + (wait if wait is not None else self._cooldown)
        self.down_until[index] = until
        return until

    def answered(self, index: int) -> None:
        """Upstream `index` answered: it is asked in the policy's order again."""
        self.down_until[index] = 0.0


def _winner(tries: dict[asyncio.Task[tuple[T, float]], int], done: set[Any]) -> tuple[T, float, int] | None:
    """The first valid answer among the finished tries (each removed from `tries`), or None. Every
    finished try is looked at, so no failure goes unretrieved."""
    won = None
    for task in done:
        index = tries.pop(task, None)
        if index is None:
            continue  # the hedge's place, not a try
        failure = task.exception()
        if isinstance(failure, Failed) and failure.kind == "too_large":
            raise failure  # the call's own answer is too large, whoever gives it
        if isinstance(failure, Abandoned):
            raise failure  # a caller left before it was written: made again without it (batching.py)
        if failure is None and won is None:
            won = (*task.result(), index)
    return won


def _drop_place(placing: asyncio.Task[tuple[int, Slot] | None]) -> None:
    """A hedge's place no longer needed (the call was answered first): never sent, so given back."""
    if not placing.done():
        placing.cancel()
    elif not placing.cancelled() and (taken := placing.result()) is not None:
        taken[1].budget.give_back(taken[1])


class Sender:
    """The sending half of a network's upstream pool (pool.HttpUpstream adds calls, batches and proofs)."""

    def __init__(
        self,
        network: str,
        urls: tuple[str, ...],
        *,
        timeout: float,
        metrics: Metrics,
        cooldown: float,
        attempt_timeout: float | None,
        max_reply_bytes: int,
        routing: Routing,
    ) -> None:
        self.network = network
        # Every reply is read under a bound: this one for a call, this one for a batch counted whole
        # (plus PROOF_HEADER_BYTES a proof header), so no client may be sent more (MAX_RESPONSE_BYTES).
        self._max_reply = max_reply_bytes
        self._urls = urls
        self._timeout = timeout
        self._attempt_timeout = attempt_timeout
        self.states = UpstreamStates(len(self._urls))
        self._metrics = metrics
        self.ordering = UpstreamOrder(self.states, cooldown)
        self._waiting = 0  # calls waiting for a place in an upstream's budget
        self.links = UpstreamLinks(network, urls, self.states, routing.headers)
        self.reroute(routing)
        self.bind_gauges()

    def bind_gauges(self) -> None:
        """The per-upstream gauges read this pool's state when scraped (a pool built for a reload that
        was refused had taken them: network_set.py binds the pool in force again)."""
        metrics, network = self._metrics, self.network
        for index in range(len(self._urls)):
            for gauge, read in (
                (metrics.upstreams.head_lag, self.states.head_lag),
                (metrics.upstreams.catching_up, self.states.catching_up),
                (metrics.upstreams.up, self.ordering.up),
            ):
                gauge.labels(network, str(index)).set_function(partial(read, index))

    @property
    def urls(self) -> tuple[str, ...]:
        return self._urls

    def reroute(self, routing: Routing) -> None:
        """The selection policy, budgets and hedging to use from the next call on (start-up, a reload)."""
        self.selector = routing.selector or Selector("priority", [1.0] * len(self._urls))
        self.budgets = routing.budgets or tuple(Budget(None, None) for _ in self._urls)
        self._hedge_after = routing.hedge_after
        self.states.declare_recent(routing.recent_blocks)

    @property
    def batch_room(self) -> int | None:
        """The most calls an auto-batch may carry: the smallest upstream budget's (no batch outgrows one)."""
        return min((r for r in (b.room for b in self.budgets) if r is not None), default=None)

    @property
    def carrying(self) -> int:
        """Calls this pool carries now: being posted to an upstream, or waiting for its budget."""
        return self.links.posting + self._waiting

    async def close(self) -> None:
        await self.links.close()

    async def _budgeted(self, index: int, deadline: float, methods: Sequence[str] = ONE_CALL) -> Slot | None:
        """Places for a request of `methods` (one a JSON-RPC call) in upstream `index`'s budget by
        loop time `deadline`: a call the pool carries meanwhile."""
        taken = await self._first_place([index], deadline, methods)
        return taken[1] if taken is not None else None

    def too_large_error(self, detail: str) -> JsonRpcError:
        """The call's answer passed its bound: refused unread past it, whoever would give it."""
        return JsonRpcError(
            LIMIT_EXCEEDED,
            f"{TOO_LARGE} ({detail}) would pass MAX_RESPONSE_BYTES ({self._max_reply} bytes); ask for less",
            reached=True,
        )

    def cool_down(self, index: int) -> None:
        """Upstream `index` gave an answer its block's proofs refute (verifying.py): it cools down as
        after a failure, so the next calls go to the others first."""
        if 0 <= index < len(self._urls):
            self.ordering.cool(index)

    def _cool(self, index: int, failure: Failed) -> None:
        """Upstream `index` failed: it cools down (for a rate limit's Retry-After, if given). A rate
        limit also rests its head polls (upstream_heads.py) until then: the provider asked for quiet."""
        until = self.ordering.cool(index, failure.wait)
        if failure.kind == "rate_limited":
            self.states.rest(index, until)
            self._metrics.upstreams.rate_limited.labels(self.network, str(index)).inc()

    def _failed(self, index: int, failure: Failed, attempts: Attempts) -> None:
        """Note a failed try: that upstream cools down (for a rate limit's Retry-After, if given),
        unless the request itself was at fault (too large or malformed for any node, or refused as a
        loop of proxies by its Via: via.py)."""
        if failure.kind == "too_large":
            return  # the call fails as a whole (_send): no node is at fault
        if failure.kind == "connect":
            self.states.lost(index)
        if failure.kind not in ("refused", "loop"):  # a request too large, malformed or looping cools none down
            self._cool(index, failure)
            self.selector.scores.observe(index, None, time.monotonic())
        self._metrics.upstreams.errors.labels(self.network, str(index), failure.kind).inc()
        throttled.warning(f"{self.network}#{index}", "upstream %s#%d failed: %s", self.network, index, failure.detail)
        attempts.failures.append(f"upstream #{index}: {failure.detail}")
        attempts.last_kind = failure.kind
        attempts.reached = attempts.reached or failure.kind in REACHED_KINDS

    async def _try(
        self,
        index: int,
        slot: Slot,
        body: bytes,
        timeout: float,
        judge: Judge[T],
        attempts: Attempts,
        max_reply: int,
    ) -> tuple[T, float]:
        """One upstream's try in the budget `slot` taken for it: the reply as `judge` makes it and its
        latency, or Failed (noted)."""
        self._metrics.child(self._metrics.upstreams.selected, self.network, str(index)).inc()
        started = time.perf_counter()
        try:
            reply = await self.links.post(slot, index, body, timeout, max_reply)
            seconds = time.perf_counter() - started
            # A reply that does not answer what was asked is a fault of that node (Failed here).
            judged = judge(reply, seconds, index)
            limited = rate_limited(reply)
            if limited is not None:
                raise Failed("rate_limited", limited)
            if type(reply) is not dict or "error" in reply:  # a result is no node's word on its health
                sick = unhealthy(reply)
                if sick is not None:
                    raise Failed("unhealthy", sick)
        except Failed as failure:
            self._failed(index, failure, attempts)
            raise
        self.ordering.answered(index)
        self.selector.scores.observe(index, seconds, time.monotonic())
        return judged, seconds

    def _now(self, pending: list[int], methods: Sequence[str]) -> tuple[int, Slot] | None:
        """The first upstream in `pending` with budget for `methods` now, and its slot (removed from `pending`)."""
        for index in pending:
            slot = self.budgets[index].try_take(methods)
            if slot is not None:
                pending.remove(index)
                return index, slot
        return None

    async def _next(self, pending: list[int], deadline: float, methods: Sequence[str]) -> tuple[int, Slot] | None:
        """No upstream in `pending` has budget now: wait, within the deadline, for whichever frees a
        place first (a node whose places are all held by calls it has not answered must not hold up
        a call another upstream could take). Removed from `pending`; None if no budget came in time."""
        for index in pending:
            self._metrics.upstreams.budget_waits.labels(self.network, str(index)).inc()
        loop = asyncio.get_running_loop()
        return await self._first_place(pending, loop.time() + deadline - time.monotonic(), methods)

    async def _first_place(
        self, pending: list[int], deadline: float, methods: Sequence[str]
    ) -> tuple[int, Slot] | None:
        """Places in the budget of whichever upstream in `pending` has them first, by loop time
        `deadline` (removed from `pending`); None if none came in time. A call the pool carries meanwhile."""
        self._waiting += 1
        try:
            taken = await take_first([self.budgets[i] for i in pending], deadline, methods)
        finally:
            self._waiting -= 1
        if taken is None:
            return None
        return pending.pop(taken[0]), taken[1]

    async def _hedged(
        self,
        first: int,
        slot: Slot,
        pending: list[int],
        body: bytes,
        timeout: float,
        judge: Judge[T],
        attempts: Attempts,
        max_reply: int,
        methods: Sequence[str] = ONE_CALL,
    ) -> tuple[T, float, int] | None:
        """Ask `first`; without an answer after hedge_after, also the next upstream that has budget,
        waiting (while `first` may still answer) for the first of them to free a place when none has
        one at once. The first valid answer wins and the other is cancelled; None if every one asked failed."""
        tries = {asyncio.create_task(self._try(first, slot, body, timeout, judge, attempts, max_reply)): first}
        placing: asyncio.Task[tuple[int, Slot] | None] | None = None
        hedged = False
        try:
            while tries:
                waiting: set[asyncio.Future[Any]] = {*tries, placing} if placing is not None else set(tries)
                wait = self._hedge_after if not hedged and pending else None
                done, _ = await asyncio.wait(waiting, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if not done:  # hedge_after passed: a place for the hedge, in whichever upstream frees one first
                    hedged = True
                    deadline = asyncio.get_running_loop().time() + timeout
                    placing = asyncio.create_task(self._first_place(pending, deadline, methods))
                    continue
                won = _winner(tries, done)
                if won is not None:
                    if hedged:
                        self._metrics.upstreams.hedge_wins.labels(self.network, str(won[2])).inc()
                    return won  # a place the hedge got meanwhile is given back (finally)
                if placing is not None and placing in done:
                    second, placing = placing.result(), None
                    if second is not None:
                        self._metrics.upstreams.hedged.labels(self.network).inc()
                        tried = self._try(second[0], second[1], body, timeout, judge, attempts, max_reply)
                        tries[asyncio.create_task(tried)] = second[0]
            return None
        finally:
            for task in tries:
                task.cancel()
            if placing is not None:
                _drop_place(placing)

    async def _send(
        self,
        body: bytes,
        method_label: str | None,
        timeout: float | None,
        judge: Judge[T],
        max_reply: int,
        *,
        hedge: bool = False,
        write: bool = False,
        methods: Sequence[str] = ONE_CALL,
    ) -> tuple[T, float, int]:
        """Post to upstreams in order until `judge` takes a reply, read under `max_reply` bytes; observe
        its latency under `method_label`. `hedge`: a slow read is also sent to the next upstream. `write`: another
        upstream is tried only when the first provably never got the call. `methods`: those of the
        JSON-RPC calls in `body`, each a place in an upstream's budget as the provider meters them."""
        budget = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        attempts = Attempts()
        pending = self.ordering.tries(self.selector)
        tried = 0
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            chosen = self._now(pending, methods) or await self._next(pending, deadline, methods)
            if chosen is None:
                attempts.failures.append("no upstream had budget (max_rps, max_concurrency) in time")
                attempts.last_kind = "timeout"
                break
            index, slot = chosen
            if tried:
                self._metrics.upstreams.failovers.labels(self.network).inc()
            tried += 1
            # A write is tried once: the whole budget is its (a share would fail it at a second node's turn).
            left = deadline - time.monotonic()
            share = left if write else attempt_share(left, len(pending) + 1, self._attempt_timeout)
            try:
                if hedge and self._hedge_after is not None and pending:
                    won = await self._hedged(index, slot, pending, body, share, judge, attempts, max_reply, methods)
                    if won is None:
                        continue
                    judged, seconds, index = won
                else:
                    judged, seconds = await self._try(index, slot, body, share, judge, attempts, max_reply)
            except Failed as failure:
                if failure.kind == "too_large":
                    # The answer the caller asked for is too large to send: every node would give it.
                    raise self.too_large_error(failure.detail) from None
                if write and not failure.unsent:
                    break  # the node may have taken the transaction: never send it to another
                continue
            if method_label is not None:
                self._metrics.child(self._metrics.upstreams.seconds, self.network, method_label, str(index)).observe(
                    seconds
                )
            return judged, seconds, index
        if attempts.last_kind == "timeout":
            raise upstream_timeout(self.network, budget, reached=attempts.reached)
        raise JsonRpcError(
            UPSTREAM_UNAVAILABLE,
            f"upstream unavailable: network '{self.network}' ({'; '.join(attempts.failures) or NONE_IN_ROTATION})",
            http_status=502,
            reached=attempts.reached,
        )
