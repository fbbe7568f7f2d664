"""Whether this replica may read its network's shared key space: its own chain agrees with the chain
of the replicas that filled it (replicas sharing one Redis whose nodes are on diverged forks).

Every key space (`Head.space`) has a trail beside its entries: the finalized blocks (height, hash)
its replicas reached, one mark per poll, the last TRAIL_MARKS kept. A replica adds its own finalized
block only on top of a mark it found on its own chain, so the trail is one chain. Before a head
names the space, the replica finds on its own chain the lowest mark at or above its finalized block
(or the top one, under which it then adds its own): each block names its parent, so every block at
or below its finalized block is then the trail's, and every final entry of the space (written by a
replica whose finalized block the trail holds) is this replica's chain's. A replica whose chain
has another block at a mark's height is on another fork: it logs it, counts it
(`rpc_proxy_fork_disagreements_total`), says so on /readyz, and from then on names a key space of
its own (`<space>/<its finalized block's hash>`), which replicas at that very block share.

A poll that cannot read the trail (Redis down or slow) keeps the standing only while its finalized
block is one a check found on the trail's chain: final entries up to there are the space's chain's.
Past it, another replica's chain may have parted from this one's since, and a shared space would take
either's final entries as the other's; so until a check passes, the head names a space of this
guard's own (`<space>/~<a token drawn for the guard>`), which no other replica or worker reads, and
the memory tier keeps serving this node's answers through the outage. So does a space this replica
just made (a new epoch), with Redis, until its first check: the trail is empty, and another replica
that takes the epoch and starts the trail with its own chain's mark would otherwise find this one's
entries there. So does a replica that cannot read its epoch's record at all (started while Redis is
down, or full under noeviction, which refuses the record's write): until it can, its head names a
space of its own under the network and identity alone (`<network>@<identity>/~<token>`).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.metrics import Metrics
from proxy.redis_link import RedisLink, RedisUnavailable

log = logging.getLogger("proxy.chain")

TRAIL_MARKS = 1024  # marks kept per key space: a replica further behind than this cannot check
OWN_MARKS = 4096  # this replica's own finalized blocks remembered per key space
DOUBT_POLLS = 3  # polls in a row without a mark it can check before a replica uses its own space
# A trail lives this long after its last exchange (every poll of a replica in its space has one): the
# trail of a space no replica names any more (an epoch moved on) goes, instead of piling up.
TRAIL_TTL_MS = 7 * 24 * 3600 * 1000
# KEYS[1] a space's trail (a sorted set: score a height, member its hash). ARGV[1] the hash expected on
# top ("" an empty trail, "-" only read), ARGV[2..3] the mark added when it is, ARGV[4] the floor, ARGV[5]
# how many marks are kept, ARGV[6] its time to live (ms). The top and the lowest mark at or above the floor.
# A key of another type is no trail (another program's, or tampered): gone, as a flushed one is.
TRAIL_SCRIPT = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'none' and kind ~= 'zset' then
  redis.call('DEL', KEYS[1])
end
local top = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if ARGV[1] ~= '-' and ARGV[1] == (top[1] or '') and (top[2] == nil or tonumber(top[2]) < tonumber(ARGV[2])) then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -tonumber(ARGV[5]) - 1)
  top = {ARGV[3], ARGV[2]}
end
redis.call('PEXPIRE', KEYS[1], ARGV[6])
local above = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[4], '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
return {top[1] or false, top[2] or false, above[1] or false, above[2] or false}
"""

Mark = tuple[int, str]  # a finalized block: (height, hash)
# This replica's block hash at a height below its finalized block (raising when its node fails to say).
OwnHash = Callable[[int], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Trail:
    """What one exchange with a trail shows: its top mark, and its lowest mark at or above the floor."""

    top: Mark | None
    above: Mark | None


def trail_key(space: str) -> str:
    return f"rcp:e:{space}:t"


class TrailStore(Protocol):
    shared: bool  # other replicas read the spaces too (Redis): a space just made is not this one's alone

    async def mark(self, space: str, expected: str | None, new: Mark, floor: int) -> Trail | None:
        """Add `new` if the top mark's hash is `expected` ("" none; None: only read); the trail then,
        or None when it cannot be read now."""
        ...


class MemoryTrails:
    """One process's trails: without Redis no other replica shares the space."""

    shared = False

    def __init__(self) -> None:
        self._trails: dict[str, dict[int, str]] = {}

    async def mark(self, space: str, expected: str | None, new: Mark, floor: int) -> Trail | None:
        trail = self._trails.setdefault(space, {})
        top = max(trail.items(), default=None)
        if expected is not None and expected == (top[1] if top else "") and (top is None or top[0] < new[0]):
            trail[new[0]] = new[1]
            while len(trail) > TRAIL_MARKS:
                del trail[min(trail)]
            top = new
        above = min(((n, h) for n, h in trail.items() if n >= floor), default=None)
        return Trail(top, above)


class RedisTrails:
    shared = True

    def __init__(self, link: RedisLink) -> None:
        self._link = link
        self._script: Any = link.client.register_script(TRAIL_SCRIPT)

    async def mark(self, space: str, expected: str | None, new: Mark, floor: int) -> Trail | None:
        args = [
            "-" if expected is None else expected,
            str(new[0]),
            new[1],
            str(floor),
            str(TRAIL_MARKS),
            str(TRAIL_TTL_MS),
        ]
        try:
            reply = await self._link.run("fork_trail", lambda _c: self._script(keys=[trail_key(space)], args=args))
        except RedisUnavailable:
            return None
        return parse_trail(reply)


def parse_trail(reply: Any) -> Trail | None:
    """The script's reply (bytes or str fields, None where there is no mark)."""
    if not isinstance(reply, list) or len(reply) != 4:
        return None
    fields = [v.decode() if isinstance(v, bytes) else v for v in reply]
    try:
        top = (int(float(fields[1])), str(fields[0])) if fields[0] is not None else None
        above = (int(float(fields[3])), str(fields[2])) if fields[2] is not None else None
    except (TypeError, ValueError):
        return None
    return Trail(top, above)


class ForkGuard:
    """One network's standing against its shared key space: the space its heads may name."""

    def __init__(self, network: str, store: TrailStore, metrics: Metrics) -> None:
        self.network = network
        self._store = store
        self._disagreements = metrics.fork_disagreements.labels(network)
        self._base = ""  # the shared space this standing is for
        self._fork = ""  # "": the shared space; else the hash naming this replica's own
        self._checked = False  # the current head's final blocks are the space's chain's
        self._doubts = 0
        self._own: dict[int, str] = {}
        self._agreed: int | None = None  # the highest finalized block a check found on the trail's chain
        # Until a check passes (the trail unread past `_agreed`, or a space just made): the head names a
        # space of this guard's own (`/~<token>`), read by no other replica or worker.
        self._aside = False
        self._unread = False  # it is aside for a trail it cannot read (said on /readyz)
        self._token = secrets.token_hex(4)
        self._fork_note: str | None = None

    @property
    def note(self) -> str | None:
        """For /readyz: why this replica uses a key space of its own (None: it shares the space)."""
        if self._unread:
            past = "" if self._agreed is None else f" past block {self._agreed}"
            return f"cannot read the shared cache's trail{past}: uses its own key space until it can"
        return self._fork_note

    def space(self, base: str) -> str | None:
        """The space a head may name for `base` (network, identity, epoch); None: not checked yet."""
        if base != self._base or not self._checked:
            return None
        space = self._judged(base)
        return f"{space}/~{self._token}" if self._aside else space

    def _judged(self, base: str) -> str:
        """The space whose trail this replica's chain is checked against: the shared one, or its fork's."""
        return f"{base}/{self._fork}" if self._fork else base

    def fresh(self, base: str | None) -> None:
        """A space this replica just made (a new epoch): named, aside, until its first check has put
        this chain's mark on the empty trail (another replica may take the epoch and start it first).
        None: made before the epoch's record could be read: the space of its own so far is left behind."""
        if base is None:
            self._token = secrets.token_hex(4)
            return
        self._reset(base)
        self._checked, self._aside = True, self._store.shared

    def unrecorded(self, base: str) -> None:
        """The epoch in force cannot be read from the store (Redis down, or full under noeviction, since
        this replica started): `base` names no epoch, and the head names a space of this guard's own
        under it until the record is read (a start during an outage keeps its memory tier)."""
        if base != self._base:
            self._reset(base)
        self._step_aside()

    def _reset(self, base: str) -> None:
        self._base, self._fork, self._checked, self._doubts, self._own = base, "", False, 0, {}
        self._agreed, self._aside, self._unread, self._fork_note = None, False, False, None

    async def check(self, base: str, final: Mark, window: Mapping[int, str], own_hash: OwnHash) -> None:
        """Before a head with finalized block `final` names `base`: is its chain the space's? (`window`:
        the head's unfinalized hashes; `own_hash` asks this replica's node for an older one.)"""
        if base != self._base:
            self._reset(base)
        self._own[final[0]] = final[1]
        while len(self._own) > OWN_MARKS:
            del self._own[min(self._own)]

        async def known(height: int) -> str | None:
            """Its chain's hash at `height`; None above its head (a mark it cannot check yet)."""
            found = window.get(height) or self._own.get(height)
            if found is None and height < final[0]:
                found = self._own[height] = await own_hash(height)
            return found

        for _ in range(2):  # the shared space, then (after a disagreement) this replica's own
            space = self._judged(base)
            verdict = await self._judge(space, final, known)
            if verdict is None:  # the trail cannot be read now
                if self._agreed is None or final[0] > self._agreed:
                    self._step_aside()
                return  # else the standing stays: its final blocks are the trail's chain's
            self._come_back()
            if verdict == "agrees":
                self._checked, self._doubts, self._agreed = True, 0, final[0]
                return
            if verdict == "unknown":
                self._doubts += 1
                self._checked = False
                if self._doubts < DOUBT_POLLS:
                    return
            self._split(space, final, verdict)

    async def _judge(self, space: str, final: Mark, known: Callable[[int], Awaitable[str | None]]) -> str | None:
        """ "agrees", "unknown" (no mark this replica can check), a disagreement's description, or None."""
        trail = await self._store.mark(space, None, final, final[0])
        for _ in range(3):  # another replica may add its mark between a read and an addition
            if trail is None:
                return None
            mark = trail.above or trail.top
            if mark is None:  # an empty trail: this replica's mark starts it
                trail = await self._store.mark(space, "", final, final[0])
                continue
            mine = await known(mark[0])
            if mine is None:
                return "unknown"
            if mine != mark[1]:
                return f"block {mark[0]} is {mark[1][:18]} in the shared cache's chain, {mine[:18]} on this node's"
            if mark[0] >= final[0]:
                return "agrees"
            trail = await self._store.mark(space, mark[1], final, final[0])  # on top of a mark of this chain
        return "unknown"

    def _split(self, space: str, final: Mark, why: str) -> None:
        if why == "unknown":
            why = f"no mark of the shared cache's chain this node can check for {DOUBT_POLLS} polls"
        self._fork, self._checked, self._doubts, self._agreed = final[1][2:18], False, 0, None
        self._fork_note = f"on another chain than the shared cache ({why}): uses its own key space"
        log.error("head tracker %s: key space %s: %s", self.network, space, self._fork_note)
        self._disagreements.inc()

    def _step_aside(self) -> None:
        """No check reaches this head's finalized block: a space no other replica or worker reads."""
        self._checked, self._aside = True, True
        if not self._unread:
            self._unread = True
            log.warning("head tracker %s: %s", self.network, self.note)

    def _come_back(self) -> None:
        """The trail is read: its check decides the space from here."""
        if self._unread:
            log.warning("head tracker %s: the shared cache's trail is read again", self.network)
        self._aside, self._unread = False, False
