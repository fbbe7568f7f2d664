"""One body's calls while they run: each charged call with its mark (forwarded.py), the outcomes of
those answered so far, and what a body cancelled midway (its client gone) still owes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import NamedTuple, Protocol

from proxy.credits.charging import free, refunded_unanswered
from proxy.forwarded import FORWARDED, Forwarded
from proxy.gateway.response_size import ResponseBudget
from proxy.prepared import Prepared
from proxy.rpc.jsonrpc import INTERNAL_ERROR, JsonRpcError
from proxy.rpc.methods import WRITE_METHODS, changes_dev_state
from proxy.values import Outcome

Execute = Callable[[Prepared, str], Awaitable[Outcome]]

# A body's task cancelled with this message (task.cancel(CUT_OFF_REASON)) is cut off at SHUTDOWN_TIMEOUT:
# a batch's calls still being made answer CUT_OFF, those already made their own answers.
CUT_OFF_REASON = "SHUTDOWN_TIMEOUT"
CUT_OFF = JsonRpcError(
    INTERNAL_ERROR, "server shutting down: SHUTDOWN_TIMEOUT reached before this answer was ready", http_status=503
)


class BatchRoom(Protocol):
    """A batch's calls in its connection's count of answers not yet taken (http/answer_bytes.Batch)."""

    async def member(self) -> None: ...  # room for one more call's answer, waited for in order
    def member_made(self, size: int) -> None: ...
    def end(self) -> None: ...


class AnswerRoom(Protocol):
    """The connection a body's answers go to (http/answer_bytes.Account): a batch's calls are made as
    it has room for their answers, not all at once."""

    def batch(self) -> BatchRoom: ...


class Left(NamedTuple):
    """What a body cancelled midway owes: its credits split into those given back and those kept."""

    given_back: int
    kept: int


class BodyRun:
    """The prepared calls of one body, run for `account`. `charged`: their credits were debited, so
    each gets a mark that says whether a request made for it was sent to a node."""

    __slots__ = (
        "_account",
        "_answers",
        "_budget",
        "_execute",
        "_finished",
        "_marks",
        "_prepared",
        "_room",
        "cut_given_back",
    )

    def __init__(
        self,
        execute: Execute,
        prepared: list[Prepared],
        account: str,
        budget: ResponseBudget,
        charged: bool,
        room: AnswerRoom | None = None,
    ) -> None:
        self._execute = execute
        self._prepared = prepared
        self._account = account
        self._budget = budget
        self._marks = [Forwarded() for _ in prepared] if charged else []
        self._finished: dict[int, Outcome] = {}  # by index: the calls answered so far
        self._answers = room
        self._room: BatchRoom | None = None  # a batch's, while its calls are made
        self.cut_given_back = 0  # credits of calls cut off before a request made for them was sent

    async def outcomes(self, slots: list[Prepared | Outcome], refusal: Outcome | None) -> list[Outcome]:
        """Each slot's outcome: its call's, run now, or the error that answers it (`refusal`: every
        call's, the body refused for credits)."""
        prepared = self._prepared
        if len(slots) == 1 and prepared:  # the common case: one call, no task, no iterator
            if not self._marks:  # open mode, a free call: nothing to give back
                return [self._budget.take(await self._execute(prepared[0], self._account))]
            forwarded = FORWARDED.set(self._marks[0])
            try:
                return [self._budget.take(await self._execute(prepared[0], self._account))]
            finally:
                FORWARDED.reset(forwarded)
        room = self._answers
        self._room = room.batch() if room is not None and len(prepared) > 1 else None
        try:
            if any(p.call.method in WRITE_METHODS or changes_dev_state(p.call.method) for p in prepared):
                # A write or a dev node's state change among them: made in order, as a node runs a batch
                # ([anvil_setStorageAt, eth_getStorageAt] reads what it set; a receipt follows its send).
                outcomes = iter([await self._member(i, p) for i, p in enumerate(prepared)])
            else:
                outcomes = iter(await asyncio.gather(*(self._member(i, p) for i, p in enumerate(prepared))))
        except asyncio.CancelledError as cancel:
            if cancel.args != (CUT_OFF_REASON,):
                raise  # its client left: nothing is answered (left)
            outcomes = iter(self._cut())
        finally:
            if self._room is not None:
                self._room.end()
        return [s if not isinstance(s, Prepared) else refusal if refusal is not None else next(outcomes) for s in slots]

    async def _member(self, index: int, prepared: Prepared) -> Outcome:
        """A batch member's outcome (in a task of its own, with its own mark), made once its connection
        has room for its answer (AnswerRoom), and dropped at once if the batch's answers outgrow the limit."""
        if self._marks:
            FORWARDED.set(self._marks[index])
        room = self._room
        if room is None:
            outcome = self._finished[index] = self._budget.take(await self._execute(prepared, self._account))
            return outcome
        await room.member()
        size = 0
        try:
            outcome = self._finished[index] = self._budget.take(await self._execute(prepared, self._account))
            size = len(outcome.payload)
        finally:
            room.member_made(size)
        return outcome

    def _cut(self) -> list[Outcome]:
        """SHUTDOWN_TIMEOUT reached: the answers made, and CUT_OFF for each call still being made,
        charged as a call whose caller left is (left). The batch is answered: its task goes on."""
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        outcomes = []
        for i, p in enumerate(self._prepared):
            if i in self._finished:
                outcomes.append(self._finished[i])
                continue
            outcomes.append(Outcome.failed(CUT_OFF))
            if self._marks and refunded_unanswered(self._marks[i].sent):
                self.cut_given_back += p.credits
        return outcomes

    def left(self) -> Left:
        """The body's credits when its task is cancelled before its answers are made: a call that got
        no answer and was sent to no node, wherever it waited (the key's upstream slot, a connection,
        another caller's identical request), is given back; one sent, or answered, is charged as any
        answer is (charging.py)."""
        if not self._marks:
            return Left(0, 0)
        finished = self._finished
        refund = sum(
            p.credits
            for i, p in enumerate(self._prepared)
            if (free(finished[i]) if i in finished else refunded_unanswered(self._marks[i].sent))
        )
        return Left(refund, sum(p.credits for p in self._prepared) - refund)
