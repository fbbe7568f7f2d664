"""Which chain an answer comes from. Pure decisions, no I/O.

A node answers for its own chain: a backup on another fork, a stalled node, a load balancer's
lagging member. Before an answer is kept, the node that gave it shows, in the same batch (so a load
balancer cannot split the two), its block at a height whose hash the tracker holds:

- a final answer (by number, or a transaction or receipt): the finalized block. Each block names its
  parent, so a node whose block at `finalized` has the network's hash has the network's blocks below;
- an answer for the current head (fees, eth_feeHistory above finality): the node's `latest` block,
  which must be the tracker's, so a node at an older (or newer) head is never kept for this one;
- an answer pinned to a block of the tracker's window, or for a hash of it (EIP-1898
  `{"blockHash": H}`, a by-hash sibling): the node's block at that height, which must be H. A node on
  another fork may still answer a hash it never had (a forked Anvil resolves it through its fork
  source and runs the call on its own state). Asked only of an upstream other than the one the
  tracker took the block from, or of one whose head went back (a load balancer's members);
- a call that names a hash the tracker saw replaced: the node's block at that height must be
  another, so it is the canonical chain's answer (null, not found), not a stale node's old block.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.chain.head_polls import Head
from proxy.values import Decision, Mode

Proof = tuple[str, str, bool]  # (the block asked beside the call, the hash it must (not) have, must have)

NOT_PROVABLE = ("", "", True)  # the hash to compare with is not known: the answer cannot be kept


def plan_proof(
    decision: Decision,
    numbered: bool,
    head: Head | None,
    named: list[str],
    orphans: Mapping[str, int],
    pinned: tuple[int, str] | None = None,
) -> Proof | None:
    """The proof a call's answer needs (NOT_PROVABLE when it needs one that cannot be had), or None.
    `pinned`: the block of the tracker's window (number, hash) the call is pinned to or names, if any."""
    for block_hash in named:
        number = orphans.get(block_hash)
        if number is not None:
            return (hex(number), block_hash, False)
    if head is None or not decision.cacheable:
        return None
    if decision.per_head:
        return ("latest", head.latest_hash, True)
    if pinned is not None:
        return (hex(pinned[0]), pinned[1], True)
    if decision.tied_to_answer or (decision.mode is Mode.IMMUTABLE and numbered):
        return (hex(head.finalized), head.final_hash, True) if head.final_hash else NOT_PROVABLE
    return None


def proof_doubt(proof: Proof, seen: str | None, *, final: bool = True, head: Head | None = None) -> str | None:
    """Why an answer whose node gave `seen` for the proof block cannot be kept, or None.

    `other_head`: at another head than the tracker's (served, not kept); `off_chain`: another block at
    the network's finalized height (`final`); `fork`: another block at an unfinalized height the
    answer was pinned to; `unproven`: no such block (behind); `orphaned`: the node still has the
    reorged-out block as canonical. `head`: the tracker's, if any.
    """
    block, expected, same = proof
    if not same:  # the node must have another block there: one without any is behind, not the chain
        if seen == expected:
            return "orphaned"
        # No block there is the chain's own answer once the chain was rolled back below that height.
        return None if seen or (head is not None and int(block, 16) > head.latest) else "unproven"
    if seen == expected:
        return None
    if block == "latest":
        return "other_head"
    if not seen:
        return "unproven"
    return "off_chain" if final else "fork"


def answer_block_number(result: Any) -> int | None:
    """The number of the block a hash-addressed answer belongs to: a block's `number`, or the
    `blockNumber` of a receipt, transaction or log (the first of a list); None when it names none."""
    item = result[0] if isinstance(result, list) and result else result
    if not isinstance(item, dict):
        return None
    value = item.get("blockNumber", item.get("number"))
    try:
        return int(value, 16) if isinstance(value, str) else None
    except ValueError:
        return None
