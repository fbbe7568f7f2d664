"""create_app: composes the proxy from small builders, one per collaborator, and its lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.cache.admission import Admission
from proxy.cache.tiers import Clock, MemoryTier, RedisTier, TieredCache
from proxy.chain.epochs import EpochStore, RedisEpochs
from proxy.chain.head_feed import EvmFeed
from proxy.chain.heads import EvmHeadTracker
from proxy.chain.identity import IdentityGuard
from proxy.chain.slots import SolanaSlotTracker
from proxy.chain.upstream_heads import watch_upstream_heads
from proxy.config import Network, Settings
from proxy.credits.handover import WorkerLedger
from proxy.credits.leases import LeasedLedger
from proxy.credits.ledger import Ledger, MemoryLedger
from proxy.credits.ledger_storage import check_ledger_storage
from proxy.http.admin import start_admin
from proxy.http.cors import Cors
from proxy.http.endpoint import RpcEndpoint
from proxy.http.front_routes import Exposition, FrontRoutes
from proxy.http.gateway import Gateway
from proxy.http.listeners import registry_exposition, start_metrics_listener, start_unix_metrics
from proxy.http.routes import fallback, guarded, healthz, metrics_route, readyz, rpc_route
from proxy.http.subscriptions import Streams
from proxy.http.ws import close_websockets, websocket_handler
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.redis_link import RedisClient, RedisLink, connect
from proxy.reload import reload_keys
from proxy.service import Service
from proxy.state import FRONT, GATEWAY, LEDGER, METRICS, REDIS, SERVICE, SETTINGS, STREAMS, WEBSOCKETS
from proxy.upstream.key_budget import KeyedUpstream, KeySlots
from proxy.upstream.pool import HttpUpstream, PerUpstream, Upstream, routing_of
from proxy.upstream.ws import UpstreamSocket
from proxy.workers.context import WorkerContext
from proxy.workers.metrics_merge import metrics_socket, scrape_all
from proxy.workers.shared_polls import SharedPolls, ShownRelay

STARTUP_WAIT = 2.0  # seconds start-up waits for the trackers' first polls


STOP_BOUND = 10.0  # seconds the lifecycle's tasks get to end once cancelled


async def stop_tasks(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the tasks and wait until they end. A task can take a cancellation for a timeout of its
    own (a Redis command's, in redis-py or a nested asyncio.timeout) and carry on: it is cancelled
    again until it ends, so no shutdown waits forever; past STOP_BOUND it is left behind, named."""
    pending = set(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STOP_BOUND
    while pending and loop.time() < deadline:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=0.25)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: a task that failed on its way out is not "never retrieved"
    if pending:
        logging.getLogger("proxy.app").warning("stopping: %s did not end when cancelled; left behind",
                                               ", ".join(sorted(t.get_name() for t in pending)))


class SystemClock:
    # The builtins themselves, not methods wrapping them: a keyed cache hit reads the clock.
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


def _http_upstream(settings: Settings) -> Callable[[Network, Metrics], Upstream]:
    def build(network: Network, metrics: Metrics) -> Upstream:
        return HttpUpstream(network.name, network.upstreams, timeout=settings.upstream_timeout, metrics=metrics,
                            batch_max=settings.upstream_batch_max,
                            batch_max_bytes=settings.upstream_batch_max_bytes,
                            attempt_timeout=settings.upstream_attempt_timeout,
                            max_reply_bytes=settings.max_response_bytes,
                            routing=routing_of(network, settings.workers))

    return build


def _streams(
    settings: Settings, runtimes: dict[str, NetworkRuntime],
) -> tuple[dict[str, EvmFeed], dict[str, UpstreamSocket]]:
    """One head feed per EVM network, fed by its tracker; one upstream WebSocket per network that has one."""
    relays = {n.name: UpstreamSocket(n.name, n.ws_upstreams, timeout=settings.upstream_timeout)
              for n in settings.networks if n.ws_upstreams}
    feeds: dict[str, EvmFeed] = {}
    for name, runtime in runtimes.items():
        tracker = runtime.tracker
        if isinstance(tracker, EvmHeadTracker):
            feed = EvmFeed(name, runtime.upstream, tracker, push=relays.get(name))
            tracker.on_head.append(feed.on_head)
            tracker.on_reorg.append(feed.on_reorg)
            feeds[name] = feed
    return feeds, relays


def _networks(
    settings: Settings, pool: dict[str, Upstream], metrics: Metrics, shared: dict[str, SharedPolls],
    epochs: EpochStore | None = None,
) -> tuple[dict[str, NetworkRuntime], list[IdentityGuard]]:
    """Each network's runtime (its upstream and head tracker), and the identity guards of EVM networks."""
    runtimes: dict[str, NetworkRuntime] = {}
    guards: list[IdentityGuard] = []
    for net in settings.networks:
        tracker: EvmHeadTracker | SolanaSlotTracker
        upstream = pool[net.name]
        # EVM upstreams are watched one by one (head, chain identity); Solana answers carry their slot.
        per_upstream = upstream if isinstance(upstream, PerUpstream) and net.family == "evm" else None
        if net.family == "evm":
            tracker = EvmHeadTracker(
                net.name, upstream, interval=settings.head_poll_interval,
                finality_depth=net.finality_depth or settings.finality_depth, metrics=metrics,
                stale_after=settings.head_stale_bound, states=per_upstream.states if per_upstream else None,
                shared=shared.get(net.name), epochs=epochs,
            )
            if per_upstream is not None:  # without it, no identity: nothing of the network is cached
                guards.append(IdentityGuard(
                    net.name, per_upstream, declared_chain_id=net.chain_id,
                    interval=settings.identity_check_interval, retry=settings.head_poll_interval, metrics=metrics,
                    on_identity=tracker.set_identity, on_adopt=tracker.adopt, checkpoint=tracker.checkpoint,
                ))
        else:
            tracker = SolanaSlotTracker(net.name, pool[net.name], interval=settings.head_poll_interval,
                                        metrics=metrics, stale_after=settings.head_stale_bound,
                                        shared=shared.get(net.name))
        runtimes[net.name] = NetworkRuntime(net, upstream, tracker, per_upstream)
    return runtimes, guards


def _shown_relay(runtimes: dict[str, NetworkRuntime], worker: WorkerContext | None) -> ShownRelay | None:
    """With workers: blocks shown to a client by one worker are told to the others (read-your-writes)."""
    if worker is None:
        return None

    def shown_by_sibling(network: str, number: int) -> None:
        runtime = runtimes.get(network)
        if runtime is not None and isinstance(runtime.tracker, EvmHeadTracker):
            runtime.tracker.hint(number, relayed=True)

    shown_relay = ShownRelay(worker.run_dir, worker.index, shown_by_sibling)
    for name, runtime in runtimes.items():
        if isinstance(runtime.tracker, EvmHeadTracker):
            runtime.tracker.on_shown.append(functools.partial(shown_relay.tell, name))
    return shown_relay


@dataclass(slots=True)
class _Stores:
    """The cache tiers and the credit ledger, with the Redis links they were built on."""

    cache: TieredCache
    ledger: Ledger
    link: RedisLink | None  # the shared cache tier's
    owned_link: bool  # opened here (not injected), so closed here
    ledger_link: RedisLink | None
    owned_ledger_link: bool
    leased: LeasedLedger | None
    shared_ledger: WorkerLedger | None = None  # with workers: refusals told to siblings, leases handed over


def _stores(
    settings: Settings, metrics: Metrics, clock: Clock, redis: RedisClient | None, ledger: Ledger | None,
) -> _Stores:
    client = redis if redis is not None else (
        connect(settings.redis_url, settings.redis_timeout) if settings.redis_url else None
    )
    link = RedisLink(client, timeout=settings.redis_timeout, metrics=metrics) if client is not None else None
    share = settings.cache_key_bytes_per_minute
    admission = Admission(settings.cache_memory_bytes // 16 if share is None else share, clock.monotonic)
    cache = TieredCache(MemoryTier(settings.cache_memory_bytes, clock), RedisTier(link) if link else None, metrics,
                        admission)
    # The ledger has a Redis client and breaker of its own: its own URL if set, its own timeout.
    ledger_url = settings.credits_redis_url or (settings.redis_url if redis is None else None)
    ledger_client = connect(ledger_url, settings.credits_redis_timeout) if ledger_url else client
    ledger_link = RedisLink(
        ledger_client, timeout=settings.credits_redis_timeout, metrics=metrics, name="credits redis",
        failures_to_open=settings.credits_redis_failures, report_up=False,
    ) if ledger_client is not None and ledger is None else None
    leased = LeasedLedger(
        ledger_link, lease_max=settings.credits_lease_max, lease_seconds=settings.credits_lease_seconds,
        fail_open=settings.credits_fail_open, journal_dir=settings.credits_journal_dir, monotonic=clock.monotonic,
        processes=settings.workers,
    ) if ledger_link is not None else None
    if ledger is None:
        ledger = leased or MemoryLedger()
    owned = redis is None and settings.redis_url is not None
    return _Stores(cache, ledger, link, owned, ledger_link, bool(ledger_url), leased)


@dataclass(slots=True)
class _Lifecycle:
    """What runs beside the server (trackers, guards, feeds, leases, listeners) and its orderly stop."""

    settings: Settings
    clock: Clock
    worker: WorkerContext | None
    pool: dict[str, Upstream]
    runtimes: dict[str, NetworkRuntime]
    guards: list[IdentityGuard]
    shared: dict[str, SharedPolls]
    shown_relay: ShownRelay | None
    stores: _Stores
    feeds: dict[str, EvmFeed]
    relays: dict[str, UpstreamSocket]
    own_exposition: Exposition
    exposition: Exposition

    async def run(self, app: web.Application) -> AsyncIterator[None]:
        settings, worker = self.settings, self.worker
        internal = own = None
        if worker is not None:  # before the public port: a scrape reaching any worker finds this one
            own = await start_unix_metrics(self.own_exposition, metrics_socket(worker.run_dir, str(worker.index)))
        if self.shown_relay is not None:
            await self.shown_relay.start()
        if settings.metrics_port is not None:
            internal = await start_metrics_listener(self.exposition, settings.metrics_host, settings.metrics_port,
                                                    reuse_port=worker is not None)
        admin = await start_admin(self.runtimes, settings, run_dir=worker.run_dir if worker else None,
                                  index=worker.index if worker else None) if settings.admin_port is not None else []
        if self.stores.ledger_link is not None and not settings.open_mode:
            await check_ledger_storage(self.stores.ledger_link, settings.credits_require_noeviction)
        if self.stores.shared_ledger is not None:
            await self.stores.shared_ledger.start()
        tasks = await self._start()
        loop = asyncio.get_running_loop()
        # Signals reach only the main thread: an app run in another (embedded, or a test's server
        # thread) is reloaded by its owner, not by SIGHUP.
        on_main = threading.current_thread() is threading.main_thread()
        if on_main:
            loop.add_signal_handler(signal.SIGHUP, self._reload, app)
        yield
        if on_main:
            loop.remove_signal_handler(signal.SIGHUP)
        for runner in (internal, own, *admin):
            if runner is not None:
                await runner.cleanup()
        await stop_tasks(tasks)
        await self._close()

    def _reload(self, app: web.Application) -> None:
        # The gateway holds what changes (keys, lists, terms); app[SETTINGS] keeps the rest.
        self.settings = reload_keys(self.settings, app[GATEWAY])

    async def _start(self) -> list[asyncio.Task[None]]:
        settings, runtimes, guards = self.settings, self.runtimes, self.guards
        tasks = [asyncio.create_task(g.run(), name=f"identity-{g.network}") for g in guards]
        tasks += [asyncio.create_task(watch_upstream_heads(r.per_upstream, settings.head_poll_interval,
                                                           self.shared.get(n)),
                                      name=f"upstream-heads-{n}")
                  for n, r in runtimes.items() if r.per_upstream is not None]
        tasks += [asyncio.create_task(r.tracker.run(), name=f"tracker-{n}") for n, r in runtimes.items()]
        if self.stores.leased is not None:
            tasks.append(asyncio.create_task(self.stores.leased.run(self.clock.time), name="credit-leases"))
        if self.stores.shared_ledger is not None:
            tasks.append(asyncio.create_task(self.stores.shared_ledger.run(self.clock.time), name="lease-handover"))
        # Serve once every upstream's identity was asked and every tracker has tried its first poll
        # (bounded): a fresh start is neither "stale" nor without an identity.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STARTUP_WAIT):
                await asyncio.gather(*(g.checked.wait() for g in guards),
                                     *(r.tracker.attempted.wait() for r in runtimes.values()))
                # ... and once the identity is known, its epoch read (nothing is cached before).
                await asyncio.gather(*(r.tracker.keyed.wait() for r in runtimes.values()
                                       if isinstance(r.tracker, EvmHeadTracker) and r.tracker.identity is not None))
        tasks += [asyncio.create_task(f.run(), name=f"feed-{n}") for n, f in self.feeds.items()]
        return tasks

    async def _close(self) -> None:
        stores = self.stores
        await asyncio.gather(*(r.close() for r in self.relays.values()))
        if stores.leased is not None:  # unspent leases go back; journaled debits are written
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(1.0, 2 * self.settings.credits_redis_timeout)):
                    await stores.leased.close(self.clock.time())
        if stores.shared_ledger is not None:
            stores.shared_ledger.close()
        await asyncio.gather(*(u.close() for u in self.pool.values()))
        if stores.owned_link and stores.link is not None:
            await stores.link.close()
        if stores.ledger_link is not None and stores.owned_ledger_link:
            await stores.ledger_link.close()
        for polls in self.shared.values():
            polls.close()
        if self.shown_relay is not None:
            self.shown_relay.close()


def _add_routes(app: web.Application, settings: Settings, gateway: Gateway, metrics: Metrics,
                exposition: Exposition) -> None:
    cors = Cors(settings.cors_allow_origins)
    app.router.add_route("OPTIONS", "/{tail:.*}", cors.preflight)
    app.router.add_get("/healthz", cors.wrap(healthz))
    app.router.add_get("/readyz", cors.wrap(readyz))
    if settings.metrics_port is None:  # else /metrics is served by the internal listener only
        app.router.add_get("/metrics", cors.wrap(metrics_route(exposition)))
    endpoint = RpcEndpoint(gateway, metrics, settings, cors)
    app[FRONT] = FrontRoutes(endpoint, app[SERVICE], exposition if settings.metrics_port is None else None,
                             settings)
    rpc_handler = rpc_route(endpoint, settings)  # adds CORS headers itself
    ws_handler = cors.wrap(guarded(websocket_handler))
    for prefix in ("", "/{network}"):
        app.router.add_post(prefix + "/v3/{api_key}", rpc_handler)
        app.router.add_get(prefix + "/ws/v3/{api_key}", ws_handler)
        for keyless in ("/v3", "/v3/"):  # the key in a header (request_key.py)
            app.router.add_post(prefix + keyless, rpc_handler)
            app.router.add_get(prefix + "/ws" + keyless, ws_handler)
    app.router.add_route("*", "/{tail:.*}", cors.wrap(fallback))


def create_app(
    settings: Settings,
    *,
    upstream_factory: Callable[[Network, Metrics], Upstream] | None = None,
    redis: RedisClient | None = None,
    registry: CollectorRegistry | None = None,
    clock: Clock | None = None,
    ledger: Ledger | None = None,
    worker: WorkerContext | None = None,
) -> web.Application:
    """The proxy as an aiohttp application; every collaborator can be injected. `worker`: this is one
    of WORKERS processes (head polls shared with its siblings, /metrics merged across them)."""
    metrics = Metrics(registry if registry is not None else CollectorRegistry())
    clock = clock or SystemClock()
    factory = upstream_factory or _http_upstream(settings)
    slots = KeySlots(settings.upstream_key_concurrency)
    pool: dict[str, Upstream] = {n.name: KeyedUpstream(factory(n, metrics), slots) for n in settings.networks}
    shared = {n.name: SharedPolls(worker.run_dir, n.name, settings.head_poll_interval)
              for n in settings.networks} if worker is not None else {}
    stores = _stores(settings, metrics, clock, redis, ledger)
    if stores.link is None:  # no Redis configured: no rpc_proxy_redis_up to say it is down
        metrics.registry.unregister(metrics.redis_up)
    if worker is not None and stores.leased is not None:
        stores.shared_ledger = WorkerLedger(worker.run_dir, worker.index, stores.leased, settings.credits_journal_dir)
    # The networks' epochs live beside the entries they name (in Redis, when the cache has it).
    runtimes, guards = _networks(settings, pool, metrics, shared,
                                 RedisEpochs(stores.link) if stores.link is not None else None)
    shown_relay = _shown_relay(runtimes, worker)
    service = Service(settings, runtimes, stores.cache, metrics)
    gateway = Gateway(settings, service, stores.ledger, metrics, clock.time)
    feeds, relays = _streams(settings, runtimes)

    app = web.Application(client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app[SERVICE] = service
    app[GATEWAY] = gateway
    app[LEDGER] = stores.ledger
    app[WEBSOCKETS] = set()
    app[STREAMS] = Streams(feeds, relays)
    if stores.link is not None:
        app[REDIS] = stores.link

    own_exposition = registry_exposition(metrics.registry)
    exposition = own_exposition if worker is None else (lambda: scrape_all(worker.run_dir))
    lifecycle = _Lifecycle(settings, clock, worker, pool, runtimes, guards, shared, shown_relay, stores, feeds,
                           relays, own_exposition, exposition)
    app.cleanup_ctx.append(lifecycle.run)
    app.on_shutdown.append(close_websockets)
    _add_routes(app, settings, gateway, metrics, exposition)
    return app
