"""eth_getLogs reads beyond one upstream call: the spec's limits on a call's range and results, a
range chunked into pieces that later ranges share (log_chunks.py, chunked_logs.py), and a range
answered from block receipts this process already holds."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from proxy.cache import log_chunks
from proxy.cache import policy as cp
from proxy.cache.chunked_logs import ChunkedLogs
from proxy.cache.tiers import TieredCache, cache_key
from proxy.chain.head_polls import Head, Resolved
from proxy.chain.heads import EvmHeadTracker
from proxy.metrics import Metrics
from proxy.prepared import Prepared
from proxy.rpc.jsonrpc import LIMIT_EXCEEDED, JsonRpcError, invalid_params, loads
from proxy.rpc.methods import MethodPolicy
from proxy.rpc.params import BlockRef, block_refs
from proxy.values import HIT, Answer, Outcome, Plan

Execute = Callable[[Prepared], Awaitable[Outcome]]  # the read-through flow, for a chunked call's pieces
Pieces = tuple[int, int, list[log_chunks.Piece]]  # a chunked range's first and last blocks, and its pieces


class LogReads:
    def __init__(
        self,
        cache: TieredCache,
        chunks: ChunkedLogs,
        metrics: Metrics,
        ttls: cp.Ttls,
        *,
        max_results: int,
        timeout: float,
    ) -> None:
        self._cache = cache
        self._chunks = chunks
        self._metrics = metrics
        self._ttls = ttls
        self._max_results = max_results
        self._timeout = timeout

    def check_results(self, params: Any, answer: Answer) -> Answer:
        results = answer.result
        limit = self._max_results
        if isinstance(results, list) and len(results) > limit:
            raise self._too_many()
        return answer

    def _too_many(self) -> JsonRpcError:
        # spec: more than 10,000 results fails with -32005, its message fixed and no `data` (only a
        # revert has one); nothing partial is returned.
        self._metrics.getlogs_rejections.labels("results").inc()
        return JsonRpcError(LIMIT_EXCEEDED, f"query returned more than {self._max_results} results")

    def check_stored(self, stored: tuple[bytes, bool], policy: MethodPolicy, plan: Plan) -> None:
        """A cached eth_getLogs answer within the result limit: one kept by a replica with a higher
        GETLOGS_MAX_RESULTS (or before it was lowered) is refused as a miss of it would be. Its logs
        are counted by their `"logIndex"` member, in C: every other member's value is hex or a bool."""
        if policy.limits_logs and plan.check_results and self.past_limit(*stored):
            raise self._too_many()

    def past_limit(self, payload: bytes, is_error: bool) -> bool:
        """Whether a cached eth_getLogs answer holds more logs than the limit (check_stored)."""
        return not is_error and payload.count(b'"logIndex"') > self._max_results

    def check_range(self, log_filter: dict[str, Any], resolved: dict[int, Resolved | None]) -> None:
        start, end = log_filter.get("fromBlock"), log_filter.get("toBlock")
        if not isinstance(start, BlockRef) or not isinstance(end, BlockRef):
            return
        a, b = resolved.get(id(start)), resolved.get(id(end))
        first = a.number if a else start.number
        last = b.number if b else end.number
        if first is not None and last is not None:
            self.refuse_reversed(first, last)

    def refuse_reversed(self, first: int, last: int) -> None:
        if first > last:
            self._metrics.getlogs_rejections.labels("range").inc()
            raise invalid_params("filter", f"fromBlock {hex(first)} is greater than toBlock {hex(last)}")

    def pieces(self, prepared: Prepared, tracker: EvmHeadTracker, head: Head | None) -> Pieces | None:
        """The pieces an eth_getLogs range that reaches into finalized blocks is asked in, aligned so
        that later ranges share them (log_chunks.py); None when the call is not chunked (a blockHash
        filter, a range wholly above finality or of one piece, a tag that cannot be resolved, no chain
        identity yet)."""
        numbered = numbered_range(tracker, head, prepared.params[0])
        if numbered is None or head is None:
            return None
        first, last = numbered
        self.refuse_reversed(first, last)
        if not log_chunks.chunked(first, last, head.finalized, self._chunks.size):
            return None
        pieces = log_chunks.plan(first, last, head.finalized, self._chunks.size)
        if len(pieces) == 1 and pieces[0].whole:
            return None  # one piece, the range itself: the ordinary flow (and its memo) serves it
        return first, last, pieces

    def deadline(self) -> float:
        """When a call that arrives now must be answered (spec: 10 s per call in total, every piece,
        retry and wait for a merge included)."""
        return asyncio.get_running_loop().time() + self._timeout

    def timed_out(self) -> JsonRpcError:
        return self._chunks.timed_out()

    async def chunked(self, prepared: Prepared, planned: Pieces, execute: Execute, deadline: float) -> Outcome:
        """A chunked call's merged answer by `deadline`, its pieces asked through the ordinary flow."""
        log_filter = prepared.params[0]
        first, last, pieces = planned
        start, end = log_filter["fromBlock"], log_filter["toBlock"]

        async def ask(lo: int, hi: int) -> tuple[bytes, bool, str]:
            # The piece is a call of its own: its key, finality, pinning and upstream checks are the
            # ordinary ones; a piece is not charged (the call is, once).
            piece_filter = {
                **log_filter,
                "fromBlock": replace(start, tag=None, number=lo),
                "toBlock": replace(end, tag=None, number=hi),
            }
            piece = Prepared(
                prepared.call,
                prepared.network,
                prepared.policy,
                [piece_filter],
                0,
                block_refs([piece_filter]),
                None,
                piece=True,
            )
            outcome = await execute(piece)
            return outcome.payload, outcome.is_error, outcome.cache

        merged = await self._chunks.run(first, last, pieces, ask, deadline)
        if merged.cache == HIT:
            self._metrics.child(self._metrics.credits_saved, prepared.network.name, prepared.call.method).inc(
                prepared.credits
            )
        return Outcome(merged.payload, merged.is_error, merged.cache)

    async def from_receipts(
        self,
        tracker: EvmHeadTracker,
        params: Any,
        plan: Plan,
        policy: MethodPolicy,
        space: str,
    ) -> tuple[bytes, bool] | None:
        """An eth_getLogs miss over a few blocks whose eth_getBlockReceipts answers this process holds
        in memory, answered (and stored) from them without the upstream; None otherwise.

        A receipts entry is found under the key the same head gives it (by number when final, by
        number and hash above), so it is of the very blocks the range names. `space`: the plan's key
        space (planning.key_space)."""
        head = tracker.head
        if head is not plan.head:
            return None  # the head moved while the cache was asked: the plan's key may name another fork
        log_filter = params[0]
        numbered = numbered_range(tracker, head, log_filter)
        if numbered is None or head is None:
            return None
        first, last = numbered
        if not 0 <= last - first < log_chunks.RECEIPTS_MAX_BLOCKS:
            return None
        blocks = []
        for number in range(first, last + 1):
            block_hash = head.hashes.get(number)
            if number > head.finalized and block_hash is None:
                return None
            form = {"n": number} if number <= head.finalized else {"n": number, "h": block_hash}
            held = self._cache.memory.get(cache_key(space, "eth_getBlockReceipts", [form]))
            if held is None or held[1]:
                return None
            blocks.append(loads(held[0]))
        logs = log_chunks.logs_from_receipts(blocks, log_filter)
        if logs is None:
            return None
        answer = Answer.from_response({"result": logs})
        if plan.check_results:
            self.check_results(plan.forward, answer)
        elif len(logs) > self._max_results:
            return answer.payload, False  # a chunked call's piece past the limit: never kept (Reads.past_result_limit)
        ttl = cp.store_ttl(plan.decision, policy.cache, "ok", self._ttls)
        if ttl is not None:
            await self._cache.set(plan.key, (answer.payload, False), ttl)
        return answer.payload, False


def numbered_range(tracker: EvmHeadTracker, head: Head | None, log_filter: dict[str, Any]) -> tuple[int, int] | None:
    """An eth_getLogs range's first and last block numbers as this head resolves them; None for a
    blockHash filter, a tag the tracker cannot resolve, or no chain identity yet."""
    start, end = log_filter.get("fromBlock"), log_filter.get("toBlock")
    if head is None or head.space is None or not isinstance(start, BlockRef) or not isinstance(end, BlockRef):
        return None
    a, b = tracker.resolve(start), tracker.resolve(end)
    if a is None or b is None or a.number is None or b.number is None:
        return None
    return a.number, b.number
