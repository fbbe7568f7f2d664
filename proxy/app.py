"""create_app: composes the proxy from small builders, one per collaborator, and its lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy import hangup
from proxy.cache.admission import WINDOW, Admission
from proxy.cache.admission_sync import DeploymentSpend
from proxy.cache.tiers import Clock, MemoryTier, RedisTier, TieredCache
from proxy.chain.epochs import RedisEpochs
from proxy.chain.heads import WROTE, EvmHeadTracker
from proxy.config import Network, Settings
from proxy.credits.leases import LeasedLedger
from proxy.credits.ledger import Ledger, MemoryLedger
from proxy.credits.ledger_storage import check_ledger_storage
from proxy.gateway.gateway import Gateway
from proxy.held_bytes import HeldBytes
from proxy.http.admin import start_admin
from proxy.http.aiohttp_routes import (
    answering_app,
    fallback,
    guarded,
    healthz,
    host_rule,
    metrics_route,
    readyz,
    rpc_route,
)
from proxy.http.app_keys import FRONT, GATEWAY, LEDGER, METRICS, REDIS, SERVICE, SETTINGS, STREAMS, WEBSOCKETS, WS_HELD
from proxy.http.cors import Cors
from proxy.http.endpoint import RpcEndpoint
from proxy.http.front_routes import Exposition, FrontRoutes
from proxy.http.listeners import registry_exposition, start_metrics_listener, start_unix_metrics
from proxy.http.ws import close_websockets, recheck_websockets, websocket_handler
from proxy.memory_limit import cgroup_memory_limit
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.network_parts import PartsBuilder
from proxy.network_set import NetworkSet
from proxy.redis_link import RedisClient, RedisLink, connect
from proxy.reload import reload_keys
from proxy.service import Service
from proxy.streams.subscription import Streams
from proxy.tasks import stop_tasks
from proxy.upstream.key_budget import KeySlots
from proxy.upstream.pool import HttpUpstream, Upstream, routing_of
from proxy.workers.context import WorkerContext
from proxy.workers.credit_handover import WorkerLedger
from proxy.workers.host_bytes import HostBytes
from proxy.workers.metrics_merge import metrics_socket, scrape_all
from proxy.workers.replica_counts import ReplicaCounts
from proxy.workers.shared_polls import ShownRelay
from proxy.workers.shared_table import SharedTables, held_counts

log = logging.getLogger("proxy.reload")


class SystemClock:
    # The builtins themselves, not methods wrapping them: a keyed cache hit reads the clock.
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


def http_upstream(settings: Settings) -> Callable[[Network, Metrics], Upstream]:
    def build(network: Network, metrics: Metrics) -> Upstream:
        return HttpUpstream(
            network.name,
            network.upstreams,
            timeout=settings.upstream_timeout,
            metrics=metrics,
            batch_max=settings.upstream_batch_max,
            batch_max_bytes=settings.upstream_batch_max_bytes,
            attempt_timeout=settings.upstream_attempt_timeout,
            max_reply_bytes=settings.max_response_bytes,
            routing=routing_of(network),
        )

    return build


def _shown_relay(runtimes: dict[str, NetworkRuntime], worker: WorkerContext | None) -> ShownRelay | None:
    """With workers: blocks shown to a client by one worker, and writes it forwarded, are told to the
    others (read-your-writes); each network's tracker tells them through PartsBuilder.on_shown."""
    if worker is None:
        return None

    def shown_by_sibling(network: str, number: int) -> None:
        runtime = runtimes.get(network)  # the runtimes in force: a reload may have replaced it
        if runtime is not None and isinstance(runtime.tracker, EvmHeadTracker):
            if number == WROTE:
                runtime.tracker.wrote(relayed=True)
            else:
                runtime.tracker.hint(number, relayed=True)

    return ShownRelay(worker.run_dir, worker.index, shown_by_sibling)


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
    # Per-key limits counted in Redis: renewed, or synced, in the background.
    background: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)

    def held(self, run_dir: str | None, kind: str) -> ReplicaCounts:
        """Held counts of `kind` for the deployment: in Redis when the cache has it, else for the host."""
        counts = ReplicaCounts(self.link, kind, held_counts(run_dir, kind))
        if self.link is not None:
            self.background.append(counts.run)
        return counts


def _stores(
    settings: Settings,
    metrics: Metrics,
    clock: Clock,
    redis: RedisClient | None,
    ledger: Ledger | None,
    worker: WorkerContext | None,
) -> _Stores:
    client = (
        redis
        if redis is not None
        else (connect(settings.redis_url, settings.redis_timeout) if settings.redis_url else None)
    )
    link = RedisLink(client, timeout=settings.redis_timeout, metrics=metrics) if client is not None else None
    share = settings.cache_key_bytes_per_minute
    per_window = settings.cache_memory_bytes // 16 if share is None else share
    deployment = DeploymentSpend(link, per_window, WINDOW) if link is not None and per_window > 0 else None
    admission = Admission(
        per_window,
        clock.monotonic,
        shared=SharedTables(worker.run_dir, "admission") if worker is not None else None,
        deployment=deployment,
    )
    cache = TieredCache(
        MemoryTier(settings.cache_memory_bytes, clock), RedisTier(link, metrics) if link else None, metrics, admission
    )
    # The ledger has a Redis client and breaker of its own: its own URL if set, its own timeout.
    ledger_url = settings.credits_redis_url or (settings.redis_url if redis is None else None)
    ledger_client = connect(ledger_url, settings.credits_redis_timeout) if ledger_url else client
    ledger_link = (
        RedisLink(
            ledger_client,
            timeout=settings.credits_redis_timeout,
            metrics=metrics,
            name="credits redis",
            failures_to_open=settings.credits_redis_failures,
            report_up=False,
        )
        if ledger_client is not None and ledger is None
        else None
    )
    leased = (
        LeasedLedger(
            ledger_link,
            lease_max=settings.credits_lease_max,
            lease_seconds=settings.credits_lease_seconds,
            fail_open=settings.credits_fail_open,
            journal_dir=settings.credits_journal_dir,
            monotonic=clock.monotonic,
            processes=settings.workers,
        )
        if ledger_link is not None
        else None
    )
    if ledger is None:
        ledger = leased or MemoryLedger()
    owned = redis is None and settings.redis_url is not None
    stores = _Stores(cache, ledger, link, owned, ledger_link, bool(ledger_url), leased)
    if deployment is not None:
        stores.background.append(deployment.run)
    return stores


@dataclass(slots=True)
class _Lifecycle:
    """What runs beside the server (trackers, guards, feeds, leases, listeners) and its orderly stop."""

    settings: Settings
    clock: Clock
    worker: WorkerContext | None
    networks: NetworkSet
    shown_relay: ShownRelay | None
    stores: _Stores
    own_exposition: Exposition
    exposition: Exposition
    answering: Callable[[], web.Application]  # the internal listeners' application, answering as the public one
    probed: Callable[[], web.Application]  # METRICS_PORT's: that, with the probes

    async def run(self, app: web.Application) -> AsyncIterator[None]:
        settings, worker = self.settings, self.worker
        internal = own = None
        if worker is not None:  # before the public port: a scrape reaching any worker finds this one
            own = await start_unix_metrics(self.own_exposition, metrics_socket(worker.run_dir, str(worker.index)))
        if self.shown_relay is not None:
            await self.shown_relay.start()
        if settings.metrics_port is not None:
            internal = await start_metrics_listener(
                self.exposition,
                self.probed(),
                settings.metrics_host,
                settings.metrics_port,
                reuse_port=worker is not None,
            )
        admin = (
            await start_admin(
                self.networks.runtimes,
                self.networks.reload,
                settings,
                self.answering(),
                run_dir=worker.run_dir if worker else None,
                index=worker.index if worker else None,
            )
            if settings.admin_port is not None
            else []
        )
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
            if hangup.received():  # sent while the process started (hangup.py): the reload it asked for
                log.info("SIGHUP received while starting: the keys are read again now that the proxy serves")
                self._reload(app)
        yield
        if on_main:
            loop.remove_signal_handler(signal.SIGHUP)
            hangup.hold()  # not its default action (exit) while the process stops
        for runner in (internal, own, *admin):
            if runner is not None:
                await runner.cleanup()
        await stop_tasks(tasks)
        await self._close()

    def _reload(self, app: web.Application) -> None:
        # The gateway holds what changes (keys, lists, terms); app[SETTINGS] keeps the rest.
        self.settings = reload_keys(self.settings, app[GATEWAY])

    async def _start(self) -> list[asyncio.Task[None]]:
        """The networks' parts (serving once their first checks are done, bounded), then the leases'."""
        await self.networks.start()
        tasks = []
        if self.stores.leased is not None:
            tasks.append(asyncio.create_task(self.stores.leased.run(self.clock.time), name="credit-leases"))
        if self.stores.shared_ledger is not None:
            tasks.append(asyncio.create_task(self.stores.shared_ledger.run(self.clock.time), name="lease-handover"))
        for run in self.stores.background:
            tasks.append(asyncio.create_task(run(), name="per-key-limits"))
        return tasks

    async def _close(self) -> None:
        stores = self.stores
        await self.networks.close()
        if stores.leased is not None:  # unspent leases go back; journaled debits are written
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(1.0, 2 * self.settings.credits_redis_timeout)):
                    await stores.leased.close(self.clock.time())
        if stores.shared_ledger is not None:
            stores.shared_ledger.close()
        if stores.owned_link and stores.link is not None:
            await stores.link.close()
        if stores.ledger_link is not None and stores.owned_ledger_link:
            await stores.ledger_link.close()
        if self.shown_relay is not None:
            self.shown_relay.close()


def _probed(answering: Callable[[], web.Application], service: Service) -> web.Application:
    """METRICS_PORT's application: /healthz and /readyz answered as on the public port, but off its
    MAX_CONNECTIONS (a flood that fills the public port does not fail an orchestrator's probes)."""
    app = answering()
    app[SERVICE] = service
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def _add_routes(
    app: web.Application,
    settings: Settings,
    gateway: Gateway,
    metrics: Metrics,
    exposition: Exposition,
    worker: WorkerContext | None,
) -> None:
    cors = Cors(settings.cors_allow_origins)
    app.router.add_route("OPTIONS", "/{tail:.*}", cors.preflight)
    app.router.add_get("/healthz", cors.wrap(healthz))
    app.router.add_get("/readyz", cors.wrap(readyz))
    if settings.metrics_port is None:  # else /metrics is served by the internal listener only
        app.router.add_get("/metrics", cors.wrap(metrics_route(exposition)))
    # MAX_INFLIGHT_BODY_BYTES is the host's, whatever WORKERS is (every worker's bodies in one count).
    host = HostBytes(worker.run_dir, worker.index, settings.workers) if worker is not None else None
    endpoint = RpcEndpoint(gateway, metrics, settings, cors, host)
    app[FRONT] = FrontRoutes(endpoint, app[SERVICE], exposition if settings.metrics_port is None else None, settings)
    rpc_handler = rpc_route(endpoint, settings)  # adds CORS headers itself
    ws_handler = cors.wrap(guarded(websocket_handler))
    for prefix in ("", "/{network}"):
        app.router.add_post(prefix + "/v3/{api_key}", rpc_handler)
        app.router.add_get(prefix + "/ws/v3/{api_key}", ws_handler)
        for keyless in ("/v3", "/v3/"):  # the key in a header (request_key.py)
            app.router.add_post(prefix + keyless, rpc_handler)
            app.router.add_get(prefix + "/ws" + keyless, ws_handler)
    if settings.open_mode:  # the root as apps configured for a plain node's URL call it (front_routes.py)
        app.router.add_post("/", rpc_handler)
        app.router.add_get("/", ws_handler)
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
    metrics.memory_limit.set(cgroup_memory_limit() or 0)
    clock = clock or SystemClock()
    factory = upstream_factory or http_upstream(settings)
    stores = _stores(settings, metrics, clock, redis, ledger, worker)
    if stores.link is None:  # no Redis configured: no rpc_proxy_redis_up to say it is down
        metrics.registry.unregister(metrics.redis_up)
    if worker is not None and stores.leased is not None:
        stores.shared_ledger = WorkerLedger(worker.run_dir, worker.index, stores.leased, settings.credits_journal_dir)
    runtimes: dict[str, NetworkRuntime] = {}
    shown_relay = _shown_relay(runtimes, worker)
    run_dir = worker.run_dir if worker is not None else None
    # UPSTREAM_KEY_CONCURRENCY: the worker's own slots, and across workers and replicas when there are.
    shared_slots = stores.held(run_dir, "upstream-per-key") if run_dir or stores.link else None
    # The networks' epochs live beside the entries they name (in Redis, when the cache has it).
    builder = PartsBuilder(
        settings,
        factory,
        KeySlots(settings.upstream_key_concurrency, shared_slots),
        metrics,
        RedisEpochs(stores.link) if stores.link is not None else None,
        worker.run_dir if worker is not None else None,
        shown_relay.tell if shown_relay is not None else None,
    )
    networks = NetworkSet(builder, settings.networks, runtimes)
    service = Service(settings, networks.runtimes, stores.cache, metrics)
    gateway = Gateway(settings, service, stores.ledger, metrics, clock.time, run_dir=run_dir, link=stores.link)
    networks.on_reload.append(gateway.router.reload)

    app = answering_app(gateway, settings, host_rule, client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app[SERVICE] = service
    app[GATEWAY] = gateway
    app[LEDGER] = stores.ledger
    app[WEBSOCKETS] = set()
    app[WS_HELD] = stores.held(run_dir, "ws-per-key")
    gateway.reloaded.append(lambda: recheck_websockets(app[WEBSOCKETS]))
    app[STREAMS] = Streams(networks.feeds, networks.relays, HeldBytes(settings.ws_max_subscription_bytes))
    if stores.link is not None:
        app[REDIS] = stores.link

    own_exposition = registry_exposition(metrics.registry)
    exposition = own_exposition if worker is None else (lambda: scrape_all(worker.run_dir))
    answering = functools.partial(answering_app, gateway, settings)
    probed = functools.partial(_probed, answering, service)
    lifecycle = _Lifecycle(
        settings, clock, worker, networks, shown_relay, stores, own_exposition, exposition, answering, probed
    )
    app.cleanup_ctx.append(lifecycle.run)
    app.on_shutdown.append(close_websockets)
    _add_routes(app, settings, gateway, metrics, exposition, worker)
    return app
