"""A trusted header chain per EVM network: the hashes of its final blocks, each believed only because
a block already believed names it as its parent. A header's fields are believed only when they hash
(headers.verify_header) to the hash the chain holds at its height, so the roots in it can prove what a
node says about the block.

It starts from a checkpoint: a `trusted_checkpoint` hash set for the network in NETWORKS_FILE, else
the tracker's finalized block once `checkpoint_quorum` upstreams (0: every one in rotation that has
reached it) give that hash at that height. From there it follows the tracker: a newer finalized
block is linked back to the chain, header by header through parent hashes, before any block between
is believed; an older block is reached by walking back from the lowest block held. One range of
consecutive heights is held, at most CHAIN_MAX hashes (32 bytes each); a walk goes at most WALK_MAX
blocks per call, and what it proved is kept for the next. A header with a field the proxy does not
know is never believed: the network is then unverifiable (one log line, `unverifiable` for /readyz
and the metric).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from proxy.chain.head_polls import Head
from proxy.chain.headers import Header, HeaderError, verify_header
from proxy.rpc.jsonrpc import JsonRpcError
from proxy.upstream.pool import PerUpstream, Upstream
from proxy.values import Answer

log = logging.getLogger("proxy.verify")

CHAIN_MAX = 1 << 17  # block hashes held per network (4 MiB of hashes)
WALK_MAX = 4096  # blocks linked by one call, forwards or back; the rest on later calls
WALK_BATCH = 128  # headers asked in one batch
HEADERS_KEPT = 1024  # proven headers' fields kept, most recently used
# Seconds an upstream's vote (a checkpoint's header, a header the pool did not give) waits for a place
# in its budget (max_rps, max_concurrency). A node whose places are all held by calls it has not
# answered (hung: a hedge's loser keeps its place until the node answers) has no say meanwhile, so the
# read it would prove is served unproven at once rather than after the node's timeout.
VOTE_BUDGET_WAIT = 1.0


class Unverifiable(Exception):
    """No header can be believed for the block (yet): why, in a few words."""


Proven = tuple[Header, Mapping[str, Any]]  # a header and the block object whose fields hashed to it


class HeaderChain:
    def __init__(
        self,
        network: str,
        upstream: Upstream,
        per: PerUpstream | None,
        *,
        quorum: int,
        trusted: str | None,
        timeout: float,
        on_unverifiable: Callable[[str], None],
    ) -> None:
        self._network = network
        self._upstream = upstream
        self._per = per
        self._quorum = quorum
        self._trusted = bytes.fromhex(trusted[2:]) if trusted else None
        self._timeout = timeout
        self._on_unverifiable = on_unverifiable
        self._hashes: dict[int, bytes] = {}
        self._low = self._high = -1
        self._low_parent = b""  # the parent hash of block `low`: where a walk back goes on from
        self._headers: OrderedDict[int, Proven] = OrderedDict()
        self._lock = asyncio.Lock()
        self._checkpoint_failures = 0  # checkpoints not agreed, and why the last one was not
        self._checkpoint_failed = ""
        self.unverifiable: str | None = None  # why no header of this network can be believed

    def held(self) -> tuple[int, int]:
        """The lowest and highest block whose hash is held ((-1, -1): none yet)."""
        return self._low, self._high

    async def header(self, number: int, head: Head | None) -> Proven:
        """Block `number`'s header, proven on the chain; Unverifiable when it cannot be (yet)."""
        kept = self._headers.get(number)
        if kept is not None:
            self._headers.move_to_end(number)
            return kept
        await self.reach(number, number, head)
        return (await self.headers([number], head))[number]

    async def headers(self, numbers: Sequence[int], head: Head | None) -> dict[int, Proven]:
        """The proven headers of several blocks (asked in one batch where not kept)."""
        if not numbers:
            return {}
        await self.reach(min(numbers), max(numbers), head)
        found: dict[int, Proven] = {}
        missing = []
        for n in numbers:
            kept = self._headers.get(n)
            if kept is not None:
                found[n] = kept
            else:
                missing.append(n)
        for start in range(0, len(missing), WALK_BATCH):
            part = missing[start : start + WALK_BATCH]
            blocks = await self._blocks(part)
            for n, block in zip(part, blocks, strict=True):
                proven = await self._believe(n, block, self._hashes[n])
                if proven is None:
                    raise Unverifiable(f"no upstream gave block {n}'s header")
                found[n] = proven
        return found

    async def reach(self, low: int, high: int, head: Head | None) -> None:
        """Hold the hashes of blocks `low` to `high` (all final), linking and walking as needed."""
        if self.unverifiable is not None:
            raise Unverifiable(self.unverifiable)
        if low in self._hashes and high in self._hashes:
            return
        failures = self._checkpoint_failures
        async with self._lock:  # one walk at a time: a second caller finds its blocks linked
            if self._high < 0:
                if self._checkpoint_failures != failures:
                    # One failed while this call waited: its verdict holds (callers waiting together
                    # are not held up once each, one after another, by an upstream with no say now).
                    raise Unverifiable(self._checkpoint_failed)
                try:
                    await self._checkpoint(head)
                except Unverifiable as exc:
                    self._checkpoint_failures += 1
                    self._checkpoint_failed = str(exc)
                    raise
            if high > self._high:
                await self._forward(high, head)
            if low < self._low:
                await self._back(low)
        if low not in self._hashes or high not in self._hashes:
            raise Unverifiable(f"blocks {low} to {high} are not linked yet")

    async def _checkpoint(self, head: Head | None) -> None:
        if self._trusted is not None:
            answers = await self._everyone("eth_getBlockByHash", ["0x" + self._trusted.hex(), False])
            for answer in answers:
                proven = self._verified(answer.result, self._trusted)
                if proven is not None:
                    self._start(proven)
                    return
            raise Unverifiable("no upstream gave the trusted checkpoint's header")
        if head is None or not head.final_hash:
            raise Unverifiable("no finalized block known yet")
        expected = bytes.fromhex(head.final_hash[2:])
        answers = await self._everyone("eth_getBlockByNumber", [hex(head.finalized), False])
        votes = [
            a
            for a in answers
            if isinstance(a.result, dict) and str(a.result.get("hash", "")).lower() == head.final_hash
        ]
        # 0: every upstream in rotation that has reached the block (a backup behind it has no say).
        needed = self._quorum or self._reached(head.finalized)
        if len(votes) < max(needed, 1):
            raise Unverifiable(f"{len(votes)} of {needed} upstreams agree on the finalized block")
        for answer in votes:
            proven = self._verified(answer.result, expected)
            if proven is not None:
                self._start(proven)
                return
        raise Unverifiable("no upstream gave the finalized block's header")

    def _reset(self) -> None:
        self._hashes.clear()
        self._headers.clear()
        self._low = self._high = -1

    def _start(self, proven: Proven) -> None:
        header = proven[0]
        self._hashes = {header.number: header.hash}
        self._low = self._high = header.number
        self._low_parent = header.parent_hash
        self._keep(header.number, proven)

    async def _forward(self, high: int, head: Head | None) -> None:
        """Link the tracker's finalized block back to the highest block held."""
        if head is None or not head.final_hash or head.finalized < high:
            raise Unverifiable(f"block {high} is not final")
        top, top_hash = head.finalized, bytes.fromhex(head.final_hash[2:])
        gap = top - self._high
        if gap > WALK_MAX and not (self._trusted is not None and gap <= CHAIN_MAX):
            # Too far to link in one call: the checkpoint is agreed again there (a configured one
            # is never dropped: the whole gap is walked once). Older blocks are walked back to.
            self._reset()
            await self._checkpoint(head)
            return
        walked, parent = await self._walk(top, top_hash, self._high + 1)
        if parent != self._hashes[self._high]:
            log.warning(
                "network %s: the finalized block does not descend from the checkpoint: agreed again", self._network
            )
            self._reset()
            await self._checkpoint(head)
            return
        self._hashes.update(walked)
        self._high = top
        while len(self._hashes) > CHAIN_MAX:  # the oldest go; their child's parent hash is where a walk back resumes
            self._low_parent = self._hashes.pop(self._low)
            self._low += 1

    async def _back(self, low: int) -> None:
        """Walk back from the lowest block held to `low` (WALK_MAX at most: the rest on later calls)."""
        if self._high - low >= CHAIN_MAX:
            raise Unverifiable(f"block {low} is older than the {CHAIN_MAX} blocks held")
        stop = max(low, self._low - WALK_MAX)
        walked, parent = await self._walk(self._low - 1, self._low_parent, stop)
        self._hashes.update(walked)
        self._low, self._low_parent = stop, parent
        if stop > low:
            raise Unverifiable(f"block {low} is not linked yet")

    async def _walk(self, top: int, top_hash: bytes, bottom: int) -> tuple[dict[int, bytes], bytes]:
        """The hashes of blocks `top` down to `bottom`, each the parent its child names (the first the
        one given), each header's fields hashing to it; and the parent hash of block `bottom`."""
        walked: dict[int, bytes] = {}
        expected = top_hash
        n = top
        while n >= bottom:
            numbers = list(range(n, max(bottom, n - WALK_BATCH + 1) - 1, -1))
            for number, block in zip(numbers, await self._blocks(numbers), strict=True):
                proven = await self._believe(number, block, expected)
                if proven is None:
                    raise Unverifiable(f"no upstream gave block {number}'s header")
                walked[number] = expected
                expected = proven[0].parent_hash
            n = numbers[-1] - 1
        return walked, expected

    async def _blocks(self, numbers: Sequence[int]) -> list[Any]:
        """The pool's block objects for `numbers` (None where it gave none)."""
        try:
            answers = await self._upstream.batch([("eth_getBlockByNumber", [hex(n), False]) for n in numbers])
        except JsonRpcError:
            return [None] * len(numbers)
        return [a.result for a in answers]

    async def _believe(self, number: int, block: Any, expected: bytes) -> Proven | None:
        """The header of block `number` that hashes to `expected`: the pool's, else each upstream's."""
        proven = self._verified(block, expected)
        if proven is None:
            for answer in await self._everyone("eth_getBlockByNumber", [hex(number), False]):
                proven = self._verified(answer.result, expected)
                if proven is not None:
                    break
        if proven is not None:
            self._keep(number, proven)
        return proven

    def _verified(self, block: Any, expected: bytes) -> Proven | None:
        if not isinstance(block, dict):
            return None
        try:
            header = verify_header(block)
        except HeaderError as exc:
            if str(exc).startswith("unknown header field") and self.unverifiable is None:
                self.unverifiable = f"a header has a field the proxy does not know ({str(exc)[21:][:40]})"
                log.error("network %s: unverifiable: %s", self._network, self.unverifiable)
                self._on_unverifiable(self.unverifiable)
            return None
        return (header, block) if header.hash == expected else None

    def _keep(self, number: int, proven: Proven) -> None:
        self._headers[number] = proven
        self._headers.move_to_end(number)
        while len(self._headers) > HEADERS_KEPT:
            self._headers.popitem(last=False)

    def _reached(self, number: int) -> int:
        if self._per is None:
            return 1
        states = self._per.states
        return sum(1 for i in range(states.size) if states.in_rotation(i) and states.vouches(i, number))

    async def _everyone(self, method: str, params: Any) -> list[Answer]:
        """Each upstream in rotation asked alone (the pool once without per-upstream access)."""
        if self._per is None:
            try:
                return [await self._upstream.request(method, params)]
            except JsonRpcError:
                return []
        per = self._per
        indices = [i for i in range(per.states.size) if per.states.in_rotation(i)]
        if len(indices) == 1:  # one upstream: asked in the caller's own task
            try:
                return [await per.ask(indices[0], method, params, timeout=self._timeout, budget_wait=VOTE_BUDGET_WAIT)]
            except JsonRpcError:
                return []
        replies = await asyncio.gather(
            *(per.ask(i, method, params, timeout=self._timeout, budget_wait=VOTE_BUDGET_WAIT) for i in indices),
            return_exceptions=True,
        )
        return [r for r in replies if isinstance(r, Answer)]
