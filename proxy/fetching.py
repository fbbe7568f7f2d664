"""A miss: its answer asked of an upstream that has the blocks it depends on (asking.py), checked
where it is to be kept forever (cache/integrity.py), and kept under its key when it belongs to it."""

from __future__ import annotations

from typing import Any

from proxy.asking import TAG_UNPROVEN, Asker, from_heads_chain
from proxy.cache import policy as cp
from proxy.cache import sharing
from proxy.cache.integrity import Integrity
from proxy.cache.tiers import FillLock, TieredCache
from proxy.chain import answer_proofs as ap
from proxy.chain.head_polls import Head
from proxy.chain.heads import EvmHeadTracker
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.rpc.jsonrpc import loads
from proxy.rpc.methods import MethodPolicy
from proxy.rpc.params import BlockRef, substitute
from proxy.upstream_reads import Read, Reads
from proxy.values import Answer, Plan
from proxy.verifying import NOT_APPLICABLE, OFF, PROVEN, UNFINAL, Verifier, shown_as


class Fetcher:
    def __init__(
        self,
        asker: Asker,
        reads: Reads,
        integrity: Integrity,
        cache: TieredCache,
        metrics: Metrics,
        ttls: cp.Ttls,
        verifier: Verifier,
    ) -> None:
        self._asker = asker
        self._reads = reads
        self._integrity = integrity
        self._verifier = verifier
        self._cache = cache
        self._metrics = metrics
        self._ttls = ttls

    async def fetch(
        self,
        net: NetworkRuntime,
        policy: MethodPolicy,
        method: str,
        params: Any,
        refs: list[BlockRef],
        plan: Plan,
        lock: FillLock,
    ) -> tuple[Answer, bool]:
        """A miss: ask upstream and keep the answer if it belongs to its key. (answer, tied): `tied` False when
        it could not be tied to the key's block (served as BYPASS); every return tells X-Verified (_told)."""
        deadline = self._reads.deadline(policy)  # the whole call's: asked again as the tag included
        read = Read(net, plan.method, plan.forward, policy, plan, deadline)
        answer, doubt = await self._asker.ask_pinned(read)
        kind = cp.answer_kind(answer.result, answer.error_code, answer.is_error, caches_reverts=policy.caches_reverts)
        if doubt == TAG_UNPROVEN or (plan.tags_resolved and kind in ("null", "error")):
            # The node may lag the tracker, or (its only node) reorged since the last poll: asked
            # again with the caller's own params, nothing kept (that answer has no fixed block).
            original = substitute(params, {id(r): r.encode() for r in refs})
            tagged = await self._asker.ask_as_tag(Read(net, method, original, policy, plan, deadline))
            return _told(net, plan, tagged), False
        provable_null = kind == "null" and self._provable_null(net, plan)
        if doubt is not None and not (doubt == "unknown_hash" and provable_null):  # served, never stored
            self._metrics.uncached_answers.labels(net.name, doubt).inc()
            return _told(net, plan, answer), False
        if plan.unvouched_hash is not None and kind == "ok" and not await self._reads.canonical(net, plan, answer):
            self._metrics.uncached_answers.labels(net.name, "unverified").inc()
            return _told(net, plan, answer), False  # a block hash not shown canonical: served, not kept
        ttl = cp.store_ttl(plan.decision, policy.cache, kind, self._ttls)
        key = plan.key
        if plan.decision.tied_to_answer and kind in ("ok", "null"):
            tracker = net.tracker
            orphans = tracker.orphans if isinstance(tracker, EvmHeadTracker) else {}
            ttl = cp.transaction_ttl(answer.result, tracker.head, orphans, self._ttls)
            if ttl is None:  # its block is not one the tracker vouches for: served, not kept
                served = await from_heads_chain(self._reads, read, answer)  # the head's chain's, not another fork's
                return _told(net, plan, served), False
            if cp.answer_block(answer.result) is None:
                # Not yet mined: true of this head only. Kept under the head's key, so the next block
                # (which may hold it) is asked again at once, whatever is left of the negative TTL.
                now_head = tracker.head
                if not isinstance(now_head, Head) or plan.head is not now_head:
                    return _told(net, plan, answer), False
                key = unmined_key(key, now_head)
        verdict, null_ttl = NOT_APPLICABLE, None
        if provable_null and ttl is not None:
            null_ttl, ttl = ttl, cp.FOREVER  # no uncle at that index of a final block: as final as the block
        if ttl == cp.FOREVER and (kind == "ok" or null_ttl is not None):
            # Verified answers (verifying.py): a refuted or unproven answer is served, never kept.
            verdict, answer = await self._verifier.settle(net, plan, answer)
            answer.verified = shown_as(net, plan.method, verdict)
            if verdict not in (PROVEN, NOT_APPLICABLE, UNFINAL, OFF):
                self._metrics.uncached_answers.labels(net.name, verdict).inc()
                return _told(net, plan, answer), False
            if null_ttl is not None and verdict != PROVEN:
                if doubt is not None:  # its node may lack the block, and no proof says otherwise
                    self._metrics.uncached_answers.labels(net.name, doubt).inc()
                    return _told(net, plan, answer), False
                ttl = null_ttl  # a null not proven (a block above finality): kept no longer than before
        if ttl == cp.FOREVER and verdict != PROVEN and net.config.verify == "required":
            ttl = self._ttls.unfinalized  # nothing unproven is kept forever (a revert, no proof covers, too)
        if ttl == cp.FOREVER and verdict != PROVEN and self._integrity.checks(net):  # a proof beats a vote
            doubt, answer = await self._integrity.doubt(net, plan, params, answer)
            if doubt is not None:  # served, never stored
                self._metrics.uncached_answers.labels(net.name, doubt).inc()
                return _told(net, plan, answer), False
        if ttl is not None and verdict != PROVEN and ap.other_item(plan.method, plan.forward, answer.result):
            self._metrics.uncached_answers.labels(net.name, "other_item").inc()  # unproven: prove() refutes it
            return _told(net, plan, answer), False  # another block, transaction or receipt than asked for: never kept
        if ttl is not None and self._reads.past_result_limit(net, policy, answer):
            return _told(net, plan, answer), True  # its key's: served to the merge, never kept
        if ttl is not None and self._cache.shared is None:
            self._cache.keep(key, (answer.payload, answer.is_error), ttl)  # memory alone: nothing to await
        elif ttl is not None:
            shared, final_at = sharing.share(plan, kind, answer.result)  # which replicas may take it
            stored = (answer.payload, answer.is_error)  # marked proven or not: tiers.may_serve
            await self._cache.set(key, stored, ttl, lock, shared=shared, final_at=final_at, proven=verdict == PROVEN)
        return _told(net, plan, answer), True

    def _provable_null(self, net: NetworkRuntime, plan: Plan) -> bool:
        """A null about a block hash (its node may lack the block) that a proof can show is the block's."""
        return plan.decision.mode is cp.Mode.IMMUTABLE and self._verifier.proves_null(net, plan.method)


def still_tied(net: NetworkRuntime, payload: bytes) -> bool:
    """A cached transaction or receipt: is the block it names still final or canonical?"""
    tracker = net.tracker
    if not isinstance(tracker, EvmHeadTracker):
        return False
    return cp.transaction_servable(loads(payload), tracker.head, tracker.orphans)


def _told(net: NetworkRuntime, plan: Plan, answer: Answer) -> Answer:
    """The answer with X-Verified told (settle() tells it of an answer it judged)."""
    if not answer.verified:
        answer.verified = shown_as(net, plan.method, "")
    return answer


def unmined_key(key: str, head: Head) -> str:
    """Where a not-yet-mined transaction or receipt (null, or pending) is kept: for one head only."""
    return f"{key}@{head.latest_hash}"
