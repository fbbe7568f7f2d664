"""What a head poll is made of: the header and head records, the batch asker of a tracker, the walk
that syncs the window of unfinalized hashes, the rule of a finality violation, and the poll loop
that outlives any one bad poll (heads.py, slots.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from proxy.chain.fields import FieldError, data
from proxy.chain.headers import HeaderError, header_hash
from proxy.logs import Throttled
from proxy.metrics import Metrics
from proxy.rpc.jsonrpc import JsonRpcError
from proxy.rpc.params import BlockRef
from proxy.upstream.pool import Upstream
from proxy.upstream.sending import too_large
from proxy.upstream.standing import UpstreamStates
from proxy.values import Answer
from proxy.workers.shared_polls import SharedPolls, aligned_delay

log = logging.getLogger("proxy.chain")

HEADER_CHUNK = 32  # headers fetched per batch while walking back through the window
# Tries for a chunk of the window from a node that shows the poll's latest block beside it (a load
# balancer's member behind the poll's node answers null for the blocks it lacks; the next try may
# reach another member).
WINDOW_TRIES = 5
ORPHANS_MAX = 4096  # reorged-out block hashes remembered per network


class TrackerError(Exception):
    """A poll could not produce a consistent head; the previous head stays in force."""


class Behind(TrackerError):
    """The poll's answer came from a node behind the network's head (a primary a few blocks behind, a
    load balancer's lagging member, a node still syncing): the poll asks once more, elsewhere.
    `shown`: the block (number, hash) the node gave as its latest, when it gave one, and `upstream`
    the node's index."""

    shown: tuple[int, str] | None = None
    upstream: int | None = None

    @classmethod
    def at(cls, upstream: int, latest: Header, head: int) -> Behind:
        behind = cls(f"upstream #{upstream} is behind the network head ({latest.number} < {head})")
        behind.shown = (latest.number, latest.hash)
        behind.upstream = upstream
        return behind


@dataclass(frozen=True, slots=True)
class Header:
    number: int
    hash: str
    parent_hash: str
    gas_limit: int
    timestamp: int
    # Whether its fields hash to its hash (chain/headers.py): None when they cannot be hashed (a
    # chain whose headers have fields of their own, a fake node's bare block).
    hashed: bool | None = None


@dataclass(frozen=True, slots=True)
class Head:
    latest: int
    safe: int
    finalized: int
    latest_hash: str
    gas_limit: int
    timestamp: int
    hashes: Mapping[int, str] = field(default_factory=dict)  # the unfinalized window, latest included
    numbers: Mapping[str, int] = field(default_factory=dict)  # the same window, hash -> number
    # The last successful poll is older than the staleness bound: tags are not resolved from this
    # head, and nothing above finalized is pinned to its (possibly outdated) window.
    stale: bool = False
    # The network's cache-key space: name, chain identity and epoch (moved on by a finality
    # violation). None until the chain identity is known: nothing is cached without it.
    space: str | None = None
    # The finalized block's hash: a node whose block at `finalized` has it is on the network's chain
    # up to there (every block names its parent). "" when not known: nothing final is proven.
    final_hash: str = ""
    # The upstream whose latest block this is (-1: not known): an answer pinned to a hash of this
    # window from another upstream is shown with that block's header first (asking.py).
    source: int = -1
    # A stale head made so by a poll that showed its window's block at this height with another hash
    # (FinalityWatch.doubted): the fork may lie lower, so any of the window's blocks may be replaced and a
    # hash of one of them is not cached either (asked upstream as is: cache/planning.py) until a poll settles it.
    doubted: int | None = None


@dataclass(slots=True)  # not frozen: one per block parameter of a miss
class Resolved:
    """A block parameter after resolution: a number (and its hash when the tracker knows it) or a hash."""

    number: int | None
    hash: str | None


async def poll_forever(
    poll: Callable[[], Awaitable[object]],
    interval: float,
    what: str,
    *,
    limit: float | None = None,
    failed: Callable[[], None] | None = None,
    attempted: asyncio.Event | None = None,
    wake: asyncio.Event | None = None,
    aligned: bool = False,
) -> None:
    """Call `poll` every `interval` seconds until cancelled; the loop outlives any one bad poll.

    `limit` bounds one poll (a hung node must not freeze the loop); `failed` runs after a poll failed;
    `attempted` is set once the first poll has finished, well or not; `wake` starts the next poll now;
    `aligned` waits for the next wall-clock multiple of `interval` (workers sharing polls poll together).
    """
    throttled = Throttled(log)  # this loop's own: a node that is down fails every poll
    while True:
        try:
            async with asyncio.timeout(limit):
                await poll()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # One line per interval says so, with a count.
            throttled.warning(what, "%s: poll failed: %s", what, str(exc) or type(exc).__name__)
            if failed is not None:
                failed()
        if attempted is not None:
            attempted.set()
        pause = aligned_delay(interval, time.time()) if aligned else interval
        if wake is None:
            await asyncio.sleep(pause)
            continue
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(pause):
                await wake.wait()
        wake.clear()


def poll_health(polled: bool, last_poll: float, stale_after: float, now: float) -> str | None:
    """Why a tracker's view cannot be trusted (for /readyz), or None when it is fresh."""
    if not polled:
        return "degraded: no successful head poll yet"
    age = now - last_poll
    if age > stale_after:
        return f"degraded: head is stale (last successful poll {age:.1f}s ago, bound {stale_after:g}s)"
    return None


class Asks(Protocol):
    """What asks a poll's calls: a tracker's PollAsker, or one upstream alone (heads.Pinned)."""

    async def ask(self, calls: list[tuple[str, Any]]) -> list[Answer]: ...

    async def direct(self, calls: list[tuple[str, Any]]) -> list[Answer]:
        """Asked of the node now (never a sibling worker's answers)."""
        ...


class PollAsker:
    """Sends a tracker's calls as one batch, or one by one to a node that refuses batches
    (an error reply or an HTTP failure to the batch); after a refusal, singles for a while."""

    SINGLES_FOR = 30  # polls before batches are tried again

    def __init__(self, upstream: Upstream, shared: SharedPolls | None = None) -> None:
        self._upstream = upstream
        self._singles_left = 0
        self._shared = shared
        self.fresh_from = 0.0  # answers fetched before this (a read-your-writes wake-up) are not taken

    async def ask(self, calls: list[tuple[str, Any]]) -> list[Answer]:
        shared = self._shared
        if shared is None:
            return await self._ask(calls)
        since = max(time.time() - shared.interval / 2, self.fresh_from)
        return await shared.ask("tracker", calls, self._ask, since=since)

    async def direct(self, calls: list[tuple[str, Any]]) -> list[Answer]:
        """Asked of the upstream now, whatever a sibling worker's poll fetched."""
        return await self._ask(calls)

    async def _ask(self, calls: list[tuple[str, Any]]) -> list[Answer]:
        if self._singles_left <= 0:
            try:
                return await self._upstream.batch(calls)
            except JsonRpcError as error:
                if too_large(error):
                    raise  # the node would send the same answers again, one by one: this poll fails
                self._singles_left = self.SINGLES_FOR
        self._singles_left -= 1
        return list(await asyncio.gather(*(self._upstream.request(m, p) for m, p in calls)))


def gone_stale(network: str, head: Head | None, age: float, bound: float) -> Head | None:
    """The head, marked stale once its last good poll is `age` seconds old, past `bound` (a new head
    object, so plans memoized against the fresh one are not used)."""
    if head is None or head.stale or age <= bound:
        return head
    log.warning(
        "head tracker %s: head is stale (no successful poll for %.1fs); tags are forwarded uncached", network, age
    )
    return replace(head, stale=True)


def header_of(answer: Answer) -> Header | None:
    """A poll's block: None for an error, a null (a tag the node lacks) or a malformed block (a number
    that is no 0x-quantity of at most 64 bits, a hash that is no 32 bytes of 0x-hex)."""
    block = answer.result
    if answer.is_error or not isinstance(block, dict):
        return None
    try:
        return Header(
            number=_quantity(block["number"]),
            hash="0x" + data(block["hash"], size=32).hex(),
            parent_hash="0x" + data(block["parentHash"], size=32).hex(),
            gas_limit=_quantity(block.get("gasLimit", "0x0")),
            timestamp=_quantity(block.get("timestamp", "0x0")),
            hashed=_hashed(block),
        )
    except (KeyError, FieldError):
        return None


_QUANTITY = re.compile(r"0x[0-9a-fA-F]{1,16}")


def _quantity(value: Any) -> int:
    if not isinstance(value, str) or not _QUANTITY.fullmatch(value):
        raise FieldError("not a quantity of at most 64 bits")
    return int(value, 16)


def _hashed(block: dict[str, Any]) -> bool | None:
    try:
        return "0x" + header_hash(block).hex() == str(block["hash"]).lower()
    except HeaderError:
        return None


def made_up(header: Header | None, states: UpstreamStates | None) -> bool:
    """Whether a poll's block is one no chain has: its fields do not hash to its hash, on a network
    whose blocks have been seen to (a chain whose headers hash otherwise is never told so). Such a
    block (a relay's or a node's edit of its number or its hash) moved the head onto another block's
    hash, or to a number the chain has not reached."""
    if header is None or header.hashed is None or states is None:
        return False
    if header.hashed:
        states.headers_hash = True
    return not header.hashed and states.headers_hash


def unsure(header: Header | None, states: UpstreamStates | None) -> bool:
    """Made up, or a block whose fields cannot be hashed on a network whose blocks have been (a relay
    that adds a field, or leaves one out, so that no check can be made)."""
    unhashed = header is not None and header.hashed is None and states is not None and states.headers_hash
    return unhashed or made_up(header, states)


def same_head(a: Head, b: Head) -> bool:
    return (
        not a.stale
        and not b.stale
        and (a.latest, a.latest_hash, a.safe, a.finalized, a.gas_limit, a.space)
        == (b.latest, b.latest_hash, b.safe, b.finalized, b.gas_limit, b.space)
    )


def get_block(tag_or_number: str) -> tuple[str, list[Any]]:
    return ("eth_getBlockByNumber", [tag_or_number, False])


async def synced_window(
    asker: Asks,
    window: int,
    latest: Header,
    finalized: int,
    old: dict[int, str],
    states: UpstreamStates | None = None,
) -> dict[int, str]:
    """Hashes of (finalized, latest], reusing what is still linked to the new latest block. Each block
    asked by number must be of that number and no made-up block (a lie kept a block's hash at the next
    height until it was final: reads of that height were answered from the other block)."""
    lower = max(finalized + 1, latest.number - window + 1)
    if latest.hash == latest.parent_hash or any(v == latest.hash and h != latest.number for h, v in old.items()):
        raise TrackerError(f"block {latest.number} was given the hash of another block")
    chain = {latest.number: latest.hash}
    expected = latest.parent_hash
    height = latest.number - 1
    top = max(old, default=-1)  # the last head's: blocks above it are new, the first batch asks those alone
    while height >= lower:
        if old.get(height) == expected:
            chain.update({h: old[h] for h in range(lower, height + 1) if h in old})
            break
        low = max(lower, height - HEADER_CHUNK + 1, top + 1 if top < height else lower)
        heights = range(height, low - 1, -1)
        answers = await _beside_latest(asker, [get_block(hex(h)) for h in heights], latest)
        for number, answer in zip(heights, answers, strict=True):
            header = header_of(answer) or await _held(asker, number)
            if header is None or header.number != number or made_up(header, states):
                raise TrackerError(f"block {number} was answered with a malformed or made-up block")
            if header.hash != expected:
                # The chain moved while we read it; keep the previous head and try again next poll.
                raise TrackerError("chain changed during the window walk")
            chain[header.number] = header.hash
            expected = header.parent_hash
            if old.get(header.number - 1) == expected:
                chain.update({h: old[h] for h in range(lower, header.number) if h in old})
                return chain
        height = low - 1
    return chain


async def replaced(
    asker: Asks, old: Mapping[int, str], hashes: Mapping[int, str], latest: Header, finalized: int, final: int | None
) -> list[int]:
    """Heights of the last window (`old`) whose blocks a reorg replaced: those the new window holds
    with another hash above the finalized block, those above its latest block, and those below it."""
    reorged = [h for h, old_hash in old.items() if h > finalized and hashes.get(h, old_hash) != old_hash]
    reorged += [h for h in old if h > latest.number]
    return reorged + await _replaced_below(asker, old, hashes, latest, final)


async def _replaced_below(
    asker: Asks, old: Mapping[int, str], hashes: Mapping[int, str], latest: Header, final: int | None
) -> list[int]:
    """Heights of the last window that have left the new one unseen (above `final`, the finalized
    block the tracker knew, which the poll checks itself), whose blocks a reorg replaced. Nothing is
    asked when the new window holds the last one's block at its bottom (the window is a hash chain,
    so every block below is the last window's); else the last window's top block below the new one
    is asked, and when it changed, each of them. A reorg that the chain had moved 64 blocks past by
    the next poll left its replaced blocks final: by-hash answers and receipts of them were served."""
    if not hashes or not old:
        return []
    bottom = min(hashes)
    if old.get(bottom) == hashes[bottom]:
        return []
    gone = sorted((h for h in old if h < bottom and (final is None or h > final)), reverse=True)
    changed: list[int] = []
    while gone:
        heights, gone = gone[:HEADER_CHUNK], gone[HEADER_CHUNK:]
        answers = await _beside_latest(asker, [get_block(hex(h)) for h in heights], latest)
        for height, answer in zip(heights, answers, strict=True):
            header = header_of(answer)
            if header is None or header.hash != old[height]:
                changed.append(height)  # a null from a node that shows the head: not served from cache either
            elif not changed:
                return []  # the top block below is the last window's: so is every block under it
    return changed


async def _beside_latest(asker: Asks, calls: list[tuple[str, Any]], latest: Header) -> list[Answer]:
    """The window's `calls` answered in one batch with the poll's latest block, by a node that shows
    that block (its hash): a load balancer's member behind the node the poll reached answers null for
    the blocks it lacks, and its answers never break the walk. Asked again, of the node directly,
    WINDOW_TRIES times in all: the balancer may send the next try to another member."""
    check = [*calls, get_block(hex(latest.number))]
    answers = await asker.ask(check)
    for _ in range(WINDOW_TRIES - 1):
        shown = header_of(answers[-1])
        if shown is not None and shown.hash == latest.hash:
            break
        answers = await asker.direct(check)
    return answers[:-1]  # still not shown: judged block by block (the chain moved, or a node lags)


async def _held(asker: Asks, number: int) -> Header | None:
    """Block `number` of the window from a node that has it, asked alone, WINDOW_TRIES times at most:
    a null from a member without it (a node that takes no batches is asked call by call, so the
    window's blocks and the latest block may reach different members of a load balancer)."""
    for _ in range(WINDOW_TRIES):
        header = header_of((await asker.direct([get_block(hex(number))]))[0])
        if header is not None:
            return header
    return None


# Heads seen in a row below the finalized block (the tracker's and the per-upstream polls, every
# upstream) before the chain counts as restarted shorter: one answer, or a few, may be a load
# balancer's member far behind, whose answers come between its other members'. 12 in a row from a
# member that gets one request in five: about 4 in a billion.
RESTART_EVIDENCE = 12


def finality_violation(known: Header, now: Header | None, latest: Header, furthest: bool) -> str | None:
    """How the finalized block `known` was violated, as the chain now reports it (None: it was not).
    `furthest`: the upstream that answered is the one furthest ahead, so a shorter chain is real."""
    if now is not None and now.number == known.number and now.hash != known.hash:
        return f"changed hash from {known.hash} to {now.hash} (a reorg below finality)"
    if now is None and latest.number < known.number and furthest:
        return f"({known.hash}) is gone: the chain is at block {latest.number} (a restarted chain)"
    return None


def resolve_ref(
    ref: BlockRef, head: Head | None, orphans: Mapping[str, int], behind: Callable[[], bool]
) -> Resolved | None:
    """Pure: a block parameter as a number (or hash) for `head`; None when it cannot be pinned (pending, no
    head, a stale head's tag, an orphan's hash). `behind`: whether `latest` trails a block a client has seen."""
    if head is not None and head.stale and (ref.tag is not None or (ref.number or 0) > head.finalized):
        return None  # spec of this proxy: a stale head resolves no tag and pins no unfinalized block
    if ref.hash is not None:
        if ref.hash in orphans:
            # A block the tracker saw replaced: whatever was cached for it, the node may now know
            # nothing of it (or hold it as a side block). Asked upstream, uncached.
            return None
        if ref.require_canonical:
            # EIP-1898 requireCanonical: only a hash the tracker knows is canonical (its unfinalized
            # window) is pinned to its number; any other hash cannot be vouched for: not cached.
            number = head.numbers.get(ref.hash) if head is not None else None
            return Resolved(number, ref.hash) if number is not None else None
        return Resolved(None, ref.hash)
    if head is None or ref.tag == "pending":
        return None
    if ref.tag == "latest" and behind():
        return None  # the head trails a block a client has seen: `latest` goes upstream as a tag
    if ref.number is not None:
        number = ref.number
    else:
        number = {"latest": head.latest, "safe": head.safe, "finalized": head.finalized, "earliest": 0}[str(ref.tag)]
    return Resolved(number, head.hashes.get(number))


def note_orphans(
    orphans: dict[str, int], reorged: list[int], old: Mapping[int, str], hashes: Mapping[int, str]
) -> None:
    """Blocks a reorg replaced: their hashes become orphans (hash -> number), the oldest forgotten first;
    and the new window's are no longer orphans: a chain that comes back (two forks each the longest
    in turn) had its own blocks' hashes answered as a node without them answers them (null)."""
    for height in reorged:
        if height in old and hashes.get(height) != old[height]:
            orphans[old[height]] = height
    for block_hash in hashes.values():
        orphans.pop(block_hash, None)
    while len(orphans) > ORPHANS_MAX:
        del orphans[next(iter(orphans))]


def publish(metrics: Metrics, network: str, head: Head, polled_at: float) -> None:
    """A head's gauges: its blocks by tag, its timestamp, when it was polled."""
    for tag, value in (("latest", head.latest), ("safe", head.safe), ("finalized", head.finalized)):
        metrics.head_block.labels(network, tag).set(value)
    metrics.head_timestamp.labels(network).set(head.timestamp)
    metrics.head_updated.labels(network).set(polled_at)
