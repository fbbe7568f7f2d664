"""Whether a call's request was sent to a node: the mark that decides what a call cancelled before its
answer is charged (credits/charging.py).

The gateway gives each call it runs a `Forwarded` mark in a context variable, as it sets CALLER:
tasks the call starts inherit it (a hedge, a chunk, a retry), so the upstream HTTP client marks the
call as it writes any request made for it. A batch of several callers' reads sent by one task
(auto-batching) carries a mark that sets each caller's, and that no request is written under once
one of them has left unless one already was: a caller given its credits back is never sent
afterwards (docs/keys-and-credits.md). None: the proxy's own calls, marked nowhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextvars import ContextVar


class Abandoned(Exception):
    """Nothing was written: a caller the request was made for left before it could be (forwarding)."""


class Forwarded:
    """One call's mark: `sent` once a request made for it was written to a node (set, never cleared)."""

    __slots__ = ("_others", "left", "sent")

    def __init__(self, others: tuple[Forwarded, ...] = (), left: Callable[[], bool] | None = None) -> None:
        self.sent = False
        self._others = others  # the callers whose requests travel together with this one
        self.left = left  # whether one of them has left (their requests are then made again without it)

    @classmethod
    def together(cls, marks: Iterable[Forwarded | None], left: Callable[[], bool] | None = None) -> Forwarded:
        """One mark for requests sent together: setting it sets each caller's. `left`: whether one of
        those callers has left; until one request was written, none may be once one has."""
        return cls(tuple(mark for mark in marks if mark is not None), left)

    def set(self) -> None:
        self.sent = True
        for other in self._others:
            other.set()


FORWARDED: ContextVar[Forwarded | None] = ContextVar("rpc_proxy_forwarded", default=None)


def forwarding() -> None:
    """The calling call's request is being written to a node now; Abandoned, and it must not be, when
    it was made for callers of whom one left before any was written (its refund is decided)."""
    mark = FORWARDED.get()
    if mark is not None:
        if mark.left is not None and not mark.sent and mark.left():
            raise Abandoned  # none written yet, and one of its callers has left: none may be now
        mark.set()
