"""Head trackers: latest/safe/finalized per EVM network, slots per Solana commitment.

The EVM tracker also keeps the hash of every block in the unfinalized window (finalized, latest].
Cache entries for those blocks are keyed by that hash, so a reorg that replaces a block changes
the key and the old answer is never served again; the tracker detects the reorg as a known height
whose hash changed, and reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from proxy.chain.epochs import EpochKeeper, EpochStore
from proxy.chain.finality import Contested, FinalityWatch, kept_final
from proxy.chain.forks import ForkGuard
from proxy.chain.head_polls import (
    Behind,
    Head,
    Header,
    PollAsker,
    Resolved,
    TrackerError,
    get_block,
    gone_stale,
    header_of,
    note_orphans,
    poll_forever,
    poll_health,
    publish,
    replaced,
    resolve_ref,
    same_head,
    synced_window,
)
from proxy.chain.poll_source import answered
from proxy.metrics import Metrics
from proxy.rpc.params import BlockRef
from proxy.upstream.pool import Upstream
from proxy.upstream.standing import ChainIdentity, UpstreamStates
from proxy.values import Answer
from proxy.workers.shared_polls import SharedPolls

log = logging.getLogger("proxy.chain")

WRITE_SETTLE = 0.02  # seconds a node may take to seal the block of a write it has answered
# Read-your-writes' bounds against a node that shows a block no chain has: a block shown more than
# SHOWN_AHEAD_MAX past the head is no floor, and one the head has not reached SHOWN_HOLD seconds on
# no longer holds `latest` back (each call would wait HEAD_CATCH_UP_WAIT for it, for ever).
SHOWN_AHEAD_MAX = 64
SHOWN_HOLD = 10.0
# What on_shown tells sibling workers for a forwarded write (a block number is never negative): they
# poll at once, and their `latest` waits for that poll too.
WROTE = -1


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
        self.on_shown: list[Callable[[int], None]] = []  # a newly shown block, or WROTE (told to sibling workers)
        # Hashes of blocks a reorg replaced (hash -> number), newest last, bounded: never answered from cache.
        self.orphans: dict[str, int] = {}
        self.last_poll = 0.0
        self.stale_after = stale_after
        self.attempted = asyncio.Event()  # the first poll has finished, well or not
        self.shown, self._shown_at, self._far_at = 0, 0.0, -SHOWN_HOLD  # the highest block shown a client, when
        self._wrote_at = 0.0  # monotonic time of the last write forwarded...
        self._polled_after = 0.0  # ...and the time up to which a successful poll covers writes
        self._caught_up = asyncio.Event()
        self._wake = asyncio.Event()
        self._upstream = upstream
        self._asker = PollAsker(upstream, shared)
        self._aligned = shared is not None
        self._interval = interval
        self._depth = finality_depth
        self._metrics = metrics
        self._window = window
        self._states = states
        self._finality = FinalityWatch(network, states, metrics)
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
        """Another chain on the same upstreams (identity.py): what was known goes; polling starts over."""
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
        """A dev node's state was changed through the proxy (anvil_setStorageAt, evm_revert...): a new epoch now,
        no block shown as a floor, and a poll `latest` waits for (it may find the chain rolled back)."""
        self._epochs.move_on()
        self.forks.fresh(self._base())  # only this replica's entries are in it yet
        self._rewound = True
        self.shown = 0
        self.wrote()

    def _base(self) -> str | None:
        """The shared key space: network, chain identity, epoch (None: not known yet)."""
        if self._identity is None or not self._epochs.loaded:
            return None
        epoch = self._epochs.epoch
        return f"{self.network}@{self._identity}" + (f"~{epoch}" if epoch else "")

    def _space(self) -> str | None:
        """The shared space once this replica's chain is found to be its chain's, else one of its own (forks.py)."""
        base = self._base() or (f"{self.network}@{self._identity}" if self._epochs.unread else None)
        return self.forks.space(base) if base is not None else None

    async def _own_hash(self, number: int) -> str:
        """This chain's block hash at a height below its finalized block (forks.py's trail check)."""
        header = header_of((await self._asker.ask([get_block(hex(number))]))[0])
        if header is None or header.number != number:  # a failed answer: this poll fails, the head stays
            raise TrackerError(f"no block {number} in the node's answer (the key space's trail is checked there)")
        return header.hash

    def _reissue(self, **changes: Any) -> None:
        """The same head as a new object: plans memoized against the old one are made again."""
        if self.head is not None:
            self.head = replace(self.head, space=self._space(), **changes)

    # --- read-your-writes: `latest` never trails a block the proxy has shown -----------------

    def hint(self, number: int, *, relayed: bool = False) -> None:
        """The proxy showed a client block `number` (`relayed`: a sibling worker did): poll now if the head lacks it."""
        head, now = self.head, time.monotonic()
        if head is not None and number > head.latest + SHOWN_AHEAD_MAX:  # no floor (a lying node's number?)
            if now - self._far_at >= self._interval:  # a poll `latest` waits for, once an interval at most
                self._far_at = now
                self.wrote(relayed=relayed)
            return None
        if number <= self.shown:
            return None
        if head is None or self.shown <= head.latest:  # the hold runs from the first floor no poll reached
            self._shown_at = now
        self.shown = number
        for tell in () if relayed else self.on_shown:
            tell(number)
        if head is not None and number > head.latest:
            self._caught_up.clear()
            self._asker.fresh_from = time.time()  # the wake-up poll takes no answer a sibling fetched before
            self._wake.set()
            self._reissue()  # memory hits at `latest` take the general path until the head catches up

    def wrote(self, *, relayed: bool = False) -> None:
        """A write was forwarded here (siblings told: WROTE) or by a sibling (`relayed`), or a block shown
        too far ahead to be a floor: poll now, and `latest` waits for that poll, HEAD_CATCH_UP_WAIT at most."""
        for tell in () if relayed else self.on_shown:
            tell(WROTE)  # (its block may be out already: automining)
        self._wrote_at = time.monotonic()
        self._caught_up.clear()
        self._asker.fresh_from = time.time() + WRITE_SETTLE  # as a poll covers it (poll): none asked sooner
        self._wake.set()
        self._reissue()

    def behind(self) -> bool:
        """`latest` may trail what a client knows: a block it was shown, or a write not polled since."""
        head, now = self.head, time.monotonic()
        shown = self.shown > head.latest and now - self._shown_at < SHOWN_HOLD if head is not None else False
        return head is not None and (shown or self._wrote_at > self._polled_after)

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
        return resolve_ref(ref, self.head, self.orphans, self.behind)

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
        """After a failed poll: past the bound since the last good one, the head is stale (a new object)."""
        self.head = gone_stale(self.network, self.head, time.time() - self.last_poll, self.stale_after)

    async def poll(self) -> Head:
        calls = [get_block("latest"), get_block("safe"), get_block("finalized")]
        started = time.monotonic()
        known_final = self._final
        if known_final is not None:
            calls.append(get_block(hex(known_final.number)))  # is the finalized block still final?
        old_head = self.head
        judge = functools.partial(self._judged, old_head=old_head, known_final=known_final)
        try:
            answers, asker, latest, violated = await answered(
                self._asker, self._upstream, self._states, calls, judge, max(self._interval, 1.0), old_head
            )
        except (Behind, Contested) as unsure:  # a replaced block's, or a finalized one's: stale
            self.head = self._finality.unsure(old_head, self.head, unsure, known_final)
            raise
        latest_a, safe_a, final_a = answers[:3]
        # A node without the finalized/safe tags: a configured depth below latest counts as final.
        final_h = header_of(final_a)
        finalized = final_h.number if final_h else max(0, latest.number - self._depth)
        finalized = min(finalized, latest.number)
        safe_h = header_of(safe_a)
        safe = safe_h.number if safe_h else max(finalized, latest.number - self._depth // 2)
        safe = max(finalized, min(safe, latest.number))

        old = dict(old_head.hashes) if old_head else {}
        # Without the finalized tag the window reaches down to the finalized block, for its hash.
        hashes = await synced_window(asker, self._window, latest, finalized - (0 if final_h else 1), old, self._states)
        final_hash = final_h.hash if final_h else hashes.get(finalized, "")
        if self._identity is not None and final_hash:
            await self._epochs.sync(f"{self.network}@{self._identity}", finalized, final_hash, violated)
            base = self._base()
            if base is not None:  # before a head names it: is this chain the one its entries are of?
                await self.forks.check(base, (finalized, final_hash), hashes, self._own_hash)
            elif self._epochs.unread:  # no epoch can be read: a space of its own (forks.py)
                self.forks.unrecorded(f"{self.network}@{self._identity}")
        reorged = await replaced(asker, old, hashes, latest, finalized, known_final.number if known_final else None)
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
        if old_head is not None and not reorged and same_head(old_head, head):
            head = old_head  # unchanged: keep the object, so plans memoized against it stay valid
        if old_head is not None and head.latest < old_head.latest:  # a shorter chain: what was shown above is gone
            self.shown = min(self.shown, head.latest)
        self.head = head
        # This replica's own finalized block only: a stored checkpoint another replica wrote may be of
        # another fork, which is no violation of this chain's finality (forks.py checks the space's trail).
        self._final = kept_final(known_final, final_h, finalized, final_hash, violated)
        if self._states is not None:
            self._states.followed(latest_a.upstream, self._final.number if self._final is not None else None)
        self.last_poll = time.time()
        # A node answers a write before its miner has sealed the block (Anvil's automining): a poll
        # covers the writes made WRITE_SETTLE before it started; for later ones, another poll soon.
        self._polled_after = max(self._polled_after, started - WRITE_SETTLE)
        if self._wrote_at > self._polled_after:
            asyncio.get_running_loop().call_later(WRITE_SETTLE, self._wake.set)
        publish(self._metrics, self.network, head, self.last_poll)
        if not self.behind():
            self._caught_up.set()
        for head_listener in self.on_head:
            head_listener(head)
        if reorged:
            self._reorged(reorged, old, hashes)
        return head

    def _reorged(self, reorged: list[int], old: dict[int, str], hashes: dict[int, str]) -> None:
        """Blocks replaced by a reorg: their hashes become orphans; the metric, the log and listeners hear."""
        note_orphans(self.orphans, reorged, old, hashes)
        depth_from = min(reorged)
        log.warning("head tracker %s: reorg detected from block %d", self.network, depth_from)
        self._metrics.reorgs.labels(self.network).inc()
        for listener in self.on_reorg:
            listener(depth_from)

    def _judged(
        self, answers: list[Answer], *, old_head: Head | None, known_final: Header | None
    ) -> tuple[Header, bool]:
        """A poll's latest block as the tracker may take it, and whether the finalized block it knew
        was violated (a new epoch begun); TrackerError when the poll's answer is not the network's."""
        latest_a, final_again = answers[0], answers[3] if known_final is not None else None
        latest = header_of(latest_a)
        if latest is None:
            raise TrackerError("upstream returned no latest block")
        if self._states is not None:
            self._states.observe_head(latest_a.upstream, latest.number)
        if self._states is not None and self._states.catching_up(latest_a.upstream):
            # A node still syncing (or stalled) answered while the others did not: its head is an old
            # block, never the network's, even before the tracker had one. The head goes stale instead.
            if old_head is not None and latest.number < old_head.latest:
                self._finality.refuse_going_back(old_head, latest, latest_a.upstream)
            raise Behind(
                f"upstream #{latest_a.upstream} is still syncing or far behind the others (at block {latest.number})"
            )
        if old_head is not None and latest.number < old_head.latest and self._states is not None:
            self._states.suspect.set()  # going back may be another chain (a restarted devnet)
        violated = known_final is not None and self._finality.violates(
            known_final, header_of(final_again) if final_again is not None else None, latest, latest_a.upstream
        )
        if violated:
            self._epochs.move_on()
            self.forks.fresh(self._base())  # only this replica's entries are in it yet
            self._reissue()  # at once: nothing of the old epoch is served while this poll goes on
        rewound, self._rewound = self._rewound, False
        if old_head is not None and latest.number < old_head.latest and not (violated or rewound):
            self._finality.refuse_going_back(old_head, latest, latest_a.upstream)
        return latest, violated
