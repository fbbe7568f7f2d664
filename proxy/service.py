"""The read-through flow for one call: policy -> validate -> resolve block -> cache -> upstream -> store.

This is the only module that awaits the cache and the upstream together.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from proxy import via
from proxy.asking import Asker
from proxy.cache import policy as cp
from proxy.cache import sharing
from proxy.cache.chunked_logs import ChunkedLogs
from proxy.cache.integrity import Integrity
from proxy.cache.log_reads import LogReads, Pieces
from proxy.cache.planning import key_space, plan_call
from proxy.cache.tiers import Coalescer, FillLock, TieredCache, trimmed
from proxy.chain import from_trackers
from proxy.chain.head_polls import Head
from proxy.chain.heads import EvmHeadTracker
from proxy.chain.shown import shown
from proxy.config import Settings
from proxy.credits.prices import credits_of
from proxy.fetching import Fetcher, still_tied, unmined_key
from proxy.memo import Memo
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.prepared import Prepared
from proxy.rpc.gas_cap import cap_gas
from proxy.rpc.jsonrpc import (
    INTERNAL_ERROR,
    METHOD_NOT_FOUND,
    Call,
    JsonRpcError,
    dumps,
    invalid_params,
)
from proxy.rpc.methods import (
    POLICIES,
    SUBSCRIPTION_METHODS,
    WRITE_METHODS,
    CacheClass,
    MethodPolicy,
    changes_dev_state,
    family_of,
    metric_label,
)
from proxy.rpc.params import BlockRef, Rules, block_refs, substitute
from proxy.upstream.key_budget import KeySlots
from proxy.upstream_reads import Read, Reads
from proxy.values import BYPASS, HIT, MISS, Answer, Outcome, Plan
from proxy.verifying import Verifier, shown_as, stored_as

log = logging.getLogger("proxy.service")
MEMO_SIZE = 10_000  # raw requests whose validation and plan are remembered
MEMO_MAX_CONTAINERS = 16  # objects and arrays in memoized params (a filter with topics has a few)
MEMO_MAX_PARAMS = 512  # bytes: larger params are validated every time rather than held in memory
MERGES_PER_KEY = 2  # chunked eth_getLogs merges one API key may have in flight (each parses its pieces)


def _fingerprint(net: NetworkRuntime, method: str, params: Any) -> tuple[str, str, bytes] | None:
    """The memo key of a request as it arrived; None for params too large to be worth remembering."""
    try:
        raw = dumps(params)
    except TypeError:  # nested past orjson's limit: the hot path leaves it to the envelope's check
        return None
    if len(raw) > MEMO_MAX_PARAMS or raw.count(b"{") + raw.count(b"[") > MEMO_MAX_CONTAINERS:
        # Parsed params cost many times their JSON (an object ~24x for `{}`): only plain calls are held.
        return None
    return (net.scope, method, raw)


# A plain single call found in the memory tier for this head (Service.memory_hit): (the plan of its
# params, whose credits, hit_cells and verified_as a hit reads; its network; the stored answer's
# payload, and whether it is an error object). A plain tuple: built and taken apart on every hit.
MemoryFind = tuple[Plan, NetworkRuntime, bytes, bool]


async def _uncached(asker: Asker, read: Read, refs: list[BlockRef]) -> tuple[Answer, str | None]:
    """A read never cached, still asked of a node that has the blocks it names; an EVM one at
    `pending` (the block after the head: the tracker cannot pin it) of a node that shows the tracker's
    head beside it (a balancer's member behind answered from its own: a `pending` nonce that went back)."""
    if isinstance(read.net.tracker, EvmHeadTracker) and any(r.tag == "pending" for r in refs):
        return await asker.ask_as_tag(read), None
    return await asker.ask_pinned(read)


def _ttls(settings: Settings) -> cp.Ttls:
    return cp.Ttls(
        unfinalized=settings.cache_unfinalized_ttl,
        negative=settings.cache_negative_ttl,
        largest_accounts=settings.solana_largest_accounts_ttl,
        token_balance=settings.solana_balance_max_age,
        identity=settings.identity_check_interval,
        unmined=settings.unmined_ttl,
    )


def _log_reads(settings: Settings, cache: TieredCache, metrics: Metrics, ttls: cp.Ttls) -> LogReads:
    chunks = ChunkedLogs(
        settings.getlogs_chunk_blocks, settings.getlogs_chunk_concurrency, settings.getlogs_max_results, metrics
    )
    return LogReads(
        cache, chunks, metrics, ttls, max_results=settings.getlogs_max_results, timeout=settings.getlogs_timeout
    )


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
        self._max_response = settings.max_response_bytes
        self._coalescer: Coalescer[tuple[Answer, bool, bool]] = Coalescer()
        self._merges: Coalescer[Outcome] = Coalescer()  # chunked eth_getLogs merges in flight, by key
        self._merge_slots = KeySlots(MERGES_PER_KEY)
        # Memos of pure work, keyed by the raw request: validation results, and plans per head.
        self._validated: Memo[tuple[str, str, bytes], tuple[Any, list[BlockRef]]] = Memo(MEMO_SIZE)
        self._plans: Memo[tuple[str, str, bytes], Plan] = Memo(MEMO_SIZE)
        self._rules = Rules(settings.eth_call_require_from, settings.getlogs_max_params)
        self._ttls = _ttls(settings)
        self._logs = _log_reads(settings, cache, metrics, self._ttls)
        reads = Reads(settings, metrics, self._logs.check_results)
        self._asker = Asker(reads)
        self._reads = reads
        self._verifier = Verifier(metrics, settings.upstream_timeout)
        integrity = Integrity(metrics, settings.upstream_timeout, cache)
        self._fetcher = Fetcher(self._asker, reads, integrity, cache, metrics, self._ttls, self._verifier)

    def unverifiable(self) -> dict[str, str]:
        """Networks whose answers cannot be proven (a header field the proxy does not know), and why."""
        return {name: why for name in self.networks if (why := self._verifier.unverifiable(name)) is not None}

    # --- before anything is charged or forwarded ------------------------------------------

    def prepare(self, call: Call, network: NetworkRuntime) -> Prepared:
        """Check the method is available on this network and validate its params; raise JsonRpcError if not.
        The allow-list was applied before routing (Gateway._route)."""
        method = call.method
        if method in SUBSCRIPTION_METHODS:
            raise JsonRpcError(
                METHOD_NOT_FOUND,
                f"method not found: {method} needs a WebSocket: connect to "
                "/ws/v3/<API_KEY> and send it as a single request (not over HTTP or in a batch)",
            )
        policy = POLICIES.get(method)
        if family_of(method) != network.config.family:
            raise JsonRpcError(
                METHOD_NOT_FOUND,
                f"method not found: {method} is not available on {network.config.family} network '{network.name}'",
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
        self,
        plain: tuple[int | str, str, list[Any]],
        network: NetworkRuntime | None,
        default_routes: Mapping[str, NetworkRuntime | None],
    ) -> MemoryFind | None:
        """The hot path: a plain single call (jsonrpc.plain_call) answered from memory for this head
        (`network`, else the method's default route); None: the general path judges it. Only params
        validated on this network have a plan. Nothing is counted: the caller counts a hit once paid for."""
        _, method, params = plain
        # .get, not [..]: a name not routed before (so not yet judged) is not remembered from here.
        net = network or default_routes.get(method)
        if net is None or self.networks.get(net.name) is not net:
            return None  # none, or a network a reload replaced or removed: the general path routes it
        try:  # _fingerprint's size checks are not needed: params they refuse were never held
            raw = dumps(params)
        except TypeError:  # nested past orjson's limit (never held either)
            return None
        # .get, not [..]: a Memo's missing key raises in Python (__missing__), ten times a lookup's cost.
        plan = self._plans.get((net.scope, method, raw))
        if plan is None or plan.head is not net.tracker.head or plan.decision.tied_to_answer:
            return None  # tied to the answer's block: checked on the general path
        stored = self._cache.memory.get(plan.key)
        if stored is None:
            return None
        payload, is_error = stored
        if len(payload) > self._max_response or (method == "eth_getLogs" and self._logs.past_limit(*stored)):
            return None  # the general path answers with the size (response_size.py) or result limit error
        if not plan.verified_as:  # once per plan (one head): what its key's entries were kept as
            plan.verified_as = stored_as(net, plan).encode()
        return plan, net, payload, is_error

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
        if outcome.verified is None and outcome.error is None:  # the trackers', a merge of log pieces
            outcome.verified = shown_as(prepared.network, prepared.call.method, "")
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
            head = net.tracker.head
            params = cap_gas(params, head.gas_limit if head is not None else None, self._settings.gas_cap_multiplier)
        local = policy is not None and policy.cache is CacheClass.TRACKER
        # eth_accounts is [] (local_answers.py) unless ALLOW_METHODS names it: a dev node's unlocked
        # accounts, for a deployment that opened eth_sendTransaction too.
        if local and not (method == "eth_accounts" and method in self._settings.allowed_methods):
            return await self._from_trackers(prepared)
        if policy is None or policy.cache is CacheClass.NONE or local:
            if prepared.refs:  # validated, uncached (eth_estimateGas): block parameters as the caller gave them
                params = substitute(params, {id(r): r.encode() for r in prepared.refs})
            answer = await net.upstream.request(method, params)
            if method in WRITE_METHODS and not answer.is_error and isinstance(net.tracker, EvmHeadTracker):
                net.tracker.wrote()  # writes are hints: the block holding it may be out already (automining)
            if isinstance(net.tracker, EvmHeadTracker) and changes_dev_state(method):
                net.tracker.state_changed()  # the dev node's state changed without a block: drop its entries
                if net.per_upstream is not None:  # its chain id too, maybe (anvil_setChainId): checked now
                    net.per_upstream.states.suspect.set()
            return Outcome.answered(shown(net.tracker, method, answer, prepared.refs), BYPASS)

        refs = prepared.refs
        tracker = net.tracker
        if isinstance(tracker, EvmHeadTracker) and tracker.behind() and any(r.tag == "latest" for r in refs):
            # Read-your-writes: a client saw a block the head has not reached; wait (bounded) for it.
            await tracker.catch_up(self._settings.head_catch_up_wait)
        head = tracker.head
        if policy.limits_logs and not prepared.piece and isinstance(tracker, EvmHeadTracker):
            planned = self._logs.pieces(prepared, tracker, head)
            if planned is not None:
                return await self._chunked(prepared, policy, params, head, planned)
        plan = self._plans.get(prepared.fingerprint) if prepared.fingerprint else None
        if plan is None or plan.head is not head:
            plan = plan_call(prepared, policy, params, head, self._ttls, self._logs, self._metrics)
            if not plan.decision.cacheable:
                # Not cached, but still asked of a node that has the blocks it names.
                self._metrics.child(self._metrics.cache_lookups, "none", "bypass").inc()
                read = Read(net, plan.method, plan.forward, policy, plan, self._reads.deadline(policy))
                answer, doubt = await _uncached(self._asker, read, refs)
                if doubt == "state_gone":  # no upstream keeps that state: counted as on a cached read's miss
                    self._metrics.uncached_answers.labels(net.name, doubt).inc()
                return Outcome.answered(shown(net.tracker, method, answer, refs), BYPASS)
            if prepared.fingerprint:
                # The head fixes everything a plan depends on (tags, finality, hashes, gas limit, identity).
                self._plans[prepared.fingerprint] = plan
        return await self._read_through(prepared, policy, params, plan)

    async def _chunked(
        self,
        prepared: Prepared,
        policy: MethodPolicy,
        params: Any,
        head: Any,
        planned: Pieces,
    ) -> Outcome:
        """A chunked eth_getLogs. A range wholly final is merged once: the merged answer is kept under
        the range's own key, so the next call costs what a plain hit of its size costs (the hot path
        serves it from memory), and identical calls in flight share one merge."""
        deadline = self._logs.deadline()  # from the call's arrival: a wait for a merge place counts
        plan = self._plans.get(prepared.fingerprint) if prepared.fingerprint else None
        if plan is None or plan.head is not head:
            plan = plan_call(prepared, policy, params, head, self._ttls, self._logs, self._metrics)
        if plan.decision.mode is not cp.Mode.IMMUTABLE or not plan.key:
            return await self._logs.chunked(prepared, planned, self._execute, deadline)
        # required: a merge an `auto` replica kept forever (unproven) is merged again (tiers.may_serve).
        stored = await self._cache.get(plan.key, proven_forever=prepared.network.config.verify == "required")
        if stored is not None:
            self._metrics.child(self._metrics.credits_saved, prepared.network.name, prepared.call.method).inc(
                prepared.credits
            )
            return Outcome(*stored, HIT)

        async def merge() -> Outcome:
            outcome = await self._logs.chunked(prepared, planned, self._execute, deadline)
            if not outcome.is_error and outcome.cache != BYPASS:  # every piece kept: so is their merge
                # Its pieces' proofs are not told apart here: a merge is kept unproven (required: for
                # the unfinalized TTL, as nothing unproven is kept forever), and its hits say so.
                ttl = self._ttls.unfinalized if prepared.network.config.verify == "required" else cp.FOREVER
                await self._cache.set(plan.key, (outcome.payload, False), ttl)
                plan.verified_as = b"unproven"
                if prepared.fingerprint:
                    self._plans[prepared.fingerprint] = plan
            return outcome

        # A merge parses every piece: a key has at most MERGES_PER_KEY merges started or joined at
        # once (memory per key), each caller in its own key's queue, never in another key's.
        # A place is free by the call's deadline at the latest (the merges holding them came first, each
        # bounded by its own): one that comes after it is given back at once (outside attack: 12 calls
        # of a key answered 10 s apart in pairs, the last after 60 s).
        async with self._merge_slots.held():
            if asyncio.get_running_loop().time() >= deadline:
                raise self._logs.timed_out()
            outcome, _ = await self._merges.run(via.coalescing(plan.key), merge)
        return outcome

    async def _read_through(self, prepared: Prepared, policy: MethodPolicy, params: Any, plan: Plan) -> Outcome:
        """The cached answer for the plan's key, else the upstream's (kept when it belongs to the key)."""
        net, method, refs = prepared.network, prepared.call.method, prepared.refs
        tracker = net.tracker
        key = plan.key
        # A plain key asks Redis inside the fill, with the fill lock in the same round trip.
        plain = not plan.decision.tied_to_answer and not policy.limits_logs
        vet = sharing.vet(plan)  # a hash outside this replica's window: only another's final block is taken
        # required: an entry kept forever is served only when its writer proved it (tiers.may_serve).
        strict = net.config.verify == "required"
        stored = self._cache.get_memory(key) if plain else await self._cache.get(key, vet, strict)
        if plan.decision.tied_to_answer:
            if stored is not None and not still_tied(net, stored[0]):
                stored = None  # its block was replaced (or is no longer known): ask again
            now_head = tracker.head
            if stored is None and isinstance(now_head, Head) and plan.head is now_head:
                stored = await self._cache.get(unmined_key(key, now_head))
        if stored is None and policy.limits_logs and isinstance(tracker, EvmHeadTracker):
            space = key_space(net, plan.head)
            stored = await self._logs.from_receipts(tracker, params, plan, policy, space) if space else None
        if stored is not None:
            self._logs.check_stored(stored, policy, plan)  # kept by a replica with a higher limit
            self._metrics.child(self._metrics.credits_saved, net.name, method).inc(prepared.credits)
            return Outcome(*stored, HIT, verified=stored_as(net, plan))

        async def fill() -> tuple[Answer, bool, bool]:
            """(answer, tied to its key, found in Redis)."""
            wait = self._settings.coalesce_wait
            hold = self._settings.upstream_timeout + 1
            lock = FillLock(key)
            if plain:
                found = await self._cache.get_or_claim(lock, hold if wait else None, vet, strict)
                if found is not None:
                    return Answer.stored(*found), True, True
            elif wait:
                lock.token = await self._cache.claim(key, hold)
            if lock.token is None:  # another replica is fetching this very key: take its answer
                found = await self._cache.await_fill(key, wait, vet, strict)
                if found is not None:
                    self._metrics.child(self._metrics.upstreams.coalesced, net.name, metric_label(method)).inc()
                    return Answer.stored(*found), True, False
            try:
                return *await self._fetcher.fetch(net, policy, method, params, refs, plan, lock), False
            finally:
                if lock.token:  # not released with the answer's store (nothing stored, or another key)
                    await self._cache.release(key, lock.token)

        (answer, tied, found), joined = await self._coalescer.run(via.coalescing(key), fill)
        if found:
            self._logs.check_stored((answer.payload, answer.is_error), policy, plan)  # another replica's fill
            self._metrics.child(self._metrics.credits_saved, net.name, method).inc(prepared.credits)
            return Outcome(answer.payload, answer.is_error, HIT, verified=stored_as(net, plan))
        if joined:
            self._metrics.child(self._metrics.upstreams.coalesced, net.name, metric_label(method)).inc()
        return Outcome.answered(shown(net.tracker, method, answer, refs), MISS if tied else BYPASS)

    async def _from_trackers(self, prepared: Prepared) -> Outcome:
        """eth_chainId, eth_blockNumber, getSlot, getBlockHeight: from what the trackers hold
        (from_trackers.py), else forwarded uncached and learned from."""
        net, method, params = prepared.network, prepared.call.method, prepared.params
        value = from_trackers.held(method, params, net.tracker, time.time(), self._ttls.token_balance)
        if value is not None:
            self._metrics.child(self._metrics.cache_lookups, "tracker", "hit").inc()
            self._metrics.child(self._metrics.credits_saved, net.name, method).inc(prepared.credits)
            return Outcome(dumps(value), False, HIT)
        self._metrics.child(self._metrics.cache_lookups, "none", "bypass").inc()
        answer = await net.upstream.request(method, params)
        answer = from_trackers.learned(method, params, net.tracker, answer, time.time())
        return Outcome.answered(shown(net.tracker, method, answer, prepared.refs), BYPASS)
