"""Calls of one API key in the making at once in this process (MAX_CALLS_IN_FLIGHT_PER_KEY): a body
waits, before its calls are validated or run, until the key has room for them, in the key's own queue
(first come, first served), never behind another key's. A batch counts its calls: one key pipelining
thousand-call batches on many connections had every one in the making at once, each 50 to 90 ms of
the event loop, and every other key's calls waited for seconds behind them. A body larger than the
cap takes the whole cap. Open mode has no keys to tell apart: nothing is held there."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from types import TracebackType


class _Queue:
    __slots__ = ("in_use", "waiting")

    def __init__(self) -> None:
        self.in_use = 0
        self.waiting: deque[tuple[int, asyncio.Future[None]]] = deque()


class KeyWork:
    def __init__(self, cap: int) -> None:
        self.cap = cap  # 0: no cap
        self._queues: dict[str, _Queue] = {}

    def in_use(self, key: str) -> int:
        queue = self._queues.get(key)
        return queue.in_use if queue is not None else 0

    def held(self, key: str | None, calls: int) -> _Held | _Free:
        """Room for `calls` calls of `key` for the `async with` block; nothing held without a key or cap."""
        if key is None or self.cap <= 0:
            return FREE
        return _Held(self, key, min(calls, self.cap))

    async def _take(self, key: str, calls: int) -> None:
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue()
        if not queue.waiting and queue.in_use + calls <= self.cap:
            queue.in_use += calls
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.waiting.append((calls, turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # its turn came as it left: given on
                self._give(key, calls)
            else:
                with contextlib.suppress(ValueError):  # (a release may have dropped it already)
                    queue.waiting.remove((calls, turn))
                self._wake(key, queue)
            raise

    def _give(self, key: str, calls: int) -> None:
        queue = self._queues[key]
        queue.in_use -= calls
        self._wake(key, queue)

    def _wake(self, key: str, queue: _Queue) -> None:
        while queue.waiting and (queue.waiting[0][1].done() or queue.in_use + queue.waiting[0][0] <= self.cap):
            calls, turn = queue.waiting.popleft()
            if not turn.done():  # (one cancelled, its task not yet told, leaves no room taken)
                queue.in_use += calls
                turn.set_result(None)
        if not queue.in_use and not queue.waiting and self._queues.get(key) is queue:
            del self._queues[key]


class _Held:
    __slots__ = ("_calls", "_key", "_work")

    def __init__(self, work: KeyWork, key: str, calls: int) -> None:
        self._work, self._key, self._calls = work, key, calls

    async def __aenter__(self) -> None:
        await self._work._take(self._key, self._calls)

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._work._give(self._key, self._calls)


class _Free:
    """Nothing to hold (a class, not a generator: entered once per body)."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        return None


FREE = _Free()
