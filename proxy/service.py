"""The read-through flow for one call: policy -> validate -> resolve block -> cache -> upstream -> store.

This is the only module that awaits the cache and the upstream together.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from proxy.cache import log_chunks
from proxy.cache import policy as cp
from proxy.cache.chunked_logs import ChunkedLogs
from proxy.cache.tiers import Coalescer, TieredCache, cache_key
from proxy.chain import local_answers, pinning
from proxy.chain.heads import EvmHeadTracker, Head, Resolved, SolanaSlotTracker
from proxy.config import Network, Settings
from proxy.credits.prices import credits_of
from proxy.metrics import HitCells, Metrics
from proxy.rpc.jsonrpc import (
    EXECUTION_REVERTED,
    INTERNAL_ERROR,
    LIMIT_EXCEEDED,
    METHOD_NOT_FOUND,
    UPSTREAM_UNAVAILABLE,
    Call,
    JsonRpcError,
    dumps,
    invalid_params,
    loads,
    trimmed,
)
from proxy.rpc.methods import (
    POLICIES,
    SUBSCRIPTION_METHODS,
    CacheClass,
    MethodPolicy,
    family_of,
    metric_label,
)
from proxy.rpc.params import BlockRef, Rules, block_refs, quantity_int, substitute
from proxy.upstream.pool import Answer, PerUpstream, Upstream

log = logging.getLogger("proxy.service")
HIT, MISS, BYPASS = "HIT", "MISS", "BYPASS"
MEMO_SIZE = 10_000  # raw requests whose validation and plan are remembered
MEMO_MAX_CONTAINERS = 16  # objects and arrays in memoized params (a filter with topics has a few)
MEMO_MAX_PARAMS = 512
FALLBACK_BLOCK_GAS_LIMIT = 30_000_000  # bytes: larger params are validated every time rather than held in memory


@dataclass(slots=True)
class NetworkRuntime:
    config: Network
    upstream: Upstream
    tracker: EvmHeadTracker | SolanaSlotTracker
    per_upstream: PerUpstream | None = None  # each upstream on its own: its head, identity, a retry
    name: str = field(init=False)  # config.name, as a plain attribute: the hot path reads it per call

    def __post_init__(self) -> None:
        self.name = self.config.name

    def health(self, now: float) -> str | None:
        """Why this network cannot be trusted to answer right now (for /readyz), or None."""
        states = self.per_upstream.states if self.per_upstream is not None else None
        if states is not None and all(states.mismatch):
            return "degraded: no upstream serves the network's chain (see rpc_proxy_upstream_identity_mismatch)"
        return self.tracker.health(now)


@dataclass(slots=True)  # not frozen: built per call, and frozen init costs 3x
class Outcome:
    """One call's answer: `payload` is the encoded result or the encoded error object."""

    payload: bytes
    is_error: bool
    cache: str
    error: JsonRpcError | None = None  # the proxy's own error (it carries the HTTP status)
    upstream_seconds: float | None = None

    @classmethod
    def failed(cls, error: JsonRpcError, cache: str = BYPASS) -> Outcome:
        return cls(error.encode(), True, cache, error)

    @classmethod
    def answered(cls, answer: Answer, cache: str) -> Outcome:
        return cls(answer.payload, answer.is_error, cache, None, answer.seconds)


@dataclass(slots=True)  # not frozen: built per call, and frozen init costs 3x
class Prepared:
    """A validated call, ready to run and priced."""

    call: Call
    network: NetworkRuntime
    policy: MethodPolicy | None
    params: Any
    credits: int
    refs: list[BlockRef]  # the block parameters inside params, found once
    fingerprint: tuple[str, str, bytes] | None = None  # the raw request, for the plan memo
    piece: bool = False  # a piece of a chunked eth_getLogs: the result limit holds over the merged answer


@dataclass(frozen=True, slots=True)
class _Plan:
    """The pure part of a cacheable call for one head: its decision, cache key and upstream params."""

    head: Any
    decision: cp.Decision
    key: str
    method: str  # the method sent upstream: the by-hash sibling when the key pins a block hash
    forward: Any
    tags_resolved: bool  # a tag was turned into a number: a failing node may just lag the tracker
    need: int | None  # the highest block the answer depends on: the answering upstream must have it
    check_end: tuple[int, str] | None  # eth_getLogs: the range's last block and hash, checked after
    by_hash: bool  # the answer is addressed or pinned by hash: a null means the node lacks the block
    credits: int  # the call's price, so a memory hit needs no policy lookup
    hit_cells: tuple[HitCells, HitCells]  # the metric cells a memory hit updates: (result, error)
    check_results: bool = True  # eth_getLogs' result limit on this answer (not on a chunked call's piece)


K = TypeVar("K")
V = TypeVar("V")


class Memo(dict[K, V]):
    """A bounded memo of pure results: when full it starts over, and hot entries come straight back.

    Reads are plain dict lookups; an LRU's bookkeeping on every read would cost the hot path more
    than the occasional recomputation after a reset. With `compute`, `memo[key]` fills itself.
    """

    def __init__(self, size: int, compute: Callable[[K], V] | None = None) -> None:
        super().__init__()
        self._size = size
        self._compute = compute

    def __setitem__(self, key: K, value: V) -> None:
        if len(self) >= self._size and key not in self:
            self.clear()
        super().__setitem__(key, value)

    def __missing__(self, key: K) -> V:
        if self._compute is None:
            raise KeyError(key)
        value = self[key] = self._compute(key)
        return value


def _fingerprint(net: NetworkRuntime, method: str, params: Any) -> tuple[str, str, bytes] | None:
    """The memo key of a request as it arrived; None for params too large to be worth remembering."""
    try:
        raw = dumps(params)
    except TypeError:  # nested past orjson's limit: the hot path leaves it to the envelope's check
        return None
    if len(raw) > MEMO_MAX_PARAMS or raw.count(b"{") + raw.count(b"[") > MEMO_MAX_CONTAINERS:
        # Parsed params cost many times their JSON (an object ~24x for `{}`): only plain calls are held.
        return None
    return (net.name, method, raw)


class Service:
    def __init__(
        self,
        settings: Settings,
        networks: Mapping[str, NetworkRuntime],
        cache: TieredCache,
        metrics: Metrics,
    ) -> None:
        self._settings = settings
        self.networks = networks
        self._cache = cache
        self._metrics = metrics
        self._coalescer: Coalescer[tuple[Answer, bool]] = Coalescer()
        # Memos of pure work, keyed by the raw request: validation results, and plans per head.
        self._validated: Memo[tuple[str, str, bytes], tuple[Any, list[BlockRef]]] = Memo(MEMO_SIZE)
        self._plans: Memo[tuple[str, str, bytes], _Plan] = Memo(MEMO_SIZE)
        self._rules = Rules(settings.eth_call_require_from, settings.getlogs_max_params)
        self._ttls = cp.Ttls(
            unfinalized=settings.cache_unfinalized_ttl,
            negative=settings.cache_negative_ttl,
            largest_accounts=settings.solana_largest_accounts_ttl,
            token_balance=settings.solana_balance_max_age,
            identity=settings.identity_check_interval,
        )
        self._chunks = ChunkedLogs(settings.getlogs_chunk_blocks, settings.getlogs_chunk_concurrency,
                                   settings.getlogs_max_results, metrics)

    # --- before anything is charged or forwarded ------------------------------------------

    def prepare(self, call: Call, network: NetworkRuntime) -> Prepared:
        """Check the method is available on this network and validate its params; raise JsonRpcError if not.
        The allow-list was applied before routing (Gateway._route)."""
        method = call.method
        if method in SUBSCRIPTION_METHODS:
            raise JsonRpcError(METHOD_NOT_FOUND, f"method not found: {method} needs a WebSocket: connect to "
                               "/ws/v3/<API_KEY> and send it as a single request (not over HTTP or in a batch)")
        policy = POLICIES.get(method)
        if family_of(method) != network.config.family:
            raise JsonRpcError(
                METHOD_NOT_FOUND, f"method not found: {method} is not available on {network.config.family} "
                f"network '{network.name}'",
            )
        params: Any = call.params
        refs: list[BlockRef] = []
        fingerprint = None
        if policy is not None and policy.validate is not None:
            if not isinstance(params, list):
                raise invalid_params("params", "expected an array of positional parameters")
            fingerprint = _fingerprint(network, method, params)
            if fingerprint:  # the memos may hold it: not in orjson's 4 KiB buffer
                fingerprint = (fingerprint[0], fingerprint[1], trimmed(fingerprint[2]))
            memo = self._validated.get(fingerprint) if fingerprint else None
            if memo is None:
                params = policy.validate(params, self._rules)
                refs = block_refs(params)
                if fingerprint:
                    self._validated[fingerprint] = (params, refs)
            else:
                params, refs = memo
        cost = credits_of(method, self._settings.method_credits, self._settings.default_credits)
        return Prepared(call, network, policy, params, cost, refs, fingerprint)

    # --- the read-through flow ----------------------------------------------------------

    def memory_hit(
        self, method: str, params: list[Any], net: NetworkRuntime,
    ) -> tuple[bytes, bool, int, HitCells] | None:
        """(payload, is_error, credits, metric cells) for a call seen before, if its plan holds for the
        current head and memory has the answer. A plan exists only for params that passed validation
        on this network.

        Nothing is counted here: the caller counts the hit once it is paid for.
        """
        fingerprint = _fingerprint(net, method, params)
        if fingerprint is None:
            return None
        try:  # only cacheable calls that passed validation have a plan
            plan = self._plans[fingerprint]
        except KeyError:
            return None
        if plan.head is not net.tracker.head or plan.decision.tied_to_answer:
            return None  # tied to the answer's block: checked on the general path
        stored = self._cache.memory.get(plan.key)
        if stored is None:
            return None
        payload, is_error = stored
        return payload, is_error, plan.credits, plan.hit_cells[is_error]

    async def execute(self, prepared: Prepared) -> Outcome:
        started = time.perf_counter()
        try:
            outcome = await self._execute(prepared)
        except JsonRpcError as error:
            outcome = Outcome.failed(error)
        except Exception:
            # A fault of ours fails this call alone; its details go to the log, never to the caller.
            log.exception("internal error executing %s on %s", prepared.call.method, prepared.network.name)
            outcome = Outcome.failed(JsonRpcError(INTERNAL_ERROR, "internal error", http_status=500))
        metrics = self._metrics
        label = metric_label(prepared.call.method)
        metrics.child(metrics.request_seconds, prepared.network.name, label, outcome.cache).observe(
            time.perf_counter() - started
        )
        return outcome

    async def _execute(self, prepared: Prepared) -> Outcome:
        net, policy, method = prepared.network, prepared.policy, prepared.call.method
        params = prepared.params
        if policy is not None and policy.gas_cap:
            params = self._cap_gas(params, net)
        if policy is not None and policy.cache is CacheClass.TRACKER:
            return await self._from_trackers(prepared)
        if policy is None or policy.cache is CacheClass.NONE:
            if prepared.refs:  # validated, uncached (eth_estimateGas): block parameters as the caller gave them
                params = substitute(params, {id(r): r.encode() for r in prepared.refs})
            answer = await net.upstream.request(method, params)
            return Outcome.answered(self._shown(net, method, answer, prepared.refs), BYPASS)

        refs = prepared.refs
        tracker = net.tracker
        if isinstance(tracker, EvmHeadTracker) and tracker.behind() and any(r.tag == "latest" for r in refs):
            # Read-your-writes: a client saw a block the head has not reached; wait (bounded) for it.
            await tracker.catch_up(self._settings.head_catch_up_wait)
        head = tracker.head
        if policy.limits_logs and not prepared.piece and isinstance(tracker, EvmHeadTracker):
            chunked = await self._chunked_logs(prepared, tracker, head)
            if chunked is not None:
                return chunked
        plan = self._plans.get(prepared.fingerprint) if prepared.fingerprint else None
        if plan is None or plan.head is not head:
            evm = isinstance(tracker, EvmHeadTracker)
            resolved = {id(r): tracker.resolve(r) for r in refs} if isinstance(tracker, EvmHeadTracker) else {}
            if policy.limits_logs:
                self._check_range(params[0], resolved)
            decision = cp.decide(policy.cache, list(resolved.values()), head, self._ttls, params)
            space = (head.space if head is not None else None) if evm else net.name
            if space is None:
                decision = cp.BYPASS  # the chain's identity is not known yet: no key can name it
            forward = self._forward(policy, params, refs, resolved, decision)
            end = pinning.range_end(params[0], resolved) if policy.limits_logs and decision.pin_hashes else None
            check_end = (end.number, end.hash) if end and end.number is not None and end.hash is not None else None
            # Hashes the call names: its block hash refs, or a content-addressed method's block hash.
            named = [r.hash for r in refs if r.hash is not None]
            if policy.cache is CacheClass.CONTENT and params and isinstance(params[0], str):
                named.append(params[0])
            need = pinning.needed_block(list(resolved.values()), named, head.numbers if head is not None else {})
            # A number the tracker would not resolve (a stale head pins nothing unfinalized) is still a
            # block the answer depends on: a node behind it answers null or an error, not the block.
            explicit = [r.number for r in refs if r.number is not None and resolved.get(id(r)) is None]
            if explicit:
                need = max(need or 0, *explicit)
            floor = pinning.tag_floor([r.tag for r in refs if r.tag is not None and resolved.get(id(r)) is None], head)
            need = floor if need is None else max(need, floor or 0)
            if decision.per_head and head is not None:
                need = max(need or 0, head.latest)  # an answer for this head: from a node that has it
            tags_resolved = any(r.tag is not None and resolved.get(id(r)) is not None for r in refs)
            cells = (self._metrics.hit_cells(net.name, method, False), self._metrics.hit_cells(net.name, method, True))
            key = ""
            if decision.cacheable and space is not None:
                key_params = substitute(params, {id(r): _key_form(r, resolved[id(r)], decision) for r in refs})
                if decision.per_head and head is not None:
                    key_params = [*key_params, {"head": [head.latest, head.latest_hash]}]
                key = cache_key(space, method, key_params)
            # An unfinalized block pinned by hash goes upstream as the method's by-hash sibling.
            upstream_method = policy.by_hash if policy.by_hash and decision.pin_hashes else method
            plan = _Plan(head, decision, key, upstream_method, forward, tags_resolved, need, check_end,
                         decision.pin_hashes or bool(named), prepared.credits, cells, not prepared.piece)
            if not decision.cacheable:
                # Not cached, but still asked of a node that has the blocks it names.
                self._metrics.child(self._metrics.cache_lookups, "none", "bypass").inc()
                answer, _ = await self._ask_pinned(net, plan.method, forward, policy, plan, self._deadline(policy))
                return Outcome.answered(self._shown(net, method, answer, refs), BYPASS)
            if prepared.fingerprint:
                # The head fixes everything a plan depends on (tags, finality, hashes, gas limit, identity).
                self._plans[prepared.fingerprint] = plan
        key = plan.key

        stored = await self._cache.get(key)
        if plan.decision.tied_to_answer:
            if stored is not None and not self._still_tied(net, stored[0]):
                stored = None  # its block was replaced (or is no longer known): ask again
            now_head = tracker.head
            if stored is None and isinstance(now_head, Head) and plan.head is now_head:
                stored = await self._cache.get(_unmined_key(key, now_head))
        if stored is None and policy.limits_logs and isinstance(tracker, EvmHeadTracker):
            stored = await self._logs_from_receipts(tracker, params, plan, policy)
        if stored is not None:
            self._metrics.child(self._metrics.credits_saved, net.name, method).inc(prepared.credits)
            return Outcome(*stored, HIT)

        async def fill() -> tuple[Answer, bool]:
            wait = self._settings.coalesce_wait
            token = await self._cache.claim(key, self._settings.upstream_timeout + 1) if wait else ""
            if token is None:  # another replica is fetching this very key: take its answer
                stored = await self._cache.await_fill(key, wait)
                if stored is not None:
                    self._metrics.child(self._metrics.coalesced, net.name, metric_label(method)).inc()
                    return Answer.stored(*stored), True
            try:
                return await self._fetch(net, policy, method, params, refs, plan)
            finally:
                if token:
                    await self._cache.release(key, token)

        (answer, tied), joined = await self._coalescer.run(key, fill)
        if joined:
            self._metrics.child(self._metrics.coalesced, net.name, metric_label(method)).inc()
        return Outcome.answered(self._shown(net, method, answer, refs), MISS if tied else BYPASS)

    async def _from_trackers(self, prepared: Prepared) -> Outcome:
        """eth_chainId, eth_blockNumber, getSlot, getBlockHeight: from what the trackers hold
        (local_answers.py), else forwarded uncached and learned from."""
        net, method, params = prepared.network, prepared.call.method, prepared.params
        value = local_answers.held(method, params, net.tracker, time.time(), self._ttls.token_balance)
        if value is not None:
            self._metrics.child(self._metrics.cache_lookups, "tracker", "hit").inc()
            self._metrics.child(self._metrics.credits_saved, net.name, method).inc(prepared.credits)
            return Outcome(dumps(value), False, HIT)
        self._metrics.child(self._metrics.cache_lookups, "none", "bypass").inc()
        answer = await net.upstream.request(method, params)
        answer = local_answers.learned(method, params, net.tracker, answer, time.time())
        return Outcome.answered(self._shown(net, method, answer, prepared.refs), BYPASS)

    def _still_tied(self, net: NetworkRuntime, payload: bytes) -> bool:
        """A cached transaction or receipt: is the block it names still final or canonical?"""
        tracker = net.tracker
        if not isinstance(tracker, EvmHeadTracker):
            return False
        return cp.transaction_servable(loads(payload), tracker.head, tracker.orphans)

    def _forward(
        self, policy: MethodPolicy, params: Any, refs: list[BlockRef], resolved: dict[int, Resolved | None],
        decision: cp.Decision,
    ) -> Any:
        """The params sent upstream: unfinalized blocks pinned to their hash wherever the method allows."""
        if policy.limits_logs and decision.pin_hashes:
            block_hash = pinning.single_block_logs(params[0], resolved)
            if block_hash is not None:  # one block: the filter names it by hash
                rest = {k: v for k, v in params[0].items() if k not in ("fromBlock", "toBlock")}
                return [{**rest, "blockHash": block_hash}]
        return substitute(params, {
            id(r): pinning.forward_form(r, resolved.get(id(r)), decision.pin_hashes) for r in refs
        })

    async def _fetch(
        self, net: NetworkRuntime, policy: MethodPolicy, method: str, params: Any, refs: list[BlockRef], plan: _Plan,
    ) -> tuple[Answer, bool]:
        """A miss: ask upstream and keep the answer if it belongs to its key. (answer, tied): `tied` is
        False when the answer could not be tied to the key's block (it is served as BYPASS)."""
        deadline = self._deadline(policy)
        answer, doubt = await self._ask_pinned(net, plan.method, plan.forward, policy, plan, deadline)
        kind = cp.answer_kind(answer.result, answer.error_code, answer.is_error, caches_reverts=policy.caches_reverts)
        if plan.tags_resolved and kind in ("null", "error"):
            # The node may not know the resolved block yet (it lags the tracker): ask again
            # with the caller's tag, and keep nothing, since that answer has no fixed block.
            original = substitute(params, {id(r): r.encode() for r in refs})
            fallback = await self._upstream(net, method, original, policy, deadline)
            self._refuse_lagging(net, fallback, plan.need)
            return fallback, False
        if doubt is not None:  # served, never stored
            self._metrics.uncached_answers.labels(net.name, doubt).inc()
            return answer, False
        ttl = cp.store_ttl(plan.decision, policy.cache, kind, self._ttls)
        key = plan.key
        if plan.decision.tied_to_answer and kind in ("ok", "null"):
            tracker = net.tracker
            orphans = tracker.orphans if isinstance(tracker, EvmHeadTracker) else {}
            ttl = cp.transaction_ttl(answer.result, tracker.head, orphans, self._ttls)
            if ttl is None:
                return answer, False  # its block is not one the tracker vouches for: served, not kept
            if cp.answer_block(answer.result) is None:
                # Not yet mined: true of this head only. Kept under the head's key, so the next block
                # (which may hold it) is asked again at once, whatever is left of the negative TTL.
                now_head = tracker.head
                if not isinstance(now_head, Head) or plan.head is not now_head:
                    return answer, False
                key = _unmined_key(key, now_head)
        if ttl is not None:
            await self._cache.set(key, (answer.payload, answer.is_error), ttl)
        return answer, True

    async def _ask_pinned(
        self, net: NetworkRuntime, method: str, forward: Any, policy: MethodPolicy, plan: _Plan,
        deadline: float | None,
    ) -> tuple[Answer, str | None]:
        """The upstream's answer, and why it cannot be tied to its key (None when it can). An upstream
        that lacks a block the answer depends on is replaced by one that has it, when one does; if
        none does, the call fails (-32002) rather than serve what a lagging node or another fork said."""
        answer, doubt = await self._ask_checked(net, method, forward, policy, plan, deadline, None)
        per = net.per_upstream
        if doubt is None and plan.by_hash and _not_found(answer):
            doubt = "unknown_hash"  # that node may not know the block: another may
        if doubt is not None and per is not None:
            other = per.states.other_with(answer.upstream, plan.need)
            if other is not None:
                try:
                    retried, again = await self._ask_checked(net, method, forward, policy, plan, deadline, other)
                except JsonRpcError:
                    if doubt == "unknown_hash":
                        raise  # a node that may not know the block said not-found; the one that may is down
                else:
                    if again is None and plan.by_hash and _not_found(retried):
                        again = "unknown_hash"
                    if again is None or doubt == "unknown_hash":
                        answer, doubt = retried, again
        if doubt == "lagging" and per is not None and await self._caught_up(per, answer.upstream, plan.need):
            doubt = "late_head"  # its head had not been seen at the block yet: served, never stored
        if doubt in ("lagging", "fork"):
            self._refuse(net, doubt, plan.need)
        return answer, doubt

    async def _caught_up(self, per: PerUpstream, index: int, need: int | None) -> bool:
        """Ask upstream `index` for its head now: has it reached block `need`? (It may have passed
        the proxy's last look at it, e.g. a block just mined and not polled yet.)"""
        if need is None or index < 0:
            return False
        try:
            answer = await per.ask(index, "eth_blockNumber", [], timeout=self._settings.upstream_timeout)
            number = int(answer.result, 16) if isinstance(answer.result, str) else -1
        except (JsonRpcError, ValueError):
            return False
        per.states.observe_head(index, number)
        return number >= need

    def _refuse(self, net: NetworkRuntime, reason: str, need: int | None) -> None:
        self._metrics.uncached_answers.labels(net.name, reason).inc()
        block = f"block {need}" if need is not None else "the block"
        raise JsonRpcError(UPSTREAM_UNAVAILABLE, f"upstream unavailable: network '{net.name}' (no upstream "
                           f"could answer for {block} of the network's chain)", http_status=502)

    def _refuse_lagging(self, net: NetworkRuntime, answer: Answer, need: int | None) -> None:
        """An answer to a tag from an upstream known to be behind the block the tag stood for: refused,
        so `latest` never goes backwards for a client."""
        per = net.per_upstream
        if per is not None and answer.upstream >= 0 and per.states.verified[answer.upstream] and need is not None \
                and per.states.latest[answer.upstream] < need:
            self._refuse(net, "lagging", need)

    async def _ask_checked(
        self, net: NetworkRuntime, method: str, forward: Any, policy: MethodPolicy, plan: _Plan,
        deadline: float | None, index: int | None,
    ) -> tuple[Answer, str | None]:
        """Ask (upstream `index` alone, or the pool) and judge whether the answer belongs to the plan's key."""
        end_answer = None
        if plan.check_end is not None and index is None:
            # A range above finalized: the node reports the range's last block in the same batch.
            answer, end_answer = await self._upstream_batch(net, method, forward, policy, plan.check_end[0], deadline,
                                                            check=plan.check_results)
        elif index is not None and net.per_upstream is not None:
            answer = await self._upstream(net, method, forward, policy, deadline, ask=index, check=plan.check_results)
        else:
            answer = await self._upstream(net, method, forward, policy, deadline, check=plan.check_results)
        per = net.per_upstream
        if per is None or answer.upstream < 0:
            return answer, None
        if not per.states.vouches(answer.upstream, None):
            return answer, "unverified"
        if not per.states.vouches(answer.upstream, plan.need):
            head = net.tracker.head
            if plan.need is not None and head is not None and plan.need > head.latest:
                return answer, "beyond_head"  # no upstream is known to have it: served, never stored
            return answer, "lagging"  # an error from it may be just that, too
        if answer.is_error:
            return answer, None
        if plan.check_end is not None:
            block_hash = plan.check_end[1]
            end = end_answer.result if end_answer is not None else None
            same_node = end_answer is not None and end_answer.upstream == answer.upstream
            if not same_node or not isinstance(end, dict) or str(end.get("hash", "")).lower() != block_hash:
                return answer, "fork"
            head = net.tracker.head
            if head is not None and not pinning.logs_on_chain(answer.result, head.hashes):
                return answer, "fork"
        if plan.decision.tied_to_answer and answer.result is None:
            # "Not mined" from a node behind the head: the transaction may be in a block it lacks.
            head = net.tracker.head
            if head is not None and not per.states.vouches(answer.upstream, head.latest):
                return answer, "behind_head"
        return answer, None

    def _shown(self, net: NetworkRuntime, method: str, answer: Answer, refs: list[BlockRef]) -> Answer:
        """Read-your-writes: note the block a forwarded answer shows; eth_blockNumber never goes back."""
        tracker = net.tracker
        if not isinstance(tracker, EvmHeadTracker) or answer.is_error:
            return answer
        if any(ref.tag == "pending" for ref in refs):
            return answer  # the block being built is no block of the chain yet: nothing was shown
        number = pinning.shown_block(method, answer.result)
        if number is None:
            return answer
        if method == "eth_blockNumber" and number < tracker.shown:
            # A lagging upstream answered: the client has already been shown a later block.
            return Answer.from_response({"result": hex(tracker.shown)}, answer.seconds, answer.upstream)
        tracker.hint(number)
        return answer

    def _deadline(self, policy: MethodPolicy) -> float | None:
        """When the call must have its answer (loop time): eth_getLogs' limit holds per call, retries included."""
        return asyncio.get_running_loop().time() + self._settings.getlogs_timeout if policy.limits_logs else None

    async def _upstream(
        self, net: NetworkRuntime, method: str, params: Any, policy: MethodPolicy, deadline: float | None = None,
        *, ask: int | None = None, check: bool = True,
    ) -> Answer:
        """One call upstream (to upstream `ask` alone if given), under eth_getLogs' limits. `check` is
        False for a piece of a chunked call: the result limit holds over the merged answer instead."""
        per = net.per_upstream
        if not policy.limits_logs:
            if ask is not None and per is not None:
                return await per.ask(ask, method, params, timeout=self._settings.upstream_timeout)
            return await net.upstream.request(method, params)
        if deadline is None:
            deadline = self._deadline(policy)
        timeout = self._settings.getlogs_timeout + 1  # the upstream's own timeout is past ours: ours decides
        try:
            async with asyncio.timeout_at(deadline):
                if ask is not None and per is not None:
                    answer = await per.ask(ask, method, params, timeout=timeout)
                else:
                    answer = await net.upstream.request(method, params, timeout=timeout)
        except TimeoutError:
            # spec: a query that runs longer than 10 seconds fails with -32005.
            if check:  # a piece's own limit is no client's: the chunked call counts its own
                self._metrics.getlogs_rejections.labels("timeout").inc()
            raise JsonRpcError(LIMIT_EXCEEDED, "query timeout exceeded") from None
        return self._check_logs_limit(params, answer) if check else answer

    async def _upstream_batch(
        self, net: NetworkRuntime, method: str, params: Any, policy: MethodPolicy, end: int, deadline: float | None,
        *, check: bool = True,
    ) -> tuple[Answer, Answer | None]:
        """eth_getLogs and the range's last block in one batch (one node answers both)."""
        if deadline is None:
            deadline = self._deadline(policy)
        try:
            async with asyncio.timeout_at(deadline):
                answer, end_answer = await net.upstream.batch(
                    [(method, params), ("eth_getBlockByNumber", [hex(end), False])]
                )
        except TimeoutError:
            if check:  # a piece's own limit is no client's: the chunked call counts its own
                self._metrics.getlogs_rejections.labels("timeout").inc()
            raise JsonRpcError(LIMIT_EXCEEDED, "query timeout exceeded") from None
        return (self._check_logs_limit(params, answer) if check else answer), end_answer

    async def _logs_from_receipts(
        self, tracker: EvmHeadTracker, params: Any, plan: _Plan, policy: MethodPolicy,
    ) -> tuple[bytes, bool] | None:
        """An eth_getLogs miss over a few blocks whose eth_getBlockReceipts answers this process holds
        in memory, answered (and stored) from them without the upstream; None otherwise.

        A receipts entry is found under the key the same head gives it (by number when final, by
        number and hash above), so it is of the very blocks the range names."""
        head = tracker.head
        if head is not plan.head:
            return None  # the head moved while the cache was asked: the plan's key may name another fork
        log_filter = params[0]
        numbered = _numbered_range(tracker, head, log_filter)
        if numbered is None or head is None:
            return None
        first, last = numbered
        if not 0 <= last - first < log_chunks.RECEIPTS_MAX_BLOCKS:
            return None
        blocks = []
        for number in range(first, last + 1):
            block_hash = head.hashes.get(number)
            if number > head.finalized and block_hash is None:
                return None
            form = {"n": number} if number <= head.finalized else {"n": number, "h": block_hash}
            held = self._cache.memory.get(cache_key(head.space, "eth_getBlockReceipts", [form]))
            if held is None or held[1]:
                return None
            blocks.append(loads(held[0]))
        logs = log_chunks.logs_from_receipts(blocks, log_filter)
        if logs is None:
            return None
        answer = Answer.from_response({"result": logs})
        if plan.check_results:
            self._check_logs_limit(plan.forward, answer)
        ttl = cp.store_ttl(plan.decision, policy.cache, "ok", self._ttls)
        if ttl is not None:
            await self._cache.set(plan.key, (answer.payload, False), ttl)
        return answer.payload, False

    async def _chunked_logs(self, prepared: Prepared, tracker: EvmHeadTracker, head: Head | None) -> Outcome | None:
        """An eth_getLogs range that reaches into finalized blocks, asked in aligned pieces that later
        ranges share (log_chunks.py); None when the call is not chunked (a blockHash filter, a range
        wholly above finality or of one piece, a tag that cannot be resolved, no chain identity yet)."""
        log_filter = prepared.params[0]
        numbered = _numbered_range(tracker, head, log_filter)
        if numbered is None or head is None:
            return None
        first, last = numbered
        start, end = log_filter["fromBlock"], log_filter["toBlock"]
        self._refuse_reversed(first, last)
        if not log_chunks.chunked(first, last, head.finalized, self._chunks.size):
            return None
        pieces = log_chunks.plan(first, last, head.finalized, self._chunks.size)
        if len(pieces) == 1 and pieces[0].whole:
            return None  # one piece, the range itself: the ordinary flow (and its memo) serves it

        async def ask(lo: int, hi: int) -> tuple[bytes, bool, str]:
            # The piece is a call of its own: its key, finality, pinning and upstream checks are the
            # ordinary ones; a piece is not charged (the call is, once).
            piece_filter = {**log_filter, "fromBlock": replace(start, tag=None, number=lo),
                            "toBlock": replace(end, tag=None, number=hi)}
            piece = Prepared(prepared.call, prepared.network, prepared.policy, [piece_filter], 0,
                             block_refs([piece_filter]), None, piece=True)
            outcome = await self._execute(piece)
            return outcome.payload, outcome.is_error, outcome.cache

        # spec: 10 s per call in total, every piece and retry included.
        deadline = asyncio.get_running_loop().time() + self._settings.getlogs_timeout
        merged = await self._chunks.run(first, last, pieces, ask, deadline)
        if merged.cache == HIT:
            self._metrics.child(self._metrics.credits_saved, prepared.network.name, prepared.call.method).inc(
                prepared.credits)
        return Outcome(merged.payload, merged.is_error, merged.cache)

    def _check_logs_limit(self, params: Any, answer: Answer) -> Answer:
        results = answer.result
        limit = self._settings.getlogs_max_results
        if isinstance(results, list) and len(results) > limit:
            # spec: more than 10,000 results fails with -32005; nothing partial is returned.
            self._metrics.getlogs_rejections.labels("results").inc()
            raise JsonRpcError(
                LIMIT_EXCEEDED, f"query returned more than {limit} results",
                data=_narrower_range(params[0], results, limit),
            )
        return answer

    def _check_range(self, log_filter: dict[str, Any], resolved: dict[int, Resolved | None]) -> None:
        start, end = log_filter.get("fromBlock"), log_filter.get("toBlock")
        if not isinstance(start, BlockRef) or not isinstance(end, BlockRef):
            return
        a, b = resolved.get(id(start)), resolved.get(id(end))
        first = a.number if a else start.number
        last = b.number if b else end.number
        if first is not None and last is not None:
            self._refuse_reversed(first, last)

    def _refuse_reversed(self, first: int, last: int) -> None:
        if first > last:
            self._metrics.getlogs_rejections.labels("range").inc()
            raise invalid_params("filter", f"fromBlock {hex(first)} is greater than toBlock {hex(last)}")

    def _cap_gas(self, params: Any, net: NetworkRuntime) -> Any:
        """spec: the gas field is capped at 10 times the current block gas limit."""
        head = net.tracker.head
        if not isinstance(params, list) or not params:
            return params
        # Before the first head poll the block gas limit is unknown: a common one stands in, so
        # the cap holds from the first call.
        gas_limit = head.gas_limit if head is not None and head.gas_limit else FALLBACK_BLOCK_GAS_LIMIT
        tx = params[0]
        if not isinstance(tx, dict) or "gas" not in tx:
            return params
        try:
            gas = quantity_int("gas", tx["gas"])
        except JsonRpcError:
            return params  # a forwarded method's malformed gas: the node answers for it
        cap = gas_limit * self._settings.gas_cap_multiplier
        if gas <= cap:
            return params
        return [{**tx, "gas": hex(cap)}, *params[1:]]


def _numbered_range(tracker: EvmHeadTracker, head: Head | None, log_filter: dict[str, Any]) -> tuple[int, int] | None:
    """An eth_getLogs range's first and last block numbers as this head resolves them; None for a
    blockHash filter, a tag the tracker cannot resolve, or no chain identity yet."""
    start, end = log_filter.get("fromBlock"), log_filter.get("toBlock")
    if head is None or head.space is None or not isinstance(start, BlockRef) or not isinstance(end, BlockRef):
        return None
    a, b = tracker.resolve(start), tracker.resolve(end)
    if a is None or b is None or a.number is None or b.number is None:
        return None
    return a.number, b.number


def _unmined_key(key: str, head: Head) -> str:
    """Where a not-yet-mined transaction or receipt (null, or pending) is kept: for one head only."""
    return f"{key}@{head.latest_hash}"


def _not_found(answer: Answer) -> bool:
    """A null, or an error other than a revert: what a node that lacks the block answers."""
    return answer.result is None and answer.error_code != EXECUTION_REVERTED


def _key_form(ref: BlockRef, resolved: Resolved | None, decision: cp.Decision) -> Any:
    if resolved is None:
        return {"t": ref.tag}
    if resolved.number is None:
        return {"h": resolved.hash}
    if decision.pin_hashes and resolved.hash is not None:
        return {"n": resolved.number, "h": resolved.hash}
    return {"n": resolved.number}


def _narrower_range(log_filter: Any, logs: list[Any], limit: int) -> dict[str, str] | None:
    """A range that ends before the block holding the (limit+1)-th log: a hint, as providers give."""
    try:
        start = int(log_filter["fromBlock"], 16)
        cut = int(logs[limit]["blockNumber"], 16)
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    if cut <= start:
        return None  # more than the limit in one block: no narrower range exists
    return {"fromBlock": hex(start), "toBlock": hex(cut - 1)}
