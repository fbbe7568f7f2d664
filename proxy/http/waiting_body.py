"""A fast connection's request whose body is left unread until there is room for it (front.py,
pipeline.py), what it read held in the body budget meanwhile, and the 503 for one the budget has no
room for."""

from __future__ import annotations

from typing import Protocol

from proxy.http.answer_bytes import Account
from proxy.http.endpoint import BUSY_BODIES, NO_CHARGE, BodyBudget, error_reply
from proxy.http.wire import Out, Request
from proxy.values import Reply


class Reader(Protocol):
    """What a pipeline asks of the connection whose answers it writes (front.FrontProtocol)."""

    request: Request | None  # the request being read, from its first byte to its last

    def encoded(self, request: Request, reply: Reply, last: bool = False) -> tuple[Out, bool]: ...

    def hand_over(self) -> None: ...

    def make_held(self, request: Request) -> None: ...

    def receive(self, request: Request) -> bool: ...


class Waits(Protocol):
    """What a request waiting for room asks of its connection's pipeline (pipeline.Pipeline)."""

    account: Account
    read_paused: bool
    waiting_body: WaitingBody

    def pause(self) -> None: ...

    def last(self, data: Out, close: bool) -> None: ...


class WaitingBody:
    """A connection's request whose body is left unread until there is room for it (body_waits),
    counted meanwhile as a request waiting for room, what it read of its body (its first read) held
    in the body budget."""

    __slots__ = ("account", "bodies", "reader", "request")

    def __init__(self, account: Account, reader: Reader, bodies: BodyBudget) -> None:
        self.account = account
        self.reader = reader
        self.bodies = bodies
        self.request: Request | None = None

    def room(self, request: Request) -> bool:
        """Whether there is room for `request`'s answer and declared body; else it waits for room."""
        return self.account.room_or_wait(request.body_coming(self.account.budget.coded_body))

    def read_on(self) -> bool:
        """Whether its connection may read on: no body waits, or there is room for it now, taken at
        once (Reader.receive: its BODY_TIMEOUT starts). Looked at again when its next bytes came,
        room found at a wake was gone (others woken with it took it): each wake read one more piece
        of a body still waiting, uncounted, until the whole body was in and nothing more came to
        start its timer (a client that sent its body and waited was never answered)."""
        request = self.request
        if request is None:
            return True
        if not self.room(request):
            return False
        self.end()
        return self.reader.receive(request)

    def begin(self, request: Request) -> bool:
        """It waits, what it read held in the body budget; False: no room there, it does not wait.
        Uncounted, 1,000 such bodies held 89 to 118 MB of RSS, up to one read (256 KB) each."""
        if not request.hold_read(self.bodies, self.account.key):
            return False
        self.request = request
        self.account.budget.waiting += 1
        return True

    def end(self, request: Request | None = None) -> None:
        """`request` (None: any) is read whole, or read on, or its connection ends: it waits no more."""
        if self.request is not None and (request is None or self.request is request):
            self.request = None
            self.account.budget.waiting -= 1


def body_waits(pipeline: Waits, request: Request) -> bool:
    """Whether a request whose body is not whole in its first read leaves the rest unread, and its
    BODY_TIMEOUT unstarted, for now: reading is paused, or there is no room for its answer and its
    declared body. What it read holds the body budget meanwhile; without room there (or past its
    key's share of it), it is answered 503: read on, it would take room it was not given. The one
    waiting already waits (WaitingBody.read_on reads it on)."""
    if request is pipeline.waiting_body.request:
        return True
    pipeline.account.keyed(request.target, request.headers)  # its body counts for its key from now
    if pipeline.read_paused or (pipeline.account.budget.held and not pipeline.waiting_body.room(request)):
        if pipeline.waiting_body.begin(request):
            pipeline.pause()
        else:
            busy(pipeline, request)
        return True
    return False


def busy(pipeline: Waits, request: Request) -> None:
    """No room in the body budget for what `request` read while it waits: answered 503 in its turn, its
    connection's last answer, and what it read let go now (its connection lingers after that answer)."""
    pipeline.last(*pipeline.waiting_body.reader.encoded(request, error_reply(BUSY_BODIES, NO_CHARGE, close=True)))
    request.parts = []
