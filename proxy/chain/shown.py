"""Read-your-writes: a forwarded answer that shows a block (a receipt, a transaction, a block,
eth_blockNumber) is a hint that `latest` must resolve to at least that block from now on."""

from __future__ import annotations

from proxy.chain import pinning
from proxy.chain.heads import EvmHeadTracker
from proxy.chain.slots import SolanaSlotTracker
from proxy.rpc.params import BlockRef
from proxy.values import Answer


def shown(tracker: EvmHeadTracker | SolanaSlotTracker, method: str, answer: Answer, refs: list[BlockRef]) -> Answer:
    """Read-your-writes: note the block a forwarded answer shows; eth_blockNumber never goes back."""
    # answer.error, not the is_error property: a call fewer on every miss
    if not isinstance(tracker, EvmHeadTracker) or answer.error is not None:
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
