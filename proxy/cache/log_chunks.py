"""Chunked eth_getLogs, the pure part: which block-range pieces a range is asked in, how their
answers are cut to the range and merged, and the spec's result limit over the merged answer.

A range is split into pieces aligned on fixed boundaries, so that overlapping, extending or inner
ranges share them:

- a whole aligned chunk of `size` blocks (GETLOGS_CHUNK_BLOCKS) wherever it ends at or below
  finalized: its answer never changes, so it is kept forever and serves every later range that
  touches it (the chunk is asked whole even when the range wants part of it);
- near finality, aligned chunks of `size // 10` blocks, for the same reason, so that as finality
  moves on only small chunks are still missing;
- the rest (the last blocks below finality that fill no small chunk, and everything above it) is
  one tail piece asked exactly: above finality it is pinned to the hash of its last block like any
  unfinalized range (pinning.py), so a reorg changes its key.

No I/O here: chunked_logs.py fetches and stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

HIT, MISS, PARTIAL, BYPASS = "HIT", "MISS", "PARTIAL", "BYPASS"
SMALL_CHUNK_DIVISOR = 10  # near finality: chunks of size // 10 blocks
# A range of more pieces is asked whole, as it comes: a cold range of thousands of chunks would be
# thousands of upstream calls (each a provider's full price) where one does, and a lookup per chunk.
MAX_PIECES = 200
# Pieces of one call that may go upstream one by one; the rest of a colder range is asked as one
# exact piece. A wide cold range thus costs at most this many upstream calls (plus one, and the
# pieces in flight when the budget ran out), not one per chunk: a call's upstream amplification is
# bounded whatever range a client names (README "Security").
MAX_UPSTREAM_PIECES = 16


@dataclass(frozen=True, slots=True)
class Piece:
    """Blocks [start, end] asked of the node (and named by the cache key); the range wants
    [want_start, want_end] of them."""

    start: int
    end: int
    want_start: int
    want_end: int

    @property
    def whole(self) -> bool:
        return (self.start, self.end) == (self.want_start, self.want_end)


def plan(first: int, last: int, finalized: int, size: int) -> list[Piece]:
    """The pieces of range [first, last], in order, given the finalized block and the chunk size."""
    if size <= 0 or first > last:
        return [Piece(first, last, first, last)]
    widths = (size, max(1, size // SMALL_CHUNK_DIVISOR))
    pieces: list[Piece] = []
    n = first
    while n <= last:
        for width in widths:
            start = n - n % width
            end = start + width - 1
            if end <= finalized:  # a whole aligned chunk below finality: immutable, shared
                pieces.append(Piece(start, end, n, min(end, last)))
                n = min(end, last) + 1
                break
        else:
            pieces.append(Piece(n, last, n, last))
            break
    return pieces


def chunked(first: int, last: int, finalized: int, size: int) -> bool:
    """Whether a range is asked in pieces: only when chunking is on, part of the range is final (a
    range wholly above finality is one piece pinned to its last block, as before), and it spans at
    most MAX_PIECES chunks."""
    return size > 0 and first <= finalized and first <= last and (last - first) // size < MAX_PIECES


def block_of(entry: Any) -> int | None:
    try:
        return int(entry["blockNumber"], 16)
    except (KeyError, TypeError, ValueError):
        return None


def cut(logs: list[Any], piece: Piece) -> list[Any]:
    """The logs of a piece's answer that the range wants (a whole chunk may reach past it)."""
    if piece.whole:
        return logs
    return [e for e in logs if (b := block_of(e)) is not None and piece.want_start <= b <= piece.want_end]


def well_formed(logs: Any, piece: Piece) -> bool:
    """A piece's answer is a list of logs, each inside the blocks that were asked: anything else is
    not kept (and not served)."""
    if not isinstance(logs, list):
        return False
    for entry in logs:
        b = block_of(entry)
        if b is None or not piece.start <= b <= piece.end:
            return False
    return True


def merge(parts: Sequence[list[Any]]) -> list[Any]:
    """The pieces' logs in range order (pieces are in block order, each answer in the node's order)."""
    return [entry for part in parts for entry in part]


def splice(parts: Sequence[bytes]) -> bytes:
    """`merge` on encoded answers: the elements of compact JSON arrays (as orjson writes them, and
    as the cache holds them) as one array, by bytes, in order."""
    return b"[" + b",".join(part[1:-1] for part in parts if len(part) > 2) + b"]"


def cache_result(upstream: Sequence[bool], bypassed: bool = False) -> str:
    """X-Cache of a chunked call: BYPASS when a piece's answer could not be kept (so the merge is not
    either), HIT when no piece went upstream, MISS when all did, else PARTIAL."""
    if bypassed:
        return BYPASS
    if not any(upstream):
        return HIT
    return MISS if all(upstream) else PARTIAL


# --- answers from cached receipts ------------------------------------------------------------

RECEIPTS_MAX_BLOCKS = 32  # a range of at most this many blocks is looked for in held receipts


def matches(entry: dict[str, Any], addresses: list[str] | None, topics: list[list[str] | None] | None) -> bool:
    """go-ethereum's filter rule: the address is in the set (if any); each topic position is a
    wildcard or holds one of its values, and the log has at least as many topics as positions."""
    if addresses is not None and str(entry.get("address", "")).lower() not in addresses:
        return False
    if not topics:
        return True
    logged = entry.get("topics")
    if not isinstance(logged, list) or len(logged) < len(topics):
        return False
    return all(wanted is None or str(logged[i]).lower() in wanted for i, wanted in enumerate(topics))


def logs_from_receipts(blocks: Sequence[Any], log_filter: dict[str, Any]) -> list[Any] | None:
    """The eth_getLogs answer of a range from the eth_getBlockReceipts answers of its blocks, in
    block order (a receipt's logs are the block's logs of that transaction, in order, in the same
    form); None when any answer is not a list of receipts with logs (a null: the block is unknown)."""
    addresses = log_filter.get("address")
    topics = log_filter.get("topics")
    if topics and topics[-1] is None:
        return None  # a trailing wildcard: nodes differ on logs with fewer topics; the node answers
    out: list[Any] = []
    for receipts in blocks:
        if not isinstance(receipts, list):
            return None
        for receipt in receipts:
            logs = receipt.get("logs") if isinstance(receipt, dict) else None
            if not isinstance(logs, list) or not all(isinstance(e, dict) for e in logs):
                return None
            out.extend(e for e in logs if matches(e, addresses, topics))
    return out
