"""One newHeads/logs stream per EVM network, fanned out to every subscriber.

The feed follows the head tracker (chain.EvmHeadTracker.on_head) and, when the network has an
upstream WebSocket, the node's own pushed heads as well (polling stays the fallback). For each new
block it makes one header fetch and one eth_getLogs by block hash, whatever the number of
subscribers, and filters logs in the proxy. Every block is delivered once, in order; after a reorg
the logs of the replaced blocks are sent again with "removed": true and the new blocks follow, as
geth does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from proxy.chain.head_polls import Head
from proxy.chain.heads import EvmHeadTracker
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import JsonRpcError
from proxy.streams.fanout import LogBatch
from proxy.streams.subscription import Relay, Relayed, Session, Subscription, spawn
from proxy.upstream.pool import Upstream
from proxy.upstream.sending import too_large
from proxy.values import Answer

log = logging.getLogger("proxy.head_feed")

CATCH_UP = 128  # most blocks delivered after one jump; older ones are skipped (logged)
KEEP = 512  # delivered block hashes remembered, for reorgs
PUSH_RETRY = 2.0  # seconds between asks for the node's pushed heads while they are lost
_BODY_FIELDS = ("transactions", "uncles")  # a newHeads payload is the header alone, as geth sends


class FeedError(Exception):
    """The chain moved while the feed read it: nothing is delivered, the next head tries again."""


class EvmFeed:
    def __init__(self, network: str, upstream: Upstream, tracker: EvmHeadTracker, *, push: Relay | None = None) -> None:
        self.network = network
        self.heads: set[Subscription] = set()
        self.logs: set[Subscription] = set()
        self._reads = FeedReads(upstream)
        self._tracker = tracker
        self._push = push
        self._pushing: Relayed | None = None
        self._delivered: dict[int, str] = {}  # number -> hash of each block already delivered
        self._block_logs: dict[str, list[dict[str, Any]]] = {}  # hash -> its logs, re-sent if removed
        self._head: Head | None = None
        self._rolled_back: int | None = None  # the tracker took a chain that ends below this block
        self._pushed: list[dict[str, Any]] = []
        self._push_retry_at = 0.0  # loop time before which a lost push is not asked for again
        self._push_failing = False
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    # --- subscribers --------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return bool(self.heads or self.logs)

    @property
    def push_live(self) -> bool:
        """The node's pushed heads are coming in (besides the tracker's polls)."""
        return self._pushing is not None and not isinstance(self._pushing, _Pending)

    def add(self, sub: Subscription) -> None:
        if not self.active:
            self._start()
        (self.logs if sub.kind == "logs" else self.heads).add(sub)
        if self._push is not None and self._pushing is None:
            spawn(self._tasks, self._subscribe_push())

    async def node_head(self) -> int:
        """The node's head block now (the tracker's if the node cannot say): a new subscription is sent
        the blocks after it, as geth sends those imported after a subscription."""
        return await self._reads.block_number(self._tracker.head.latest if self._tracker.head else -1)

    def discard(self, sub: Subscription) -> None:
        self.heads.discard(sub)
        self.logs.discard(sub)
        if not self.active and self._pushing is not None:
            pushing, self._pushing = self._pushing, None
            spawn(self._tasks, pushing.cancel())

    def take_over(self, old: EvmFeed) -> None:
        """A reload replaced the network's pool with one on the same chain: the old feed's subscribers
        are this feed's now, and it goes on after the last block the old one delivered (each block
        once, in order, as after an upstream drop)."""
        subs = old.heads | old.logs
        self.heads |= old.heads
        self.logs |= old.logs
        old.heads.clear()
        old.logs.clear()
        for sub in subs:
            sub.source = self
        if not self.active:
            return
        self._delivered, self._block_logs = dict(old._delivered), dict(old._block_logs)
        if self._push is not None and self._pushing is None:
            spawn(self._tasks, self._subscribe_push())
        self._head = self._tracker.head
        self._wake.set()

    def end_all(self, error: JsonRpcError) -> None:
        """Every subscriber is told its subscription is over (a reload removed the network, or its
        pool now serves another chain) and let go."""
        for sub in self.heads | self.logs:
            sub.session.end(sub, error)
        self.heads.clear()
        self.logs.clear()

    def _start(self) -> None:
        """The first subscriber: the stream starts after the tracker's current head."""
        self._delivered.clear()
        self._block_logs.clear()
        head = self._tracker.head
        if head is not None:
            self._delivered[head.latest] = head.latest_hash

    # --- inputs -------------------------------------------------------------------------

    def on_head(self, head: Head) -> None:
        """The tracker's listener: remember the newest head and wake the worker."""
        self._head = head
        self._wake.set()

    def on_reorg(self, height: int) -> None:
        """The tracker's listener: blocks from `height` up were replaced or rolled back (anvil_rollback,
        evm_revert: a shorter chain with no new block), so their delivered logs are removed now."""
        self._rolled_back = height if self._rolled_back is None else min(height, self._rolled_back)
        self._wake.set()

    def _on_pushed(self, _method: str, header: Any) -> None:
        if isinstance(header, dict):
            self._pushed.append(header)
            self._wake.set()

    def _push_again(self) -> None:
        """Subscribers, and no push: the node's socket dropped for longer than it was tried again
        (upstream/ws.py), or could not be opened. Polls carry the stream meanwhile; the push is asked
        for again at most every PUSH_RETRY seconds."""
        if self._push is None or self._pushing is not None or not self.active:
            return
        now = asyncio.get_running_loop().time()
        if now >= self._push_retry_at:
            self._push_retry_at = now + PUSH_RETRY
            spawn(self._tasks, self._subscribe_push())

    async def _subscribe_push(self) -> None:
        assert self._push is not None
        self._pushing = _Pending()
        try:
            relayed = await self._push.subscribe(
                "eth_subscribe", ["newHeads"], on_ok=lambda: None, on_notify=self._on_pushed, on_lost=self._push_lost
            )
        except Exception as exc:
            if not self._push_failing:  # once per outage, not at every retry
                log.warning("head feed %s: no push heads from the upstream WebSocket (%s); polling", self.network, exc)
            self._push_failing = True
            self._pushing = None
            return
        if self._push_failing:
            log.info("head feed %s: push heads from the upstream WebSocket again", self.network)
            self._push_failing = False
        if self._pushing is None or not self.active:  # everyone left meanwhile
            await relayed.cancel()
            self._pushing = None
        else:
            self._pushing = relayed

    def _push_lost(self) -> None:
        self._pushing = None  # the tracker's polls carry on; the next subscriber subscribes again

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            pushed, self._pushed = self._pushed, []
            head, self._head = self._head, None
            if not self.active:
                continue
            self._push_again()
            try:
                for header in pushed:
                    await self._deliver_pushed(header)
                if head is not None:
                    await self._advance(head)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("head feed %s: %s", self.network, exc)

    # --- the stream -----------------------------------------------------------------------

    async def _advance(self, head: Head) -> None:
        delivered = self._delivered
        if not delivered:
            delivered[head.latest] = head.latest_hash
            return
        top = max(delivered)
        conflicts = [n for n, h in delivered.items() if head.hashes.get(n, h) != h]
        rolled_back, self._rolled_back = self._rolled_back, None
        if rolled_back is not None:  # the chain ends at its head now: nothing delivered above it is left
            conflicts += [n for n in delivered if n > head.latest]
        if conflicts:
            fork = min(conflicts) - 1
            if fork > head.latest:  # rolled back below every block it replaced: the highest one left
                fork = await self._meeting(head.latest)
                if fork == head.latest and fork not in delivered:
                    # None left (a revert past the blocks remembered): the chain goes on from its head.
                    delivered[fork] = head.latest_hash
        elif head.latest <= top:
            return  # nothing new (or a view that lags what was delivered)
        elif head.latest - top > CATCH_UP:
            # A jump past the tracker's window: a reorg beneath it shows only on the node's chain.
            fork = await self._meeting(top)
        else:
            fork = top
        numbers, headers = await self._from(fork, head, top)
        if self._breaks(fork, numbers, headers):
            # A reorg below the tracker's window (a dev node's revert past its finalized block): the
            # blocks delivered are compared with the node's chain down to where the two meet.
            fork = await self._meeting(fork)
            numbers, headers = await self._from(fork, head, top)
            if self._breaks(fork, numbers, headers):
                raise FeedError(f"block {numbers[0]} does not extend the delivered chain")
        hashes = [str(h["hash"]).lower() for h in headers]
        logs = await self._reads.logs(hashes) if self.logs and hashes else [[] for _ in numbers]
        removed = sorted(n for n in delivered if n > fork)
        for n in removed:
            gone = self._block_logs.pop(delivered.pop(n), [])
            self._send_logs([{**entry, "removed": True} for entry in gone])
        for n, header, block_hash, block_logs in zip(numbers, headers, hashes, logs, strict=True):
            self._deliver(n, block_hash, header, block_logs)
        self._prune(head)
        if numbers and numbers[-1] < head.latest:  # the rest of a long reorg's new chain: next time
            self._head = self._head or head
            self._wake.set()

    def _breaks(self, fork: int, numbers: list[int], headers: list[dict[str, Any]]) -> bool:
        """The first block read right after `fork` is not the child of the block delivered there."""
        delivered = self._delivered
        return bool(headers) and numbers[0] == fork + 1 and fork in delivered and _parent(headers[0]) != delivered[fork]

    async def _from(self, fork: int, head: Head, top: int) -> tuple[list[int], list[dict[str, Any]]]:
        """The numbers and headers of the blocks to deliver after `fork`. After a reorg (`fork` below
        `top`, the last block delivered) every block from the fork up to `top`, so the client's chain
        joins up, then CATCH_UP more at most (the rest next time); ahead of `top`, the last CATCH_UP
        at most (older ones skipped, logged)."""
        if fork < top:
            start, end = fork + 1, min(head.latest, max(top, fork + CATCH_UP))
        else:
            start, end = max(fork + 1, head.latest - CATCH_UP + 1), head.latest
            if start > fork + 1:
                log.warning(
                    "head feed %s: skipped blocks %d-%d (more than %d at once)",
                    self.network,
                    fork + 1,
                    start - 1,
                    CATCH_UP,
                )
        numbers = list(range(start, end + 1))
        return numbers, await self._reads.headers(numbers, head)

    async def _meeting(self, below: int) -> int:
        """The highest delivered block, at or under `below`, that the node's chain still has; under
        every block delivered when it has none of them (their logs are all sent again as removed)."""
        numbers = sorted((n for n in self._delivered if n <= below), reverse=True)
        if not numbers:
            return below
        for part in (numbers[:1], *(numbers[at : at + CATCH_UP] for at in range(1, len(numbers), CATCH_UP))):
            answers = await self._reads.read([("eth_getBlockByNumber", [hex(n), False]) for n in part])
            for n, answer in zip(part, answers, strict=True):
                header = _result(answer)
                if isinstance(header, dict) and str(header.get("hash", "")).lower() == self._delivered[n]:
                    return n  # the highest first, alone: most often the chains meet there
        return numbers[-1] - 1

    async def _deliver_pushed(self, header: dict[str, Any]) -> None:
        """A head the node pushed: delivered at once when it extends the delivered chain; anything
        else (a gap, a fork) waits for the tracker's poll, which reconciles."""
        try:
            number, block_hash = int(header["number"], 16), str(header["hash"]).lower()
            parent = str(header["parentHash"]).lower()
        except (KeyError, TypeError, ValueError):
            return
        if not self._delivered:
            return
        top = max(self._delivered)
        if number != top + 1 or self._delivered[top] != parent:
            return
        logs = (await self._reads.logs([block_hash]))[0] if self.logs else []
        if max(self._delivered) == top:  # nothing delivered meanwhile
            self._deliver(number, block_hash, header, logs)

    def _deliver(self, number: int, block_hash: str, header: dict[str, Any], logs: list[dict[str, Any]]) -> None:
        self._delivered[number] = block_hash
        if self.heads:
            payload = jsonrpc.dumps({k: v for k, v in header.items() if k not in _BODY_FIELDS})
            for sub in _past(self.heads, number):
                sub.notify(payload)
        if self.logs:
            self._block_logs[block_hash] = logs
            self._send_logs(logs, number)

    def _send_logs(self, logs: list[dict[str, Any]], number: int | None = None) -> None:
        """Each log encoded once, the batch handed to each connection: O(connections) here, the
        matching and sending in each connection's own writer (subscriptions.Session.push_logs).
        `number`: the block's, new; None: removed logs, for subscriptions sent a block already."""
        if not self.logs:
            return
        batch = LogBatch.of(logs)
        by_session: dict[Session, list[Subscription]] = {}
        for sub in _past(self.logs, number):
            by_session.setdefault(sub.session, []).append(sub)
        for session, subs in by_session.items():
            session.push_logs(tuple(subs), batch)

    def _prune(self, head: Head) -> None:
        """Only unfinalized blocks are replaced on a live chain: the logs of the rest are forgotten
        (a block's logs may be megabytes). The hashes of the last KEEP blocks delivered are kept, so a
        reorg past finality (a dev node's revert) still finds where the chains meet."""
        if not self._delivered:
            return
        top = max(self._delivered)
        for n, block_hash in list(self._delivered.items()):
            if n < top - KEEP:
                del self._delivered[n]
                self._block_logs.pop(block_hash, None)
            elif n < head.finalized and n != top:
                self._block_logs.pop(block_hash, None)


class FeedReads:
    """A feed's upstream reads: one each per block, whoever listens."""

    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream
        self._asking: asyncio.Future[int] | None = None  # the node's head, asked for the subscriptions made meanwhile

    async def headers(self, numbers: list[int], head: Head) -> list[dict[str, Any]]:
        calls: list[tuple[str, Any]] = [
            ("eth_getBlockByHash", [head.hashes[n], False])
            if n in head.hashes
            else ("eth_getBlockByNumber", [hex(n), False])
            for n in numbers
        ]
        answers = await self.read(calls)
        headers = []
        for n, answer in zip(numbers, answers, strict=True):
            header = _result(answer)
            if not isinstance(header, dict) or header.get("number") != hex(n) or not header.get("hash"):
                raise FeedError(f"block {n} is not available from the node yet")
            expected = head.hashes.get(n)
            if expected is not None and str(header["hash"]).lower() != expected:
                raise FeedError(f"block {n} changed while it was read")
            headers.append(header)
        return headers

    async def block_number(self, fallback: int) -> int:
        """The node's head block number, or `fallback` when it gives none: one ask at a time, shared by
        the subscriptions made while it runs (a burst of subscribes is one call to the node)."""
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self._block_number(fallback))
        return await asyncio.shield(self._asking)

    async def _block_number(self, fallback: int) -> int:
        with contextlib.suppress(FeedError, ValueError, TypeError):
            [answer] = await self.read([("eth_blockNumber", [])])
            value = _result(answer)
            if isinstance(value, str) and value[:2] == "0x":
                return int(value, 16)
        return fallback

    async def read(self, calls: list[tuple[str, Any]]) -> list[Answer]:
        """The calls' answers, in batches of CATCH_UP calls at most (a long reorg's new chain is read
        in several)."""
        answers: list[Answer] = []
        for at in range(0, len(calls), CATCH_UP):
            answers += await self._batch(calls[at : at + CATCH_UP])
        return answers

    async def _batch(self, calls: list[tuple[str, Any]]) -> list[Answer]:
        """One batch, each reply read under MAX_RESPONSE_BYTES counted whole. A catch-up's batch (up to
        CATCH_UP blocks, their logs on a busy chain tens of MB) too large as a whole is read again in
        halves, each bounded alike; one block's own reply too large fails the read (FeedError, logged)."""
        try:
            return await self._upstream.batch(calls)
        except JsonRpcError as error:
            if not too_large(error):
                raise
            if len(calls) == 1:
                raise FeedError(f"{error.message} (raise MAX_RESPONSE_BYTES to read it)") from None
        half = len(calls) // 2
        return [*await self._batch(calls[:half]), *await self._batch(calls[half:])]

    async def logs(self, hashes: list[str]) -> list[list[dict[str, Any]]]:
        answers = await self.read([("eth_getLogs", [{"blockHash": h}]) for h in hashes])
        out = []
        for block_hash, answer in zip(hashes, answers, strict=True):
            logs = _result(answer)
            if not isinstance(logs, list):
                raise FeedError(f"no logs for block {block_hash} from the node")
            out.append([entry for entry in logs if isinstance(entry, dict)])
        return out


def _parent(header: dict[str, Any]) -> str:
    return str(header.get("parentHash", "")).lower()


def _past(subs: set[Subscription], number: int | None) -> list[Subscription]:
    """The subscriptions a block is sent to: past the block each started after (the first block sent
    to one ends its wait: a reorg's lower ones follow); removed logs (None) to those sent one."""
    sent = []
    for sub in subs:
        if number is None and sub.after >= 0:
            continue
        if number is not None and number <= sub.after:
            continue
        sub.after = -1
        sent.append(sub)
    return sent


def _result(answer: Answer) -> Any:
    return None if answer.is_error else answer.result


class _Pending:
    """A push subscription being opened: present, so a second subscriber does not open another."""

    async def cancel(self) -> None:
        return None
