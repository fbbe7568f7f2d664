"""Whether a call's request was sent to a node: the mark that decides what a call cancelled before its
answer is charged (credits/charging.py).

The gateway gives each call it runs a `Forwarded` mark in a context variable, as it sets CALLER:
tasks the call starts inherit it (a hedge, a chunk, a retry), so the upstream HTTP client marks the
call as it writes any request made for it. A batch of several callers' reads sent by one task
(auto-batching) carries a mark that sets each caller's. None: the proxy's own calls, marked nowhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextvars import ContextVar


class Forwarded:
    """One call's mark: `sent` once a request made for it was written to a node (set, never cleared)."""

    __slots__ = ("_others", "sent")

    def __init__(self, others: tuple[Forwarded, ...] = ()) -> None:
        self.sent = False
        self._others = others  # the callers whose requests travel together with this one

    @classmethod
    def together(cls, marks: Iterable[Forwarded | None]) -> Forwarded:
        """One mark for requests sent together: setting it sets each caller's."""
        return cls(tuple(mark for mark in marks if mark is not None))

    def set(self) -> None:
        self.sent = True
        for other in self._others:
            other.set()


FORWARDED: ContextVar[Forwarded | None] = ContextVar("rpc_proxy_forwarded", default=None)


def forwarding() -> None:
    """The calling call's request is being written to a node now."""
    mark = FORWARDED.get()
    if mark is not None:
        mark.set()
