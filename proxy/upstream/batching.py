"""Auto-batching: cacheable reads that arrive in the same event-loop turn travel upstream as one
JSON-RPC batch, one HTTP round trip instead of many. A read may carry a proof block (proofs.py): the
batch then also asks that block's header, once per block. The turn's first call leads: it yields one
turn (where a callback scheduled then would run), then takes the queue; alone, it is sent from its
own task, so a lone call costs one loop turn and nothing else."""

from __future__ import annotations

import asyncio
import contextvars
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from functools import partial
from typing import Any, cast

from proxy import via
from proxy.forwarded import FORWARDED, Abandoned, Forwarded
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import UPSTREAM_UNAVAILABLE, JsonRpcError
from proxy.upstream.sending import too_large
from proxy.values import Answer

Single = Callable[[str, Any, float | None], Coroutine[Any, Any, Answer]]
Alone = Callable[[str, Any, str | None], Awaitable[Answer]]  # one call, with its proof block if any
Together = Callable[[Sequence[tuple[str, Any, str | None]]], Awaitable[list[Answer]]]  # calls and proofs, one node
# method, params, waiter, proof block, and the caller's mark (forwarded.py): set when its batch is sent
Queued = tuple[str, Any, "asyncio.Future[Answer | None]", str | None, Forwarded | None]


@types.coroutine
def _one_turn() -> Generator[None, None, None]:
    """One turn of the loop yielded, as asyncio.sleep(0) yields it, without its coroutine around it
    (every lone read passes here)."""
    yield


class _Turn:
    """This turn's calls that may travel in one request: those carrying the same Via marks (via.py: a
    request carries one Via), the first the leader's (its waiter None)."""

    __slots__ = ("leading", "queue")

    def __init__(self) -> None:
        self.queue: list[Queued] = []
        self.leading = False  # a call leads this turn's queue: it takes the queue a turn after its own


class AutoBatcher:
    def __init__(
        self,
        network: str,
        single: Single,
        alone: Alone,
        together: Together,
        *,
        batch_max: int,
        batch_max_bytes: int,
        room: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.network = network
        self._room = room  # the most calls the upstreams' budgets let one request carry (max_rps, max_concurrency)
        self._single = single
        self._alone = alone
        self._together = together
        self._batch_max = batch_max
        self._batch_max_bytes = batch_max_bytes
        self._turn = _Turn()  # this turn's calls that came with no rpc-proxy marks (nearly all)
        self._marked: dict[str, _Turn] = {}  # ... and those that came with some, by their marks
        self._deliveries: set[asyncio.Task[None]] = set()

    async def enqueue(self, method: str, params: Any, proof: str | None = None) -> Answer:
        received = via.RECEIVED.get()  # a call with other proxies' marks goes with the same marks only
        turn = self._turn if received is None else self._marked.setdefault(received, _Turn())
        if turn.leading:  # a call of this turn leads: this one goes with it
            waiter: asyncio.Future[Answer | None] = asyncio.get_running_loop().create_future()
            turn.queue.append((method, params, waiter, proof, FORWARDED.get()))
            answer = await waiter
            if answer is None:  # alone after all (its leader was cancelled): sent from this task
                return await self._alone(method, params, proof)
            return answer
        # The turn's first call leads: it yields once, so the calls made in this turn join it, then
        # takes the queue. Alone, it is sent from its own task: no future, no callback, no task.
        turn.leading = True
        leader = FORWARDED.get()
        turn.queue.append(
            (method, params, cast("asyncio.Future[Answer | None]", None), proof, leader)
        )  # one if others join
        try:
            await _one_turn()
        except BaseException:
            self._dispatch(self._take(turn, received)[1:])  # the others still go
            raise
        queue = self._take(turn, received)
        if len(queue) == 1:
            return await self._alone(method, params, proof)
        waiter = asyncio.get_running_loop().create_future()
        queue[0] = (method, params, waiter, proof, leader)
        self._dispatch(queue)
        answer = await waiter
        if answer is None:  # alone after all (the others left while the batch waited): sent from this task
            return await self._alone(method, params, proof)
        return answer

    def _take(self, turn: _Turn, received: str | None) -> list[Queued]:
        """The leader takes its turn's queue: later calls (with these marks) begin another."""
        turn.leading = False
        queue, turn.queue = turn.queue, []
        if received is not None:
            del self._marked[received]
        return queue

    def _dispatch(self, queue: list[Queued]) -> None:
        """Groups of at most `batch_max` calls and `batch_max_bytes` of params: one client's large
        call travels alone, never in a batch a node might refuse for its size."""
        if len(queue) == 1:
            waiter = queue[0][2]
            if not waiter.done():
                waiter.set_result(None)  # the caller sends it alone (enqueue)
            return
        group: list[Queued] = []
        size = calls = 0
        room = self._room()
        blocks: set[str] = set()  # the group's proof blocks: a header each, in the batch (pool._with_proofs)
        for call in queue:
            cost = len(jsonrpc.dumps(call[1])) + len(call[0]) + 64  # params, method, envelope
            weight = 1 if call[3] is None else 2  # a call with its proof header is two calls upstream
            headers = len(blocks) + (call[3] is not None and call[3] not in blocks)
            # UPSTREAM_BATCH_MAX counts the headers too: a provider refuses a batch past its cap.
            over = len(group) + 1 + headers > self._batch_max or (room is not None and calls + weight > room)
            if group and (over or size + cost > self._batch_max_bytes):
                self._start(group)
                group, size, calls = [], 0, 0
                blocks.clear()
            group.append(call)
            size += cost
            calls += weight
            if call[3] is not None:
                blocks.add(call[3])
        if group:
            self._start(group)

    def _start(self, group: list[Queued]) -> None:
        # Sent from a task of its own: whatever it sends for the group marks each caller sent.
        task = asyncio.create_task(self._deliver(group), context=_marked(group))
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

    async def _deliver(self, group: list[Queued]) -> None:
        # Every waiter is answered whatever happens here, so no caller is left waiting forever.
        failure: Exception = JsonRpcError(
            UPSTREAM_UNAVAILABLE, f"upstream unavailable: network '{self.network}' (call abandoned)", http_status=502
        )
        try:
            if len(group) == 1:  # alone: a failure is its own, not the batch's
                method, params, _, block, _ = group[0]
                answers = [await self._alone(method, params, block)]
            else:
                try:
                    answers = await self._together([(m, p, b) for m, p, _, b, _ in group])
                except JsonRpcError as error:
                    if error.http_status == 504 or too_large(error) or via.refused_as_loop(error.message):
                        # Timed out: asking again, one by one, would only wait longer. Too large as a
                        # whole (its bound is the batch's): the node would send it all again. Refused
                        # as a loop (its Via): each call alone carries the same marks.
                        raise
                    # The batch failed as a whole (a 413 for its size, a 5xx): each call is asked
                    # alone, so only a call that fails by itself fails.
                    await self._resend_singly(group)
                    return
            for (_, _, waiter, _, _), answer in zip(group, answers, strict=True):
                if not waiter.done():
                    waiter.set_result(answer)
        except Abandoned:
            # A caller left while the group waited (a budget, a connection) and was given its credits
            # back: nothing was written, and the others go without it (docs/keys-and-credits.md).
            waiting, group = [call for call in group if not call[2].done()], []
            self._dispatch(waiting)
        except Exception as error:  # the upstream's JsonRpcError, or a fault of ours: each caller hears it
            failure = error
        finally:
            for _, _, waiter, _, _ in group:
                if not waiter.done():
                    waiter.set_exception(failure)

    async def _resend_singly(self, group: list[Queued]) -> None:
        # Alone means alone: a node that fails a call inside batches answers it, unproven (proof None),
        # each under its caller's mark alone (one that leaves holds back its own call only).
        singles = [asyncio.create_task(self._single(c[0], c[1], None), context=_marked([c])) for c in group]
        results = await asyncio.gather(*singles, return_exceptions=True)
        for (_, _, waiter, _, _), result in zip(group, results, strict=True):
            if waiter.done():  # answered, or left (its call then never written: Abandoned)
                continue
            if isinstance(result, BaseException):
                waiter.set_exception(result)
            else:
                waiter.set_result(result)


def _marked(group: list[Queued]) -> contextvars.Context:
    """A context whose requests mark the group's callers sent as they are written, and are not written
    once one of those callers has left before any was (its waiter cancelled: forwarded.py)."""
    context = contextvars.copy_context()
    context.run(FORWARDED.set, Forwarded.together((call[4] for call in group), partial(_left, group)))
    return context


def _left(group: list[Queued]) -> bool:
    return any(call[2].cancelled() for call in group)
