"""Asking several upstreams in turn within one call's time, without letting a stalled one take it all
or cutting off a slow one that would answer: each attempt may run until the call's deadline, and
once it has had its share of the time left (split over the attempts still possible) the next one
starts beside it. Outcomes are judged in the order they come; the first the judge takes is the
call's, and the attempts still running are cancelled. Only reads asked past the pool's own order
pass here (a walk after a node had no answer, old state asked first of a node known to hold it),
never a plain miss: each attempt is a task of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Walk(Generic[T, R]):
    """One walk: `start(timeout)` begins the next attempt (None when there is none left to start),
    `remaining()` is how many could still start (itself included), `judge(value)` gives the walk's
    result or None to go on. An attempt that raises `failure` (an upstream's failure) ended without an
    answer and is kept in `failures`; any other exception ends the walk with it."""

    def __init__(
        self,
        start: Callable[[float], Awaitable[T] | None],
        remaining: Callable[[], int],
        judge: Callable[[T], R | None],
        deadline: float,
        failure: type[BaseException],
    ) -> None:
        self._start = start
        self._remaining = remaining
        self._judge = judge
        self._deadline = deadline
        self._failure = failure
        self.failures: list[BaseException] = []

    async def run(self) -> R | None:
        """The first result the judge takes, or None when every attempt ended without one or the
        deadline passed first."""
        loop = asyncio.get_running_loop()
        running: set[asyncio.Future[T]] = set()
        start_next = True
        try:
            while True:
                left = self._deadline - loop.time()
                if left <= 0:
                    return None
                waiting = self._remaining() if start_next else 0
                if waiting:
                    attempt = self._start(left)
                    if attempt is not None:
                        running.add(asyncio.ensure_future(attempt))
                if not running:
                    return None
                # The newest attempt's share of the time left before another starts beside it.
                share = left / waiting if waiting > 1 else left
                done, _ = await asyncio.wait(running, timeout=share, return_when=asyncio.FIRST_COMPLETED)
                start_next = True  # its share is spent, or an attempt ended: the next may start
                for task in done:
                    running.discard(task)
                    error = task.exception()
                    if error is None:
                        result = self._judge(task.result())
                        if result is not None:
                            return result
                    elif isinstance(error, self._failure):
                        self.failures.append(error)
                    else:
                        raise error
        finally:
            for task in running:
                task.cancel()
            for task in running:
                task.add_done_callback(_retrieved)


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A cancelled attempt's end, retrieved: its exception is never "never retrieved"."""
    if not task.cancelled():
        task.exception()
