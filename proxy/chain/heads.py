"""Head trackers: latest/safe/finalized per EVM network, slots per Solana commitment.

The EVM tracker also keeps the hash of every block in the unfinalized window (finalized, latest].
Cache entries for those blocks are keyed by that hash, so a reorg that replaces a block changes
the key and the old answer is never served again; the tracker detects the reorg as a known height
whose hash changed, and reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from proxy.chain.epochs import EpochKeeper, EpochStore
from proxy.chain.forks import ForkGuard
from proxy.logs import Throttled
from proxy.metrics import Metrics
from proxy.rpc.jsonrpc import JsonRpcError
from proxy.rpc.params import BlockRef
from proxy.upstream.pool import Upstream
from proxy.upstream.sending import too_large
from proxy.upstream.standing import ChainIdentity, UpstreamStates
from proxy.values import Answer
from proxy.workers.shared_polls import SharedPolls, aligned_delay

log = logging.getLogger("proxy.chain")

HEADER_CHUNK = 32  # headers fetched per batch while walking back through the window
ORPHANS_MAX = 4096  # reorged-out block hashes remembered per network
WRITE_SETTLE = 0.02  # seconds a node may take to seal the block of a write it has answered


class TrackerError(Exception):
    """A poll could not produce a consistent head; the previous head stays in force."""


@dataclass(frozen=True, slots=True)
class Header:
    number: int
    hash: str
    parent_hash: str
    gas_limit: int
    timestamp: int


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


class Asker:
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


def _header(answer: Answer) -> Header | None:
    block = answer.result
    if answer.is_error or not isinstance(block, dict):
        return None
    try:
        return Header(
            number=int(block["number"], 16),
            hash=str(block["hash"]).lower(),
            parent_hash=str(block["parentHash"]).lower(),
            gas_limit=int(block.get("gasLimit", "0x0"), 16),
            timestamp=int(block.get("timestamp", "0x0"), 16),
        )
    except (KeyError, TypeError, ValueError):
        return None


def _same_head(a: Head, b: Head) -> bool:
    return (
        not a.stale
        and not b.stale
        and (a.latest, a.latest_hash, a.safe, a.finalized, a.gas_limit, a.space)
        == (b.latest, b.latest_hash, b.safe, b.finalized, b.gas_limit, b.space)
    )


def _get_block(tag_or_number: str) -> tuple[str, list[Any]]:
    return ("eth_getBlockByNumber", [tag_or_number, False])


async def synced_window(
    asker: Asker,
    window: int,
    latest: Header,
    finalized: int,
    old: dict[int, str],
) -> dict[int, str]:
    """Hashes of (finalized, latest], reusing what is still linked to the new latest block."""
    lower = max(finalized + 1, latest.number - window + 1)
    chain = {latest.number: latest.hash}
    expected = latest.parent_hash
    height = latest.number - 1
    while height >= lower:
        if old.get(height) == expected:
            chain.update({h: old[h] for h in range(lower, height + 1) if h in old})
            break
        low = max(lower, height - HEADER_CHUNK + 1)
        answers = await asker.ask([_get_block(hex(h)) for h in range(height, low - 1, -1)])
        for answer in answers:
            header = _header(answer)
            if header is None or header.hash != expected:
                # The chain moved while we read it; keep the previous head and try again next poll.
                raise TrackerError("chain changed during the window walk")
            chain[header.number] = header.hash
            expected = header.parent_hash
            if old.get(header.number - 1) == expected:
                chain.update({h: old[h] for h in range(lower, header.number) if h in old})
                return chain
        height = low - 1
    return chain


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


class EvmHeadTracker:
    def __init__(
        self,
        network: str,
        upstream: Upstream,
        *,
        interval: float,
        finality_depth: int,
        metrics: Metrics,
        window: int = 256,
        stale_after: float = 6.0,
        states: UpstreamStates | None = None,
        shared: SharedPolls | None = None,
        epochs: EpochStore | None = None,
    ) -> None:
        self.network = network
        self.head: Head | None = None
        self.on_reorg: list[Callable[[int], None]] = []
        self.on_head: list[Callable[[Head], None]] = []  # called after every successful poll
        self.on_shown: list[Callable[[int], None]] = []  # a newly shown block (told to sibling workers)
        # Hashes of blocks a reorg replaced (hash -> number), newest last (bounded): never answered
        # from the cache.
        self.orphans: dict[str, int] = {}
        self.last_poll = 0.0
        self.stale_after = stale_after
        self.attempted = asyncio.Event()  # the first poll has finished, well or not
        self.shown = 0  # the highest block the proxy has shown a client (read-your-writes)
        self._wrote_at = 0.0  # monotonic time of the last write forwarded...
        self._polled_after = 0.0  # ...and the time up to which a successful poll covers writes
        self._caught_up = asyncio.Event()
        self._wake = asyncio.Event()
        self._upstream = upstream
        self._asker = Asker(upstream, shared)
        self._aligned = shared is not None
        self._interval = interval
        self._depth = finality_depth
        self._metrics = metrics
        self._window = window
        self._states = states
        self._identity: str | None = None  # the chain identity's key space; None: not known yet
        self.identity: ChainIdentity | None = None  # the network's chain (eth_chainId is answered from it)
        self._final: Header | None = None  # the finalized block of the last poll (or of the epoch's record)
        # The epoch (moved on by a finality violation, a replaced chain, a dev node's state change).
        self._epochs = EpochKeeper(epochs)
        self.forks = ForkGuard(network, self._epochs.store.trails, metrics)  # is its chain the shared space's?
        self.keyed = self._epochs.keyed  # keys were first named (identity and epoch known)
        self._rewound = False  # a dev node's state changed: the next poll may take a shorter chain

    # --- the cache-key space: network name, chain identity, epoch --------------------------

    def set_identity(self, identity: ChainIdentity) -> None:
        if identity != self.identity:
            self._epochs.forget()  # its epoch record is read on the next poll, now
            self._wake.set()
        self.identity = identity
        self._identity = identity.key_space()
        self._reissue()

    def adopt(self, identity: ChainIdentity) -> None:
        """Another chain on the same upstreams (identity.py's adoption rule): what was known of the old
        one (head, block hashes, blocks shown, the finalized block) goes, and polling starts over."""
        self.head = None
        self.orphans.clear()
        self.shown = 0
        self._final = None
        if self._states is not None:
            self._states.final_mark = None
        self._caught_up.set()
        self.set_identity(identity)
        self._wake.set()

    def checkpoint(self) -> tuple[int, str] | None:
        """The network's finalized block (number, hash), once the tracker vouches for it."""
        head = self.head
        if head is None or not head.final_hash or not self._epochs.loaded:
            return None
        return (head.finalized, head.final_hash)

    def state_changed(self) -> None:
        """A dev node's state was changed through the proxy (anvil_setStorageAt, evm_revert...): a new
        epoch at once, so no entry of the old state is served, and a poll now, which may find the chain
        rolled back (its subscribers get the removed logs without waiting for a block)."""
        self._epochs.move_on()
        self._fresh_epoch()
        self._rewound = True
        self._asker.fresh_from = time.time()
        self._wake.set()
        self._reissue()

    def _base(self) -> str | None:
        """The shared key space: network, chain identity, epoch (None: not known yet)."""
        if self._identity is None or not self._epochs.loaded:
            return None
        epoch = self._epochs.epoch
        return f"{self.network}@{self._identity}" + (f"~{epoch}" if epoch else "")

    def _space(self) -> str | None:
        """The shared space once this replica's chain is found to be its chain's, or one of its own."""
        base = self._base()
        return self.forks.space(base) if base is not None else None

    def _fresh_epoch(self) -> None:
        base = self._base()
        if base is not None:
            self.forks.fresh(base)  # only this replica's entries are in it yet

    async def _own_hash(self, number: int) -> str:
        """This chain's block hash at a height below its finalized block (forks.py's trail check)."""
        header = _header((await self._asker.ask([_get_block(hex(number))]))[0])
        if header is None or header.number != number:  # a failed answer: this poll fails, the head stays
            raise TrackerError(f"no block {number} in the node's answer (the key space's trail is checked there)")
        return header.hash

    def _reissue(self, **changes: Any) -> None:
        """The same head as a new object: plans memoized against the old one are made again."""
        if self.head is not None:
            self.head = replace(self.head, space=self._space(), **changes)

    # --- read-your-writes: `latest` never trails a block the proxy has shown -----------------

    def hint(self, number: int, *, relayed: bool = False) -> None:
        """The proxy showed a client block `number`: poll now if the head has not reached it.
        `relayed`: a sibling worker showed it (not told on again)."""
        if number <= self.shown:
            return
        self.shown = number
        if not relayed:
            for tell in self.on_shown:
                tell(number)
        head = self.head
        if head is not None and number > head.latest:
            self._caught_up.clear()
            self._asker.fresh_from = time.time()  # the wake-up poll takes no answer a sibling fetched before
            self._wake.set()
            self._reissue()  # memory hits at `latest` take the general path until the head catches up

    def wrote(self) -> None:
        """A client's transaction was forwarded: poll now, and `latest` waits for that poll (bounded by
        HEAD_CATCH_UP_WAIT, as for a shown block): on an automining devnet its block is already out."""
        self._wrote_at = time.monotonic()
        self._caught_up.clear()
        self._asker.fresh_from = time.time()
        self._wake.set()
        self._reissue()

    def behind(self) -> bool:
        """`latest` may trail what a client knows: a block it was shown, or a write not polled since."""
        head = self.head
        return head is not None and (self.shown > head.latest or self._wrote_at > self._polled_after)

    async def catch_up(self, wait: float) -> None:
        """Wait up to `wait` seconds for the head to reach the highest block shown to a client."""
        if not self.behind() or wait <= 0:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                while self.behind():
                    self._caught_up.clear()
                    await self._caught_up.wait()

    def resolve(self, ref: BlockRef) -> Resolved | None:
        """Turn a block parameter into a number (or hash); None when it cannot be pinned (pending, no head)."""
        head = self.head
        if head is not None and head.stale and (ref.tag is not None or (ref.number or 0) > head.finalized):
            return None  # spec of this proxy: a stale head resolves no tag and pins no unfinalized block
        if ref.hash is not None:
            if ref.hash in self.orphans:
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
        if ref.tag == "latest" and self.behind():
            return None  # the head trails a block a client has seen: `latest` goes upstream as a tag
        if ref.number is not None:
            number = ref.number
        else:
            number = {"latest": head.latest, "safe": head.safe, "finalized": head.finalized, "earliest": 0}[
                str(ref.tag)
            ]
        return Resolved(number, head.hashes.get(number))

    async def run(self) -> None:
        await poll_forever(
            self.poll,
            self._interval,
            f"head tracker {self.network}",
            limit=max(self._interval, self.stale_after),
            failed=self.check_staleness,
            attempted=self.attempted,
            wake=self._wake,
            aligned=self._aligned,
        )

    def health(self, now: float) -> str | None:
        self.check_staleness()
        return poll_health(self.head is not None, self.last_poll, self.stale_after, now)

    def check_staleness(self) -> None:
        """After a failed poll: once the last good one is older than the bound, mark the head stale
        (a new head object, so plans memoized against the fresh one are not used)."""
        head = self.head
        if head is not None and not head.stale and time.time() - self.last_poll > self.stale_after:
            log.warning(
                "head tracker %s: head is stale (no successful poll for %.1fs); tags are forwarded uncached",
                self.network,
                time.time() - self.last_poll,
            )
            self.head = replace(head, stale=True)

    async def poll(self) -> Head:
        calls = [_get_block("latest"), _get_block("safe"), _get_block("finalized")]
        started = time.monotonic()
        known_final = self._final
        if known_final is not None:
            calls.append(_get_block(hex(known_final.number)))  # is the finalized block still final?
        answers = await self._asker.ask(calls)
        latest_a, safe_a, final_a = answers[:3]
        latest = _header(latest_a)
        if latest is None:
            raise TrackerError("upstream returned no latest block")
        if self._states is not None:
            self._states.observe_head(latest_a.upstream, latest.number)
        old_head = self.head
        if self._states is not None and self._states.catching_up(latest_a.upstream):
            # A node still syncing (or stalled) answered while the others did not: its head is an old
            # block, never the network's, even before the tracker had one. The head goes stale instead.
            if old_head is not None and latest.number < old_head.latest:
                self._refuse_going_back(old_head, latest, latest_a.upstream)
            raise TrackerError(
                f"upstream #{latest_a.upstream} is still syncing or far behind the others (at block {latest.number})"
            )
        if old_head is not None and latest.number < old_head.latest and self._states is not None:
            self._states.suspect.set()  # going back may be another chain (a restarted devnet)
        violated = known_final is not None and self._violates(
            known_final, _header(answers[3]), latest, latest_a.upstream
        )
        if violated:
            self._epochs.move_on()
            self._fresh_epoch()
            self._reissue()  # at once: nothing of the old epoch is served while this poll goes on
        rewound, self._rewound = self._rewound, False
        if old_head is not None and latest.number < old_head.latest and not (violated or rewound):
            self._refuse_going_back(old_head, latest, latest_a.upstream)
        # A node without the finalized/safe tags: a configured depth below latest counts as final.
        final_h = _header(final_a)
        finalized = final_h.number if final_h else max(0, latest.number - self._depth)
        finalized = min(finalized, latest.number)
        safe_h = _header(safe_a)
        safe = safe_h.number if safe_h else max(finalized, latest.number - self._depth // 2)
        safe = max(finalized, min(safe, latest.number))

        old = dict(old_head.hashes) if old_head else {}
        # Without the finalized tag the window reaches down to the finalized block, for its hash.
        hashes = await synced_window(self._asker, self._window, latest, finalized - (0 if final_h else 1), old)
        final_hash = final_h.hash if final_h else hashes.get(finalized, "")
        if self._identity is not None and final_hash:
            await self._epochs.sync(f"{self.network}@{self._identity}", finalized, final_hash, violated)
            base = self._base()
            if base is not None:  # before a head names it: is this chain the one its entries are of?
                await self.forks.check(base, (finalized, final_hash), hashes, self._own_hash)
        reorged = [h for h, old_hash in old.items() if h > finalized and hashes.get(h, old_hash) != old_hash]
        reorged += [h for h in old if h > latest.number]
        head = Head(
            latest.number,
            safe,
            finalized,
            latest.hash,
            latest.gas_limit,
            latest.timestamp,
            hashes,
            {h: n for n, h in hashes.items()},
            space=self._space(),
            final_hash=final_hash,
            source=latest_a.upstream,
        )
        if old_head is not None and not reorged and _same_head(old_head, head):
            head = old_head  # unchanged: keep the object, so plans memoized against it stay valid
        self.head = head
        # This replica's own finalized block only: a stored checkpoint another replica wrote may be of
        # another fork, which is no violation of this chain's finality (forks.py checks the space's trail).
        self._final = final_h or Header(finalized, final_hash, "", 0, 0) if final_hash else final_h
        if self._states is not None:
            self._states.final_mark = self._final.number if self._final is not None else None
        self.last_poll = time.time()
        # A node answers a write before its miner has sealed the block (Anvil's automining): a poll
        # covers the writes made WRITE_SETTLE before it started; for later ones, another poll soon.
        self._polled_after = max(self._polled_after, started - WRITE_SETTLE)
        if self._wrote_at > self._polled_after:
            asyncio.get_running_loop().call_later(WRITE_SETTLE, self._wake.set)
        self._publish(head)
        if not self.behind():
            self._caught_up.set()
        for head_listener in self.on_head:
            head_listener(head)
        if reorged:
            self._reorged(reorged, old, hashes)
        return head

    def _refuse_going_back(self, old_head: Head, latest: Header, upstream: int) -> None:
        if not self._furthest(upstream) or not old_head.stale:
            # An upstream behind the network (or on a shorter fork) answered: `latest` never goes
            # backwards for it; if only such answers come, the head goes stale and then the shorter
            # chain is taken from the upstream furthest ahead (a reorg to a shorter chain, a rollback).
            # Not before: one URL may be a load balancer whose lagging member is on a fork the
            # network left, and its answers come between the others'.
            raise TrackerError(f"upstream #{upstream} is behind the network head ({latest.number} < {old_head.latest})")

    def _reorged(self, reorged: list[int], old: dict[int, str], hashes: dict[int, str]) -> None:
        """Blocks replaced by a reorg: their hashes become orphans; the metric, the log and listeners hear."""
        for height in reorged:
            if height in old and hashes.get(height) != old[height]:
                self.orphans[old[height]] = height
        while len(self.orphans) > ORPHANS_MAX:
            del self.orphans[next(iter(self.orphans))]
        depth_from = min(reorged)
        log.warning("head tracker %s: reorg detected from block %d", self.network, depth_from)
        self._metrics.reorgs.labels(self.network).inc()
        for listener in self.on_reorg:
            listener(depth_from)

    def _furthest(self, index: int) -> bool:
        """No other upstream serving the network is known to be further ahead than `index`."""
        states = self._states
        if states is None or not 0 <= index < states.size:
            return states is None
        ahead = [states.latest[i] for i in range(states.size) if states.verified[i] and states.in_rotation(i)]
        return states.latest[index] >= max(ahead, default=states.latest[index])

    def _violates(self, known: Header, now: Header | None, latest: Header, upstream: int) -> bool:
        """A finalized block whose hash changed, or that the chain no longer reaches (a devnet
        restarted with the same genesis): every entry of the network may be wrong."""
        what = finality_violation(known, now, latest, self._furthest(upstream))
        if what is None:
            return False
        states = self._states
        if now is None and states is not None and states.below_final < RESTART_EVIDENCE:
            # Gone on this answer only so far: the head neither goes back nor moves to a new epoch
            # until every head seen for RESTART_EVIDENCE answers in a row agrees.
            raise TrackerError(
                f"upstream #{upstream} is at block {latest.number}, below the finalized block "
                f"{known.number} ({states.below_final} such heads in a row; a restarted chain "
                f"after {RESTART_EVIDENCE})"
            )
        log.error(
            "head tracker %s: finalized block %d %s; the network's cache entries are invalidated",
            self.network,
            known.number,
            what,
        )
        self._metrics.finality_violations.labels(self.network).inc()
        if self._states is not None:
            self._states.suspect.set()  # a restarted devnet looks like this: its identity is checked now
            self._states.below_final = 0
        return True

    def _publish(self, head: Head) -> None:
        for tag, value in (("latest", head.latest), ("safe", head.safe), ("finalized", head.finalized)):
            self._metrics.head_block.labels(self.network, tag).set(value)
        self._metrics.head_timestamp.labels(self.network).set(head.timestamp)
        self._metrics.head_updated.labels(self.network).set(self.last_poll)
