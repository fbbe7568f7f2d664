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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .chain import Head, Resolved
from .jsonrpc import EXECUTION_REVERTED
from .methods import CacheClass

FOREVER = math.inf


class Mode(Enum):
    IMMUTABLE = "immutable"
    TTL = "ttl"
    BYPASS = "bypass"


@dataclass(frozen=True, slots=True)
class Ttls:
    unfinalized: float = 12.0
    negative: float = 2.0
    largest_accounts: float = 3600.0
    token_balance: float = 0.4


@dataclass(frozen=True, slots=True)
class Decision:
    mode: Mode
    ttl: float = FOREVER
    pin_hashes: bool = False  # key unfinalized blocks by their hash

    @property
    def cacheable(self) -> bool:
        return self.mode is not Mode.BYPASS


BYPASS = Decision(Mode.BYPASS, 0.0)


def decide(cache: CacheClass, blocks: list[Resolved | None], head: Head | None, ttls: Ttls) -> Decision:
    """Before the upstream call: may this request be cached, and how."""
    if cache is CacheClass.NONE:
        return BYPASS
    if cache is CacheClass.LARGEST_ACCOUNTS:
        return Decision(Mode.TTL, ttls.largest_accounts)
    if cache is CacheClass.TOKEN_BALANCE:
        return Decision(Mode.TTL, ttls.token_balance)
    if cache is CacheClass.CONTENT:
        return Decision(Mode.IMMUTABLE)
    if any(b is None for b in blocks):
        return BYPASS  # pending, or no head yet: nothing to pin the answer to
    numbers = [b.number for b in blocks if b is not None and b.number is not None]
    if not numbers:
        return Decision(Mode.IMMUTABLE)  # addressed by block hash only: content-addressed
    if head is None:
        return BYPASS
    top = max(numbers)
    if top > head.latest:
        return BYPASS  # a block the tracker has not seen: its answer may change once it exists
    if top <= head.finalized:
        return Decision(Mode.IMMUTABLE)
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
