"""What a head tracker holds against its upstreams' answers: `latest` never goes back for a node
behind the network; a finalized block whose hash changed is a violation only once FINALITY_EVIDENCE
polls in a row show the same new hash (an upstream that then shows the known hash again contradicts
itself: it leaves head tracking for FLIP_COOL seconds); one that the chain no longer reaches only
when the upstream furthest ahead shows it, and a chain counts as restarted shorter only after
RESTART_EVIDENCE heads in a row below its finalized block (a load balancer's member far behind
answers between the others')."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from proxy.chain.head_polls import RESTART_EVIDENCE, Behind, Head, Header, TrackerError, finality_violation
from proxy.metrics import Metrics
from proxy.upstream.standing import UpstreamStates

log = logging.getLogger("proxy.chain")

# Polls in a row that must show a finalized block's same new hash before it is believed: one node that
# answers from two forks in turn (a load balancer over both, a relay) would otherwise move the network
# to a new epoch, and back, on every poll. A real reorg below finality is shown by every poll after it.
FINALITY_EVIDENCE = 3
FLIP_COOL = 300.0  # seconds an upstream that contradicted itself on a finalized block is not followed


class Contested(TrackerError):
    """A poll showed the finalized block with a new hash, not yet believed (FinalityWatch._corroborate)."""


def kept_final(
    known: Header | None, final: Header | None, number: int, final_hash: str, violated: bool
) -> Header | None:
    """The finalized block the next poll checks: this poll's (its tag's block, or `number` and
    `final_hash` without the tag), never one below the last poll's but after a violation (a new
    epoch). A finalized block that goes back (a balancer's lagging member, or a claim withdrawn: a
    node that gave `latest` for an unknown tag) leaves the higher one checked, so a later reorg of a
    block once said final is a violation, as it was not: the old fork's answers stayed kept forever."""
    taken = final or (Header(number, final_hash, "", 0, 0) if final_hash else None)
    if violated or known is None or taken is None or taken.number >= known.number:
        return taken
    return known


class FinalityWatch:
    def __init__(self, network: str, states: UpstreamStates | None, metrics: Metrics) -> None:
        self.network = network
        self._states = states
        self._metrics = metrics
        # A new hash of the finalized block not yet believed: (its height, the hash, the upstream that
        # showed it first, polls in a row that showed it).
        self._changed: tuple[int, str, int, int] | None = None

    def refuse_going_back(self, old_head: Head, latest: Header, upstream: int) -> None:
        if not self.furthest(upstream) or not old_head.stale:
            # An upstream behind the network (or on a shorter fork) answered: `latest` never goes
            # backwards for it; if only such answers come, the head goes stale and then the shorter
            # chain is taken from the upstream furthest ahead (a reorg to a shorter chain, a rollback).
            # Not before: one URL may be a load balancer whose lagging member is on a fork the
            # network left, and its answers come between the others'.
            raise Behind.at(upstream, latest, old_head.latest)

    def doubted(self, old_head: Head | None, head: Head | None, behind: Behind) -> Head | None:
        """The tracker's `head`, made stale when a poll whose every answer was below it (`behind.shown`: the block
        its node gave as latest) shows a block of its window with another hash: the chain above that block was
        replaced (a reorg to a shorter chain), or the node is on another fork. Either way the window is
        no longer sure, so no tag resolves to it and nothing above finalized is pinned to its hashes
        (README: a replaced block is never served once a poll has seen it); the next poll that shows the
        same takes the shorter chain (refuse_going_back), one that shows the head again makes it fresh.
        Unchanged when the node is behind on the head's own chain (a lagging node) or below the window,
        when the head is stale already, when it is no longer the one the poll began with, or when
        another upstream is known to be further ahead than the node: a backup on a fork the network
        left, whose polls made the head stale in turn, and every read then went unpinned to whichever
        upstream was picked (its fork's blocks, balances and receipts served for the network's)."""
        shown = behind.shown
        if old_head is None or head is not old_head or shown is None or old_head.stale:
            return head
        if behind.upstream is not None and not self.furthest(behind.upstream):
            return head
        number, block_hash = shown
        held = old_head.hashes.get(number)
        if held is None or held == block_hash:
            return head
        log.warning(
            "head tracker %s: a poll shows block %d with another hash than the head's chain (a reorg to a "
            "shorter chain, or a node on another fork): the head is stale until a poll agrees",
            self.network,
            number,
        )
        return replace(old_head, stale=True, doubted=number)

    def unsure(
        self, old_head: Head | None, head: Head | None, failed: TrackerError, final: Header | None
    ) -> Head | None:
        """The tracker's `head` after a poll that `failed` with a Behind (doubted) or a Contested (contested)."""
        if isinstance(failed, Behind):
            return self.doubted(old_head, head, failed)
        return self.contested(head, final.number) if final is not None else head

    def contested(self, head: Head | None, final: int) -> Head | None:
        """The tracker's `head` once a poll showed its finalized block `final` with another hash that is
        not yet believed: stale and doubted from there (as `doubted` makes it), so the window's blocks,
        its hashes and the tags are asked as they are, uncached, until a poll settles it. Its final
        blocks' entries are still served: the poll may be a node on another fork, and a real reorg
        below finality moves the network to a new epoch once FINALITY_EVIDENCE polls show it."""
        if head is None or head.doubted is not None:
            return head
        return replace(head, stale=True, doubted=final)

    def furthest(self, index: int) -> bool:
        """No other upstream serving the network is known to be further ahead than `index`."""
        states = self._states
        if states is None or not 0 <= index < states.size:
            return states is None
        ahead = [states.latest[i] for i in range(states.size) if states.verified[i] and states.in_rotation(i)]
        return states.latest[index] >= max(ahead, default=states.latest[index])

    def violates(self, known: Header, now: Header | None, latest: Header, upstream: int) -> bool:
        """A finalized block whose hash changed, or that the chain no longer reaches (a devnet
        restarted with the same genesis): every entry of the network may be wrong."""
        what = finality_violation(known, now, latest, self.furthest(upstream))
        self._corroborate(known, now, upstream)
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
        self._changed = None
        if self._states is not None:
            self._states.suspect.set()  # a restarted devnet looks like this: its identity is checked now
            self._states.below_final = 0
        return True

    def _corroborate(self, known: Header, now: Header | None, upstream: int) -> None:
        """Count the polls in a row that show the finalized block `known` with one new hash; TrackerError
        until FINALITY_EVIDENCE have. An upstream that showed a new hash and now shows `known`'s again
        contradicts itself (two forks behind one URL): it leaves head tracking for FLIP_COOL seconds."""
        if now is None or now.number != known.number:
            return
        changed = self._changed
        if now.hash == known.hash:
            self._changed = None
            # (A hash the block has since been known by is no going back: a restarted devnet's new
            # chain, shown by one poll and adopted by the identity check before the next.)
            if changed is not None and changed[2] == upstream and changed[1] != known.hash:
                self._contradicted(known, changed[1], upstream)
            return
        seen = changed[3] + 1 if changed is not None and changed[:2] == (now.number, now.hash) else 1
        self._changed = (now.number, now.hash, changed[2] if changed and seen > 1 else upstream, seen)
        if seen < FINALITY_EVIDENCE:
            raise Contested(
                f"upstream #{upstream} shows the finalized block {known.number} with another hash {now.hash} "
                f"({seen} such polls in a row; a reorg below finality after {FINALITY_EVIDENCE})"
            )

    def _contradicted(self, known: Header, other: str, upstream: int) -> None:
        log.warning(
            "head tracker %s: upstream #%d showed the finalized block %d as %s, then as %s again (two forks "
            "behind one upstream?): no violation; it is out of head tracking for %gs",
            self.network,
            upstream,
            known.number,
            other,
            known.hash,
            FLIP_COOL,
        )
        self._metrics.finality_contradictions.labels(self.network, str(upstream)).inc()
        if self._states is not None:
            self._states.flipped(upstream, time.monotonic() + FLIP_COOL)
