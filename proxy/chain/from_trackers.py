"""Answers the proxy already holds: no upstream call per request.

| Method                      | Answered from                                                    |
| --------------------------- | ---------------------------------------------------------------- |
| eth_chainId                 | the network's chain identity (identity.py), once it is known     |
| eth_blockNumber             | the head tracker's latest block, unless the head is stale or     |
|                             | trails a block a client was shown (then forwarded: `_shown`)     |
| eth_accounts                | nothing: the proxy holds no accounts, so `[]` (as Infura answers)|
| getSlot, getBlockHeight     | the slot tracker's value per commitment while at most            |
|                             | SOLANA_BALANCE_MAX_AGE old; forwarded answers refresh it         |

Whatever is not held goes upstream uncached (X-Cache BYPASS), and its answer is learned.
"""

from __future__ import annotations

from typing import Any

from proxy.chain.heads import EvmHeadTracker
from proxy.chain.slots import SolanaSlotTracker
from proxy.values import Answer


def _commitment(params: Any) -> tuple[str, bool]:
    """(commitment, whether the call sets minContextSlot) of canonical getSlot/getBlockHeight params."""
    config = params[0] if isinstance(params, list) and params and isinstance(params[0], dict) else {}
    return str(config.get("commitment", "finalized")), "minContextSlot" in config


def held(
    method: str, params: Any, tracker: EvmHeadTracker | SolanaSlotTracker, now: float, max_age: float
) -> Any | None:
    """The answer the trackers hold for this call, or None: ask upstream."""
    if isinstance(tracker, SolanaSlotTracker):
        commitment, min_slot = _commitment(params)
        return None if min_slot else tracker.fresh(method, commitment, now, max_age)
    if method == "eth_accounts":
        return []  # a node's unlocked accounts are never the proxy's clients' to see or use
    if method == "eth_chainId":
        return hex(tracker.identity.chain_id) if tracker.identity is not None else None
    if method == "eth_blockNumber":
        head = tracker.head
        if head is None or head.stale or tracker.behind():
            return None
        # Read-your-writes: the number shown is noted, so `eth_blockNumber` never goes back (`_shown`).
        tracker.hint(head.latest)
        return hex(head.latest)
    return None


def learned(
    method: str, params: Any, tracker: EvmHeadTracker | SolanaSlotTracker, answer: Answer, now: float
) -> Answer:
    """A forwarded Solana slot or height refreshes the tracker; the answer never goes below a value
    already shown. (EVM answers go through the service's read-your-writes `_shown`.)"""
    value = answer.result
    if not isinstance(tracker, SolanaSlotTracker) or answer.is_error or type(value) is not int:
        return answer
    commitment, _ = _commitment(params)
    shown = tracker.observe(method, commitment, value, now)
    if shown == value:
        return answer
    return Answer.from_response({"result": shown}, answer.seconds, answer.upstream)
