"""One read upstream for the read-through flow, and its judgment: asked of the pool or of one upstream
alone, beside the header of the block that shows its node's chain (proofs.py) or the range's last
block, under eth_getLogs' time and result limits; then whether the answer belongs to its plan's key
(a doubt, or None). Which upstream to ask, and how often again, is asking.py's."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, NoReturn

from proxy.chain import pinning, proofs
from proxy.chain.slots import SolanaSlotTracker
from proxy.config import Settings
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.rpc.jsonrpc import LIMIT_EXCEEDED, UPSTREAM_UNAVAILABLE, JsonRpcError
from proxy.rpc.methods import MethodPolicy
from proxy.upstream.pool import PerUpstream
from proxy.upstream.replies import rate_limited, unhealthy
from proxy.upstream.sending import attempt_share
from proxy.upstream.standing import CATCH_UP_BLOCKS
from proxy.values import Answer, Plan

# Solana methods a node answers from a cache of its own, with that cache's slot in context.slot: an
# in-step node's answer may be far below the slot shown (Agave keeps getLargestAccounts for 2 hours).
NODE_CACHED = frozenset({"getLargestAccounts"})
# Tries for a Solana answer in step with the slot already shown at its commitment (Reads.at_slot_shown).
SLOT_TRIES = 3
CheckResults = Callable[[Any, Answer], Answer]  # eth_getLogs' result limit on an answer (log_reads.py)


class Read(NamedTuple):
    """One read as the flow asks it of upstreams: its network, the method and params that go
    upstream, its policy, its plan for the head, and when it must be answered (loop time: Reads.deadline)."""

    net: NetworkRuntime
    method: str
    forward: Any
    policy: MethodPolicy
    plan: Plan
    deadline: float


class Reads:
    def __init__(self, settings: Settings, metrics: Metrics, check_results: CheckResults) -> None:
        self._settings = settings
        self._metrics = metrics
        self._check_results = check_results

    def deadline(self, policy: MethodPolicy) -> float:
        """When the call must have its answer (loop time), every upstream asked and asked again included:
        UPSTREAM_TIMEOUT from now, or eth_getLogs' own limit (GETLOGS_TIMEOUT)."""
        return asyncio.get_running_loop().time() + self.budget(policy)

    def budget(self, policy: MethodPolicy) -> float:
        """The seconds one call has: UPSTREAM_TIMEOUT, or eth_getLogs' own limit (GETLOGS_TIMEOUT)."""
        return self._settings.getlogs_timeout if policy.limits_logs else self._settings.upstream_timeout

    def past_result_limit(self, net: NetworkRuntime, policy: MethodPolicy, answer: Answer) -> bool:
        """An eth_getLogs answer of more than GETLOGS_MAX_RESULTS logs (counted): a chunked call's
        piece, asked without the limit (the merged call counts its own). Never kept: a call of exactly
        the piece's range would be served it from the cache, past the limit."""
        results = answer.result
        if policy.limits_logs and isinstance(results, list) and len(results) > self._settings.getlogs_max_results:
            self._metrics.uncached_answers.labels(net.name, "too_many_results").inc()
            return True
        return False

    def share(self, read: Read) -> float | None:
        """The next upstream call's timeout: what is left of the read's time, or UPSTREAM_ATTEMPT_TIMEOUT
        if less (docs/caching.md "Failover within budget"); None once the time has passed: no upstream
        is asked again. An eth_getLogs call is bounded by its own deadline instead (_ask_logs: -32005
        once it passes)."""
        if read.policy.limits_logs:
            return self._settings.getlogs_timeout + 1  # as _ask_logs': the deadline decides
        remaining = read.deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return None
        return attempt_share(remaining, 1, self._settings.upstream_attempt_timeout)

    def ask(
        self,
        net: NetworkRuntime,
        method: str,
        params: Any,
        policy: MethodPolicy,
        deadline: float | None = None,
        *,
        ask: int | None = None,
        check: bool = True,
        proof: str | None = None,
        timeout: float | None = None,
    ) -> Awaitable[Answer]:
        """One call upstream (to upstream `ask` alone if given), under eth_getLogs' limits. `check` is
        False for a piece of a chunked call: the result limit holds over the merged answer instead.
        `proof`: the block whose hash the same node reports beside the answer (proofs.py). `timeout`:
        the call's share of the read's time (share()), else UPSTREAM_TIMEOUT (eth_getLogs: its
        deadline). Without eth_getLogs' limits, the upstream's own call is returned: no layer of its
        own around it."""
        per = net.per_upstream
        if not policy.limits_logs:
            if ask is not None and per is not None:
                alone = self._settings.upstream_timeout if timeout is None else timeout
                if proof is not None:
                    return per.proven(method, params, proof, index=ask, timeout=alone)
                return per.ask(ask, method, params, timeout=alone)
            if proof is not None and per is not None:
                return per.proven(method, params, proof, timeout=timeout)  # the pool's: auto-batched without one
            return net.upstream.request(method, params, timeout=timeout)
        return self._ask_logs(net, method, params, policy, deadline, ask, check, proof)

    async def _ask_logs(
        self,
        net: NetworkRuntime,
        method: str,
        params: Any,
        policy: MethodPolicy,
        deadline: float | None,
        ask: int | None,
        check: bool,
        proof: str | None,
    ) -> Answer:
        """ask() for eth_getLogs: within its deadline, its results within the limit."""
        per = net.per_upstream
        if deadline is None:
            deadline = self.deadline(policy)
        timeout = self._settings.getlogs_timeout + 1  # the upstream's own timeout is past ours: ours decides
        try:
            async with asyncio.timeout_at(deadline):
                if proof is not None and per is not None:
                    answer = await per.proven(method, params, proof, index=ask, timeout=timeout)
                elif ask is not None and per is not None:
                    answer = await per.ask(ask, method, params, timeout=timeout)
                else:
                    answer = await net.upstream.request(method, params, timeout=timeout)
        except TimeoutError:
            # spec: a query that runs longer than 10 seconds fails with -32005.
            if check:  # a piece's own limit is no client's: the chunked call counts its own
                self._metrics.getlogs_rejections.labels("timeout").inc()
            raise JsonRpcError(LIMIT_EXCEEDED, "query timeout exceeded") from None
        return self._check_results(params, answer) if check else answer

    async def _with_range_end(
        self,
        net: NetworkRuntime,
        method: str,
        params: Any,
        policy: MethodPolicy,
        end: int,
        deadline: float | None,
        *,
        check: bool = True,
        index: int | None = None,
    ) -> tuple[Answer, Answer | None]:
        """eth_getLogs and the range's last block in one batch (one node answers both: upstream `index`
        alone if given, else the pool's); the logs alone and no block (None) from a node that refuses
        batches."""
        if deadline is None:
            deadline = self.deadline(policy)
        end_answer: Answer | None = None
        calls = [(method, params), ("eth_getBlockByNumber", [hex(end), False])]
        per = net.per_upstream
        try:
            async with asyncio.timeout_at(deadline):
                if index is not None and per is not None:
                    answer, end_answer = await per.ask_all(index, calls, timeout=self._settings.getlogs_timeout + 1)
                elif (both := await net.upstream.together(calls)) is None:
                    answer = await net.upstream.request(method, params)
                else:
                    answer, end_answer = both
        except TimeoutError:
            if check:  # a piece's own limit is no client's: the chunked call counts its own
                self._metrics.getlogs_rejections.labels("timeout").inc()
            raise JsonRpcError(LIMIT_EXCEEDED, "query timeout exceeded") from None
        return (self._check_results(params, answer) if check else answer), end_answer

    async def checked(
        self,
        read: Read,
        index: int | None,
        timeout: float | None = None,
    ) -> tuple[Answer, str | None]:
        """Ask (upstream `index` alone, or the pool; within `timeout` seconds if given: share()) and
        judge whether the answer belongs to the plan's key."""
        net, method, forward, policy, plan, deadline = read
        end_answer = None
        per = net.per_upstream
        proof = plan.proof if plan.check_end is None and per is not None else None
        deferred = None
        if proof is not None and plan.proof_pinned and per is not None and not any(per.states.mixed):
            # The pinned block's header costs a call: asked only of an upstream other than the one
            # the tracker took the block from (a backup, which may be on another fork).
            deferred, proof = proof, None
        check = plan.check_results
        if proof is not None:
            answer = await self.ask(
                net, method, forward, policy, deadline, ask=index, check=check, proof=proof[0], timeout=timeout
            )
        elif plan.check_end is not None:
            # A range above finalized: the node reports the range's last block in the same batch.
            answer, end_answer = await self._with_range_end(
                net, method, forward, policy, plan.check_end[0], deadline, check=plan.check_results, index=index
            )
        elif index is not None and net.per_upstream is not None:
            answer = await self.ask(net, method, forward, policy, deadline, ask=index, check=check, timeout=timeout)
        else:
            answer = await self.ask(net, method, forward, policy, deadline, check=check, timeout=timeout)
        head = net.tracker.head
        if deferred is not None and answer.upstream >= 0 and (head is None or head.source != answer.upstream):
            index, proof = answer.upstream, deferred
            answer = await self.ask(
                net, method, forward, policy, deadline, ask=index, check=check, proof=proof[0], timeout=timeout
            )
        if per is None or answer.upstream < 0:
            solana = net.tracker if isinstance(net.tracker, SolanaSlotTracker) else None
            if solana is not None and method == "getMultipleAccounts":
                _one_per_key(forward, answer)
            return (answer if solana is None else await self.at_slot_shown(read, solana, answer)), None
        if not per.states.vouches(answer.upstream, None):
            return answer, "unverified"
        if (
            plan.decision.tied_to_answer
            and answer.result is None
            and head is not None
            and not per.states.vouches(answer.upstream, head.latest)
        ):
            return answer, "behind_head"  # "not mined" from a node behind: it may be in a block it lacks
        # A block the same node showed in the same batch outranks what the proxy last saw of its head
        # (a load balancer's members differ: its head may be one member's, the answer another's).
        doubt, shown = batch_doubt(net, plan, proof, answer, end_answer)
        # The head's own block beside a range past it (or to `pending`): a node without it answers short.
        # (A fork there with one upstream is its node's reorg since the last poll: ask_pinned.)
        past_head = plan.check_end is not None and not plan.decision.pin_hashes
        if past_head and (doubt == "unproven" or (doubt == "fork" and per.states.size > 1)):
            return answer, "below_head"  # asked of a node at the head (ask_pinned)
        if doubt == "unproven" and not per.states.vouches(answer.upstream, plan.need):
            doubt = "lagging"  # without the block, as its head said
        if doubt is not None:
            return answer, doubt  # an error from a node behind (a range error) is not served either
        if (shown is None or plan.need is None or shown < plan.need) and not per.states.vouches(
            answer.upstream, plan.need
        ):
            if plan.need is not None and head is not None and plan.need > head.latest:
                if (shown is None or shown < head.latest) and not per.states.vouches(answer.upstream, head.latest):
                    return answer, "below_head"  # a node short of the head itself: asked elsewhere (ask_pinned)
                return answer, "beyond_head"  # no upstream is known to have it: served, never stored
            return answer, "lagging"  # an error from it may be just that, too
        if answer.is_error:
            return answer, None
        if plan.check_end is not None and head is not None and not pinning.logs_on_chain(answer.result, head.hashes):
            return answer, "fork"
        return answer, None

    async def caught_up(self, per: PerUpstream, index: int, need: int | None, timeout: float | None) -> bool:
        """Ask upstream `index` for its head now, within `timeout` (share(); None: no time is left): has
        it reached block `need`? (It may have passed the proxy's last look at it, e.g. a block just
        mined and not polled yet.)"""
        if need is None or index < 0 or timeout is None:
            return False
        try:
            answer = await per.ask(index, "eth_blockNumber", [], timeout=timeout)
            number = int(answer.result, 16) if isinstance(answer.result, str) else -1
        except (JsonRpcError, ValueError):
            return False
        per.states.observe_head(index, number)
        return number >= need

    async def canonical(self, net: NetworkRuntime, plan: Plan, answer: Answer) -> bool:
        """A hash-addressed answer for a hash outside the tracker's window: is its block canonical?
        The node that gave it shows its block at that height and its finalized block, in one batch."""
        per, head, block_hash = net.per_upstream, plan.head, plan.unvouched_hash
        if per is None or head is None or block_hash is None or answer.upstream < 0:
            return per is None  # without per-upstream state nothing is proven, and nothing asked
        if not head.final_hash:
            return False
        number = proofs.answer_block_number(answer.result)
        try:
            if number is None:  # a count, an empty list: the block's number from the same node first
                block = await per.ask(
                    answer.upstream, "eth_getBlockByHash", [block_hash, False], timeout=self._settings.upstream_timeout
                )
                number = proofs.answer_block_number(block.result)
                if number is None:
                    return False
            header = await per.proven(
                "eth_getBlockByNumber",
                [hex(number), False],
                hex(head.finalized),
                index=answer.upstream,
                timeout=self._settings.upstream_timeout,
            )
        except JsonRpcError:
            return False
        found = header.result.get("hash") if isinstance(header.result, dict) else None
        return header.proof == head.final_hash and isinstance(found, str) and found.lower() == block_hash

    async def at_slot_shown(self, read: Read, tracker: SolanaSlotTracker, answer: Answer) -> Answer:
        """A Solana answer whose context.slot is more than CATCH_UP_BLOCKS below a slot already shown at
        its commitment (a node behind: restarted from an old snapshot, a balancer's member behind) is
        never the answer: asked of each other upstream in rotation (the furthest polled first), then of
        the pool, SLOT_TRIES in all, within the call's time; else the call fails (-32002, `lagging`)."""
        shown = None if read.method in NODE_CACHED else _behind(read, tracker, answer)
        if shown is None:
            return answer
        upstream = read.net.upstream
        per = upstream if isinstance(upstream, PerUpstream) else None
        others: list[int | None] = []
        if per is not None:  # its own slot a poll behind the one shown, maybe: every other, furthest first
            states = per.states
            ranked = sorted(range(states.size), key=lambda i: -states.latest[i])
            others = [i for i in ranked if i != answer.upstream and states.in_rotation(i)]
        tries = (others + [None] * SLOT_TRIES)[:SLOT_TRIES]
        for index in tries:
            if (timeout := self.share(read)) is None:
                break  # the call's time is up
            try:
                if index is not None and per is not None:
                    retried = await per.ask(index, read.method, read.forward, timeout=timeout)
                else:
                    retried = await upstream.request(read.method, read.forward, timeout=timeout)
            except JsonRpcError:
                continue
            if retried.is_error and _no_answer({"error": retried.error}):
                continue  # a node unhealthy or rate-limited (pool.ask hands its word back): no answer
            if _behind(read, tracker, retried) is None:
                return retried
        self.refuse(read.net, "lagging", shown, "slot")

    def refuse(self, net: NetworkRuntime, reason: str, need: int | None, unit: str = "block") -> NoReturn:
        self._metrics.uncached_answers.labels(net.name, reason).inc()
        block = f"{unit} {need}" if need is not None else f"the {unit}"
        raise JsonRpcError(
            UPSTREAM_UNAVAILABLE,
            f"upstream unavailable: network '{net.name}' (no upstream could answer for {block} of the network's chain)",
            http_status=502,
        )


def batch_doubt(
    net: NetworkRuntime,
    plan: Plan,
    proof: proofs.Proof | None,
    answer: Answer,
    end_answer: Answer | None,
) -> tuple[str | None, int | None]:
    """What the block asked beside the call says (a doubt, or None), and the highest block number
    the node showed it has on the network's chain (None when it showed none)."""
    per = net.per_upstream
    assert per is not None
    if proof is not None:
        head = net.tracker.head
        if (
            answer.proof is None
            and plan.proof_pinned
            and head is not None
            and head.source == answer.upstream
            and not per.states.went_back(answer.upstream)
        ):
            return None, None  # the head's own node, not seen steady yet, that takes no batches: as if deferred
        if answer.proof is None:
            return "unverified", None  # no header came with it (it failed, or the call went alone): never kept
        doubt = proofs.proof_doubt(proof, answer.proof, final=not plan.proof_pinned, head=head)
        if doubt == "off_chain":
            per.states.off_chain(answer.upstream)  # checked again at once (identity.py)
        if doubt is not None:
            return doubt, None
        return None, int(proof[0], 16) if proof[2] and proof[0].startswith("0x") else None
    if plan.check_end is not None:
        if end_answer is None:
            # Asked alone (the node refuses batches): a block asked alone would show nothing of the
            # logs' node (a load balancer's members differ), so nothing does: served, never kept.
            return "unverified", None
        end = end_answer.result
        same_node = end_answer.upstream == answer.upstream
        if same_node and end is None and not plan.tags_resolved:
            # No block there (a node behind, a balancer's lagging member): asked again, elsewhere. (A
            # range the caller named by tags is refused, as another fork's: asked as the tag, an answer
            # the node's head cannot be shown beside would be judged by its head as last polled.)
            return "unproven", None
        if not same_node or not isinstance(end, dict) or str(end.get("hash", "")).lower() != plan.check_end[1]:
            # An error from a node without the range's last block (a range error) is not served either.
            return "unproven" if answer.is_error else "fork", None
        return None, plan.check_end[0]
    return None, None


def _no_answer(reply: dict[str, Any]) -> bool:
    """A node's word that it cannot answer now (Agave's -32005 unhealthy or behind, a rate limit)."""
    return unhealthy(reply) is not None or rate_limited(reply) is not None


def _one_per_key(forward: Any, answer: Answer) -> None:
    """getMultipleAccounts answers one entry per key asked, in their order (Agave): a list of another
    length pairs no entry with its key, so it is no answer to the call (-32002), never kept."""
    result = answer.result
    value = result.get("value") if isinstance(result, dict) else None
    if isinstance(value, list) and isinstance(forward, list) and forward and len(value) != len(forward[0]):
        raise JsonRpcError(
            UPSTREAM_UNAVAILABLE,
            f"malformed result: getMultipleAccounts answered {len(value)} accounts for {len(forward[0])} keys",
            http_status=502,
        )


def _behind(read: Read, tracker: SolanaSlotTracker, answer: Answer) -> int | None:
    """The slot already shown that a Solana answer falls behind: its context.slot more than
    CATCH_UP_BLOCKS below it, or getBlock's -32004 (not available) at `finalized` for a block more than
    that below it (a backup behind passed it through while the primary was unhealthy); else None."""
    if answer.is_error:
        return tracker.lacks(read.forward, answer.error_code, CATCH_UP_BLOCKS) if read.method == "getBlock" else None
    return tracker.behind(read.forward, answer.result, CATCH_UP_BLOCKS)
