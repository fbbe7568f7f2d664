"""Bytes of answers made and not yet taken by their clients, bounded per connection, per API key and
per process (MAX_PENDING_ANSWER_BYTES, ..._PER_KEY, ..._PER_PROCESS): a request is made only while
its connection, its key and the process have room for its answer, else it waits, unmade, in order,
until what its clients take makes room. Without it a client that reads nothing held as many answers
as it sent requests: a count of answers bounded nothing when one answer is 4 MB. With WORKERS=N each
worker holds a key to its share of the key's bound (key_share): no count shared on the answers' path."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping

from proxy.http.first_answers import FAIR_OVER, FirstAnswers

SIZES_KEPT = 8  # a connection's estimate of its next answer: the largest of its last answers
UNKNOWN_SHARE = 2  # before any answer, one is reckoned at half the connection's bound (2 made at once)
# ...less this (at most a FLOOR_SHARE of it): their requests' bodies count with them (Account.bodies), and
# two with bodies under it together are still made at once.
BODY_ALLOWANCE = 64 * 1024
# A request's body is held about this many times over while its call is made (the bytes read, the
# parsed JSON, the call forwarded: 3.4 per 4 MB body, bench/body_copies.py), and it is reckoned so
# from the moment its room is found (its read, while it arrives over several). Reckoned once, 100
# connections each sending 3 calls of 4 MB held 5.6 times the count in RSS.
BODY_COPIES = 3
# And never under a 64th of it: as many answers as a connection may have made at once (MAX_WAITING,
# WS_MAX_INFLIGHT), once its answers are known to be small.
FLOOR_SHARE = 64
# Before any, an answer is reckoned at this in its key's and the process's counts: many new
# connections of one key (a pool opening) are not held up by half their own bound each (and how
# many such answers are made at once is bounded: first_answers.py).
UNKNOWN_SHARED = 64 * 1024
PROCESS = object()  # the process's pass (AnswerBytes.passes), beside each key's


def key_share(per_key: int, workers: int) -> int:
    """A worker's part of MAX_PENDING_ANSWER_BYTES_PER_KEY, the host's: an even split, rounded up (the
    kernel spreads connections over the workers; a key's first answer in a worker is made whatever it
    is, so a key with all its connections on one worker still gets answers)."""
    return -(-per_key // workers)


class AnswerBytes:
    """The process's count, shared by every transport of a serving process: bytes of answers made
    and not yet taken (being made: reckoned at their connection's estimate; encoded and waiting; and
    written but not yet taken by the client, in the transport's buffer or the kernel's), in all and per
    key, and the connections whose requests wait for room, woken in turn as bytes are taken."""

    def __init__(self, per_connection: int, per_key: int, per_process: int) -> None:
        self.per_connection = per_connection
        self.per_key = per_key
        self.per_process = per_process
        self.held = 0  # bytes, all connections together
        self.keys: dict[str, int] = {}  # bytes per API key (those with any)
        self.waiting = 0  # requests held, unmade, for want of room (all connections)
        # A coded (gzip) request body is reckoned at the most it may decode to (MAX_BODY_BYTES) until
        # it is decoded: 1 KB on the wire may hold 1 MB.
        self.coded_body = 0
        self._waiters: dict[Callable[[], None], None] = {}  # in the order they began to wait
        self._wake_soon: asyncio.Handle | None = None
        # Connections whose last bytes written (under POLL_FROM) are measured only with their next
        # write: an idle keep-alive connection's would stay counted after its client took them. They
        # are measured when a request waits for room and when the count is read (measured).
        self.unmeasured: dict[Account, None] = {}
        # The one connection per key (and one in the process, under PROCESS) whose batch made alone
        # may go past that bound, until its client has taken all it holds (batch_room): each
        # connection's batch was made alone past every shared bound, and 20 connections of one key,
        # each sent one batch of 30 MB, held 600 MB against a bound of 64 MiB.
        self.passes: dict[object, Account] = {}
        # Answers being made whose connections have had none: how many at once is bounded.
        self.first = FirstAnswers(max(1, per_process // max(1, per_connection // UNKNOWN_SHARE)), self._wake_later)
        # The account an API key opens (None: no account, its connection stays unkeyed); the key
        # itself unless told (Gateway.account; open mode's are any name). A key taken from the path
        # unchecked let a client name a made-up key first, then hold a real key's calls where no
        # bound of it saw them.
        self.account_of: Callable[[str], str | None] = lambda key: key
        # The key a request's headers present, where its path names none (endpoint.key_of).
        self.secret_of: Callable[[Mapping[str, str]], str | None] = lambda headers: None

    def charge(self, key: str | None, delta: int) -> None:
        """A connection's bytes changed by `delta`; bytes taken wake those waiting for room."""
        self.held += delta
        if key is not None:
            left = self.keys.get(key, 0) + delta
            if left > 0:
                self.keys[key] = left
            else:
                self.keys.pop(key, None)
        if delta < 0 and self._waiters and self._wake_soon is None:  # inline: every answer taken passes here
            self._wake_soon = asyncio.get_running_loop().call_soon(self._wake)

    def _wake_later(self) -> None:
        if self._waiters and self._wake_soon is None:
            self._wake_soon = asyncio.get_running_loop().call_soon(self._wake)

    def room(self, key: str | None, own: int, more: int, shared: int | None = None) -> bool:
        """Whether an answer reckoned at `more` bytes (`shared` in the key's and the process's counts)
        may be made for a connection holding `own`: within every bound, or the first of its bound's
        holders (an answer larger than a bound is made alone: nothing is refused for its size here)."""
        if own and own + more > self.per_connection:
            return False
        shared = more if shared is None else shared
        held = 0
        if key is not None:
            held = self.keys.get(key, 0)
            if held and held + shared > self.per_key:
                return False
        if self.held and self.held + shared > self.per_process:
            return self._fair(key, held, shared)
        return True

    def _fair(self, key: str | None, held: int, shared: int) -> bool:
        """Past the process's bound: whether a key holding nothing (one answer at a time, as the first
        of its own bound), or under its even share of the bound (over the keys holding any, itself
        among them) up to a FAIR_OVER part past it, is made still. Four keys whose clients read nothing
        held the whole bound at its defaults (and connections' first answers, reckoned before their
        size is known, three times it), and every other key's calls waited until those were reset."""
        if key is None:
            return False  # no key (none presented that opens an account): no share of its own
        if not held:
            return True
        limit = self.per_process
        return held + shared <= limit // len(self.keys) and self.held + shared <= limit + limit // FAIR_OVER

    def batch_room(self, account: Account, more: int, alone: bool) -> bool:
        """Whether a batch's call reckoned at `more` bytes may be made for `account` in its key's and
        the process's counts: within each bound, or past it holding that bound's pass, which a batch
        made `alone` (Batch.room) takes when no other connection holds it."""
        key = account.key
        if key is not None and not self._fits(key, self.keys.get(key, 0), self.per_key, account, more, alone):
            return False
        return self._fits(PROCESS, self.held, self.per_process, account, more, alone)

    def _fits(self, bound: object, held: int, limit: int, account: Account, more: int, alone: bool) -> bool:
        holder = self.passes.get(bound)
        if holder is account or not held or held + more <= limit:
            return True
        if alone and holder is None:
            self.passes[bound] = account
            account.passes += 1
            return True
        return False

    def give_back(self, account: Account) -> None:
        """`account`'s passes are free again (its client took all it held, or it closed)."""
        for bound, holder in list(self.passes.items()):
            if holder is account:
                del self.passes[bound]
        account.passes = 0
        self._wake_later()

    def wait(self, retry: Callable[[], None]) -> None:
        """`retry` is called once, after the next bytes taken anywhere (it waits again if still short);
        the bytes of idle connections are measured first (those their clients took wake it at once)."""
        self._waiters[retry] = None
        self.measure()

    def measure(self) -> None:
        """The unmeasured connections' bytes, measured now (those still unsent are polled as any)."""
        unmeasured, self.unmeasured = self.unmeasured, {}
        for account in unmeasured:
            account.measure()

    def measured(self) -> int:
        """`held`, with every connection's written bytes measured (the gauge's reading)."""
        self.measure()
        return self.held

    def forget(self, retry: Callable[[], None]) -> None:
        self._waiters.pop(retry, None)

    def _wake(self) -> None:
        self._wake_soon = None
        waiters, self._waiters = self._waiters, {}
        for retry in waiters:
            retry()


class Estimate:
    """A connection's reckoning of its next answer's size, before it is made: the largest of its last
    SIZES_KEPT answers, and never under a FLOOR_SHARE of its bound (pure: fed sizes, read as an int).
    Its batches' calls have one of their own (Account.member), fed their answers' sizes."""

    def __init__(self, bound: int) -> None:
        self._floor = max(1, bound // FLOOR_SHARE)
        self._sizes: deque[int] = deque(maxlen=SIZES_KEPT)
        self.size = max(self._floor, bound // UNKNOWN_SHARE - min(BODY_ALLOWANCE, self._floor))
        self.shared = min(self.size, UNKNOWN_SHARED)  # as reckoned in its key's and the process's counts
        self.unknown = True  # no answer seen yet (first_answers.py)

    def saw(self, size: int) -> None:
        self._sizes.append(size)
        self.size = self.shared = max(self._floor, max(self._sizes))
        self.unknown = False


POLL_SECONDS = 0.02  # how often bytes written and not yet taken are measured again, while any are
POLL_MAX_SECONDS = 0.64  # doubling up to this while none are taken (a client that reads nothing costs little)
POLL_FROM = 64 * 1024  # written bytes below this are measured with the next (the kernel takes them at once)


class Account:
    """One connection's bytes in the process's count: answers being made (at its Estimate), encoded
    and waiting their turn, and written but not yet taken (measured by `unsent`, again every
    POLL_SECONDS while any are: the kernel's queue drains with no event to tell)."""

    def __init__(
        self,
        budget: AnswerBytes,
        loop: asyncio.AbstractEventLoop,
        unsent: Callable[[], int],
        retry: Callable[[], None],
        first: Callable[[], object] | None = None,
    ) -> None:
        self.budget = budget
        # The task making its first answer not yet written, when answers go out in the order asked
        # (HTTP/1.1: those encoded and waiting may be behind a batch being made, never holding it).
        # None: each goes out as it is made (WebSocket), so all that wait are ahead of a batch.
        self.first = first
        self._loop = loop
        self._unsent = unsent
        self._retry = retry
        self.key: str | None = None  # the API key of its first request that names one
        self.estimate = Estimate(budget.per_connection)
        self.member = Estimate(budget.per_connection)  # a batch's next call's answer (Batch)
        self.batches: list[Batch] = []  # its batches being made, oldest first
        self.member_calls = 0  # its batches' calls being made (reckoned at `member`, in every count)
        self.members_made = 0  # bytes of its batches' answers made so far (counted as any bytes)
        # Its batches' bytes in its own count and in the shared ones (batched(): off the hit path).
        self.batch_own = self.batch_charged = 0
        self.batches_made = 0  # batches whose calls are all made, counted until their answer is (made)
        self._members_room: asyncio.Event | None = None  # set when a batch's call waiting for room may look again
        self.making = 0  # answers being made
        self.unknown = 0  # of them, those made before any answer of its own was (first_answers.py)
        self.bodies = 0  # its requests' bodies (BODY_COPIES each), from their first read until answered
        self.queued = 0  # bytes encoded, waiting for the answers before them
        self.written = 0  # bytes written, not yet known to be taken
        self.own = 0  # what it holds against its own bound
        self.charged = 0  # what the process's and its key's counts hold for it
        self._poll: asyncio.TimerHandle | None = None
        self._every = POLL_SECONDS
        self.closed = False
        self.passes = 0  # the shared bounds its batches may go past (AnswerBytes.passes)

    def keyed(self, target: tuple[str | None, str | None] | None, headers: Mapping[str, str] | None = None) -> None:
        """Its key: the account of the first request whose key (in its path, else its `headers`) opens
        one (what it holds already counts for it); a made-up key counts for nothing."""
        if self.key is None and target is not None:
            secret = target[1] or (self.budget.secret_of(headers) if headers is not None else None)
            key = self.budget.account_of(secret) if secret else None
            if key is None:
                return
            if self.unknown and not self.closed:
                self.budget.first.made(None, -self.unknown)
                self.budget.first.made(key, self.unknown)
            self.key = key
            if self.charged and not self.closed:
                self.budget.keys[self.key] = self.budget.keys.get(self.key, 0) + self.charged

    def room(self, body: int = 0, call: bool = True) -> bool:
        """Whether a request whose body is `body` bytes may be made now (its answer at the estimate).
        Not a JSON-RPC `call` (a health probe, a scrape of /metrics): at once while its connection
        holds nothing, never behind others' answers (past the process's bound, a keyed proxy's
        /healthz waited with the calls: an orchestrator restarts a process whose probes time out);
        else as a call (a client pipelining scrapes and reading nothing holds one answer past it)."""
        body *= BODY_COPIES
        estimate = self.estimate
        if not call:
            if self.written:
                self.measure()  # what its client took of the last answer (under POLL_FROM, unmeasured)
            if not self.own:
                return True
        if estimate.unknown and not self.budget.first.room(self.key):
            return False
        return self.budget.room(self.key, self.own, estimate.size + body, estimate.shared + body)

    def others_hold(self, held: object) -> bool:
        """Whether requests are `held` for want of room that others' bytes take (its own would fit):
        not its client's idleness, when its client has taken all it was sent (the caller's look)."""
        return bool(held) and self.own + self.estimate.size <= self.budget.per_connection

    def wait(self) -> None:
        """Its next request waits for room: retried after the next bytes taken anywhere."""
        self.budget.wait(self._retry)
        if self.written:
            self._polling()

    def room_or_wait(self, body: int, call: bool = True) -> bool:
        """room(body, call); without it, its next request waits for room (wait)."""
        if self.room(body, call):
            return True
        self.wait()
        return False

    def making_one(self, body: int = 0) -> None:
        """A request is being made: its answer reckoned at the estimate, and its `body` bytes held."""
        self.making += 1
        self.bodies += body * BODY_COPIES
        if self.estimate.unknown and not self.closed:
            self.unknown += 1
            self.budget.first.made(self.key, 1)
        self.recount()

    def reading(self, body: int) -> None:
        """A request body of `body` bytes is read on, room found for it (FrontProtocol.receive):
        reckoned as while it is made; -`body` once it is read (then made, or held for room)."""
        if not self.closed:
            self.bodies += body * BODY_COPIES
            self.recount()

    def made(self, size: int, reckoned: bool, body: int = 0) -> None:
        """An answer is encoded: `size` bytes waiting their turn, no longer reckoned at the estimate
        (`reckoned`: it was, as a JSON-RPC answer being made), its request's `body` let go."""
        if reckoned:
            self.making -= 1
            self.bodies -= body * BODY_COPIES
            self.estimate.saw(size)
            if self.unknown:  # the others it makes are reckoned at this one's size now
                self.budget.first.made(self.key, -self.unknown)
                self.unknown = 0
        self.queued += size
        if self.batches_made:
            self._batch_answered(asyncio.current_task())
        self.recount()

    def enqueued(self, size: int) -> None:
        self.queued += size
        self.recount()

    def dropped(self, size: int) -> None:
        """An answer waiting its turn was not written (its connection closed, or fell behind)."""
        self.queued -= size
        self.recount()

    def wrote(self, size: int, dequeued: bool = False) -> None:
        if dequeued:
            self.queued -= size
        self.written += size
        self.recount()
        if self.batches:
            self.members_look()  # an answer before a batch written: it may be first now (Batch)
        if self.written >= POLL_FROM:
            self._polling()
        elif self._poll is None:
            self.budget.unmeasured[self] = None

    def batch(self) -> Batch:
        """A batch of its connection begins to be made (gateway/running.py)."""
        return Batch(self)

    async def room_taken(self) -> None:
        """Until bytes are taken anywhere, its batches move up, or it closes (Batch.member waits)."""
        event = self._members_room
        if event is None:
            event = self._members_room = asyncio.Event()
        event.clear()
        self.budget.wait(self.members_look)
        if self.written:
            self._polling()
        self.budget.waiting += 1
        try:
            await event.wait()
        finally:
            self.budget.waiting -= 1

    def _batch_answered(self, task: object) -> None:
        """The answer of the batch made in `task` is counted: its calls' answers leave the count."""
        for batch in self.batches:
            if batch.ended and batch.task is task:
                batch.release()
                return

    def members_look(self) -> None:
        if self._members_room is not None:
            self._members_room.set()

    def close(self) -> None:
        """The connection is gone: its bytes leave the count (answers still being made are not written)."""
        self.closed = True
        self.budget.forget(self._retry)
        self.budget.forget(self.members_look)
        for batch in [batch for batch in self.batches if batch.ended]:
            batch.release()  # nothing of it will be written: the closed connection's next batch goes on
        self.members_look()
        self.budget.unmeasured.pop(self, None)
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None
        if self.passes:
            self.budget.give_back(self)
        if self.unknown:
            self.budget.first.made(self.key, -self.unknown)
            self.unknown = 0
        self.budget.charge(self.key, -self.charged)
        self.charged = self.own = self.making = self.bodies = self.queued = self.written = 0

    def recount(self) -> None:
        if self.closed:
            return
        taken = self.queued + self.written
        held = taken + self.bodies
        self.own = self.making * self.estimate.size + held + self.batch_own
        charged = self.making * self.estimate.shared + held + self.batch_charged
        if charged != self.charged:
            self.budget.charge(self.key, charged - self.charged)
            self.charged = charged
        if self.passes and not taken and not self.batches:
            self.budget.give_back(self)  # its client took all it was sent past the bound

    def batched(self) -> None:
        """Its batches' calls or answers changed: their bytes reckoned again, then its count."""
        made, calls, member = self.members_made, self.member_calls, self.member
        self.batch_own = made + calls * member.size
        self.batch_charged = made + calls * member.shared
        self.recount()

    def _polling(self) -> None:
        if self._poll is None and not self.closed:
            self._poll = self._loop.call_later(self._every, self.measure)

    def measure(self) -> None:
        """Its written bytes the client has not taken yet, measured again (polled while any are)."""
        if self._poll is not None:
            self._poll.cancel()
        self._poll = None
        if self.closed:
            return
        written, self.written = self.written, self._unsent()
        self._every = min(2 * self._every, POLL_MAX_SECONDS) if self.written >= written else POLL_SECONDS
        self.recount()
        if self.written:
            self._polling()


class Batch:
    """One batch's calls while they are made, in its connection's count: each answer as it is made
    (in the key's and the process's counts too: others' requests wait for them), and each call being
    made reckoned at the connection's `member` estimate. A call is made while its connection, its key
    and the process have room for it, or when its batch is the connection's oldest and its client has
    taken all it was sent (made alone, as one answer larger than a bound is: past its key's or the
    process's bound only with that bound's pass, one connection at a time); a closed connection's
    batches are made one at a time. Pipelined batches were each reckoned at one answer and all made
    at once: 12 batches of 300 answers of 100 KB on one connection held 534 MB."""

    __slots__ = ("_account", "_turn", "ended", "made", "making", "task")

    def __init__(self, account: Account) -> None:
        self._account = account
        self._turn: asyncio.Lock | None = None  # its calls wait for room in order, one at a time
        self.making = 0  # calls being made
        self.made = 0  # bytes of its answers made so far
        self.ended = False  # all its calls are made (or it was cancelled); it is counted until its answer is
        self.task = asyncio.current_task()  # the body's: where its answer is counted (Account.made)
        account.batches.append(self)
        # No longer reckoned at the connection's estimate, but by its calls: a batch waiting for room
        # held its key's and the process's counts at the estimate, which a 30 MB batch answer before
        # it made 30 MB (11 waiting batches of a client that read nothing held 330 MB no answer took).
        account.making -= 1
        if account.written:  # what its client took of the last answers (under POLL_FROM, unmeasured)
            account.measure()  # (recounted) may leave it alone: its calls go on together (upstream batches)
        else:
            account.batched()

    def room(self) -> bool:
        """Room for its next call: in its connection's count, or made alone (past that bound, and past
        its key's or the process's with their pass); in its key's and the process's counts too."""
        account = self._account
        if account.batches[0] is self and (account.closed or (not account.written and self._first())):
            return account.closed or account.budget.batch_room(account, account.member.size, True)
        if account.closed or account.own + account.member.size > account.budget.per_connection:
            return False
        return account.budget.batch_room(account, account.member.size, False)

    def _first(self) -> bool:
        """Every answer before it is taken by its client: it is the connection's next to be written
        (its answers in order), or nothing else waits to be (as they are made)."""
        account = self._account
        return account.first() is self.task if account.first is not None else not account.queued

    async def member(self) -> None:
        """Room for one more call's answer, waited for in the batch's order."""
        turn = self._turn
        if (turn is None or not turn.locked()) and self.room():
            self._making()
            return
        if turn is None:
            turn = self._turn = asyncio.Lock()
        async with turn:
            while not self.room():
                await self._account.room_taken()
            self._making()

    def member_made(self, size: int) -> None:
        """A call being made is answered in `size` bytes (0: it failed, or was cancelled)."""
        if self.ended:  # a call cancelled after its batch gave up (gather's order)
            return
        account = self._account
        self.making -= 1
        self.made += size
        account.member_calls -= 1
        account.members_made += size
        account.member.saw(size)
        account.batched()

    def end(self) -> None:
        """Its calls are made (or it was cancelled). Their answers stay in the count, and the batch
        first in its connection's order, until the batch's answer is counted in their place
        (Account.made): a batch behind it is not made alone meanwhile."""
        account = self._account
        self.ended = True
        account.member_calls -= self.making
        self.making = 0
        account.batches_made += 1
        if account.closed:
            self.release()
        else:
            account.batched()

    def release(self) -> None:
        account = self._account
        account.making += 1  # its answer's count (Account.made) takes its reckoning off once more
        account.batches.remove(self)
        account.batches_made -= 1
        account.members_made -= self.made
        self.made = 0
        account.batched()
        account.members_look()

    def _making(self) -> None:
        account = self._account
        self.making += 1
        account.member_calls += 1
        account.batched()
