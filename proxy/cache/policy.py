"""Pure cache decisions: how long an answer may be kept, from its policy, its blocks and the head.

| What                                                      | How it is cached                           |
| --------------------------------------------------------- | ------------------------------------------ |
| state/receipts/logs at or below finalized                 | immutable                                  |
| the same above finalized                                  | short TTL, key pinned to the block hash    |
| blocks beyond the tracker's latest, `pending`, no head    | bypass (never stored)                      |
| addressed by block hash (receipts, uncles, EIP-1898)      | immutable once non-null                    |
| null not-found answers                                    | negative TTL at most, never immutable      |
| errors                                                    | never, except eth_call reverts (code 3) when final |
| getLargestAccounts / getTokenAccountBalance               | configured TTL / max age                   |
| Solana getBalance/getAccountInfo/getMultipleAccounts      | max age, as getTokenAccountBalance         |
| a Solana call with `minContextSlot`                       | bypass                                     |
| Solana getBlock/getTransaction                            | immutable at `finalized`, else bypass      |
| chain identity data (net_version, getGenesisHash...)      | identity TTL, in the chain identity's keys |
| fees of the current head                                  | short TTL, the head's number+hash in key   |
| eth_feeHistory                                            | as a block read, per head above finalized  |
| a transaction or receipt by its hash                      | by the block it names: immutable at/below  |
|                                                           | finalized, short TTL while that hash is    |
|                                                           | canonical, not kept otherwise; checked     |
|                                                           | again on every hit (transaction_servable)  |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.chain.head_polls import Head, Resolved
from proxy.rpc.jsonrpc import EXECUTION_REVERTED
from proxy.rpc.methods import CacheClass
from proxy.values import FOREVER as FOREVER
from proxy.values import Decision as Decision
from proxy.values import Mode as Mode


@dataclass(frozen=True, slots=True)
class Ttls:
    unfinalized: float = 12.0
    negative: float = 2.0
    largest_accounts: float = 3600.0
    token_balance: float = 0.4
    identity: float = 30.0
    unmined: float = 0.25  # a null receipt: well under a client's poll interval (viem, ethers: 4 s, 1 s)


BYPASS = Decision(Mode.BYPASS, 0.0)
IMMUTABLE = Decision(Mode.IMMUTABLE)  # one instance for every immutable call (a miss makes no Decision)


def solana_config(params: Any) -> dict[str, Any]:
    """The config object of canonical Solana params (the last param), or {}."""
    return params[-1] if isinstance(params, list) and params and isinstance(params[-1], dict) else {}


# decide() compares with module names, not CacheClass.X: in Python 3.11 an attribute of an Enum class
# passes EnumType.__getattr__'s slow lookup (about 60 ns more each, some ten per miss).
_NONE, _TRACKER, _CONTENT, _HEAD, _TRANSACTION = (
    CacheClass.NONE,
    CacheClass.TRACKER,
    CacheClass.CONTENT,
    CacheClass.HEAD,
    CacheClass.TRANSACTION,
)
_LARGEST_ACCOUNTS, _TOKEN_BALANCE, _IDENTITY, _SOLANA_FINAL = (
    CacheClass.LARGEST_ACCOUNTS,
    CacheClass.TOKEN_BALANCE,
    CacheClass.IDENTITY,
    CacheClass.SOLANA_FINAL,
)


def decide(
    cache: CacheClass,
    blocks: list[Resolved | None],
    head: Head | None,
    ttls: Ttls,
    params: Any = None,
    *,
    client_state: bool = False,
) -> Decision:
    """Before the upstream call: may this request be cached, and how. `client_state`: the answer is
    computed from code or state the client supplied (overrides)."""
    if cache is _NONE or cache is _TRACKER:
        return BYPASS  # TRACKER: what the tracker cannot answer goes upstream, uncached
    if client_state:
        # Any size, chosen by one client, useful to nobody else: never kept, in either tier.
        return BYPASS
    if "minContextSlot" in solana_config(params):
        return BYPASS  # the caller asks for a node at least at that slot: only the node can say
    if cache is _LARGEST_ACCOUNTS:
        return Decision(Mode.TTL, ttls.largest_accounts)
    if cache is _TOKEN_BALANCE:
        return Decision(Mode.TTL, ttls.token_balance)
    if cache is _IDENTITY:
        return Decision(Mode.TTL, ttls.identity)
    if cache is _SOLANA_FINAL:
        # A finalized block or transaction never changes; at `confirmed` it still may (or vanish).
        return IMMUTABLE if solana_config(params).get("commitment") == "finalized" else BYPASS
    if cache is _CONTENT:
        return IMMUTABLE
    if cache is _HEAD or cache is _TRANSACTION:
        if head is None or head.stale:
            return BYPASS  # no head to tie the answer to
        if cache is _HEAD:
            return Decision(Mode.TTL, ttls.unfinalized, per_head=True)
        return Decision(Mode.TTL, ttls.unfinalized, tied_to_answer=True)
    top = -1  # the highest block number named (a loop, not generators: every miss passes here)
    for b in blocks:
        if b is None:
            return BYPASS  # pending, or no head yet: nothing to pin the answer to
        if b.number is not None and b.number > top:
            top = b.number
    if top < 0:
        return IMMUTABLE  # addressed by block hash only: content-addressed
    if head is None:
        return BYPASS
    if top > head.latest:
        return BYPASS  # a block the tracker has not seen: its answer may change once it exists
    if top <= head.finalized:
        return IMMUTABLE
    if cache is CacheClass.FEE_HISTORY:
        return Decision(Mode.TTL, ttls.unfinalized, per_head=True)  # no hash form: keyed by the head instead
    if top not in head.hashes:
        return BYPASS  # outside the tracked window: no hash to pin the answer to
    return Decision(Mode.TTL, ttls.unfinalized, pin_hashes=True)


def answer_kind(result: Any, error_code: int | None, is_error: bool, *, caches_reverts: bool) -> str:
    """`caches_reverts`: the method's code 3 is a deterministic revert (eth_call); elsewhere it is an error."""
    if is_error:
        return "revert" if error_code == EXECUTION_REVERTED and caches_reverts else "error"
    return "null" if result is None else "ok"


def store_ttl(decision: Decision, cache: CacheClass, kind: str, ttls: Ttls) -> float | None:
    """After the upstream call: seconds to keep the answer (FOREVER for immutable), or None to not store."""
    if not decision.cacheable:
        return None
    if kind == "error":
        return None
    if kind == "revert":
        # A revert at a final block is deterministic; anywhere else it may not be.
        ok = cache is CacheClass.BLOCK and decision.mode is Mode.IMMUTABLE
        return FOREVER if ok else None
    if kind == "null":
        return min(ttls.negative, decision.ttl)
    return decision.ttl


def answer_block(result: Any) -> tuple[int, str] | None:
    """The block (number, hash) a transaction or receipt names; None for a pending one or no block."""
    if not isinstance(result, dict):
        return None
    number, block_hash = result.get("blockNumber"), result.get("blockHash")
    if not isinstance(number, str) or not isinstance(block_hash, str):
        return None
    try:
        return int(number, 16), block_hash.lower()
    except ValueError:
        return None


def transaction_ttl(result: Any, head: Head | None, orphans: Mapping[str, int], ttls: Ttls) -> float | None:
    """After the upstream call, for a transaction or receipt by hash: seconds to keep it, or None.

    Immutable once its block is at or below finalized; while above, kept for the unfinalized TTL only
    if the tracker holds that very block hash as canonical (so a reorg that replaces the block is seen,
    and transaction_servable stops serving it). A pending transaction (no block yet) is "not yet
    mined", like null: UNMINED_TTL at most (and the caller keys it to the head: a new block ends it).
    """
    if result is None:
        return min(ttls.negative, ttls.unmined)
    block = answer_block(result)
    if block is None:
        pending = isinstance(result, dict) and result.get("blockHash", "absent") is None
        return min(ttls.negative, ttls.unfinalized, ttls.unmined) if pending else None
    if head is None or not transaction_servable(result, head, orphans):
        return None  # a block the tracker has not seen (or saw replaced): served, not kept
    return FOREVER if block[0] <= head.finalized else ttls.unfinalized


def transaction_servable(result: Any, head: Head | None, orphans: Mapping[str, int]) -> bool:
    """May a cached transaction or receipt be served now: its block is final, or canonical per the
    tracker's window, and no reorg the tracker saw replaced it."""
    block = answer_block(result)
    if block is None:
        return True  # null or pending: only ever kept for the negative TTL
    number, block_hash = block
    if head is None or block_hash in orphans:
        return False
    if number <= head.finalized:
        return True
    return not head.stale and head.hashes.get(number) == block_hash
