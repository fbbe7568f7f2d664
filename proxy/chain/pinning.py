"""Tie every answer to the block it belongs to. Pure decisions, no I/O.

- An unfinalized read goes upstream pinned to the block hash its key holds (EIP-1898
  `{"blockHash": ...}`, a receipts call by hash, an eth_getLogs filter by `blockHash` for a single
  block), so the node can only answer from that block, whatever fork it is on.
- An eth_getLogs range that reaches above finalized is checked after the answer: in the same batch
  the node reports the range's last block, which must carry the pinned hash, and every log must
  carry the hash the tracker holds for its block.
- The block an answer depends on (the highest block number, or the tracker's number for a pinned
  hash) must be at or below the head of the upstream that produced it (upstream_state.py).
- Read-your-writes: a forwarded answer that shows block N (a receipt, a transaction, a block,
  eth_blockNumber) is a hint that `latest` must resolve to at least N from now on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.chain.head_polls import Head, Resolved
from proxy.rpc.params import BlockRef, substitute


def forward_form(ref: BlockRef, resolved: Resolved | None, pin: bool) -> Any:
    """What goes upstream for a block parameter: pinned to its hash when the key holds one (and the
    position takes a hash), else the resolved number, else what the caller sent."""
    if pin and resolved is not None and resolved.hash is not None and ref.hash is None:
        pinned = ref.encode_hash(resolved.hash)
        if pinned is not None:
            return pinned
    return ref.encode(resolved.number if resolved is not None and ref.tag is not None else None)


def needed_block(resolved: list[Resolved | None], hashes: list[str], window: Mapping[str, int]) -> int | None:
    """The highest block the answer depends on: its block numbers, and the numbers of the block
    hashes it names (`hashes`) where the tracker's window (`window`, hash -> number) knows them."""
    numbers = [r.number for r in resolved if r is not None and r.number is not None]
    numbers += [window[h] for h in hashes if h in window]
    return max(numbers) if numbers else None


def tag_floor(unresolved: list[str], head: Head | None) -> int | None:
    """The block a tag forwarded as a tag (a stale head, a head behind a shown block) stood for at
    the last good head: the answering upstream must have reached it, or `latest` would go back."""
    if head is None or not unresolved:
        return None
    floors = {"latest": head.latest, "pending": head.latest, "safe": head.safe, "finalized": head.finalized}
    return max((floors.get(tag, 0) for tag in unresolved), default=None)


def single_block_logs(log_filter: dict[str, Any], resolved: Mapping[int, Resolved | None]) -> str | None:
    """The pinned hash of an eth_getLogs range of one unfinalized block, to send as `blockHash`."""
    start, end = log_filter.get("fromBlock"), log_filter.get("toBlock")
    if not isinstance(start, BlockRef) or not isinstance(end, BlockRef):
        return None
    a, b = resolved.get(id(start)), resolved.get(id(end))
    if a is None or b is None or a.number is None or a.number != b.number:
        return None
    return b.hash


def range_end(log_filter: dict[str, Any], resolved: Mapping[int, Resolved | None]) -> Resolved | None:
    """The resolved last block of an eth_getLogs range (None for a blockHash filter)."""
    end = log_filter.get("toBlock")
    return resolved.get(id(end)) if isinstance(end, BlockRef) else None


def logs_on_chain(logs: Any, hashes: Mapping[int, str]) -> bool:
    """Every log of a block the tracker holds a hash for carries that hash."""
    if not isinstance(logs, list):
        return False
    for entry in logs:
        try:
            number = int(entry["blockNumber"], 16)
            block_hash = str(entry["blockHash"]).lower()
        except (KeyError, TypeError, ValueError):
            return False
        expected = hashes.get(number)
        if expected is not None and expected != block_hash:
            return False
    return True


# Forwarded methods whose answers show a block number a client may then read at `latest`.
SHOWS_BLOCK = frozenset(
    {
        "eth_blockNumber",
        "eth_getTransactionReceipt",
        "eth_getTransactionByHash",
        "eth_getBlockByNumber",
        "eth_getBlockByHash",
        "eth_getTransactionByBlockHashAndIndex",
        "eth_getTransactionByBlockNumberAndIndex",
        # Lists of logs or receipts, each naming its block (spec: the log object's blockNumber).
        "eth_getLogs",
        "eth_getFilterChanges",
        "eth_getBlockReceipts",
    }
)


def shown_block(method: str, result: Any) -> int | None:
    """The block number an answer shows a client, if any: a list's, the higher of its first and last
    entries' (logs come in chain order; a log a reorg removed shows no block of the chain)."""
    if method not in SHOWS_BLOCK or result is None:
        return None
    if method == "eth_blockNumber":
        return _number(result)
    if isinstance(result, list):
        ends = [_listed(entry) for entry in (result[:1] + result[-1:])]
        return max((n for n in ends if n is not None), default=None)
    return _number(result.get("blockNumber") or result.get("number")) if isinstance(result, dict) else None


def _listed(entry: Any) -> int | None:
    if not isinstance(entry, dict) or entry.get("removed") is True:
        return None
    return _number(entry.get("blockNumber"))


def _number(value: Any) -> int | None:
    if not isinstance(value, str):
        return None
    try:
        return int(value, 16)
    except ValueError:
        return None


def forward_params(
    params: Any,
    refs: list[BlockRef],
    resolved: dict[int, Resolved | None],
    pin_hashes: bool,
    logs: bool,
) -> Any:
    """The params sent upstream: unfinalized blocks pinned to their hash wherever the method allows."""
    if logs and pin_hashes:
        block_hash = single_block_logs(params[0], resolved)
        if block_hash is not None:  # one block: the filter names it by hash
            rest = {k: v for k, v in params[0].items() if k not in ("fromBlock", "toBlock")}
            return [{**rest, "blockHash": block_hash}]
    return substitute(params, {id(r): forward_form(r, resolved.get(id(r)), pin_hashes) for r in refs})
