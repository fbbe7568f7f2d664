"""hedging.Walk: a failover walk within one call's time (the pure part; the walks through real nodes
are in test_node_kinds.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from proxy.hedging import Walk
from tests.support import eventually


class Attempts:
    """Scripted attempts, started in order: each a coroutine factory; what was started and cancelled."""

    def __init__(self, *scripts: Callable[[], Awaitable[str]]) -> None:
        self.scripts = list(scripts)
        self.started: list[int] = []
        self.cancelled: list[int] = []

    def start(self, timeout: float) -> Awaitable[str] | None:
        if not self.scripts:
            return None
        index = len(self.started)
        self.started.append(index)
        script = self.scripts.pop(0)

        async def run() -> str:
            try:
                return await script()
            except asyncio.CancelledError:
                self.cancelled.append(index)
                raise

        return run()

    def remaining(self) -> int:
        return len(self.scripts)


def taken(outcome: str) -> str | None:
    """Takes any answer but "no"."""
    return None if outcome == "no" else outcome


DOWN = RuntimeError  # an upstream's failure here: no answer, the walk goes on


async def cancelled(attempts: Attempts, which: list[int]) -> None:
    """Polled until the cancellations have reached the attempts' own code."""

    async def reached() -> bool:
        return sorted(attempts.cancelled) == which

    await eventually(reached, 5, f"attempts {which} cancelled")


def deadline_in(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


async def test_a_slow_attempt_past_its_share_still_answers_beside_the_next_one() -> None:
    """Rule: once an attempt has had its share of the time left, the next starts beside it, and the
    first keeps running: its answer is taken when it comes (the stalled one is cancelled)."""
    slow_answers, second_started = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        await slow_answers.wait()
        return "archive"

    async def stalled() -> str:
        second_started.set()
        await asyncio.Event().wait()
        return "never"

    async def answer_once_the_second_started() -> None:
        await second_started.wait()
        slow_answers.set()

    attempts = Attempts(slow, stalled)
    helper = asyncio.ensure_future(answer_once_the_second_started())
    result = await Walk(attempts.start, attempts.remaining, taken, deadline_in(2), DOWN).run()
    await helper
    assert result == "archive"
    await cancelled(attempts, [1])
    assert attempts.started == [0, 1]


async def test_an_attempt_without_an_answer_starts_the_next_at_once() -> None:
    """Rule: an attempt that ends with no answer (an error, or one the judge does not take) does not
    wait out its share: the next starts at once (a share of 30 s would time the test out)."""

    async def fails() -> str:
        raise RuntimeError("down")

    async def says_no() -> str:
        return "no"

    async def answers() -> str:
        return "answer"

    attempts = Attempts(fails, says_no, answers)
    walk = Walk(attempts.start, attempts.remaining, taken, deadline_in(60), DOWN)
    result = await asyncio.wait_for(walk.run(), 10)
    assert result == "answer" and attempts.started == [0, 1, 2]
    assert [str(error) for error in walk.failures] == ["down"]  # kept, for the caller to raise


async def test_past_the_deadline_nothing_is_taken_and_every_attempt_is_cancelled() -> None:
    """Rule: the walk ends at the call's deadline with no result, and cancels what still runs."""

    async def stalled() -> str:
        await asyncio.Event().wait()
        return "never"

    attempts = Attempts(stalled, stalled)
    assert await Walk(attempts.start, attempts.remaining, taken, deadline_in(0.3), DOWN).run() is None
    await cancelled(attempts, [0, 1])
    assert attempts.started == [0, 1]


async def test_an_error_that_is_no_upstreams_failure_ends_the_walk_with_it_and_cancels_the_rest() -> None:
    """Rule: an attempt's exception other than an upstream's failure (a bug) ends the walk with it."""

    async def stalled() -> str:
        await asyncio.Event().wait()
        return "never"

    async def breaks() -> str:
        raise KeyError("a bug")

    attempts = Attempts(stalled, breaks)
    with pytest.raises(KeyError):
        await Walk(attempts.start, attempts.remaining, taken, deadline_in(0.5), DOWN).run()
    await cancelled(attempts, [0])
