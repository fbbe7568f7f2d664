"""Chunked eth_getLogs, the I/O part: ask a range's pieces (log_chunks.py) concurrently with a
bound, each through the ordinary read-through flow (its own cache key, finality rules, hash pinning
and per-upstream head checks), and merge their answers under the spec's limits over the whole call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from proxy.cache import log_chunks as lc
from proxy.metrics import Metrics
from proxy.rpc.jsonrpc import LIMIT_EXCEEDED, UPSTREAM_UNAVAILABLE, JsonRpcError, dumps, loads

# Ask blocks [start, end] with the call's filter: (payload, is_error, X-Cache of that piece).
AskPiece = Callable[[int, int], Awaitable[tuple[bytes, bool, str]]]


@dataclass(slots=True)
class Merged:
    """A chunked call's answer: the merged logs (or a piece's error object) and its X-Cache."""

    payload: bytes
    is_error: bool
    cache: str


class _PieceFailed(Exception):
    """A piece's node answered with an error: the call answers with it, as the node would have."""

    def __init__(self, payload: bytes, went_upstream: bool) -> None:
        super().__init__("piece failed")
        self.payload = payload
        self.went_upstream = went_upstream


class _Pieces:
    """One chunked call's pieces as they are asked: the call's budget of pieces sent upstream, and
    what they did (charging.py needs whether a node did work; the merge whether one was not kept)."""

    def __init__(self, ask: AskPiece, concurrency: int) -> None:
        self._ask = ask
        self._bound = asyncio.Semaphore(concurrency)
        self.worked = False  # a piece was answered by a node: the call did upstream work (charging.py)
        self.upstream = 0  # pieces that went upstream
        self.bypassed = False  # a piece's answer was served but not kept (not tied to its blocks' chain)
        self.stopped = False  # a piece found no node: no piece not yet started is asked

    async def _asked(self, start: int, end: int) -> tuple[bytes, bool, str]:
        try:
            return await self._ask(start, end)
        except JsonRpcError as error:
            self.worked = self.worked or error.reached  # a node had the piece (a timeout, a garbled answer)
            raise

    async def one(self, piece: lc.Piece, budgeted: bool = True) -> tuple[bytes, list[int | None], bool] | None:
        async with self._bound:
            if self.stopped or (budgeted and self.upstream >= lc.MAX_UPSTREAM_PIECES):
                return None  # past the call's budget: the rest of the range is asked at once (run)
            payload, is_error, cache = await self._asked(piece.start, piece.end)
            went = cache != lc.HIT
            self.worked = self.worked or went
            self.upstream += went
            if is_error and not piece.whole:
                # A node may refuse a whole chunk (its own result or range limit) that the
                # range needs only part of: that part is asked exactly.
                piece = lc.Piece(piece.want_start, piece.want_end, piece.want_start, piece.want_end)
                payload, is_error, cache = await self._asked(piece.start, piece.end)
                went = True
            self.bypassed = self.bypassed or cache == lc.BYPASS
        if is_error:
            raise _PieceFailed(payload, went)
        logs = loads(payload)
        if not lc.well_formed(logs, piece):
            raise JsonRpcError(
                UPSTREAM_UNAVAILABLE,
                "upstream unavailable: the node's eth_getLogs answer holds logs outside the blocks asked",
                http_status=502,
            )
        # Only the piece's bytes and its logs' blocks are kept, not the parsed logs: the merge
        # splices bytes (no long encode at the end), and each parse is this piece's own callback.
        cut = lc.cut(logs, piece)
        return (payload if cut is logs else dumps(cut)), [lc.block_of(e) for e in cut], went


class ChunkedLogs:
    def __init__(self, size: int, concurrency: int, max_results: int, metrics: Metrics) -> None:
        self.size = size
        self._concurrency = concurrency
        self._max_results = max_results
        self._metrics = metrics

    def timed_out(self) -> JsonRpcError:
        """spec: a query that runs longer than 10 seconds fails with -32005 (counted)."""
        self._metrics.getlogs_rejections.labels("timeout").inc()
        return JsonRpcError(LIMIT_EXCEEDED, "query timeout exceeded")

    async def run(self, first: int, last: int, pieces: list[lc.Piece], ask: AskPiece, deadline: float) -> Merged:
        """The merged answer of range [first, last]; JsonRpcError -32005 past the limits."""
        asking = _Pieces(ask, self._concurrency)
        tasks = [asyncio.ensure_future(asking.one(p)) for p in pieces]
        try:
            async with asyncio.timeout_at(deadline):
                answers = await asyncio.gather(*tasks)
                # Pieces take the semaphore in order, so those past the budget are the range's tail.
                deferred = next((i for i, answer in enumerate(answers) if answer is None), None)
                if deferred is not None:
                    start = pieces[deferred].want_start
                    tail = await asking.one(lc.Piece(start, last, start, last), budgeted=False)
                    answers = [*answers[:deferred], tail]
        except JsonRpcError as error:
            unreached = error.code == UPSTREAM_UNAVAILABLE and not error.reached
            if unreached and not asking.worked:
                # The first piece to end found no node (a 429, say) while others were already
                # asked: whether the call is charged (charging.py) is known once they are answered.
                asking.stopped = True
                await _settle(tasks, deadline)
                asking.worked = asking.worked or any(not t.done() for t in tasks)  # with a node at the deadline
            if asking.worked and unreached:
                # Some pieces were answered before this one failed (a 429, say): the call did
                # upstream work and is charged (charging.py), never a free amplification.
                raise JsonRpcError(
                    error.code,
                    error.message,
                    error.data,
                    http_status=error.http_status,
                    headers=error.headers,
                    reached=True,
                ) from error
            raise
        except TimeoutError:
            # spec: a query that runs longer than 10 seconds fails with -32005, every piece and retry
            # included (pieces answered before the deadline are kept for the next call; those still
            # in flight end with this one).
            raise self.timed_out() from None
        except _PieceFailed as failed:
            return Merged(failed.payload, True, lc.MISS if failed.went_upstream else lc.HIT)
        finally:
            for task in tasks:  # the call has its answer: pieces not started yet are not asked
                task.cancel()
        return self._merged([answer for answer in answers if answer is not None], asking.bypassed)

    def _merged(self, done: list[tuple[bytes, list[int | None], bool]], bypassed: bool) -> Merged:
        """The pieces' answers spliced in order, within the result limit over the whole range."""
        blocks = [b for _, part, _ in done for b in part]
        if len(blocks) > self._max_results:
            # spec: more than 10,000 results over the whole range fails with -32005 (no `data`: only a
            # revert has one); nothing partial.
            self._metrics.getlogs_rejections.labels("results").inc()
            raise JsonRpcError(LIMIT_EXCEEDED, f"query returned more than {self._max_results} results")
        return Merged(
            lc.splice([payload for payload, _, _ in done]),
            False,
            lc.cache_result([went for _, _, went in done], bypassed),
        )


async def _settle(tasks: Iterable[asyncio.Future[Any]], deadline: float) -> None:
    """Wait, until `deadline` at most, for the pieces in flight to end (answered or failed)."""
    pending = [t for t in tasks if not t.done()]
    if pending:
        loop = asyncio.get_running_loop()
        await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()))
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # seen: their failures are this call's one answer, not stray tracebacks
