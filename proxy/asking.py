"""Asking upstreams for an answer that can be tied to its cache key: pinned to an upstream that has
the blocks the answer depends on (per-upstream heads), checked for the fork it comes from, and within
the call's time (one UPSTREAM_TIMEOUT, each upstream asked its share: Reads.share; eth_getLogs' own
limit). An upstream that lacks a block is replaced by one that has it; if none does, the call fails
(-32002) rather than serve what a lagging node or another fork said."""

from __future__ import annotations

from collections.abc import Awaitable

from proxy.cache import policy as cp
from proxy.chain import proofs
from proxy.chain.answer_proofs import PROVABLE
from proxy.chain.heads import EvmHeadTracker
from proxy.hedging import Walk
from proxy.network import NetworkRuntime
from proxy.rpc.jsonrpc import (
    EXECUTION_REVERTED,
    INVALID_REQUEST,
    PARSE_ERROR,
    UPSTREAM_UNAVAILABLE,
    JsonRpcError,
)
from proxy.rpc.methods import CacheClass
from proxy.upstream.replies import block_unknown, state_gone
from proxy.upstream.sending import too_large, upstream_timeout
from proxy.upstream_reads import Read, Reads
from proxy.values import Answer, Mode, Plan

# A state read by block hash alone that this many upstreams answer as not knowing the block (null,
# "header not found"), none saying its state was pruned, is a hash no node knows: asked no further,
# so a made-up hash costs what it did before every upstream was walked (the first node and one other).
UNKNOWN_ENOUGH = 2

# Doubts that fail the call (-32002) when no other upstream could answer: serving the answer would
# serve another chain's (or a node behind's) view of the block.
REFUSED = frozenset({"lagging", "fork", "off_chain", "unproven", "orphaned"})
# A read at a tag the tracker resolved whose node could not show the block: asked again as the tag.
TAG_UNPROVEN = "tag_unproven"
# Errors that are a node's answer to the call whatever blocks it holds: a revert, the request's own faults.
ANSWERS_TO_THE_REQUEST = frozenset({EXECUTION_REVERTED, INVALID_REQUEST, PARSE_ERROR})

# Reads of a block's history rather than its state: a node that shows a final block yet answers null
# for its receipts, the block itself or its counts has dropped them (history expiry, EIP-4444), as a
# pruned node drops old state. (A transaction or uncle at an index may be null: its null is proven.)
HISTORY = frozenset(
    {
        "eth_getBlockReceipts",
        "eth_getBlockByNumber",
        "eth_getBlockTransactionCountByNumber",
        "eth_getUncleCountByBlockNumber",
    }
)

# Tries for an answer shown at the block it needs when a node behind answered first (one URL may be a
# load balancer whose member far behind takes a share of the calls: each try may reach another member).
# Each try may take what is left of the call's time: a slow member at the head still answers, and a
# stalled one ends the call at its deadline.
ASK_AGAIN = 5


class Asker:
    """Which upstream answers a read, and how often it is asked again, until its answer can be tied to
    its key or is refused; one read and its judgment are Reads'."""

    def __init__(self, reads: Reads) -> None:
        self._reads = reads

    async def ask_pinned(
        self,
        read: Read,
    ) -> tuple[Answer, str | None]:
        """The upstream's answer, and why it cannot be tied to its key (None when it can). An upstream
        that lacks a block the answer depends on is replaced by one that has it, when one does; if
        none does, the call fails (-32002) rather than serve what a lagging node or another fork said."""
        net, policy, plan = read.net, read.policy, read.plan
        answer, doubt = await self._first_answer(read)
        if (
            (plan.need is not None or plan.by_hash)
            and policy.cache is CacheClass.BLOCK
            and _lacks_state(read, answer, doubt)
        ) or (answer.is_error and state_gone(answer.error)):  # any method: logs, a receipt by its hash
            answer, doubt = await _state_elsewhere(self._reads, read, answer, doubt)
            if doubt == "state_gone" and not answer.is_error:
                _unless_required(read)
            if doubt in ("state_gone", "unknown_hash"):
                return answer, doubt  # every upstream that might hold it was asked: served, never kept
        per, head = net.per_upstream, net.tracker.head
        if (
            per is not None
            and head is not None
            and (
                doubt == "below_head"
                or (doubt == "other_head" and answer.proof_number is not None and answer.proof_number < head.latest)
            )
        ):
            # README "A node behind the head": a read at the head (fees, a range past it) from a node
            # that has not reached the tracker's head is never the answer.
            return await self._at_head(read, answer.upstream, head.latest)
        if doubt == "unverified" and answer.unbatched and not _not_found(answer):
            # Its node refused the batch that would have shown its chain: served as the node gave it,
            # never kept, and not asked elsewhere. (A null or an error is asked again below.)
            return answer, doubt
        orphan = plan.proof is not None and not plan.proof[2]  # null is the canonical chain's answer
        # A null or an error is asked again beside its block's header, also when it came unproven (its
        # batch failed and it went alone): a load balancer's lagging member answers that way too, and
        # serving its range error would answer for a chain without the block.
        shown_at = (
            _provable_block(net, plan, answer)
            if doubt in (None, "unverified") and not orphan and _not_found(answer)
            else None
        )
        if shown_at is not None:
            answer, doubt = await self._shown_at_need(read, answer, shown_at)
            if doubt in REFUSED:
                self._reads.refuse(net, doubt, plan.need)
            return answer, doubt
        if doubt is None and plan.by_hash and _not_found(answer) and not orphan:
            doubt = "unknown_hash"  # that node may not know the block: another may
        elif (
            doubt == "unverified"
            and not answer.unbatched
            and plan.need is not None
            and head is not None
            and plan.need <= head.latest
            and not plan.tags_resolved
            and _not_found(answer)
        ):
            # Its batch failed (a 500, a partial reply) and it went alone, with no header the tracker
            # still holds to show it with (or for a block a reorg replaced): a load balancer's lagging
            # member answers that way. Asked again; served only when shown with the chain, else refused
            # (-32002).
            doubt = "unproven"
        if doubt is None:
            return answer, doubt  # tied to its key: nothing to ask elsewhere (_elsewhere keeps it so)
        return await self._elsewhere(read, answer, doubt, orphan)

    async def _elsewhere(
        self,
        read: Read,
        answer: Answer,
        doubt: str | None,
        orphan: bool,
    ) -> tuple[Answer, str | None]:
        """An answer in doubt asked again of another upstream that has the block (or of the pool once
        more), then what its doubt means for the call: kept, served only, or refused."""
        net, plan = read.net, read.plan
        per = net.per_upstream
        if doubt is not None and doubt != "other_head" and per is not None:
            other = per.states.other_with(answer.upstream, plan.need)
            # No other upstream: the pool once more when the tracker knows the block (a load balancer
            # may send it to a member that has it).
            timeout = self._reads.share(read)  # None: the call's time is up, nothing asked again
            if timeout is not None and (
                other is not None
                or (
                    plan.need is not None
                    and not plan.tags_resolved
                    and doubt in ("unknown_hash", "unproven", "lagging")
                )
            ):
                try:
                    retried, again = await self._reads.checked(read, other, timeout)
                except JsonRpcError:
                    if doubt == "unknown_hash":
                        raise  # a node that may not know the block said not-found; the one that may is down
                else:
                    if again is None and plan.by_hash and _not_found(retried) and not orphan:
                        again = "unknown_hash"
                    if again is None or doubt == "unknown_hash":
                        answer, doubt = retried, again
        if (
            doubt == "unknown_hash"
            and plan.need is not None
            and not plan.tags_resolved
            and not (per is not None and per.states.vouches(answer.upstream, plan.need))
        ):
            # The tracker has the block the caller named: a node without it is behind, not the chain.
            # (A node whose head has the block means its null: no uncle, no transaction at that index.
            # A tag the tracker resolved is asked again as the tag instead: service.py.)
            doubt = "unproven"
        if (
            doubt == "lagging"
            and per is not None
            and await self._reads.caught_up(per, answer.upstream, plan.need, self._reads.share(read))
        ):
            # Its head had not been seen at the block yet. Asked again beside that block's header
            # when the tracker holds its hash (the head and the answer may be two members' of a load
            # balancer), else served, never stored.
            shown_at = _provable_block(net, plan, answer)
            if shown_at is None:
                doubt = "late_head"
            else:
                answer, doubt = await self._shown_at_need(read, answer, shown_at)
        if (plan.tags_resolved and doubt in ("unproven", "lagging")) or (doubt == "fork" and _one_chain(net)):
            # At a tag the tracker resolved, its node showed no block the tracker holds beside the
            # answer, or a head short of it: it may lag the tracker (a load balancer's stalled member
            # may have answered both the call and the look at its head). Asked again with the
            # caller's tag instead (fetching.py), never kept, rather than refused for a block the
            # chain has; the tag's answer is served only from a node at the tracker's head. So is
            # any read whose block is another fork's when the network has one upstream (a `latest`,
            # a range to `pending`, a number of the unfinalized window): the tracker's chain is that
            # node's, and it reorged since the last poll (every such read was a 502 until then).
            doubt = TAG_UNPROVEN
        if doubt in REFUSED:
            self._reads.refuse(net, doubt, plan.need)
        return answer, doubt

    def _first_answer(
        self,
        read: Read,
    ) -> Awaitable[tuple[Answer, str | None]]:
        """The pool's answer; for state older than some upstream keeps (a pruned node), the answer of
        the first upstream known to hold it, asked alone (the pool when that one fails). The pool's
        own call is returned, not wrapped: every miss passes here, most to archive nodes."""
        per, need = read.net.per_upstream, read.plan.need
        if per is not None and need is not None and read.policy.cache is CacheClass.BLOCK and per.states.windowed():
            states = per.states
            if any(states.in_rotation(i) and not states.holds_state(i, need) for i in range(states.size)):
                holder = states.other_with_state((), need)
                if holder is not None:
                    return self._holder_first(read, holder)
        return self._reads.checked(read, None)

    async def _holder_first(self, read: Read, holder: int) -> tuple[Answer, str | None]:
        """Upstream `holder`'s answer, asked alone; the pool's (whose order decides, and which asks a
        pruned node's error again) when it fails, or beside it once it has had half the call's time
        (hedging.py): a stalled holder leaves time for the rest, a slow one is not cut off."""
        attempts: list[int | None] = [holder, None]

        def start(timeout: float) -> Awaitable[tuple[Answer, str | None]] | None:
            return self._reads.checked(read, attempts.pop(0), timeout) if attempts else None

        walk = Walk(start, lambda: len(attempts), _taken, read.deadline, JsonRpcError)
        found = await walk.run()
        if found is not None:
            return found
        if walk.failures:
            raise walk.failures[-1]  # the pool's failure (or the holder's, when the time was up before the pool's)
        raise upstream_timeout(read.net.name, self._reads.budget(read.policy))

    async def _shown_at_need(
        self,
        read: Read,
        answer: Answer,
        proof: proofs.Proof,
    ) -> tuple[Answer, str | None]:
        """A null or an error for a call that needs a block the tracker holds: the answer of a node
        that has the block (no uncle there, no such log), or of one behind it (a load balancer's lagging
        member: a range error, a null for a hash it never saw)? Asked again with the node's header at
        that height in the same batch, ASK_AGAIN times at most; served only from a node that shows the
        block (a null by hash is still never stored: `unknown_hash`), else refused as `lagging`."""
        net, method, forward, policy, plan, deadline = read
        per = net.per_upstream
        assert per is not None
        index = per.states.other_with(answer.upstream, plan.need)
        for _ in range(ASK_AGAIN):
            if (timeout := self._reads.share(read)) is None:
                break  # the call's time is up: as when no try showed the block
            try:
                retried = await self._reads.ask(
                    net,
                    method,
                    forward,
                    policy,
                    deadline,
                    ask=index,
                    check=plan.check_results,
                    proof=proof[0],
                    timeout=timeout,
                )
            except JsonRpcError as error:
                if too_large(error):
                    raise  # asked again, the node would send it again
                retried = None
            if retried is not None and retried.proof is None and (not _not_found(retried) or retried.unbatched):
                return retried, "unverified"  # a node that takes no batches shows nothing: served, never kept
            # A null or an error with no header (a batch answered in part) is the doubt itself: asked again.
            if (
                retried is not None
                and retried.proof is not None
                and _shown(net, proof, retried.proof, retried.proof_number)
            ):
                return retried, "unknown_hash" if plan.by_hash and _not_found(retried) else None
            index = None  # the pool once more: a load balancer may send it to a member that has the block
        return answer, "lagging"

    async def _at_head(
        self,
        read: Read,
        behind: int,
        latest: int,
    ) -> tuple[Answer, str | None]:
        """The answer of a node at the tracker's head (`latest`) for a read at the head that upstream
        `behind` answered from an older block: another upstream that has reached it first, then the
        pool (a load balancer may send it to a member at the head), ASK_AGAIN tries in all; else the
        call fails (-32002, `lagging`)."""
        net = read.net
        per = net.per_upstream
        assert per is not None
        index = per.states.other_with(behind, latest)
        for _ in range(ASK_AGAIN):
            if (timeout := self._reads.share(read)) is None:
                break  # the call's time is up: as when no try reached the head
            try:
                retried, again = await self._reads.checked(read, index, timeout)
            except JsonRpcError:
                retried, again = None, "failed"
            index = None
            if retried is None:
                continue
            if again in (None, "beyond_head") or (
                again == "other_head" and retried.proof_number is not None and retried.proof_number >= latest
            ):
                return retried, again
        self._reads.refuse(net, "lagging", latest)

    async def ask_as_tag(self, read: Read) -> Answer:
        """A call asked with the caller's tag (its resolved block was not shown: `read` holds the
        caller's params), beside the node's latest block in the same batch. Refused when that node is
        behind the block the tag stood for (so `latest` never goes backwards for a client) or its
        latest block is an older one of the tracker's window, or one the tracker saw replaced (a load
        balancer's lagging member), or when the call's time is up first."""
        net, method, params, policy, plan, deadline = read
        need, head, per = plan.need, net.tracker.head, net.per_upstream
        proof = ("latest", head.latest_hash, True) if head is not None and per is not None else None
        index: int | None = None  # the pool's choice first, then an upstream known to have reached `need`
        for _ in range(ASK_AGAIN):
            if (timeout := self._reads.share(read)) is None:
                break
            block = proof[0] if proof else None
            answer = await self._reads.ask(
                net, method, params, policy, deadline, ask=index, proof=block, timeout=timeout
            )
            if proof is None or answer.unbatched:
                # No block can come beside it: judged by the node's head as last polled.
                if (
                    per is not None
                    and answer.upstream >= 0
                    and per.states.verified[answer.upstream]
                    and need is not None
                    and per.states.latest[answer.upstream] < need
                ):
                    self._reads.refuse(net, "lagging", need)
                return answer
            if answer.proof is not None and _shown(net, proof, answer.proof, answer.proof_number):
                return answer  # the head the same node showed outranks its last polled one
            # Not shown at the tracker's head, or not shown at all (its batch failed and it went
            # alone): an upstream behind (the first by priority a few blocks back, a load balancer's
            # lagging member) answers a tag with its own older head. Asked again of another upstream
            # that has reached the head, else of the pool (the balancer may pick a member at the head).
            index = per.states.other_with(answer.upstream, need) if per is not None else None
        self._reads.refuse(net, "lagging", need)


async def _state_elsewhere(
    reads: Reads,
    read: Read,
    answer: Answer,
    doubt: str | None,
) -> tuple[Answer, str | None]:
    """A node said it has no state at the block asked (a pruned node's error; a null or "header not
    found" for a final block: _lacks_state): a pruned node is noted as keeping recent state only,
    and the call goes to each upstream that may still hold it until one answers. When none can,
    the first node's answer is served (`state_gone`: never kept, X-Cache BYPASS, counted), or, for
    a block named by hash alone that no node called pruned, `unknown_hash` (a hash none knows)."""
    net, plan = read.net, read.plan
    per, need = net.per_upstream, plan.need
    if per is None:
        return answer, doubt
    # A read by hash alone (need None: a block older than the tracker's window) is asked of every
    # other upstream; a number teaches a pruned node's window, a null or a missing block none.
    pruned = answer.is_error and state_gone(answer.error)
    if need is not None and pruned:
        per.states.state_gone(answer.upstream, need)
    states, tried = per.states, {answer.upstream}
    unknown = 0 if pruned else 1  # nodes that know no such block (by hash alone, and none said pruned)

    def others() -> list[int]:
        if need is None and not pruned and unknown >= UNKNOWN_ENOUGH:
            return []  # a hash no node knows (made up, another fork's): not every upstream is asked
        return states.others_with_state(tried, need)

    def start(timeout: float) -> Awaitable[tuple[Answer, str | None]] | None:
        left = others()
        if not left:
            return None
        tried.add(left[0])
        return reads.checked(read, left[0], timeout)

    def judge(outcome: tuple[Answer, str | None]) -> tuple[Answer, str | None] | None:
        nonlocal pruned, unknown
        retried, again = outcome
        if retried.is_error and state_gone(retried.error):
            pruned = True
            if need is not None:
                states.state_gone(retried.upstream, need)
            return None
        if _lacks_state(read, retried, again):
            unknown += 1
            return None  # an archive node without that block's history: no answer either
        return retried, again

    # Each node may take until the call's deadline, and once it has had its share of the time left the
    # next starts beside it: stalled nodes leave time for the rest, a slow archive is not cut off.
    found = await Walk(start, lambda: len(others()), judge, read.deadline, JsonRpcError).run()
    if found is not None:
        return found
    return answer, "state_gone" if need is not None or pruned else "unknown_hash"


async def from_heads_chain(reads: Reads, read: Read, answer: Answer) -> Answer:
    """What to serve for a transaction or receipt by hash that is not kept: `answer`, unless its block
    is at a height where the fresh head holds another hash, or one the tracker saw replaced: another
    fork's (a backup on a fork the network left gave it, where the network's node answers null). Then
    the answer of an upstream at the head on the head's chain, when its block is on that chain too or
    it has none (null, pending); -32002 when none gives one (the network's node cooling down, or its
    own reorg not polled yet), never the other fork's. With one upstream, `answer`: its own chain moved
    since the last poll."""
    net = read.net
    per, head, tracker = net.per_upstream, net.tracker.head, net.tracker
    block = cp.answer_block(answer.result)
    if block is None or per is None or head is None or head.stale or not isinstance(tracker, EvmHeadTracker):
        return answer
    number, block_hash = block
    held = head.hashes.get(number)
    if (block_hash not in tracker.orphans and (held is None or held == block_hash)) or _one_chain(net):
        return answer
    other, timeout = per.states.other_with(answer.upstream, head.latest), reads.share(read)
    if other is not None and timeout is not None:
        try:
            retried, doubt = await reads.checked(read, other, timeout)
        except JsonRpcError:
            pass
        else:
            if (
                doubt is None
                and not retried.is_error
                and cp.transaction_servable(retried.result, head, tracker.orphans)
            ):
                return retried
    reads.refuse(net, "fork", number)


def _taken(outcome: tuple[Answer, str | None]) -> tuple[Answer, str | None]:
    """A walk's judge that takes the first answer that comes."""
    return outcome


def _provable_block(net: NetworkRuntime, plan: Plan, answer: Answer) -> proofs.Proof | None:
    """The header a null or an error is shown with (the block the call needs, whose hash the tracker
    holds), unless the answer came with it already or a tag resolved to it (asked again as the tag).
    For a hash the tracker does not know, asked of an upstream whose head went back (a load
    balancer's lagging member may not have the block yet): the node's latest block."""
    head, need, per = net.tracker.head, plan.need, net.per_upstream
    if head is None or per is None or plan.tags_resolved:
        return None
    expected = head.hashes.get(need) if need is not None else None
    if expected is None:
        mixed = 0 <= answer.upstream < per.states.size and per.states.mixed[answer.upstream]
        return ("latest", head.latest_hash, True) if mixed and plan.by_hash and need is None else None
    proof = (hex(need or 0), expected, True)
    shown = answer.proof == expected and plan.proof is not None and plan.proof[:2] == proof[:2]
    return None if shown else proof


def _one_chain(net: NetworkRuntime) -> bool:
    """The network has one upstream: no other fork than the one its head tracker follows."""
    per = net.per_upstream
    return per is None or per.states.size == 1


def _shown(net: NetworkRuntime, proof: proofs.Proof, seen: str | None, number: int | None = None) -> bool:
    """The node showed the block a proof asks for; for `latest`, a head at or past the tracker's (not
    an older block of its window, nor one it saw replaced, nor one below it: `number`, the number
    the node gave with that hash, when it gave one: a load balancer's member far behind)."""
    tracker = net.tracker
    head = tracker.head
    if proof[0] != "latest":
        return proofs.proof_doubt(proof, seen, final=False, head=head) is None
    orphans = tracker.orphans if isinstance(tracker, EvmHeadTracker) else {}
    return (
        bool(seen)
        and head is not None
        and (
            seen == head.latest_hash
            or (seen not in head.numbers and seen not in orphans and (number is None or number >= head.latest))
        )
    )


def _lacks_state(read: Read, answer: Answer, doubt: str | None) -> bool:
    """The node's answer says it cannot give the state at the block asked: a pruned-state error; or,
    for a state read or a history read (HISTORY) of a final block its node showed it has (no doubt:
    the finalized header came beside it), a null (neither answers null for a block that exists) or
    an unknown-block error (a node without that block's history). Its answer is never kept as the
    final block's."""
    if answer.is_error and state_gone(answer.error):
        return True
    plan = read.plan
    # A block named by hash alone past the tracker's window: an old block (or one no node knows),
    # also when the read is never cached (requireCanonical: true), so no mode or doubt to wait for.
    old_by_hash = plan.by_hash and plan.need is None
    if not (read.policy.reads_state or read.method in HISTORY) or (
        not old_by_hash and (doubt is not None or plan.decision.mode is not Mode.IMMUTABLE)
    ):
        return False
    return block_unknown(answer.error) if answer.is_error else answer.result is None


def _unless_required(read: Read) -> None:
    """A final block's null no upstream could replace: under `required`, -32002 for a read a proof
    covers (no proof can show such a null: none was proven); else it is served, never kept."""
    net = read.net
    if net.config.verify == "required" and read.method in PROVABLE:
        raise JsonRpcError(
            UPSTREAM_UNAVAILABLE,
            f"upstream unavailable: network '{net.name}' (no proven answer for {read.method}:"
            " no upstream has the final block's state or history)",
            http_status=502,
        )


def _not_found(answer: Answer) -> bool:
    """A null, or an error other than a revert: what a node that lacks the block answers. Not an error
    about the request itself (JSON-RPC's -32600, -32700: a body too large for the node to read)."""
    return answer.result is None and answer.error_code not in ANSWERS_TO_THE_REQUEST
