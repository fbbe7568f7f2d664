"""A cacheable call's plan for one head: its cache decision and key, what goes upstream, the block
its answer depends on, and how the answer will be shown to belong to the chain. Pure but for the
metric cells it looks up once."""

from __future__ import annotations

from typing import Any

from proxy.cache import policy as cp
from proxy.cache.log_reads import LogReads
from proxy.cache.tiers import cache_key
from proxy.chain import pinning, proofs
from proxy.chain.head_polls import Resolved
from proxy.chain.heads import EvmHeadTracker
from proxy.chain.slots import SolanaSlotTracker
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.prepared import Prepared
from proxy.rpc.methods import CacheClass, MethodPolicy
from proxy.rpc.params import BlockRef, substitute
from proxy.values import Plan


def key_space(net: NetworkRuntime, head: Any) -> str | None:
    """The space a network's cache keys name for this head (None: no key yet): an EVM head's (network,
    chain identity, epoch), of its own for a network that keeps answers unverified (verify = "off"),
    so that no verifying proxy (after a reload, or a replica sharing Redis) finds them as proven; a
    Solana cluster's (network, genesis hash), so no other cluster behind the same Redis shares it."""
    tracker = net.tracker
    if isinstance(tracker, SolanaSlotTracker):
        return tracker.space
    space: str | None = head.space if head is not None else None
    return space + "|unverified" if space is not None and net.config.verify == "off" else space


def plan_call(
    prepared: Prepared,
    policy: MethodPolicy,
    params: Any,
    head: Any,
    ttls: cp.Ttls,
    logs: LogReads,
    metrics: Metrics,
) -> Plan:
    """The call's decision, cache key and upstream params for this head (pure but for metric cells)."""
    net, method, refs = prepared.network, prepared.call.method, prepared.refs
    tracker = net.tracker
    evm = isinstance(tracker, EvmHeadTracker)
    evm_tracker = tracker if isinstance(tracker, EvmHeadTracker) else None
    resolved, named, explicit, unresolved_tags, tags_resolved = _resolve(evm_tracker, refs)
    blocks = list(resolved.values())
    if policy.limits_logs:
        logs.check_range(params[0], resolved)
    client_state = policy.client_state is not None and len(params) > policy.client_state
    decision = cp.decide(policy.cache, blocks, head, ttls, params, client_state=client_state)
    space = key_space(net, head)
    if space is None:
        decision = cp.BYPASS  # the chain's identity is not known yet: no key can name it
    forward = pinning.forward_params(params, refs, resolved, decision.pin_hashes, policy.limits_logs)
    check_end = _range_check(params[0], resolved, decision, head) if policy.limits_logs else None
    # Hashes the call names: its block hash refs, or a content-addressed method's block hash.
    if policy.cache is CacheClass.CONTENT and params and isinstance(params[0], str):
        named.append(params[0])
    need = _needed(blocks, named, explicit, unresolved_tags, head, decision.per_head)
    proof, unvouched, proof_pinned = None, None, False
    if evm and isinstance(tracker, EvmHeadTracker):
        numbered = False
        for b in blocks:  # a loop: an any() over a generator that stops early costs a GeneratorExit
            if b is not None and b.number is not None:
                numbered = True
                break
        pinned = _pinned_block(blocks, named, head) if decision.cacheable and check_end is None else None
        proof = proofs.plan_proof(decision, numbered, head, named, tracker.orphans, pinned)
        proof_pinned = pinned is not None and proof is not None and proof[:2] == (hex(pinned[0]), pinned[1])
        if proof == proofs.NOT_PROVABLE:
            decision, proof = cp.BYPASS, None  # no hash to show the answer's chain by: not kept
        elif proof is not None and not proof[2]:
            decision = cp.BYPASS  # a reorged-out hash: answered as the canonical chain does, never kept
        elif decision.mode is cp.Mode.IMMUTABLE and not numbered and head is not None:
            unvouched = next((h for h in named if h not in head.numbers), None)
        if head is not None and head.doubted is not None and _doubted(named, head):
            # A block a poll showed replaced, maybe: asked as is, uncached, and answered as the node
            # answers it (null for a block it no longer has), not held to the window's height.
            decision, proof = cp.BYPASS, None
            need = _needed(blocks, [], explicit, unresolved_tags, head, decision.per_head)
    cells = metrics.hit_cells(net.name, method)
    key = ""
    if decision.cacheable and space is not None:
        key_params = substitute(params, {id(r): _key_form(r, resolved[id(r)], decision) for r in refs})
        if decision.per_head and head is not None:
            key_params = [*key_params, {"head": [head.latest, head.latest_hash]}]
        key = cache_key(space, method, key_params)
    # An unfinalized block pinned by hash goes upstream as the method's by-hash sibling.
    upstream_method = policy.by_hash if policy.by_hash and decision.pin_hashes else method
    return Plan(
        head,
        decision,
        key,
        upstream_method,
        forward,
        tags_resolved,
        need,
        check_end,
        decision.pin_hashes or bool(named),
        prepared.credits,
        cells,
        not prepared.piece,
        proof,
        unvouched,
        proof_pinned,
    )


# What one pass over a call's block parameters finds (a plain tuple: made per miss, unpacked at once):
# by id(ref) what the tracker resolves it to (EVM), the block hashes the refs name, the numbers and
# the tags the tracker would not resolve, and whether a tag was turned into a number.
_Refs = tuple[dict[int, Resolved | None], list[str], list[int], list[str], bool]


def _resolve(tracker: EvmHeadTracker | None, refs: list[BlockRef]) -> _Refs:
    """One pass over a call's block parameters (`tracker` None: not an EVM network)."""
    resolved: dict[int, Resolved | None] = {}
    named: list[str] = []
    explicit: list[int] = []
    unresolved_tags: list[str] = []
    tags_resolved = False
    for r in refs:
        found = tracker.resolve(r) if tracker is not None else None
        if tracker is not None:
            resolved[id(r)] = found
        if r.hash is not None:
            named.append(r.hash)
        if found is None:
            if r.number is not None:
                explicit.append(r.number)
            if r.tag is not None:
                unresolved_tags.append(r.tag)
        elif r.tag is not None:
            tags_resolved = True
    return resolved, named, explicit, unresolved_tags, tags_resolved


def _range_check(
    log_filter: dict[str, Any], resolved: dict[int, Resolved | None], decision: cp.Decision, head: Any
) -> tuple[int, str] | None:
    """The block an eth_getLogs answer's node shows beside it, in the same batch: the range's last
    block when the answer is pinned by hash; for a range past the head or to `pending`, the head's own
    block (a node without it, such as a load balancer's lagging member, answers short of blocks the
    chain has)."""
    last = log_filter.get("toBlock")
    end = pinning.range_end(log_filter, resolved)
    if decision.pin_hashes:
        return (end.number, end.hash) if end is not None and end.number is not None and end.hash is not None else None
    past = end.number > head.latest if end is not None and end.number is not None and head is not None else False
    pending = end is None and isinstance(last, BlockRef) and last.tag == "pending"
    if (past or pending) and head is not None and not head.stale and head.latest_hash:
        return head.latest, head.latest_hash
    return None


def _needed(
    blocks: list[Resolved | None],
    named: list[str],
    explicit: list[int],
    unresolved_tags: list[str],
    head: Any,
    per_head: bool,
) -> int | None:
    """The highest block the answer depends on: the answering upstream must have reached it."""
    need = pinning.needed_block(blocks, named, head.numbers if head is not None else {})
    # A number the tracker would not resolve (a stale head pins nothing unfinalized) is still a
    # block the answer depends on: a node behind it answers null or an error, not the block.
    if explicit:
        need = max(need or 0, *explicit)
    floor = pinning.tag_floor(unresolved_tags, head)
    need = floor if need is None else max(need, floor or 0)
    if per_head and head is not None:
        need = max(need or 0, head.latest)  # an answer for this head: from a node that has it
    return need


def _pinned_block(resolved: Any, named: list[str], head: Any) -> tuple[int, str] | None:
    """The highest block (number, hash) of the tracker's window a call is pinned to (above finalized:
    a final number is proven at the finalized block) or names by hash."""
    if head is None:
        return None
    known = [
        (r.number, r.hash)
        for r in resolved
        if r is not None and r.number is not None and r.number > head.finalized and r.hash is not None
    ]
    if named:
        known += [(head.numbers[h], h) for h in named if h in head.numbers]
    return max(known) if known else None


def _doubted(named: list[str], head: Any) -> bool:
    """A hash the call names is of the doubted head's window (Head.doubted): the poll showed another
    hash at one height, and the fork may lie lower, so any block of the window may be replaced."""
    return any(h in head.numbers for h in named)


def _key_form(ref: BlockRef, resolved: Resolved | None, decision: cp.Decision) -> Any:
    if resolved is None:
        return {"t": ref.tag}
    if resolved.number is None:
        return {"h": resolved.hash}
    if decision.pin_hashes and resolved.hash is not None:
        return {"n": resolved.number, "h": resolved.hash}
    return {"n": resolved.number}


def final_block_key(space: str, number: int) -> str:
    """The key plan_call names eth_getBlockByNumber(number, false) by when the block is final
    (_key_form: a final block by its number alone), for readers of headers beside the service."""
    return cache_key(space, "eth_getBlockByNumber", [{"n": number}, False])
