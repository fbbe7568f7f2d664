"""One call as the read-through flow carries it: prepared (validated, priced), planned for a head,
and answered (its outcome and X-Cache)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.cache import policy as cp
from proxy.metrics import HitCells
from proxy.network import NetworkRuntime
from proxy.rpc.jsonrpc import Call, JsonRpcError
from proxy.rpc.methods import MethodPolicy
from proxy.rpc.params import BlockRef
from proxy.upstream.pool import Answer

HIT, MISS, BYPASS = "HIT", "MISS", "BYPASS"


@dataclass(slots=True)  # not frozen: built per call, and frozen init costs 3x
class Outcome:
    """One call's answer: `payload` is the encoded result or the encoded error object."""

    payload: bytes
    is_error: bool
    cache: str
    error: JsonRpcError | None = None  # the proxy's own error (it carries the HTTP status)
    upstream_seconds: float | None = None

    @classmethod
    def failed(cls, error: JsonRpcError, cache: str = BYPASS) -> Outcome:
        return cls(error.encode(), True, cache, error)

    @classmethod
    def answered(cls, answer: Answer, cache: str) -> Outcome:
        return cls(answer.payload, answer.is_error, cache, None, answer.seconds)


@dataclass(slots=True)  # not frozen: built per call, and frozen init costs 3x
class Prepared:
    """A validated call, ready to run and priced."""

    call: Call
    network: NetworkRuntime
    policy: MethodPolicy | None
    params: Any
    credits: int
    refs: list[BlockRef]  # the block parameters inside params, found once
    fingerprint: tuple[str, str, bytes] | None = None  # the raw request, for the plan memo
    piece: bool = False  # a piece of a chunked eth_getLogs: the result limit holds over the merged answer


@dataclass(slots=True)  # not frozen: built per miss (sixteen fields); never changed once built
class Plan:
    """The pure part of a cacheable call for one head: its decision, cache key and upstream params."""

    head: Any
    decision: cp.Decision
    key: str
    method: str  # the method sent upstream: the by-hash sibling when the key pins a block hash
    forward: Any
    tags_resolved: bool  # a tag was turned into a number: a failing node may just lag the tracker
    need: int | None  # the highest block the answer depends on: the answering upstream must have it
    check_end: tuple[int, str] | None  # eth_getLogs: the range's last block and hash, checked after
    by_hash: bool  # the answer is addressed or pinned by hash: a null means the node lacks the block
    credits: int  # the call's price, so a memory hit needs no policy lookup
    hit_cells: tuple[HitCells, HitCells]  # the metric cells a memory hit updates: (result, error)
    check_results: bool = True  # eth_getLogs' result limit on this answer (not on a chunked call's piece)
    # Which chain the answering node is on, asked in the same batch (proofs.py): (block, hash, same),
    # `same` False for a reorged-out hash the node's canonical chain must no longer have there.
    proof: tuple[str, str, bool] | None = None
    # A hash the call names that the tracker does not hold in its window: kept only once shown canonical.
    unvouched_hash: str | None = None
    # The proof is the block the call is pinned to or names (of the tracker's window, not final): asked
    # only of an upstream other than the head's source, or of one whose head went back (asking.py).
    proof_pinned: bool = False
