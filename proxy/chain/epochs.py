"""The network's epoch and finalized checkpoint, kept beside the cache entries.

An epoch is the part of a network's cache keys moved on when entries may no longer belong to the
chain: a finality violation, a devnet restarted with the same genesis, a dev node's state changed
through the proxy. With Redis the record lives there (`rcp:e:<network>@<identity>`), so a restarted
proxy or a new replica starts in the epoch in force; before it serves or stores anything its chain
is found to be the one the epoch's key space holds entries of (the space's trail, forks.py). Records are
changed by compare-and-set on the epoch, so replicas that see the same change agree on one epoch.

A record Redis no longer holds (flushed, or its key evicted) may have lost its space's trail with it
while entries of that space are still written: a replica whose record is gone moves on to a new
epoch, and a record made in Redis anew always names a new epoch, so no replica takes up (or goes
back to) a space it cannot check, nor one whose entries are of a state it has left.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.chain.forks import MemoryTrails, RedisTrails, TrailStore
from proxy.redis_link import RedisLink, RedisUnavailable

NONE = "-"  # the expected epoch of a record that does not exist yet

# spec of this proxy: the checkpoint moves only forward within an epoch; another epoch replaces it.
# A record without all three fields, or with a number that is not decimal digits, is no record (this
# proxy writes them whole): it is replaced as a missing one would be, and read as missing (parse_record);
# so is a key of another type than a hash (it made every exchange fail: the space was never shared).
ADVANCE_SCRIPT = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'none' and kind ~= 'hash' then
  redis.call('DEL', KEYS[1])
end
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'number', 'hash')
if cur[1] == false or cur[3] == false or cur[2] == false or not string.match(cur[2], '^%d+$') then
  cur = {false, false, false}
end
if (cur[1] == false and ARGV[1] == '-') or cur[1] == ARGV[1] then
  local number, hash = ARGV[3], ARGV[4]
  if cur[1] == ARGV[2] and tonumber(cur[2]) > tonumber(number) then
    number, hash = cur[2], cur[3]
  end
  redis.call('HSET', KEYS[1], 'epoch', ARGV[2], 'number', number, 'hash', hash)
end
return redis.call('HMGET', KEYS[1], 'epoch', 'number', 'hash')
"""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """An epoch and a finalized block (number, hash) of the chain it belongs to."""

    epoch: str
    number: int
    hash: str


MISSING = Checkpoint(NONE, 0, "")  # what a store answers where it holds no record


def new_epoch() -> str:
    """A name no earlier epoch had (replicas agree on it through the store, not by deriving it)."""
    return secrets.token_hex(6)


def record_key(base: str) -> str:
    return f"rcp:e:{base}"


class EpochStore(Protocol):
    trails: TrailStore  # each key space's trail of finalized blocks, in the same store (forks.py)

    async def advance(self, base: str, expected: str, new: Checkpoint) -> Checkpoint | None:
        """Write `new` if the record's epoch is `expected` (NONE: no record); the record in force
        after (MISSING: there is none), or None when the store cannot be read now."""
        ...


class MemoryEpochs:
    """One process's epochs: without Redis nothing outlives the process, and nothing needs to."""

    def __init__(self) -> None:
        self._records: dict[str, Checkpoint] = {}
        self.trails: TrailStore = MemoryTrails()

    async def advance(self, base: str, expected: str, new: Checkpoint) -> Checkpoint | None:
        current = self._records.get(base)
        if (current.epoch if current is not None else NONE) == expected:
            if current is not None and current.epoch == new.epoch and current.number > new.number:
                new = current
            self._records[base] = new
        return self._records.get(base, MISSING)


class RedisEpochs:
    def __init__(self, link: RedisLink) -> None:
        self._link = link
        self._script: Any = link.client.register_script(ADVANCE_SCRIPT)
        self.trails: TrailStore = RedisTrails(link)

    async def advance(self, base: str, expected: str, new: Checkpoint) -> Checkpoint | None:
        args = [expected, new.epoch, str(new.number), new.hash]
        try:
            reply = await self._link.run("epoch", lambda _c: self._script(keys=[record_key(base)], args=args))
        except RedisUnavailable:
            return None
        return parse_record(reply)


def parse_record(reply: Any) -> Checkpoint | None:
    """A record as HMGET returns it (bytes or str fields): MISSING when there is none (or none whole:
    ADVANCE_SCRIPT), None when the reply cannot be read."""
    if not isinstance(reply, list) or len(reply) != 3:
        return None
    if any(v is None for v in reply):
        return MISSING
    epoch, number, block_hash = (v.decode() if isinstance(v, bytes) else str(v) for v in reply)
    if not (number.isascii() and number.isdigit()):
        return MISSING
    return Checkpoint(epoch, int(number), block_hash)


class EpochKeeper:
    """One network's epoch as its tracker holds it: the name in its keys, the stored record's epoch
    (the compare-and-set's guess), and whether keys may be named yet."""

    def __init__(self, store: EpochStore | None) -> None:
        self.store = store if store is not None else MemoryEpochs()
        self.epoch = ""
        self.loaded = False  # the record was read and its checkpoint found on the chain: keys can be named
        # Not loaded, and the store could not be read or written (Redis down, or full under noeviction)
        # since this keeper last named keys: the tracker names a space of its own meanwhile (forks.py).
        self.unread = False
        self.keyed = asyncio.Event()  # keys were first named
        self._record = NONE
        self._moved = False  # moved on since the record was last written with this epoch

    def forget(self) -> None:
        """Another chain identity: its own record is read next."""
        self.loaded, self._record = False, NONE

    def move_on(self) -> None:
        """A state change or a finality violation here: a new epoch, which supersedes whatever epoch the
        record names when it is next written (another replica's may be of the state before this one)."""
        self.epoch, self._moved = new_epoch(), True

    async def sync(self, base: str, finalized: int, final_hash: str, violated: bool) -> None:
        """Read and move on the record: adopt another replica's epoch, check a stored checkpoint on
        the chain before naming keys, and advance the checkpoint."""
        mine = (finalized, final_hash)
        if not self.loaded and not violated and not self._moved and self._record == NONE:
            # Only read (an impossible expected epoch writes nothing): is there an epoch in force?
            stored = await self.store.advance(base, "?", Checkpoint("", 0, ""))
            if stored is not None and stored is not MISSING:
                self._adopt(stored, proven=(stored.number, stored.hash) == mine)
                return
        if self._record == NONE and self.store.trails.shared:
            self.epoch = new_epoch()  # a record made anew: never the name of a space it may have held
        stored = await self._written(base, Checkpoint(self.epoch, finalized, final_hash))
        if stored is None:  # the store cannot be read now: keys stay as they are until it can, or
            self.unread = self.unread or not self.loaded  # unnamed ones are named aside meanwhile
            if self.unread:
                self.keyed.set()  # named, in a space of the tracker's own (forks.py)
            return
        if stored is MISSING:  # the record kept is gone (flushed, evicted), and its space's trail may be
            self.epoch, self._record, self.loaded = new_epoch(), NONE, False  # made anew on the next poll
            return
        if stored.epoch != self.epoch:
            if self._moved:  # yet another replica wrote meanwhile: over it on the next poll
                self._record = stored.epoch
            else:
                self._adopt(stored, proven=(stored.number, stored.hash) == mine)  # another replica moved first
            return
        self._record, self._moved = stored.epoch, False
        self._named()

    async def _written(self, base: str, mine: Checkpoint) -> Checkpoint | None:
        """The record after this replica's checkpoint is written: over another replica's epoch too when
        this replica moved on since the record it knew (that epoch may be of the state before its move)."""
        expected = self._record
        for _ in range(2):
            stored = await self.store.advance(base, expected, mine)
            if stored is None or stored is MISSING or stored.epoch == mine.epoch or not self._moved:
                return stored
            expected = stored.epoch
        return stored

    def _adopt(self, stored: Checkpoint, *, proven: bool) -> None:
        """Take a stored epoch; unless this poll's finalized block is its very checkpoint, keys are named
        from the next poll on, once this replica's checkpoint is in the record too. Whether this chain
        is the one the epoch's entries are of is the space's trail's to show (forks.py): a checkpoint
        another replica wrote may be of another fork, which is no violation of this chain's finality."""
        self.epoch, self._record, self.loaded = stored.epoch, stored.epoch, False
        if proven:
            self._named()

    def _named(self) -> None:
        self.loaded, self.unread = True, False
        self.keyed.set()
