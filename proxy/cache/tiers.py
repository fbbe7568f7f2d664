"""Cache keys, the in-process tier, the Redis tier, the tiered lookup and coalescing of misses.

Key encoding (documented in README): `v1|` + JSON `[key space, method, canonical params]` (the key
space names the network, its chain identity and epoch: `Head.space`) with
object keys sorted and block parameters replaced by `{"n": number}` (final),
`{"n": number, "h": hash}` (unfinalized, pinned to its block hash) or `{"h": hash}`. Keys longer
than 200 bytes become `v1#` + the SHA-256 of that text. An answer is held as `Stored`: the JSON
that is spliced into the response and whether it is an error object. Redis holds it as
redis_format.py writes it; memory holds the pair (the JSON copied once, when stored, into bytes of
its own length), so a hit neither decodes nor copies it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import secrets
import sys
import time
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from proxy.cache.admission import Admission
from proxy.cache.redis_format import Entry, Stored, decode_value, encode_value
from proxy.key_context import CALLER
from proxy.logs import Throttled
from proxy.metrics import Metrics
from proxy.redis_link import RedisLink, RedisUnavailable
from proxy.rpc.jsonrpc import dumps_canonical

log = logging.getLogger("proxy.cache")
throttled = Throttled(log)  # a Redis full of values of another program's would otherwise log every read
T = TypeVar("T")
MAX_PLAIN_KEY = 200
REDIS_PREFIX = "rcp:c:"
LOCK_PREFIX = "rcp:l:"
# Release a replica's fill lock only if it still holds it (it may have expired and passed on).
RELEASE_SCRIPT = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# A miss's first round trip: the stored answer and its PTTL, else the fill lock taken (ARGV[1] a
# token, "" for no lock) for ARGV[2] ms. KEYS are an answer and its lock: one slot (shared_keys).
GET_OR_LOCK_SCRIPT = """
local value = redis.call('GET', KEYS[1])
if value then return {value, redis.call('PTTL', KEYS[1]), 0} end
if ARGV[1] == '' then return {false, 0, 0} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {false, 0, 1} end
return {false, 0, 0}
"""
# A fill's last round trip: the answer stored (PX ARGV[2] ms, "" for none), then its lock released
# if this replica still holds it (token ARGV[3]).
SET_AND_UNLOCK_SCRIPT = """
if ARGV[2] == '' then redis.call('SET', KEYS[1], ARGV[1]) else redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) end
if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return 1
"""


def trimmed(data: bytes) -> bytes:
    """`data` copied into bytes of its own length, for what is held long. orjson's dumps returns bytes
    over a buffer of at least 4 KiB, about ten times the text for large texts (measured with orjson
    3.13 and tracemalloc; see README, "What the bound covers")."""
    return bytes(memoryview(data))


def cache_key(network: str, method: str, key_params: Any) -> str:
    text = dumps_canonical([network, method, key_params])
    if len(text) <= MAX_PLAIN_KEY:
        return "v1|" + text.decode()
    return "v1#" + hashlib.sha256(text).hexdigest()


def shared_keys(key: str) -> tuple[str, str]:
    """The Redis keys of an answer and of its fill lock. Both carry one hash tag, a checksum of the
    key, so a Redis Cluster keeps the pair in one slot (a poll reads both at once) while different
    answers spread over every slot; the key itself contains braces, which cannot be the tag."""
    tag = f"{{{zlib.crc32(key.encode()):08x}}}"
    return REDIS_PREFIX + tag + key, LOCK_PREFIX + tag + key


Vet = Callable[[int | None], bool]  # may this replica take a Redis value with this tag (sharing.py)?


class Found(NamedTuple):
    """A Redis entry as a fill's first round trip finds it."""

    stored: Stored | None  # None: a value this proxy did not write (redis_format.py), a miss
    ttl: float  # its remaining seconds (math.inf when immutable)
    final_at: int | None  # its writer's finalized height, for a hash-addressed answer (sharing.py)
    proven: bool = False  # its writer proved it (redis_format.py)


def may_serve(found: Found, vet: Vet | None, proven_forever: bool) -> bool:
    """May this replica serve a Redis entry: one this proxy wrote, whose tag `vet` takes (sharing.py),
    and, with `proven_forever` (VERIFY_ANSWERS=required: nothing unproven is kept forever), one with
    no expiry only when its writer proved it (an `auto` replica keeps some answers forever unproven)."""
    if found.stored is None or (vet is not None and not vet(found.final_at)):
        return False
    return not proven_forever or found.proven or found.ttl != math.inf


@dataclass(slots=True)
class FillLock:
    """The replicas' fill lock on one key: this replica's token, "" when it holds none (released, or
    not needed), None when another replica holds it (and is fetching the key)."""

    key: str
    token: str | None = ""


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...


# What an entry costs in this process, as CPython's allocators size it (see README, "What the bound
# covers"). Objects up to 512 bytes come from pymalloc in 16-byte steps; larger ones from malloc,
# which adds an 8-byte header and rounds to 16. Each entry is its key (a str), its payload (bytes of
# exactly its length), the (payload, is_error) tuple, and a slot in the LRU's tables, which
# sys.getsizeof reports whole (an OrderedDict's hash table, its node array and one 32-byte node per
# entry); an entry that expires adds a float and a slot in the table of expiry times. Measured with
# tracemalloc and /proc RSS by `python -m bench.memory_bound --entry-cost`.
SMALL_OBJECT_LIMIT = 512
STORED_TUPLE_BYTES = 64  # sys.getsizeof((b"", False)) is 56, rounded to pymalloc's 16
EXPIRY_FLOAT_BYTES = 32  # a float is 24, rounded to 16


def allocated(size: int) -> int:
    """Bytes an allocation of `size` bytes takes from the allocator (pymalloc or malloc)."""
    if size <= SMALL_OBJECT_LIMIT:
        return (size + 15) & ~15
    return (size + 8 + 15) & ~15


def entry_cost(key: str, payload: bytes, expiring: bool) -> int:
    """Bytes one entry's own objects take, apart from its slot in the tables."""
    cost = allocated(sys.getsizeof(key)) + allocated(sys.getsizeof(payload)) + STORED_TUPLE_BYTES
    return cost + EXPIRY_FLOAT_BYTES if expiring else cost


class MemoryTier:
    """An LRU bounded in bytes, with a per-entry expiry; the bound counts what entries really cost.

    `bytes_used` is every entry's own objects (`entry_cost`) plus the tables that hold them, so the
    tier's share of the process's memory stays within `max_bytes`. Only entries that expire have an
    expiry time: it is checked on read (an expired entry is dropped then), and the LRU bound evicts
    the rest. A hit is one dict lookup and one move to the end of the order.
    """

    def __init__(self, max_bytes: int, clock: Clock) -> None:
        self._max = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()  # least recently used first
        self._expiries: dict[str, float] = {}  # monotonic expiry time of each entry that has one
        self._items = 0  # the sum of entry_cost over the entries

    @property
    def bytes_used(self) -> int:
        return self._items + sys.getsizeof(self._entries) + sys.getsizeof(self._expiries)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Stored | None:
        try:
            stored = self._entries[key]  # subscript, not .get(): a call fewer on a hit
        except KeyError:
            return None
        expiries = self._expiries
        if expiries:
            expires = expiries.get(key)
            if expires is not None and expires <= self._clock.monotonic():
                self._remove(key)
                return None
        self._entries.move_to_end(key)
        return stored

    def set(self, key: str, stored: Stored, ttl: float) -> None:
        if ttl <= 0:
            return
        payload = trimmed(stored[0])  # not the upstream answer's oversized buffer, for as long as it lives
        expiring = ttl != math.inf
        cost = entry_cost(key, payload, expiring)
        if cost > self._max:  # larger than the whole tier: not kept in memory
            return
        if key in self._entries:  # a new key (a miss's) has nothing to replace
            self._remove(key)
        self._entries[key] = (payload, stored[1])
        if expiring:
            self._expiries[key] = self._clock.monotonic() + ttl
        self._items += cost
        entries = self._entries
        while entries and self.bytes_used > self._max:
            self._remove(next(iter(entries)))  # the least recently used; the new entry goes last

    def _remove(self, key: str) -> None:
        stored = self._entries.pop(key, None)
        if stored is not None:
            expiring = self._expiries.pop(key, None) is not None
            self._items -= entry_cost(key, stored[0], expiring)


class RedisTier:
    def __init__(self, link: RedisLink, metrics: Metrics) -> None:
        self._link = link
        self._release: Any = link.client.register_script(RELEASE_SCRIPT)
        self._invalid = metrics.redis_invalid_values

    def _entry(self, operation: str, value: Any) -> Entry | None:
        """A value read from Redis, decoded; None (counted, logged without its bytes) when this proxy did
        not write it: never served nor kept in memory, but asked of the node and written over."""
        entry = decode_value(bytes(value))
        if entry is None:
            self._invalid.labels(operation).inc()
            throttled.warning(
                f"invalid {operation}",
                "a value in the Redis cache is not one this proxy writes (%s): taken as a miss and written over",
                operation,
            )
        return entry

    def _found(self, value: Any, pttl: Any, operation: str = "cache_get") -> Found:
        """A value read with its remaining milliseconds (negative or None: no expiry); a value this proxy
        did not write is Found with nothing stored (a miss)."""
        entry = self._entry(operation, value)
        if entry is None:
            return Found(None, 0.0, None)
        ttl = math.inf if pttl is None or int(pttl) < 0 else int(pttl) / 1000
        return Found(entry.stored, ttl, entry.final_at, entry.proven)

    async def lock(self, key: str, token: str, hold: float) -> bool:
        """Take the replicas' fill lock on a key for `hold` seconds; False if another replica has it."""
        lock = shared_keys(key)[1]
        taken = await self._link.run("fill_lock", lambda c: c.set(lock, token, nx=True, px=max(1, int(hold * 1000))))
        return bool(taken)

    async def unlock(self, key: str, token: str) -> None:
        lock = shared_keys(key)[1]
        await self._link.run("fill_unlock", lambda _c: self._release(keys=[lock], args=[token]))

    async def get_or_lock(self, key: str, token: str, hold: float) -> tuple[Found | None, bool]:
        """The answer, its remaining seconds and its tag if stored; else whether the fill lock was taken
        for `token` ("": not asked for). One round trip, where a get and a lock took two."""
        name, lock = shared_keys(key)
        hold_ms = str(max(1, int(hold * 1000)))
        value, pttl, taken = await self._link.run(
            "cache_get", lambda c: c.eval(GET_OR_LOCK_SCRIPT, 2, name, lock, token, hold_ms)
        )
        if value is None:
            return None, bool(taken)
        return self._found(value, pttl), False

    async def set_and_unlock(
        self, key: str, stored: Stored, ttl: float, token: str, final_at: int | None = None, proven: bool = False
    ) -> None:
        """set() and unlock() in one round trip."""
        name, lock = shared_keys(key)
        px = "" if ttl == math.inf else str(max(1, int(ttl * 1000)))
        value = encode_value(stored, final_at, proven)
        await self._link.run("cache_set", lambda c: c.eval(SET_AND_UNLOCK_SCRIPT, 2, name, lock, value, px, token))

    async def _get_and(self, operation: str, name: str, also: Callable[[Any], Any]) -> list[Any]:
        """GET the value and more commands of the same slot in a single round trip. Not a
        transaction: a cluster runs no transaction across nodes, and none is needed here."""

        async def command(client: Any) -> Any:
            async with client.pipeline(transaction=False) as pipe:
                pipe.get(name)
                also(pipe)
                return await pipe.execute()

        return list(await self._link.run(operation, command))

    async def poll(self, key: str) -> tuple[Found | None, bool]:
        """The answer if stored, and whether a replica still holds the fill lock."""
        name, lock = shared_keys(key)
        value, pttl, locked = await self._get_and("fill_poll", name, lambda pipe: pipe.pttl(name).exists(lock))
        return (self._found(value, pttl, "fill_poll") if value is not None else None), bool(locked)

    async def get(self, key: str) -> Found | None:
        """The answer, its remaining seconds (math.inf when immutable) and its tag."""
        name = shared_keys(key)[0]
        value, pttl = await self._get_and("cache_get", name, lambda pipe: pipe.pttl(name))
        if value is None:
            return None
        return self._found(value, pttl)

    async def get_many(self, keys: Sequence[str]) -> list[Stored | None]:
        """Many answers in one round trip (a pipeline of GETs, not a transaction: any slots)."""

        async def command(client: Any) -> Any:
            async with client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.get(shared_keys(key)[0])
                return await pipe.execute()

        values = await self._link.run("cache_get_many", command)
        entries = [self._entry("cache_get_many", v) if v is not None else None for v in values]
        return [entry.stored if entry is not None else None for entry in entries]

    async def set(
        self, key: str, stored: Stored, ttl: float, final_at: int | None = None, proven: bool = False
    ) -> None:
        value, name = encode_value(stored, final_at, proven), shared_keys(key)[0]
        if ttl == math.inf:
            await self._link.run("cache_set", lambda c: c.set(name, value))
        else:
            await self._link.run("cache_set", lambda c: c.set(name, value, px=max(1, int(ttl * 1000))))


class TieredCache:
    """Memory in front of Redis; a Redis hit fills memory; Redis failures only cost a miss."""

    def __init__(
        self,
        memory: MemoryTier,
        shared: RedisTier | None,
        metrics: Metrics,
        admission: Admission | None = None,
    ) -> None:
        self.memory = memory
        self.shared = shared
        self._metrics = metrics
        self._admission = admission
        self._refused = metrics.uncached_answers.labels("any", "key_cache_share")
        # Read when scraped, so evictions and expiries show without anyone updating the gauges.
        metrics.cache_memory_bytes.set_function(lambda: memory.bytes_used)
        metrics.cache_entries.set_function(lambda: len(memory))
        self._lookups = {
            (tier, result): metrics.cache_lookups.labels(tier, result)
            for tier in ("memory", "redis")
            for result in ("hit", "miss")
        }

    def get_memory(self, key: str) -> Stored | None:
        stored = self.memory.get(key)
        if stored is not None:
            self._lookups["memory", "hit"].inc()
            return stored
        self._lookups["memory", "miss"].inc()
        return None

    async def get(self, key: str, vet: Vet | None = None, proven_forever: bool = False) -> Stored | None:
        """Memory's answer, else Redis's where `may_serve` (memory keeps it)."""
        stored = self.get_memory(key)
        if stored is not None or self.shared is None:
            return stored
        try:
            found = await self.shared.get(key)
        except RedisUnavailable:
            found = None
        if found is None or found.stored is None or not may_serve(found, vet, proven_forever):
            self._lookups["redis", "miss"].inc()
            return None
        self._lookups["redis", "hit"].inc()
        self.memory.set(key, found.stored, found.ttl)
        return found.stored

    async def get_many(self, keys: Sequence[str]) -> dict[str, Stored]:
        """The answers memory or Redis holds for `keys` (one Redis round trip for memory's misses)."""
        found: dict[str, Stored] = {}
        missed = []
        for key in keys:
            stored = self.memory.get(key)
            if stored is not None:
                found[key] = stored
            else:
                missed.append(key)
        if missed and self.shared is not None:
            with contextlib.suppress(RedisUnavailable):
                for key, value in zip(missed, await self.shared.get_many(missed), strict=True):
                    if value is not None:
                        found[key] = value
        return found

    # --- coalescing across replicas (a Redis lock per key while one replica fills it) ------

    async def get_or_claim(
        self, lock: FillLock, hold: float | None, vet: Vet | None = None, proven_forever: bool = False
    ) -> Stored | None:
        """For a key memory lacks: Redis's answer (memory keeps it) where `may_serve`, else the fill lock
        claimed as claim() does, in the same round trip (hold None: no lock wanted). The lock's token:
        "" when no lock is needed; None when another replica is fetching the key."""
        if self.shared is None:
            return None
        token = secrets.token_hex(8) if hold is not None else ""
        try:
            found, taken = await self.shared.get_or_lock(lock.key, token, hold or 0.0)
        except RedisUnavailable:
            return None
        if found is None:
            self._lookups["redis", "miss"].inc()
            lock.token = token if taken or not token else None
            return None
        stored = found.stored
        if stored is None or not may_serve(found, vet, proven_forever):
            # Not a value this proxy writes (redis_format.py), or not this replica's to serve
            # (sharing.py, or unproven for good under required): fetched from its own node, unlocked,
            # and written over.
            lock.token = ""
            self._lookups["redis", "miss"].inc()
            return None
        self._lookups["redis", "hit"].inc()
        self.memory.set(lock.key, stored, found.ttl)
        return stored

    async def claim(self, key: str, hold: float) -> str | None:
        """A token when this replica should fetch the key ("" if no lock is needed); None if another is."""
        if self.shared is None:
            return ""
        token = secrets.token_hex(8)
        try:
            return token if await self.shared.lock(key, token, hold) else None
        except RedisUnavailable:
            return ""

    async def release(self, key: str, token: str) -> None:
        if token and self.shared is not None:
            with contextlib.suppress(RedisUnavailable):
                await self.shared.unlock(key, token)

    async def await_fill(
        self, key: str, wait: float, vet: Vet | None = None, proven_forever: bool = False
    ) -> Stored | None:
        """Wait up to `wait` seconds for another replica's fill; None if it gave up or stored nothing."""
        if self.shared is None:
            return None
        deadline = time.monotonic() + wait
        pause = 0.005
        while time.monotonic() < deadline:
            await asyncio.sleep(pause)
            try:
                found, locked = await self.shared.poll(key)
            except RedisUnavailable:
                return None
            if found is not None and found.stored is not None and may_serve(found, vet, proven_forever):
                self._lookups["redis", "hit"].inc()
                return found.stored
            if not locked:
                return None  # the filler finished without storing (an error, say): fetch it ourselves
            pause = min(pause * 2, 0.05)
        return None

    def keep(self, key: str, stored: Stored, ttl: float) -> bool:
        """Memory's part of `set`, all of it without Redis: False when the key's admission share
        refused the answer (served, kept in neither tier: admission.py)."""
        admission = self._admission
        if admission is not None and not admission.admit(CALLER.get(), len(stored[0])):
            self._refused.inc()
            return False
        self.memory.set(key, stored, ttl)
        return True

    async def set(
        self,
        key: str,
        stored: Stored,
        ttl: float,
        lock: FillLock | None = None,
        *,
        shared: bool = True,
        final_at: int | None = None,
        proven: bool = False,
    ) -> None:
        """Kept in memory and (`shared`) Redis, tagged with `final_at` (sharing.py) and `proven`
        (redis_format.py); `lock`, the fill lock on this key, released in the same round trip."""
        if self.keep(key, stored, ttl) and self.shared is not None and shared:
            with contextlib.suppress(RedisUnavailable):
                if lock is not None and lock.token and lock.key == key:
                    await self.shared.set_and_unlock(key, stored, ttl, lock.token, final_at, proven)
                    lock.token = ""
                else:
                    await self.shared.set(key, stored, ttl, final_at, proven)


class _Left(Exception):
    """The caller running a shared call went away (cancelled) before it finished."""


class _Run(Generic[T]):
    """A call in flight; its future made only once a second caller joins (most misses have none)."""

    __slots__ = ("shared",)

    def __init__(self) -> None:
        self.shared: asyncio.Future[T] | None = None


class Coalescer(Generic[T]):
    """Identical concurrent misses share one call: the first runs it, the rest await its result.

    The first caller runs it in its own task (a miss is one task, not two). When that caller goes
    away (cancelled), the callers still waiting do not fail: the first of them runs the call again
    and the others join that run.
    """

    def __init__(self) -> None:
        self._inflight: dict[str, _Run[T]] = {}

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    async def run(self, key: str, call: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """The call's result, and whether this caller took it from a run another caller made."""
        running = self._inflight.get(key)
        while running is not None:
            shared = running.shared
            if shared is None:
                shared = running.shared = asyncio.get_running_loop().create_future()
            try:
                return await asyncio.shield(shared), True  # a joiner that leaves cancels nothing
            except _Left:
                running = self._inflight.get(key)  # None: this caller runs it again
        run: _Run[T] = _Run()
        self._inflight[key] = run
        try:
            result = await call()
        except asyncio.CancelledError:
            self._settle(key, run, _Left())
            raise
        except BaseException as exc:
            self._settle(key, run, exc)
            raise
        if self._inflight.get(key) is run:
            del self._inflight[key]
        if run.shared is not None:
            run.shared.set_result(result)
        return result, False

    def _settle(self, key: str, run: _Run[T], error: BaseException) -> None:
        if self._inflight.get(key) is run:
            del self._inflight[key]
        if run.shared is not None:
            run.shared.set_exception(error)
            run.shared.exception()  # retrieved: joiners that left must not leave it "never retrieved"
