"""Which hash-addressed answers go to the shared tier, and which a replica takes from it. Pure.

A key space is shared only by replicas whose chains agree up to their finalized blocks
(proxy/chain/forks.py), but a block hash names a block of whichever chain has it: a replica on a
fork not yet seen as one, or one behind, holds blocks another replica's node never had. So:

- an answer for a hash the replica's window holds is of its chain; one for a hash outside it is kept
  in Redis with the writer's finalized height (`final_at`) when the answer's block is at or below it
  (the writer's chain there is the space's: forks.py), and taken from Redis by a replica whose hash
  is outside its window only when that height is at or below its own finalized block: its chain is
  the space's up to there, so it holds the block;
- a null for a hash outside the writer's window (its node lacks the block) stays in its memory: a
  replica whose chain has the block must not read it;
- a transaction or receipt goes to Redis only when its block is at or below the writer's finalized
  block (or it names none: not yet mined, kept under the head's key); every hit is checked against
  the reader's own head (`transaction_servable`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from proxy.cache import policy as cp
from proxy.chain.proofs import answer_block_number
from proxy.values import Plan

Vet = Callable[[int | None], bool]  # a shared entry's `final_at` (None: none): may this replica take it?


class Share(NamedTuple):
    """Where an answer is kept: in Redis too (`shared`), and the writer's finalized height to tag it with."""

    shared: bool
    final_at: int | None


EVERYWHERE = Share(True, None)


def share(plan: Plan, kind: str, result: Any) -> Share:
    """How the answer the writer fetched for `plan` is kept."""
    head = plan.head
    final = head.finalized if head is not None else -1
    if plan.decision.tied_to_answer:
        block = cp.answer_block(result)
        return Share(block is None or block[0] <= final, None)
    if plan.unvouched_hash is None:
        return EVERYWHERE  # numbered, or a hash of the writer's window: of its chain
    if kind == "null":
        return Share(False, None)  # the writer's node lacks the block; another's may have it
    number = answer_block_number(result)
    return Share(True, final if number is not None and 0 <= number <= final else None)


def vet(plan: Plan) -> Vet | None:
    """The check a Redis entry for `plan` passes before it is served (None: none needed)."""
    if plan.unvouched_hash is None or plan.head is None:
        return None
    final = plan.head.finalized

    def final_here(final_at: int | None) -> bool:
        return final_at is not None and final_at <= final

    return final_here
