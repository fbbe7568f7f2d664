"""Solana's slot tracker: the slot at each commitment, polled with getSlot, and the newest value
forwarded answers showed (from_trackers.py serves getSlot and getBlockHeight from it)."""

from __future__ import annotations

import asyncio
import time

from proxy.chain.head_polls import PollAsker, TrackerError, poll_forever, poll_health
from proxy.metrics import Metrics
from proxy.rpc.params import COMMITMENTS
from proxy.upstream.pool import Upstream
from proxy.workers.shared_polls import SharedPolls


class SolanaSlotTracker:
    """The slot at each commitment, polled with getSlot."""

    def __init__(
        self,
        network: str,
        upstream: Upstream,
        *,
        interval: float,
        metrics: Metrics,
        stale_after: float = 6.0,
        shared: SharedPolls | None = None,
    ) -> None:
        self.network = network
        self.slots: dict[str, int] = {}
        # The newest value seen per (method, commitment) and when: getSlot from the polls, getSlot and
        # getBlockHeight from forwarded answers too. Served while younger than the max age.
        self.recent: dict[tuple[str, str], tuple[int, float]] = {}
        self.last_poll = 0.0
        self.stale_after = stale_after
        self.attempted = asyncio.Event()  # the first poll has finished, well or not
        self._upstream = upstream
        self._asker = PollAsker(upstream, shared)
        self._aligned = shared is not None
        self._interval = interval
        self._metrics = metrics

    @property
    def head(self) -> None:
        return None  # Solana answers carry their own context.slot; nothing resolves through a head.

    async def run(self) -> None:
        await poll_forever(
            self.poll,
            self._interval,
            f"slot tracker {self.network}",
            limit=max(self._interval, self.stale_after),
            attempted=self.attempted,
            aligned=self._aligned,
        )

    def health(self, now: float) -> str | None:
        return poll_health(bool(self.slots), self.last_poll, self.stale_after, now)

    async def poll(self) -> dict[str, int]:
        answers = await self._asker.ask([("getSlot", [{"commitment": c}]) for c in COMMITMENTS])
        slots = {}
        for commitment, answer in zip(COMMITMENTS, answers, strict=True):
            if not answer.is_error and isinstance(answer.result, int):
                slots[commitment] = answer.result
                self._metrics.head_block.labels(self.network, commitment).set(answer.result)
        if not slots:
            raise TrackerError("upstream returned no slot")
        self.slots = slots
        self.last_poll = time.time()
        for commitment, slot in slots.items():
            self.observe("getSlot", commitment, slot, self.last_poll)
        self._metrics.head_updated.labels(self.network).set(self.last_poll)
        return slots

    def observe(self, method: str, commitment: str, value: int, now: float) -> int:
        """Note a slot or block height seen at `now`; returns the value to show, which never goes
        below one already shown (a lagging node's older answer is not passed on)."""
        held = self.recent.get((method, commitment))
        if held is not None and held[0] > value:
            return held[0]
        self.recent[(method, commitment)] = (value, now)
        return value

    def fresh(self, method: str, commitment: str, now: float, max_age: float) -> int | None:
        """The value seen for (method, commitment) if it is at most `max_age` seconds old."""
        held = self.recent.get((method, commitment))
        return held[0] if held is not None and now - held[1] <= max_age else None
