"""The networks in force, and a reload of NETWORKS_FILE applied to them without a restart.

A reload reads the file again; a file that does not parse or check is refused whole (nothing
applied). Then, per network of the file:
- kept with new routing fields only (selection, weights, budgets, hedging, integrity checks, hosts):
  applied to its pool from the next call on;
- added, or changed in what its pool is built from (upstream URLs, WebSocket URLs, family, chain id,
  finality depth): new parts are built and started (first identity check and head poll awaited,
  bounded like start-up), then swapped in, in one step of the loop, for every holder: the service
  and router (one shared dict), the subscription feeds and relays, the admin listener, shutdown;
- removed (and the pool a change replaced): no longer served (its calls get the unknown-network
  error), its tasks stopped, and its pool closed once the calls it carries (in flight, or waiting
  for a provider budget, which it shares with its successor) are answered, at most UPSTREAM_TIMEOUT
  later.
Cache entries are keyed by network, chain identity and epoch (chain/heads.py): a new pool on another
chain names other keys, and one on the same chain checks its epoch's checkpoint first (epochs.py).

Subscribers of a replaced network's newHeads/logs feed are moved to the new feed when the new pool
serves the same chain (it goes on after the last block delivered, each block once); otherwise, and
for a removed network, each is sent an error notification saying its subscription ended. Relayed
subscriptions (newPendingTransactions, Solana pubsub) of a retired pool end with the same
notification as an upstream WebSocket lost for good.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from proxy.chain.heads import EvmHeadTracker
from proxy.config import ConfigError, Network, file_networks
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.network_parts import Parts, PartsBuilder
from proxy.rpc.jsonrpc import UPSTREAM_UNAVAILABLE, JsonRpcError
from proxy.streams.head_feed import EvmFeed
from proxy.upstream.pool import http_pool, routing_of
from proxy.upstream.ws import UpstreamSocket

# What a network's pool is built from: a change of one of these builds new parts.
STRUCTURE = ("family", "upstreams", "ws_upstreams", "finality_depth", "chain_id", "upstream_headers", "ws_headers")


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """What a reload does to each network (by name)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()  # new parts: what its pool is built from changed
    kept: tuple[str, ...] = ()  # routing fields applied to its pool


def plan_reload(current: Mapping[str, Network], new: Mapping[str, Network]) -> ReloadPlan:
    """Compare the networks in force with the file's (pure)."""
    replaced = tuple(
        n
        for n, net in new.items()
        if n in current and any(getattr(net, f) != getattr(current[n], f) for f in STRUCTURE)
    )
    return ReloadPlan(
        added=tuple(n for n in new if n not in current),
        removed=tuple(n for n in current if n not in new),
        replaced=replaced,
        kept=tuple(n for n in new if n in current and n not in replaced),
    )


class NetworkSet:
    """Every network's parts, and the dicts the rest of the app reads them from (changed in place)."""

    def __init__(
        self, builder: PartsBuilder, networks: Sequence[Network], runtimes: dict[str, NetworkRuntime] | None = None
    ) -> None:
        self.builder = builder
        self.parts: dict[str, Parts] = {}
        # Service.networks, the router's, the admin's, the sibling relay's: one dict, changed in place.
        self.runtimes: dict[str, NetworkRuntime] = runtimes if runtimes is not None else {}
        self.feeds: dict[str, EvmFeed] = {}  # Streams.feeds
        self.relays: dict[str, UpstreamSocket] = {}  # Streams.relays
        self.on_reload: list[Callable[[Mapping[str, str]], None]] = []  # told each family's default network
        for net in networks:
            self._install(builder.build(net))
        self._reloading = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()  # shutdown: retiring pools close now

    async def start(self) -> None:
        await self.builder.start(list(self.parts.values()))

    async def reload(self) -> tuple[int, dict[str, object]]:
        """NETWORKS_FILE read again and applied: (HTTP status, answer)."""
        settings = self.builder.settings
        if settings.networks_file is None:
            return 409, {"error": "no NETWORKS_FILE is set: nothing to reload"}
        async with self._reloading:
            try:
                listed, defaults = file_networks(settings)
                rehearse(listed)
            except ConfigError as exc:  # its messages never echo a URL
                return 400, {"error": str(exc)}
            new = {n.name: n for n in listed}
            plan = plan_reload({name: r.config for name, r in self.runtimes.items()}, new)
            fresh = [self.builder.build(new[name]) for name in (*plan.added, *plan.replaced)]
            await self.builder.start(fresh)
            if (wrong := await _another_chain(fresh, min(settings.upstream_timeout, RELOAD_CHECK_WAIT))) is not None:
                await asyncio.gather(*(self.builder.retire(parts, 0) for parts in fresh))
                for parts in fresh:  # the gauges the refused pools took: back to the pools in force
                    self._gauges_back(parts.name)
                return 409, {
                    "error": f"network {wrong!r}: no upstream serves its chain (chain_id, genesis): not reloaded"
                }
            # From here to the hand-over, nothing awaits: every holder sees the new networks at once.
            retired = [self._uninstall(name) for name in (*plan.removed, *plan.replaced)]
            for parts in fresh:
                self._install(parts)
            for name in plan.kept:
                self._reroute(self.runtimes[name], new[name])
            for hook in self.on_reload:
                hook(defaults)
            for parts in retired:
                self._hand_over(parts, self.parts.get(parts.name))
                self._retire(parts)
        return 200, {
            "reloaded": sorted(n for n in new if n not in settings.from_environment),
            "added": sorted(plan.added),
            "removed": sorted(plan.removed),
            "replaced": sorted(plan.replaced),
        }

    async def close(self) -> None:
        """Shutdown: every network's parts retired at once, and those a reload was retiring."""
        self._stopping.set()
        await asyncio.gather(*(self.builder.retire(p, 0) for p in self.parts.values()), *self._retiring)

    # --- the swap -------------------------------------------------------------------------

    def _install(self, parts: Parts) -> None:
        name = parts.name
        self.parts[name] = parts
        self.runtimes[name] = parts.runtime
        if parts.feed is not None:
            self.feeds[name] = parts.feed
        if parts.relay is not None:
            self.relays[name] = parts.relay

    def _uninstall(self, name: str) -> Parts:
        self.runtimes.pop(name)
        self.feeds.pop(name, None)
        self.relays.pop(name, None)
        return self.parts.pop(name)

    def _reroute(self, runtime: NetworkRuntime, network: Network) -> None:
        self.builder.reroute(runtime.upstream, network)
        runtime.config = network

    def _gauges_back(self, name: str) -> None:
        metrics = self.builder.metrics
        live = self.parts.get(name)
        if live is None:  # a network the reload would have added
            _forget_gauges(metrics, name, None)
            return
        pool = http_pool(live.runtime.upstream)
        if pool is not None:
            _forget_gauges(metrics, name, pool.states.size)
            pool.bind_gauges()
            for index, mismatch in enumerate(pool.states.mismatch):
                metrics.identity_mismatch.labels(name, str(index)).set(1 if mismatch else 0)

    def _hand_over(self, old: Parts, new: Parts | None) -> None:
        """The old feed's subscribers: to the new feed when it serves the same chain, else ended."""
        if old.feed is None or not old.feed.active:
            return
        if new is not None and new.feed is not None and _identity(old) is not None and _identity(old) == _identity(new):
            new.feed.take_over(old.feed)
            return
        why = "removed" if new is None else "given upstreams of another chain (or of one not yet verified)"
        old.feed.end_all(
            JsonRpcError(
                UPSTREAM_UNAVAILABLE,
                f"network '{old.name}' was {why} by a reload of NETWORKS_FILE: subscription ended; subscribe again",
            )
        )

    def _retire(self, parts: Parts) -> None:
        """In the background: calls already routed to the old pool get up to UPSTREAM_TIMEOUT to finish."""

        async def retire() -> None:
            await self.builder.retire(parts, self.builder.settings.upstream_timeout, self._stopping)
            successor = self.parts.get(parts.name)  # its tasks have stopped: nothing sets its gauges again
            _forget_gauges(
                self.builder.metrics,
                parts.name,
                len(successor.runtime.config.upstreams) if successor is not None else None,
            )

        task = asyncio.create_task(retire(), name=f"retire-{parts.name}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)


def rehearse(networks: Sequence[Network]) -> None:
    """Every network's routing worked out on throwaway budgets before anything is applied: what the
    swap computes cannot fail halfway through it, with some networks changed and others not. Start-up
    and `rpc-proxy check` run it too (cli.py): a value that cannot be applied is a configuration error."""
    for net in networks:
        try:
            routing_of(net)
        except (ValueError, ArithmeticError) as exc:
            raise ConfigError(f"NETWORKS_FILE: network {net.name!r}: its upstream options cannot be applied") from exc


def _identity(parts: Parts) -> object:
    tracker = parts.runtime.tracker
    return tracker.identity if isinstance(tracker, EvmHeadTracker) else None


def _forget_gauges(metrics: Metrics, network: str, upstreams: int | None) -> None:
    """Gauges of what a reload took away stop being exported rather than stay at their last value (an
    alert on a head that no longer moves): a removed network's (`upstreams` None), or the upstream
    indexes a replaced pool no longer has."""
    per_network = (
        []
        if upstreams is not None
        else [metrics.head_block, metrics.head_timestamp, metrics.head_updated, metrics.unverifiable]
    )
    # rpc_proxy_upstream_up too: left, it read the retired pool (kept alive) and RpcProxyNetworkDown
    # could fire for good of a network a reload removed.
    per_upstream = [
        metrics.upstreams.head_lag,
        metrics.upstreams.catching_up,
        metrics.upstreams.up,
        metrics.identity_mismatch,
    ]
    for gauge in (*per_network, *per_upstream):
        samples = [sample for family in gauge.collect() for sample in family.samples]
        for sample in samples:
            labels = sample.labels
            if labels.get("network") != network:
                continue
            if gauge in per_upstream and upstreams is not None and int(labels["upstream"]) < upstreams:
                continue
            with contextlib.suppress(KeyError):
                gauge.remove(*labels.values())


RELOAD_CHECK_WAIT = 10.0  # seconds a reload waits for its new networks' upstreams to be checked


async def _another_chain(fresh: list[Parts], wait: float) -> str | None:
    """The first new network whose every upstream serves another chain than it declares (its identity
    checks' first round, waited for up to `wait` seconds): a reload that would leave it serving none
    (it answered "replaced", and the network was dead). None when each has one that may serve it."""
    for parts in fresh:
        guard, per = parts.guard, parts.runtime.per_upstream
        if guard is None or per is None:
            continue
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(guard.checked.wait(), wait)
        if per.states.size and all(per.states.mismatch):
            return parts.name
    return None
