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
import time
from collections.abc import Collection
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


def parse_identity(chain_id: object, genesis: object) -> ChainIdentity | None:
    """The identity in two answers (eth_chainId, the genesis block), or None if they hold none."""
    if not isinstance(chain_id, str) or not isinstance(genesis, dict) or not isinstance(genesis.get("hash"), str):
        return None
    try:
        return ChainIdentity(int(chain_id, 16), genesis["hash"].lower())
    except ValueError:
        return None


STEADY_HEADS = 5  # heads seen in order before an upstream counts as one steady node
# An upstream whose own head is more than this many blocks behind the furthest one is catching up (a
# node still syncing, a stalled one): out of head tracking and of `latest` reads until it is back.
CATCH_UP_BLOCKS = 32


class UpstreamStates:
    """Per upstream index: its latest block, whether its identity is verified, whether it mismatches."""

    def head_lag(self, index: int) -> int:
        """Blocks upstream `index`'s head is behind the furthest one's (0 while its head is unknown)."""
        latest = self.latest
        best = max(latest, default=-1)
        return best - latest[index] if latest[index] >= 0 else 0

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
        # How many of its last blocks' state it keeps (None: all, an archive node as far as is known):
        # stated in NETWORKS_FILE (`recent_blocks`), and learned from its errors for older state.
        self.recent_declared: list[int | None] = [None] * size
        self.recent_learned: list[int | None] = [None] * size
        # Its eth_syncing said it is still syncing (an object with currentBlock < highestBlock).
        self.syncing = [False] * size
        # The network's finalized block as the tracker last knew it, and how many heads seen in a row
        # (the tracker's polls and the per-upstream polls, any upstream) were below it: a chain that
        # no longer reaches it (a restarted devnet) shows only such heads; a load balancer whose member
        # is behind shows them between its other members' (heads.py).
        self.final_mark: int | None = None
        self.below_final = 0
        self._reached_final = [False] * size  # its head was once at or above final_mark
        # It showed the network's finalized block with another hash, then with the known one again (a
        # node that contradicts itself: finality.py): out of head tracking until then (time.monotonic()).
        self.flipped_until = [0.0] * size
        # Ahead of the tracker's head, it showed a block of the head's chain with another hash (a fork
        # that parted below it, poll_source.from_ahead): that block's number, until a poll finds it
        # holding the head, or the head is taken from it (`followed`). Its blocks from there on are
        # another chain's: never asked for a block the tracker's node lacks (`other_with`), so no
        # client is shown one (nor `latest` raised to it).
        self.parted: list[int | None] = [None] * size
        # A head poll's block hashed from its fields (chain/head_polls.py made_up): from then on one
        # that does not is a made-up block, never the head nor one of its window.
        self.headers_hash = False

    def observe_syncing(self, index: int, result: object) -> None:
        """An eth_syncing answer: false when synced, else an object (currentBlock, highestBlock). An
        object whose current block has reached the highest counts as synced (some clients say so)."""
        if not 0 <= index < self.size:
            return
        syncing = bool(result)
        if isinstance(result, dict):
            try:
                syncing = int(str(result.get("currentBlock")), 16) < int(str(result.get("highestBlock")), 16)
            except ValueError:
                syncing = True
        self.syncing[index] = syncing

    def behind_by(self, index: int) -> int:
        """Blocks its own head is behind the furthest upstream in rotation (0 when unknown)."""
        if not 0 <= index < self.size or self.latest[index] < 0:
            return 0
        best = max((self.latest[i] for i in range(self.size) if self.in_rotation(i)), default=UNKNOWN)
        return max(best - self.latest[index], 0)

    def catching_up(self, index: int) -> bool:
        """Still syncing (its eth_syncing says so), far behind the others, or lately contradicting itself
        on the finalized block: not followed by the head tracker nor asked first, while another upstream
        in rotation is not catching up (syncing below the finalized block: whatever the others)."""
        if not 0 <= index < self.size or not self._lagging(index):
            return False
        if self.syncing[index] and self.final_mark is not None and self.latest[index] < self.final_mark:
            return True  # syncing below the network's finalized block: never its head, even alone
        return any(i != index and self.in_rotation(i) and not self._lagging(i) for i in range(self.size))

    def _lagging(self, index: int) -> bool:
        flipped = self.flipped_until[index] > time.monotonic()
        return self.syncing[index] or flipped or self.behind_by(index) > CATCH_UP_BLOCKS

    def flipped(self, index: int, until: float) -> None:
        """Upstream `index` showed two hashes for one finalized block: out of head tracking until `until`."""
        if 0 <= index < self.size:
            self.flipped_until[index] = until

    def ahead_of(self, index: int, number: int | None = None) -> list[int]:
        """The upstreams other than `index` in rotation, not syncing, whose heads are above block
        `number` (default: upstream `index`'s own head), furthest first."""
        if number is None:
            number = self.latest[index] if 0 <= index < self.size else UNKNOWN
        ahead = [
            i
            for i in range(self.size)
            if i != index and self.in_rotation(i) and not self.syncing[i] and self.latest[i] > number
        ]
        return sorted(ahead, key=lambda i: -self.latest[i])

    def declare_recent(self, windows: tuple[int | None, ...]) -> None:
        """NETWORKS_FILE's state windows (start-up, a reload); what was learned from errors starts over."""
        for index in range(self.size):
            self.recent_declared[index] = windows[index] if index < len(windows) else None
            self.recent_learned[index] = None

    def windowed(self) -> bool:
        """Some upstream keeps recent state only, as declared or learned (else every one is an archive
        node as far as is known, and holds_state is true of all: nothing to look at per call)."""
        size = self.size
        return self.recent_declared.count(None) != size or self.recent_learned.count(None) != size

    def state_window(self, index: int) -> int | None:
        """How many of its last blocks' state upstream `index` keeps (None: all, as far as is known)."""
        known = [w for w in (self.recent_declared[index], self.recent_learned[index]) if w is not None]
        return min(known) if known else None

    def holds_state(self, index: int, number: int | None) -> bool:
        """Upstream `index` can answer for the state at block `number` as far as is known: an archive
        node, or one whose kept window (behind its own head) reaches that block. None (a block named
        by hash alone): no window rules it out."""
        if number is None or not 0 <= index < self.size:
            return True
        window = self.state_window(index)
        return window is None or self.latest[index] < 0 or self.latest[index] - number < window

    def state_gone(self, index: int, number: int) -> None:
        """Upstream `index` said it no longer has the state at block `number` (a pruned node): it keeps
        fewer than its head's distance to that block, so it is not asked for that old state again."""
        if not 0 <= index < self.size or number >= self.latest[index]:
            return  # at or past its head: a node behind, not a pruned one (asking.py's lagging rule)
        depth = self.latest[index] - number
        learned = self.recent_learned[index]
        self.recent_learned[index] = depth if learned is None else min(learned, depth)

    def other_with_state(self, tried: Collection[int], number: int | None) -> int | None:
        """An upstream not in `tried`, in rotation, verified, with block `number` and its state: the
        first declared."""
        for i in range(self.size):
            if i not in tried and self._has_state(i, number):
                return i
        return None

    def others_with_state(self, tried: Collection[int], number: int | None) -> list[int]:
        """Every upstream other_with_state could give, in declared order."""
        return [i for i in range(self.size) if i not in tried and self._has_state(i, number)]

    def _has_state(self, index: int, number: int | None) -> bool:
        return self.in_rotation(index) and self.vouches(index, number) and self.holds_state(index, number)

    def went_back(self, index: int) -> bool:
        """Its head was once seen lower than before (not merely not yet seen steady)."""
        return 0 <= index < self.size and self._went_back[index]

    def observe_head(self, index: int, number: int) -> None:
        if 0 <= index < self.size:
            if self.final_mark is not None and number >= self.final_mark:
                self.below_final, self._reached_final[index] = 0, True
            elif self.final_mark is not None and self._reached_final[index] and not self.syncing[index]:
                # Only a node that had reached the finalized block and went back says the chain
                # restarted: one still syncing, or stuck below it all along, says nothing of the chain
                # (it took over the head, and the cache was dropped, when the synced node went down).
                self.below_final += 1
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

    def followed(self, index: int, final_mark: int | None) -> None:
        """The tracker took its head from upstream `index`, whose finalized block it knows as
        `final_mark`: that upstream's chain is the head's, parted from it nowhere. (The first poll may
        reach a backup on a fork the network left, and the next the node the network follows: a mark
        set while the head was the backup's kept that node, now the head's, from every read the
        backup was refuted for.)"""
        self.final_mark = final_mark
        if 0 <= index < self.size:
            self.parted[index] = None

    def _parted_at(self, index: int, number: int | None) -> bool:
        parted = self.parted[index]
        return parted is not None and (number is None or number >= parted)

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
        """Another verified upstream whose head has block `number`, on the head's chain there: the one
        furthest ahead."""
        candidates = [
            i
            for i in range(self.size)
            if i != index and not self.cordoned[i] and self.vouches(i, number) and not self._parted_at(i, number)
        ]
        return max(candidates, key=lambda i: self.latest[i]) if candidates else None
