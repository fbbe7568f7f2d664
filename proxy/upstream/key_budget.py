"""The per-key upstream budget: at most `per_key` upstream calls of one API key in flight at once.

Every call made for a key counts, whatever made it: a single miss, each member of a batch, each
piece of a chunked eth_getLogs, a retry on another upstream. A key's calls past its cap wait in
that key's own queue (first come, first served); no key ever waits behind another key's calls, so
a wide eth_getLogs batch of one key delays another key's miss only by what the node itself takes
to answer at most `per_key` extra calls. The proxy's own calls (head polls, identity probes) and
open mode (no keys) are not budgeted.

With workers (WORKERS > 1) or Redis the cap is the deployment's: a call holding its worker's slot
also takes one of the key's places, counted in Redis across replicas or else in the run directory
across the host's workers (workers/replica_counts.py), and waits, trying again every few
milliseconds, while the key's calls elsewhere hold them all. Any one worker may use the whole cap.
Only calls to the upstream pay for this (a Redis round trip each way, or a file lock); hits do not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

from proxy.key_context import CALLER
from proxy.upstream.pool import Upstream
from proxy.upstream.standing import UpstreamStates
from proxy.values import Answer
from proxy.workers.replica_counts import Hold, ReplicaCounts

SHARED_RETRY = 0.002  # seconds before a call whose key's places are all held elsewhere tries again
SHARED_RETRY_MAX = 0.05  # ...doubling up to this


class _Queue:
    __slots__ = ("slots", "users")

    def __init__(self, per_key: int) -> None:
        self.slots = asyncio.Semaphore(per_key)
        self.users = 0  # calls holding or awaiting a slot: the queue is dropped when none is left


class KeySlots:
    """Per-key concurrency caps, each key queued apart. `per_key` 0: no cap. `shared`: the places
    counted across the workers of a host."""

    def __init__(self, per_key: int, shared: ReplicaCounts | None = None) -> None:
        self.per_key = per_key
        self.shared = shared
        self._queues: dict[str, _Queue] = {}

    def in_use(self, key: str) -> int:
        """Calls of `key` holding a slot now."""
        queue = self._queues.get(key)
        return self.per_key - queue.slots._value if queue is not None else 0

    def held(self) -> _Held | _Unbudgeted:
        """A slot of the calling key for the `async with` block: awaited in the key's own queue when
        its cap is reached; nothing for the proxy's own calls, open mode or no cap."""
        key = CALLER.get()
        if key is None or self.per_key <= 0:
            return UNBUDGETED
        return _Held(self, key)

    def _queue(self, key: str) -> _Queue:
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue(self.per_key)
        queue.users += 1
        return queue

    def _left(self, key: str, queue: _Queue) -> None:
        queue.users -= 1
        if not queue.users:
            del self._queues[key]


class _Unbudgeted:
    """No slot to take (a class, not a generator: the hot path enters one per upstream call)."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *_exc: object) -> None:
        return None


UNBUDGETED = _Unbudgeted()


class _Held:
    """One call of `key` holding a slot of its queue while the block runs."""

    __slots__ = ("_hold", "_key", "_owner", "_queue")

    def __init__(self, owner: KeySlots, key: str) -> None:
        self._owner = owner
        self._key = key
        self._queue: _Queue | None = None
        self._hold: Hold | None = None

    async def __aenter__(self) -> None:
        owner = self._owner
        queue = owner._queue(self._key)
        try:
            await queue.slots.acquire()
        except BaseException:
            owner._left(self._key, queue)  # cancelled while queued: it holds no slot
            raise
        if owner.shared is not None:
            try:
                self._hold = await _shared_place(owner.shared, self._key, owner.per_key)
            except BaseException:
                queue.slots.release()
                owner._left(self._key, queue)
                raise
        self._queue = queue

    async def __aexit__(self, *_exc: object) -> None:
        queue = self._queue
        if queue is not None:
            self._queue = None
            if self._owner.shared is not None and self._hold is not None:
                hold, self._hold = self._hold, None
                await self._owner.shared.release(self._key, hold)
            queue.slots.release()
            self._owner._left(self._key, queue)


async def _shared_place(shared: ReplicaCounts, key: str, cap: int) -> Hold:
    """One of `key`'s places across the workers and replicas, once one is free."""
    delay = SHARED_RETRY
    while True:
        hold = await shared.take(key, cap)
        if hold is not None:
            return hold
        await asyncio.sleep(delay)
        delay = min(2 * delay, SHARED_RETRY_MAX)


class KeyedUpstream:
    """A network's upstream with every call made for a key counted against that key's slots."""

    def __init__(self, inner: Upstream, slots: KeySlots) -> None:
        self.inner = inner
        self._slots = slots

    @property
    def states(self) -> UpstreamStates:
        # AttributeError when the inner upstream has none: then this is no PerUpstream either.
        states: UpstreamStates = self.inner.states  # type: ignore[attr-defined]
        return states

    def request(self, method: str, params: Any, *, timeout: float | None = None) -> Awaitable[Answer]:
        held = self._slots.held()
        if held is UNBUDGETED:  # the hot path's case in open mode: the inner call itself, no layer around it
            return self.inner.request(method, params, timeout=timeout)
        return self._held_request(held, method, params, timeout)

    async def _held_request(self, held: Any, method: str, params: Any, timeout: float | None) -> Answer:
        async with held:
            return await self.inner.request(method, params, timeout=timeout)

    async def batch(self, calls: Sequence[tuple[str, Any]]) -> list[Answer]:
        async with self._slots.held():
            return await self.inner.batch(calls)

    async def together(self, calls: Sequence[tuple[str, Any]]) -> list[Answer] | None:
        async with self._slots.held():
            return await self.inner.together(calls)

    async def ask_all(self, index: int, calls: Sequence[tuple[str, Any]], *, timeout: float) -> list[Answer]:
        async with self._slots.held():
            answers: list[Answer] = await self.inner.ask_all(index, calls, timeout=timeout)  # type: ignore[attr-defined]
            return answers

    async def ask(
        self, index: int, method: str, params: Any, *, timeout: float, budget_wait: float | None = None
    ) -> Answer:
        async with self._slots.held():
            answer: Answer = await self.inner.ask(  # type: ignore[attr-defined]
                index, method, params, timeout=timeout, budget_wait=budget_wait
            )
            return answer

    def proven(
        self, method: str, params: Any, block: str, *, index: int | None = None, timeout: float | None = None
    ) -> Awaitable[Answer]:
        held = self._slots.held()
        if held is UNBUDGETED:
            unheld: Awaitable[Answer] = self.inner.proven(  # type: ignore[attr-defined]
                method, params, block, index=index, timeout=timeout
            )
            return unheld
        return self._held_proven(held, method, params, block, index, timeout)

    async def _held_proven(
        self, held: Any, method: str, params: Any, block: str, index: int | None, timeout: float | None
    ) -> Answer:
        async with held:
            answer: Answer = await self.inner.proven(  # type: ignore[attr-defined]
                method, params, block, index=index, timeout=timeout
            )
            return answer

    async def close(self) -> None:
        await self.inner.close()
