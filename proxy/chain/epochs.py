"""The network's epoch and finalized checkpoint, kept beside the cache entries.

An epoch is the part of a network's cache keys moved on when entries may no longer belong to the
chain: a finality violation, a devnet restarted with the same genesis, a dev node's state changed
through the proxy. With Redis the record lives there (`rcp:e:<network>@<identity>`), so a restarted
proxy or a new replica starts in the epoch in force, and checks the record's checkpoint (a finalized
block of that epoch's chain) against the chain before it serves or stores anything. Records are
changed by compare-and-set on the epoch, so replicas that see the same change agree on one epoch.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.redis_link import RedisLink, RedisUnavailable

NONE = "-"  # the expected epoch of a record that does not exist yet

# spec of this proxy: the checkpoint moves only forward within an epoch; another epoch replaces it.
ADVANCE_SCRIPT = """
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'number', 'hash')
if (cur[1] == false and ARGV[1] == '-') or cur[1] == ARGV[1] then
  local number, hash = ARGV[3], ARGV[4]
  if cur[1] == ARGV[2] and cur[2] and tonumber(cur[2]) > tonumber(number) then
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


def new_epoch() -> str:
    """A name no earlier epoch had (replicas agree on it through the store, not by deriving it)."""
    return secrets.token_hex(6)


def record_key(base: str) -> str:
    return f"rcp:e:{base}"


class EpochStore(Protocol):
    async def advance(self, base: str, expected: str, new: Checkpoint) -> Checkpoint | None:
        """Write `new` if the record's epoch is `expected` (NONE: no record); the record in force
        after, or None when the store cannot be read now."""
        ...


class MemoryEpochs:
    """One process's epochs: without Redis nothing outlives the process, and nothing needs to."""

    def __init__(self) -> None:
        self._records: dict[str, Checkpoint] = {}

    async def advance(self, base: str, expected: str, new: Checkpoint) -> Checkpoint | None:
        current = self._records.get(base)
        if (current.epoch if current is not None else NONE) == expected:
            if current is not None and current.epoch == new.epoch and current.number > new.number:
                new = current
            self._records[base] = new
        return self._records.get(base)


class RedisEpochs:
    def __init__(self, link: RedisLink) -> None:
        self._link = link
        self._script: Any = link.client.register_script(ADVANCE_SCRIPT)

    async def advance(self, base: str, expected: str, new: Checkpoint) -> Checkpoint | None:
        args = [expected, new.epoch, str(new.number), new.hash]
        try:
            reply = await self._link.run("epoch", lambda _c: self._script(keys=[record_key(base)], args=args))
        except RedisUnavailable:
            return None
        return parse_record(reply)


def parse_record(reply: Any) -> Checkpoint | None:
    """A record as HMGET returns it (bytes or str fields), or None when it holds none."""
    if not isinstance(reply, list) or len(reply) != 3 or any(v is None for v in reply):
        return None
    epoch, number, block_hash = (v.decode() if isinstance(v, bytes) else str(v) for v in reply)
    try:
        return Checkpoint(epoch, int(number), block_hash)
    except ValueError:
        return None
