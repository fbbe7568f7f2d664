"""Solana's slot tracker: the slot at each commitment, polled with getSlot, and the newest value
forwarded answers showed (from_trackers.py serves getSlot and getBlockHeight from it).

It also holds the cluster's identity, its genesis hash (getGenesisHash, asked at the first poll and
then every IDENTITY_CHECK_INTERVAL seconds), which names the network's cache-key space (`space`) as
the chain identity does an EVM network's: two clusters behind one Redis (two deployments, or one
whose SOLANA_UPSTREAM moved from devnet to mainnet) share no entry. Until it is known nothing of the
network is cached; a cluster whose genesis hash changes (a restarted test validator) gets a new space
at once, with an ERROR line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from proxy.chain.head_polls import PollAsker, TrackerError, poll_forever, poll_health
from proxy.metrics import Metrics
from proxy.rpc.jsonrpc import JsonRpcError
from proxy.rpc.params import COMMITMENTS
from proxy.upstream.pool import Upstream
from proxy.workers.shared_polls import SharedPolls

log = logging.getLogger("proxy.identity")
_BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")


def genesis_of(result: object) -> str | None:
    """The genesis hash in a getGenesisHash answer (32 bytes in base58), or None if it holds none."""
    if isinstance(result, str) and 32 <= len(result) <= 44 and _BASE58.issuperset(result):
        return result
    return None


# Seconds a slot shown holds the network's slots up ("never back") with no poll reaching it again: a
# value one node gave in error (a devnet's slot in a mainnet pool, a glitch) is let go then, as an EVM
# block shown is (heads.SHOWN_HOLD); else it would fail every honest poll, and refuse every read, for ever.
SLOT_HOLD = 10.0

BLOCK_NOT_AVAILABLE = -32004  # Agave's "Block not available for slot N": not produced yet, where it asked


def commitment_of(params: Any) -> str:
    """A Solana call's commitment: its config object's, else Agave's default (finalized)."""
    for param in params if isinstance(params, list) else ():
        if isinstance(param, dict) and isinstance(param.get("commitment"), str):
            return str(param["commitment"])
    return "finalized"


def _below(answered: dict[str, int], held: dict[str, int]) -> bool:
    """Every slot a poll answered is below the one held at its commitment (none held: not below)."""
    return bool(held) and all(slot < held.get(commitment, -1) for commitment, slot in answered.items())


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
        identity_interval: float = 30.0,
    ) -> None:
        self.network = network
        # The cluster's genesis hash, and the cache-key space it names (None: not known, nothing cached).
        self.genesis: str | None = None
        self.space: str | None = None
        self.on_space: list[Callable[[str], None]] = []  # told each new space (NetworkRuntime.rescope)
        self._identity_interval = identity_interval
        self._identity_due = 0.0  # time.monotonic() of the next getGenesisHash
        self.slots: dict[str, int] = {}
        self._reached: dict[str, float] = {}  # per commitment, when a poll last reached its slot (monotonic)
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
        if time.monotonic() >= self._identity_due:
            await self.check_identity()
        answers = await self._asker.ask([("getSlot", [{"commitment": c}]) for c in COMMITMENTS])
        answered = {
            commitment: answer.result
            for commitment, answer in zip(COMMITMENTS, answers, strict=True)
            if not answer.is_error and type(answer.result) is int
        }
        if not answered:
            raise TrackerError("upstream returned no slot")
        if _below(answered, self.slots):
            # A cluster reset (a restarted test validator) looks so too: its genesis hash is asked now,
            # and a new one starts the slots anew (check_identity).
            await self.check_identity()
        held = self._held(answered)
        if _below(answered, held):
            # Never back (caching.md "Solana slots"): a node behind (restarted from an old snapshot)
            # fails the poll; the slots stay, and go stale if no poll reaches them again.
            raise TrackerError(f"upstream is behind the slots already shown ({answered} < {held})")
        slots = dict(held)
        reached = time.monotonic()
        for commitment, slot in answered.items():
            if slot >= held.get(commitment, slot):
                self._reached[commitment] = reached
            slots[commitment] = slot = max(slot, held.get(commitment, slot))
            self._metrics.head_block.labels(self.network, commitment).set(slot)
        now = time.time()
        # The latest block's time, with no getBlockTime asked (a call more per poll): when a poll first
        # saw the processed slot pass the previous poll's, at most a poll interval after the block.
        processed, before = slots.get("processed"), held.get("processed")
        if processed is not None and before is not None and processed > before:
            self._metrics.head_timestamp.labels(self.network).set(now)
        self.slots = slots
        self.last_poll = now
        # What the poll saw (a value held above it stays shown while seen again within SLOT_HOLD: observe).
        for commitment, slot in answered.items():
            self.observe("getSlot", commitment, slot, now)
        self._metrics.head_updated.labels(self.network).set(self.last_poll)
        return slots

    def _held(self, answered: dict[str, int]) -> dict[str, int]:
        """The slots a poll may not go below: those held, but for one above the poll's that no poll has
        reached SLOT_HOLD seconds on (let go, with a WARNING; a value shown there goes as observe says)."""
        held, now = self.slots, time.monotonic()
        gone = [
            commitment
            for commitment, slot in answered.items()
            if slot < held.get(commitment, -1) and now - self._reached.get(commitment, now) >= SLOT_HOLD
        ]
        if not gone:
            return held
        logging.getLogger("proxy.chain").warning(
            "network %s: no upstream reached the slots %s again in %.0f s (one node's error?): the slots go back to %s",
            self.network,
            {commitment: held[commitment] for commitment in gone},
            SLOT_HOLD,
            {commitment: answered[commitment] for commitment in gone},
        )
        return {commitment: slot for commitment, slot in held.items() if commitment not in gone}

    async def check_identity(self) -> None:
        """Ask the cluster's genesis hash; a new one names a new key space (entries of the old cluster
        are never served). No answer: asked again at the next poll, the space left as it was."""
        try:
            answer = await self._upstream.request("getGenesisHash", [])
        except JsonRpcError:
            return
        genesis = None if answer.is_error else genesis_of(answer.result)
        if genesis is None:
            return
        self._identity_due = time.monotonic() + self._identity_interval
        if genesis == self.genesis:
            return
        if self.genesis is None:
            log.info("network %s: cluster genesis hash is %s", self.network, genesis)
        else:
            log.error(
                "network %s: the upstream now serves the cluster with genesis hash %s, not %s: a new cache "
                "namespace; entries of the old cluster are never served",
                self.network,
                genesis,
                self.genesis,
            )
        if self.genesis is not None:
            # Another cluster (a restarted test validator): its slots start anew, so do the ones shown.
            self.slots, self.recent, self._reached = {}, {}, {}
        self.genesis = genesis
        self.space = space = f"{self.network}@{genesis}"
        for listener in self.on_space:
            listener(space)

    def observe(self, method: str, commitment: str, value: int, now: float) -> int:
        """Note a slot or block height seen at `now`; returns the value to show, which never goes
        below one already shown (a lagging node's older answer is not passed on) while that one was
        seen again within SLOT_HOLD seconds (each poll sees the slots it reaches)."""
        held = self.recent.get((method, commitment))
        if held is not None and held[0] > value and now - held[1] < SLOT_HOLD:
            return held[0]
        self.recent[(method, commitment)] = (value, now)
        return value

    def shown(self, commitment: str) -> int:
        """The highest slot shown at `commitment` (polled, or a forwarded getSlot's); -1 when none."""
        held = self.recent.get(("getSlot", commitment))
        return held[0] if held is not None else -1

    def behind(self, params: Any, result: Any, slack: int) -> int | None:
        """The slot already shown at the call's commitment when the answer's context.slot is more than
        `slack` slots below it (a node behind answered: never kept, caching.md "Solana slots"), else
        None. Nodes in step differ by a slot or two at `processed`: within the slack is in step."""
        context = result.get("context") if isinstance(result, dict) else None
        slot = context.get("slot") if isinstance(context, dict) else None
        if type(slot) is not int:
            return None
        shown = self.shown(commitment_of(params))
        return shown if slot < shown - slack else None

    def lacks(self, params: Any, code: int | None, slack: int) -> int | None:
        """For getBlock's Agave -32004 (block not available) at `finalized` of a slot more than `slack`
        below the finalized slot shown: that slot shown (a node behind said it, not the network), else
        None. At `confirmed` Agave answers -32004 for a skipped slot above the root too: the network's
        word, never a lag."""
        slot = params[0] if isinstance(params, list) and params else None
        if code != BLOCK_NOT_AVAILABLE or type(slot) is not int or commitment_of(params) != "finalized":
            return None
        shown = self.shown("finalized")
        return shown if 0 <= slot < shown - slack else None

    def fresh(self, method: str, commitment: str, now: float, max_age: float) -> int | None:
        """The value seen for (method, commitment) if it is at most `max_age` seconds old."""
        held = self.recent.get((method, commitment))
        return held[0] if held is not None and now - held[1] <= max_age else None
