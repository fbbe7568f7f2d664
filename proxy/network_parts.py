"""One network's moving parts, built, started and retired in one place: at start-up and on a reload.

A network runs on its upstream pool, its head tracker (EVM) or slot tracker (Solana), an identity
guard (EVM pools), a per-upstream watcher (each upstream's own head, or slot), a newHeads/logs feed
(EVM), an upstream WebSocket relay (when it has ws upstreams) and, with WORKERS > 1, the head polls
its workers share. `Parts` holds them with the tasks they run; `PartsBuilder` makes them from a
`Network`, starts them (serving once the first identity check and head poll are done, bounded like
start-up) and retires them: tasks stopped, then the pool closed once the calls it carries (those
waiting for budget too) have had their chance.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.chain import answer_proofs
from proxy.chain.epochs import EpochStore, MemoryEpochs
from proxy.chain.heads import EvmHeadTracker
from proxy.chain.identity import IdentityGuard
from proxy.chain.slots import SolanaSlotTracker
from proxy.chain.upstream_heads import watch_upstream_heads
from proxy.config import Network, Settings
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.streams.head_feed import EvmFeed
from proxy.tasks import stop_tasks
from proxy.upstream.budget import BudgetBook
from proxy.upstream.key_budget import KeyedUpstream, KeySlots
from proxy.upstream.pool import PerUpstream, Upstream, http_pool, routing_of
from proxy.upstream.ws import UpstreamSocket
from proxy.workers.shared_polls import SharedPolls

STARTUP_WAIT = 2.0  # seconds a start waits for the first identity checks and head polls
DRAIN_POLL = 0.05  # seconds between looks at a retired pool's requests in flight


@dataclass(slots=True)
class Parts:
    """Everything one network runs on, and the tasks it runs."""

    runtime: NetworkRuntime
    guard: IdentityGuard | None = None
    feed: EvmFeed | None = None
    relay: UpstreamSocket | None = None
    polls: SharedPolls | None = None
    # A Solana pool, its upstreams' own slots polled one by one (an EVM pool's heads: runtime.per_upstream).
    slot_polls: PerUpstream | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.runtime.name


def structure(network: Network) -> str:
    """A digest of what a network's pool is built from: workers that build from the same file agree
    on it, so their shared polls meet in one file, and never in the file of the pool it replaced."""
    fields = (network.family, network.upstreams, network.ws_upstreams, network.chain_id, network.finality_depth)
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:12]


@dataclass(slots=True)
class PartsBuilder:
    """What every network's parts are made with (the app's collaborators)."""

    settings: Settings
    factory: Callable[[Network, Metrics], Upstream]
    slots: KeySlots
    metrics: Metrics
    epochs: EpochStore | None  # None: one MemoryEpochs for every network this process builds
    run_dir: str | None = None  # with workers: where the shared polls live
    on_shown: Callable[[str, int], None] | None = None  # with workers: blocks shown, told to siblings

    budgets: BudgetBook = field(init=False)  # every pool's provider budgets (budget.py)

    def __post_init__(self) -> None:
        # Shared, so a network rebuilt on a reload reads its chain's epoch record and checks its
        # checkpoint (epochs.py) instead of starting a fresh namespace of its own.
        if self.epochs is None:
            self.epochs = MemoryEpochs()
        # With workers, budgets with limits are counted in the run directory, across the workers.
        self.budgets = BudgetBook(self.run_dir)

    def reroute(self, upstream: Upstream, net: Network) -> None:
        """The network's routing applied to its pool, with the book's budgets: one per upstream URL,
        so a pool and the one a reload replaced it with count in one window."""
        pool = http_pool(upstream)
        if pool is not None:
            pool.reroute(routing_of(net, self.budgets))

    def build(self, net: Network) -> Parts:
        settings, metrics = self.settings, self.metrics
        upstream: Upstream = KeyedUpstream(self.factory(net, metrics), self.slots)
        self.reroute(upstream, net)
        polls = (
            SharedPolls(self.run_dir, f"{net.name}-{structure(net)}", settings.head_poll_interval)
            if self.run_dir is not None
            else None
        )
        # The node's WebSocket: relayed subscriptions (both families) and pushed heads (EVM).
        relay = (
            UpstreamSocket(
                net.name,
                net.ws_upstreams,
                timeout=settings.upstream_timeout,
                max_message=settings.max_response_bytes,
                headers=net.ws_headers,
            )
            if net.ws_upstreams
            else None
        )
        if net.family != "evm":
            tracker = SolanaSlotTracker(
                net.name,
                upstream,
                interval=settings.head_poll_interval,
                metrics=metrics,
                stale_after=settings.head_stale_bound,
                shared=polls,
                identity_interval=settings.identity_check_interval,
            )
            runtime = NetworkRuntime(net, upstream, tracker)
            tracker.on_space.append(runtime.rescope)
            slot_polls = upstream if isinstance(upstream, PerUpstream) else None
            return Parts(runtime, relay=relay, polls=polls, slot_polls=slot_polls)
        # EVM upstreams are watched one by one (head, chain identity); Solana upstreams by their slot.
        per_upstream = upstream if isinstance(upstream, PerUpstream) else None
        evm = EvmHeadTracker(
            net.name,
            upstream,
            interval=settings.head_poll_interval,
            finality_depth=net.finality_depth or settings.finality_depth,
            metrics=metrics,
            stale_after=settings.head_stale_bound,
            states=per_upstream.states if per_upstream else None,
            shared=polls,
            epochs=self.epochs,
        )
        guard = None
        if per_upstream is not None:  # without it, no identity: nothing of the network is cached
            guard = IdentityGuard(
                net.name,
                per_upstream,
                declared_chain_id=net.chain_id,
                interval=settings.identity_check_interval,
                retry=settings.head_poll_interval,
                metrics=metrics,
                on_identity=evm.set_identity,
                on_adopt=evm.adopt,
                checkpoint=evm.checkpoint,
            )
        pool = http_pool(upstream)
        if pool is not None and net.verify != "off":  # a final block's state read carries its proof
            pool.proof_beside = functools.partial(answer_proofs.proof_beside_head, evm)
        if self.on_shown is not None:
            evm.on_shown.append(functools.partial(self.on_shown, net.name))
        if relay is not None:  # its connections are held to the chain the HTTP upstreams' checks name
            relay.identity = lambda: evm.identity
        feed = EvmFeed(net.name, upstream, evm, push=relay)
        evm.on_head.append(feed.on_head)
        evm.on_reorg.append(feed.on_reorg)
        return Parts(NetworkRuntime(net, upstream, evm, per_upstream), guard, feed, relay, polls)

    async def start(self, started: Sequence[Parts]) -> None:
        """Run each network's tasks; return once every upstream's identity was asked and every tracker
        tried its first poll, and then read its epoch (bounded): a fresh network is neither "stale" nor
        without an identity. The feeds start last."""
        interval = self.settings.head_poll_interval
        for parts in started:
            name, runtime = parts.name, parts.runtime
            _poll_clock_starts(self.metrics, name)
            if parts.guard is not None:
                parts.tasks.append(asyncio.create_task(parts.guard.run(), name=f"identity-{name}"))
            first: asyncio.Event | None = None
            watched = runtime.per_upstream or parts.slot_polls
            if watched is not None:
                first = asyncio.Event()
                solana = runtime.per_upstream is None
                parts.tasks.append(
                    asyncio.create_task(
                        watch_upstream_heads(watched, interval, parts.polls, first, solana=solana),
                        name=f"upstream-heads-{name}",
                    )
                )
            parts.tasks.append(
                asyncio.create_task(
                    _after(first, self.settings.upstream_timeout, runtime.tracker.run()), name=f"tracker-{name}"
                )
            )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STARTUP_WAIT):
                await asyncio.gather(
                    *(p.guard.checked.wait() for p in started if p.guard is not None),
                    *(p.runtime.tracker.attempted.wait() for p in started),
                )
                # ... and once the identity is known, its epoch read (nothing is cached before).
                await asyncio.gather(
                    *(
                        t.keyed.wait()
                        for p in started
                        if isinstance(t := p.runtime.tracker, EvmHeadTracker) and t.identity
                    )
                )
        for parts in started:
            if parts.feed is not None:
                parts.tasks.append(asyncio.create_task(parts.feed.run(), name=f"feed-{parts.name}"))

    async def retire(self, parts: Parts, grace: float, stopping: asyncio.Event | None = None) -> None:
        """Stop a network's tasks and close what it holds; its pool once the calls it carries (being
        posted, or waiting for a provider budget's place) are answered, after `grace` seconds, or when
        `stopping` is set (the proxy is shutting down)."""
        await stop_tasks(parts.tasks)
        parts.tasks.clear()
        if parts.relay is not None:
            await parts.relay.close()
        pool = http_pool(parts.runtime.upstream)
        if pool is not None and grace > 0:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            while pool.carrying and loop.time() < deadline and not (stopping and stopping.is_set()):
                await asyncio.sleep(DRAIN_POLL)
        await parts.runtime.upstream.close()
        if parts.polls is not None:
            parts.polls.close()


def _poll_clock_starts(metrics: Metrics, network: str) -> None:
    """The last-poll gauge exists from the tracker's start, not from its first good poll: a network whose
    polls all fail (a revoked token answering every call with an error) still ages, so RpcProxyHeadStale
    fires. A network a reload rebuilds keeps the time it had."""
    gauge = metrics.head_updated
    if not any(s.labels.get("network") == network for family in gauge.collect() for s in family.samples):
        gauge.labels(network).set(time.time())


async def _after(first: asyncio.Event | None, wait: float, run: Coroutine[Any, Any, None]) -> None:
    """`run` once each upstream's own head and eth_syncing were asked once (bounded by `wait`): the
    tracker's first poll never follows a node still syncing because nothing was known of it yet."""
    if first is not None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await first.wait()
    await run
