"""What the proxy knows of each upstream of one network: its own head, and whether it serves the
network's chain. Pure state and the decisions made from it; the I/O that feeds it lives in
identity.py (per-upstream probes), chain.py (the tracker's polls) and upstream.py (failures).

An answer is worth caching only if the upstream that produced it vouches for it: its chain
identity was verified since its last lost connection, and its own head had reached every block
the answer depends on. A node answers `[]` or a partial list for blocks past its head rather than
an error, so a lagging upstream's answer is never stored.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

UNKNOWN = -1


@dataclass(frozen=True, slots=True)
class ChainIdentity:
    """A chain as its nodes report it: eth_chainId and the genesis block's hash."""

    chain_id: int
    genesis: str

    def describe(self) -> str:
        return f"chain id {self.chain_id}, genesis {self.genesis[:18]}"

    def key_space(self) -> str:
        """The part of cache keys that names this chain (the genesis hash shortened to 64 bits)."""
        return f"{self.chain_id}:{self.genesis[2:18]}"


STEADY_HEADS = 5  # heads seen in order before an upstream counts as one steady node


class UpstreamStates:
    """Per upstream index: its latest block, whether its identity is verified, whether it mismatches."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.latest = [UNKNOWN] * size
        self.verified = [False] * size
        self.mismatch = [False] * size
        # Verified once, then its connection failed: out of rotation until its identity is checked again.
        self.lost_since_verified = [False] * size
        self.cordoned = [False] * size  # taken out by an operator (the admin listener) until uncordoned
        self.suspect = asyncio.Event()  # set when an upstream must have its identity checked again
        # Not (yet) one steady node: its head went back once (a load balancer whose members differ, a
        # rolled-back dev node), or fewer than STEADY_HEADS of its heads were seen. Answers pinned to a
        # block of the tracker's window come from it with that block's header (proofs.py).
        self.mixed = [True] * size
        self._steady = [0] * size
        self._went_back = [False] * size
        # A provider's rate limit (429, Retry-After): its head polls rest until then (time.monotonic()).
        self.resting_until = [0.0] * size

    def went_back(self, index: int) -> bool:
        """Its head was once seen lower than before (not merely not yet seen steady)."""
        return 0 <= index < self.size and self._went_back[index]

    def observe_head(self, index: int, number: int) -> None:
        if 0 <= index < self.size:
            if number < self.latest[index]:
                self._went_back[index] = self.mixed[index] = True
            else:
                self._steady[index] += 1
                self.mixed[index] = self._went_back[index] or self._steady[index] < STEADY_HEADS
            self.latest[index] = number

    def rest(self, index: int, until: float) -> None:
        if 0 <= index < self.size:
            self.resting_until[index] = until

    def resting(self, index: int, now: float) -> bool:
        """Rate-limited by its provider until later than `now`: not polled meanwhile."""
        return self.resting_until[index] > now

    def lost(self, index: int) -> None:
        """Its connection failed: it may come back as another chain (a restarted devnet), so it is
        out of rotation until its identity is checked again."""
        if 0 <= index < self.size and self.verified[index]:
            self.verified[index] = False
            self.lost_since_verified[index] = True
            self.suspect.set()

    def reconnected(self, index: int) -> None:
        """A new connection opened while none of its calls was in flight: the old one was closed
        (a node restarted, say). Its answers are not kept until its identity is checked again; it
        stays in rotation (nothing failed)."""
        if 0 <= index < self.size and self.verified[index]:
            self.verified[index] = False
            self.suspect.set()

    def off_chain(self, index: int) -> None:
        """It answered for a block of another chain than the network's: checked again at once."""
        if 0 <= index < self.size and self.verified[index]:
            self.verified[index] = False
            self.suspect.set()

    def judged(self, index: int, matches: bool) -> None:
        self.mismatch[index] = not matches
        self.verified[index] = matches
        if matches:
            self.lost_since_verified[index] = False

    def in_rotation(self, index: int) -> bool:
        """Serves the network's chain as far as is known. An upstream never verified (not reachable
        at start-up) stays in rotation, but none of its answers is cached."""
        return not self.mismatch[index] and not self.lost_since_verified[index] and not self.cordoned[index]

    def vouches(self, index: int, number: int | None) -> bool:
        """Upstream `index` is verified and its own head has block `number` (None: no block number)."""
        if not 0 <= index < self.size or not self.verified[index]:
            return False
        return number is None or self.latest[index] >= number

    def other_with(self, index: int, number: int | None) -> int | None:
        """Another verified upstream whose head has block `number`: the one furthest ahead."""
        candidates = [i for i in range(self.size) if i != index and not self.cordoned[i] and self.vouches(i, number)]
        return max(candidates, key=lambda i: self.latest[i]) if candidates else None
