"""Plain records that cross the house: a node's answer, one call as the read-through flow carries it
(prepared, planned, answered), and what a transport sends back. Everything may import this module;
it imports only the rpc envelope and, for type checking alone, the modules its fields name."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from proxy.metrics import HitCells
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import JsonRpcError

HIT, MISS, BYPASS = "HIT", "MISS", "BYPASS"  # X-Cache
FOREVER = math.inf


class Mode(Enum):
    IMMUTABLE = "immutable"
    TTL = "ttl"
    BYPASS = "bypass"


@dataclass(frozen=True, slots=True)
class Decision:
    mode: Mode
    ttl: float = FOREVER
    pin_hashes: bool = False  # key unfinalized blocks by their hash
    per_head: bool = False  # the head's number and hash are part of the key: a new block changes it
    # The answer names its own block (a transaction by hash): kept, and served, only while that block
    # is final or canonical per the tracker (transaction_ttl, transaction_servable).
    tied_to_answer: bool = False
    cacheable: bool = field(init=False)  # not BYPASS: read several times per miss, so a field

    def __post_init__(self) -> None:
        object.__setattr__(self, "cacheable", self.mode is not Mode.BYPASS)


@dataclass(slots=True)  # not frozen: two per miss, and frozen init costs 3x
class Answer:
    """A node's JSON-RPC answer: `payload` is the encoded result, or the encoded error object."""

    payload: bytes
    result: Any = None
    error: dict[str, Any] | None = None
    seconds: float = 0.0
    upstream: int = -1  # the index of the upstream that produced it; -1: not known (a stored answer)
    # The hash the same node gave, in the same batch, for the proof block the call was asked with
    # ("" when it had no such block; None when no proof was asked): see pool.HttpUpstream.proven().
    proof: str | None = None
    # Asked alone because its node refused the batch its proof was in: no block can come beside it
    # (asking.py serves it as the node gave it, and never keeps it).
    unbatched: bool = False
    # The number of that proof block as the same node gave it (None: not given, or no proof asked).
    proof_number: int | None = None
    # What its block's proofs said of it (X-Verified: proven, unproven, not-applicable; "" not judged).
    verified: str = ""
    # The call that proves it (an eth_getProof for a state read about a final block), asked of the
    # same node in the same batch, and that call's result: verifying.py needs no call of its own.
    state_proof: tuple[tuple[str, Any], Any] | None = None

    @property
    def is_error(self) -> bool:
        return self.error is not None

    @property
    def error_code(self) -> int | None:
        code = self.error.get("code") if self.error else None
        return code if isinstance(code, int) else None

    def with_proof(self, proof: str | None, number: int | None = None) -> Answer:
        """This answer with the hash (and number) its node gave for the proof block (not
        dataclasses.replace: per miss)."""
        return Answer(
            self.payload,
            self.result,
            self.error,
            self.seconds,
            self.upstream,
            proof,
            self.unbatched,
            number,
            self.verified,
            self.state_proof,
        )

    @classmethod
    def stored(cls, payload: bytes, is_error: bool) -> Answer:
        """An answer another replica fetched and stored: only its encoded bytes are at hand."""
        return cls(payload, None, {"stored": True} if is_error else None)

    @classmethod
    def from_response(cls, obj: dict[str, Any], seconds: float = 0.0, upstream: int = -1) -> Answer:
        if "error" in obj and obj["error"] is not None:
            error = obj["error"] if isinstance(obj["error"], dict) else {"code": -32603, "message": str(obj["error"])}
            return cls(jsonrpc.dumps(error), None, error, seconds, upstream)
        result = obj.get("result")
        return cls(jsonrpc.dumps_result(result), result, None, seconds, upstream)


@dataclass(slots=True)  # not frozen: built per call, and frozen init costs 3x
class Outcome:
    """One call's answer: `payload` is the encoded result or the encoded error object."""

    payload: bytes
    is_error: bool
    cache: str
    error: JsonRpcError | None = None  # the proxy's own error (it carries the HTTP status)
    upstream_seconds: float | None = None
    verified: str | None = None  # X-Verified: proven, unproven or not-applicable (None: no header)
    local: bool = False  # answered by the proxy itself, no node asked (charging.free)

    @classmethod
    def failed(cls, error: JsonRpcError, cache: str = BYPASS) -> Outcome:
        return cls(error.encode(), True, cache, error)

    @classmethod
    def answered(cls, answer: Answer, cache: str) -> Outcome:
        return cls(answer.payload, answer.is_error, cache, None, answer.seconds, answer.verified or None)


@dataclass(slots=True)  # not frozen: built per miss (sixteen fields); never changed once built
class Plan:
    """The pure part of a cacheable call for one head: its decision, cache key and upstream params."""

    head: Any
    decision: Decision
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
    # X-Verified of a memory hit of this plan's key, worked out at its first hit (b"": not yet).
    verified_as: bytes = b""


@dataclass(slots=True)
class Reply:
    """What a transport sends back for one request body."""

    body: bytes | None  # None: nothing to send (notifications only)
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    upstream_seconds: float | None = None  # the slowest upstream call's (ACCESS_LOG)
    close: bool = False  # the connection is closed after it (the rest of a body is never read)


# A memory hit paid without awaiting, which the fast server writes after a pre-built head: a plain
# tuple, always read by unpacking it into these names, in this order:
#   charged     credits
#   remaining   credits left today (>= 0)
#   verified    X-Verified: b"proven", b"unproven" or b"not-applicable"
#   length      of the body
#   body        the encoded answer
# Not a class: one is made and dropped on every hit, and a dataclass's or NamedTuple's construction
# and deallocation cost about 1,200 instructions a hit that a tuple's display does not
# (bench.hit_path). A Lookup is a NamedTuple, so `type(x) is tuple` tells a PaidHit from any record.
PaidHit = tuple[int, int, bytes, int, bytes]


# A record made on the hot path without NamedTuple's Python-level __new__ (a call per hit):
# new_record(Lookup, (unpaid, parsed)).
new_record = tuple.__new__
