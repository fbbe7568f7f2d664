"""What a head tracker holds against its upstreams' answers: `latest` never goes back for a node
behind the network; a finalized block whose hash changed, or that the chain no longer reaches, is a
violation only when the upstream furthest ahead shows it, and a chain counts as restarted shorter
only after RESTART_EVIDENCE heads in a row below its finalized block (a load balancer's member far
behind answers between the others')."""

from __future__ import annotations

import logging
from dataclasses import replace

from proxy.chain.head_polls import RESTART_EVIDENCE, Behind, Head, Header, TrackerError, finality_violation
from proxy.metrics import Metrics
from proxy.upstream.standing import UpstreamStates

log = logging.getLogger("proxy.chain")


class FinalityWatch:
    def __init__(self, network: str, states: UpstreamStates | None, metrics: Metrics) -> None:
        self.network = network
        self._states = states
        self._metrics = metrics

    def refuse_going_back(self, old_head: Head, latest: Header, upstream: int) -> None:
        if not self.furthest(upstream) or not old_head.stale:
            # An upstream behind the network (or on a shorter fork) answered: `latest` never goes
            # backwards for it; if only such answers come, the head goes stale and then the shorter
            # chain is taken from the upstream furthest ahead (a reorg to a shorter chain, a rollback).
            # Not before: one URL may be a load balancer whose lagging member is on a fork the
            # network left, and its answers come between the others'.
            raise Behind.at(upstream, latest, old_head.latest)

    def doubted(self, old_head: Head | None, head: Head | None, shown: tuple[int, str] | None) -> Head | None:
        """The tracker's `head`, made stale when a poll whose every answer was below it (`shown`: the block its node
        gave as latest) shows a block of its window with another hash: the chain above that block was
        replaced (a reorg to a shorter chain), or the node is on another fork. Either way the window is
        no longer sure, so no tag resolves to it and nothing above finalized is pinned to its hashes
        (README: a replaced block is never served once a poll has seen it); the next poll that shows the
        same takes the shorter chain (refuse_going_back), one that shows the head again makes it fresh.
        Unchanged when the node is behind on the head's own chain (a lagging node) or below the window,
        when the head is stale already, or when it is no longer the one the poll began with."""
        if old_head is None or head is not old_head or shown is None or old_head.stale:
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
