"""What a node's reply says, judged purely: whether it answers the call or batch it was sent for (its
ids; the shape each method's result must have), whether it is a provider's rate limit, its
Retry-After, and the proof header asked beside a call."""

from __future__ import annotations

import re
import time
from email.utils import parsedate_to_datetime
from typing import Any

from proxy.rpc.jsonrpc import EXECUTION_REVERTED
from proxy.rpc.methods import POLICIES
from proxy.rpc.result_shapes import Shape

RETRY_AFTER_MAX = 300.0  # seconds: the longest Retry-After honoured (a provider's bad header cannot park it)
# Phrases of providers' rate-limit errors (Infura, Alchemy, QuickNode...) in an HTTP 200 reply.
RATE_LIMIT_PHRASES = (
    "rate limit",
    "request rate",
    "too many requests",
    "compute units per second",
    "request limit reached",
    "rate exceeded",
)


# Phrases of a node's error for state it no longer keeps (a pruned, "full" node), as the clients word
# them: geth ("missing trie node", "required historical state unavailable", "historical state ... is
# not available"), Nethermind (MissingTrieNodeException), Erigon ("... is not available" for data
# before its pruned step, "pruned"), Anvil with --prune-history ("BlockOutOfRangeError").
# EIP-4444's error code for history a node no longer keeps ("pruned history unavailable": geth, and
# Reth and Nethermind after it).
PRUNED_HISTORY = 4444
STATE_GONE_PHRASES = (
    "missing trie node",
    "missingtrienode",
    "historical state",
    "state not available",
    "state is not available",
    "is not available: blocknum",
    "has been pruned",
    "pruned history",
    "due to pruning",
    "blockoutofrangeerror",
    "block out of range",
    "no state available",  # Nethermind: "No state available for block 0x..."
    "is pruned",  # Reth: "state at block #N is pruned"
    "world state unavailable",  # Besu
)


# Anvil words a block past its head and a pruned one alike: the numbers tell them apart.
_OUT_OF_RANGE = re.compile(r"block height is (\d+) but requested was (\d+)")


def _node_words(error: dict[str, Any] | None) -> str | None:
    """An error's words as the node wrote them, lower-cased; None for none, and for a revert, whose
    reason is the contract's to word ("execution reverted: block not found" is a contract's answer)."""
    if not error or error.get("code") == 3:
        return None
    text = f"{error.get('message', '')} {error.get('data', '')}".lower()
    return None if text.startswith("execution reverted") else text  # geth's words; Besu's, capitalised


def state_gone(error: dict[str, Any] | None) -> bool:
    """A node's error saying it lacks the state (or history) at the block asked: another node may
    have it. Not a node behind saying the block is past its head (that is the lagging rule's)."""
    text = _node_words(error)
    if text is None:
        return False
    if error is not None and error.get("code") == PRUNED_HISTORY:
        return True
    heights = _OUT_OF_RANGE.search(text)
    if heights is not None:
        return int(heights.group(2)) < int(heights.group(1))
    return any(phrase in text for phrase in STATE_GONE_PHRASES)


# Phrases of a node's error for a block it does not have at all (geth's "header not found" and
# "unknown block", Erigon's and Besu's "block not found", Nethermind's "could not be found"): for a
# block its node showed the chain has (a final one), that node lacks its history, as a pruned one would.
# EIP-1474's -32001 "Resource not found" too: Anvil's answer for an uncle of a block it does not have.
BLOCK_UNKNOWN_PHRASES = (
    "header not found",
    "unknown block",
    "block not found",
    "could not be found",
    "resource not found",
)


def block_unknown(error: dict[str, Any] | None) -> bool:
    """A node's error saying it has no such block (not a revert, nor a fault of the request)."""
    text = _node_words(error)
    return text is not None and any(phrase in text for phrase in BLOCK_UNKNOWN_PHRASES)


def proof_call(block: str) -> tuple[str, list[Any]]:
    """The header asked beside a call, in the same batch, to show which chain the answering node is on."""
    return ("eth_getBlockByNumber", [block, False])


def proof_hash(block: Any, is_error: bool) -> str:
    """The hash in a proof header's answer (`block`, its result); "" when the node has no such block
    (a null, or an error: nodes behind answer a number past their head with a range error)."""
    if is_error:
        return ""
    value = block.get("hash") if isinstance(block, dict) else None
    return value.lower() if isinstance(value, str) else ""


def proof_number(block: Any, is_error: bool) -> int | None:
    """The number in a proof header's answer (None when there is none, or it cannot be read)."""
    value = block.get("number") if isinstance(block, dict) and not is_error else None
    try:
        return int(value, 16) if isinstance(value, str) else None
    except ValueError:
        return None


def is_response(reply: Any) -> bool:
    """A JSON-RPC response object: a result or an error, never both (JSON-RPC 2.0 section 5: "Either the
    result member or error member MUST be included, but both members MUST NOT be included"). An
    `"error": null` beside a result is read as no error, as a missing "jsonrpc" member is tolerated."""
    return isinstance(reply, dict) and ("result" in reply) != (reply.get("error") is not None)


# The shape each method's result must have (methods.py): a result of another shape (a node that
# lies, a broken proxy in front of it) answers no call of that method. Judged on each answer a caller
# takes (judging.py), a null aside (judged as nodes mean it: asking.py).
SHAPES: dict[str, Shape] = {name: policy.result for name, policy in POLICIES.items() if policy.result is not None}


def shape_problem(method: str, shape: Shape, result: Any) -> str:
    """What a misshapen result is: its method and JSON type, never the node's bytes (they may be large)."""
    return f"malformed result: {method} answered with {type(result).__name__} that is not {shape.name}"


def single_problem(reply: Any, sent: int) -> str | None:
    """Why a reply does not answer the single call with id `sent`, or None when it does.

    An error object with `id: null` is the node saying it could not read the call (JSON-RPC 2.0
    section 5: the id is null when it could not be determined): its answer to this request, about
    the request, not a fault of the node."""
    if not is_response(reply):
        both = isinstance(reply, dict) and "result" in reply
        return "malformed reply: both a result and an error" if both else "malformed reply"
    if reply.get("id") is None and reply.get("error") is not None:
        return None
    if reply.get("id") != sent or isinstance(reply.get("id"), bool):
        return "reply id differs from the request id"
    return None


# Failures after a node took the call: it may have run it (charging.py charges such calls).
REACHED_KINDS = frozenset({"timeout", "invalid", "mismatch"})
# HTTP statuses that say the request itself is at fault (malformed, too large): the next upstream
# may still take it, but none is cooled down for everyone else because of one caller's request.
REQUEST_FAULT_STATUSES = frozenset({400, 413, 414, 431})


# Agave's -32005 (JSON_RPC_SERVER_ERROR_NODE_UNHEALTHY): "Node is unhealthy", "Node is behind by 42
# slots". The node's state, not an answer: the next upstream is asked.
NODE_UNHEALTHY_CODE = -32005
NODE_UNHEALTHY_WORDS = "node is "


def unhealthy(reply: Any) -> str | None:
    """A reply that is a node's word that it is unhealthy or behind rather than an answer, or None; a
    batch is when any of its answers is."""
    items = reply if isinstance(reply, list) else (reply,)
    for item in items:
        error = item.get("error") if type(item) is dict else None
        if type(error) is dict and error.get("code") == NODE_UNHEALTHY_CODE:
            message = str(error.get("message", ""))
            if message.lower().startswith(NODE_UNHEALTHY_WORDS):
                return f"node unhealthy: {message[:80]}"
    return None


def rate_limited(reply: Any) -> str | None:
    """A reply that is a provider's rate-limit error rather than an answer, or None; a batch is when
    any of its answers is (it is asked again as a whole elsewhere)."""
    if isinstance(reply, list):
        for item in reply:
            if type(item) is not dict or "error" in item:  # an answer with a result is no rate limit
                limited = rate_limited(item)
                if limited is not None:
                    return limited
        return None
    error = reply.get("error") if isinstance(reply, dict) else None
    if not isinstance(error, dict) or error.get("code") == EXECUTION_REVERTED:
        return None  # a contract's revert reason is the contract's to word
    message = str(error.get("message", "")).lower()
    if message.startswith("execution reverted"):
        return None
    if error.get("code") == 429 or any(phrase in message for phrase in RATE_LIMIT_PHRASES):
        return "rate-limit error"
    return None


def retry_after(value: str | None) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP date (RFC 9110 10.2.3). None (the
    usual cooldown) when it names no wait: absent, unreadable, zero, negative or a date gone by."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError):
            return None
    return min(seconds, RETRY_AFTER_MAX) if seconds > 0 else None
