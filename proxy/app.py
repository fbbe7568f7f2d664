"""create_app: routes, collaborators and lifecycles."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from proxy.cache.tiers import Clock, MemoryTier, RedisTier, TieredCache
from proxy.chain.head_feed import EvmFeed
from proxy.chain.heads import EvmHeadTracker, SolanaSlotTracker, watch_upstream_heads
from proxy.chain.identity import IdentityGuard
from proxy.config import Network, Settings
from proxy.credits.leases import LeasedLedger
from proxy.credits.ledger import Ledger, MemoryLedger
from proxy.http.gateway import Gateway, Reply, invalid_key_error
from proxy.http.listeners import Exposition, registry_exposition, start_metrics_listener, start_unix_metrics
from proxy.http.responses import JSON_CONTENT_TYPE, NO_CHARGE, error_response, json_response
from proxy.http.subscriptions import Streams
from proxy.http.ws import close_websockets, websocket_handler
from proxy.logs import redacted
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.redis_link import RedisClient, RedisLink, RedisUnavailable, config_values, connect
from proxy.rpc.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, JsonRpcError
from proxy.service import Service
from proxy.state import GATEWAY, LEDGER, METRICS, REDIS, SERVICE, SETTINGS, STREAMS, WEBSOCKETS
from proxy.upstream.pool import HttpUpstream, PerUpstream, Upstream
from proxy.upstream.ws import UpstreamSocket
from proxy.workers.context import WorkerContext
from proxy.workers.metrics_merge import metrics_socket, scrape_all
from proxy.workers.shared_polls import SharedPolls, ShownRelay

log = logging.getLogger("proxy.app")


class BodyBudget:
    """Bytes that request bodies being received may hold, all clients together."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        if self.held and self.held + size > self.limit:  # one body of any allowed size always fits
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


class SystemClock:
    # The builtins themselves, not methods wrapping them: a keyed cache hit reads the clock.
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
STARTUP_WAIT = 2.0  # seconds start-up waits for the trackers' first polls
RPC_PATH = re.compile(r"^(/[^/]+)?(/ws)?/v3(/[^/]*)?$")

_HTTP_ERRORS = {
    404: "not found: send JSON-RPC to POST /v3/<API_KEY> or WebSocket /ws/v3/<API_KEY>",
    405: "method not allowed: send JSON-RPC with POST",
    413: "request body too large",
}


def guarded(handler: Handler) -> Handler:
    """Every failure leaves as a JSON-RPC error body, never a traceback.

    A wrapper on the two JSON-RPC routes rather than a middleware: middlewares cost every
    request a little, and the hot path is a cache hit that takes microseconds.
    """

    async def run(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ConnectionResetError:
            raise
        except Exception as exc:
            return failure_response(request, exc)

    return run


def failure_response(request: web.Request, exc: Exception) -> web.Response:
    """A JsonRpcError as its own response; anything else as -32603, with the details in the log only."""
    if isinstance(exc, JsonRpcError):
        return error_response(exc, NO_CHARGE)
    log.exception("internal error serving %s", redacted(request.path))
    return error_response(JsonRpcError(INTERNAL_ERROR, "internal error", http_status=500), NO_CHARGE)


async def fallback(request: web.Request) -> web.StreamResponse:
    """Any other path or HTTP method: a JSON-RPC error, not aiohttp's text page."""
    rpc_path = RPC_PATH.match(request.path) is not None
    status = 405 if rpc_path else 404
    return error_response(JsonRpcError(INVALID_REQUEST, _HTTP_ERRORS[status], http_status=status), NO_CHARGE)


def rpc_route(gateway: Gateway, metrics: Metrics, settings: Settings) -> Handler:
    """The JSON-RPC POST handler, bound to its collaborators (no app lookups per request)."""
    inflight = metrics.inflight
    open_hit_headers = {**gateway.open_hit_headers, "Content-Type": JSON_CONTENT_TYPE}
    max_body_bytes = settings.max_body_bytes
    receiving = BodyBudget(settings.max_inflight_body_bytes)

    def too_large() -> web.Response:
        error = JsonRpcError(INVALID_REQUEST, f"request body too large: the limit is {max_body_bytes} bytes",
                             http_status=413)
        return error_response(error, NO_CHARGE)

    def closing(code: int, message: str, status: int, headers: dict[str, str] | None = None) -> web.Response:
        """An answer after which the connection is closed: the rest of its body is never read."""
        response = error_response(JsonRpcError(code, message, http_status=status, headers=headers), NO_CHARGE)
        response.force_close()
        return response

    async def read_body(request: web.Request) -> bytes | web.Response:
        """The body of a request whose body is still arriving: within BODY_TIMEOUT, and within the bytes
        all bodies being received may hold together (MAX_INFLIGHT_BODY_BYTES)."""
        declared = request.content_length
        if declared is not None and declared > max_body_bytes:
            return too_large()  # refused before a byte of it is buffered
        held = declared if declared is not None else max_body_bytes
        if not receiving.take(held):
            return closing(INTERNAL_ERROR, "server busy: too many request bodies being received", 503,
                           {"Retry-After": "1"})
        try:
            async with asyncio.timeout(settings.body_timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            return too_large()
        except TimeoutError:
            return closing(INVALID_REQUEST, f"request body not received within {settings.body_timeout:g}s", 408)
        except ConnectionResetError:
            # A client that goes away mid-body is routine on the internet: no traceback, no error line.
            log.debug("client closed the connection before its request body arrived")
            return closing(INVALID_REQUEST, "request body incomplete", 400)
        finally:
            receiving.give(held)

    async def awaited(
        request: web.Request, body: bytes | None, account: str, network: NetworkRuntime | None, memory_checked: bool,
    ) -> web.StreamResponse:
        """Everything that awaits: counted in flight while it runs."""
        inflight.inc()
        try:
            if body is None:
                read = await read_body(request)
                if isinstance(read, web.Response):
                    return read
                body = read
            return json_response(await gateway.handle(body, account, network, memory_checked=memory_checked))
        finally:
            inflight.dec()

    async def rpc_handler(request: web.Request) -> web.StreamResponse:
        # guarded() written out: one coroutine fewer on the path every cache hit takes.
        try:
            match = request.match_info
            account = gateway.account(match.get("api_key", ""))
            if account is None:
                return error_response(invalid_key_error(), {"X-Credits-Charged": "0", "X-Credits-Remaining": "0"})
            network = gateway.network_for(request.host, match.get("network"))
            content = request.content
            if not content.is_eof():  # the body is still arriving
                return await awaited(request, None, account, network, False)
            body = content.read_nowait()  # the whole body is here (the usual case): no await
            if len(body) > max_body_bytes:
                return too_large()
            # A cache hit is answered right here when nothing needs awaiting: always in open mode,
            # and with API keys when the key's credit lease covers it. It never yields to the loop,
            # so no scrape could ever see it in flight, and the in-flight gauge is left alone.
            if gateway.open_mode:
                encoded = gateway.open_hit(body, network)
                if encoded is not None:
                    return web.Response(body=encoded, headers=open_hit_headers)  # copied, never changed
                return await awaited(request, body, account, network, True)
            hit = gateway.keyed_hit(body, account, network)
            if hit.__class__ is tuple:  # a paid hit: its body and headers
                encoded, headers = hit
                headers["Content-Type"] = JSON_CONTENT_TYPE
                return web.Response(body=encoded, headers=headers)
            if isinstance(hit, Reply):
                return json_response(hit)
            return await awaited(request, body, account, network, hit is True)
        except ConnectionResetError:
            raise
        except Exception as exc:
            return failure_response(request, exc)

    return rpc_handler


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready when every network's tracker has a fresh view. Answered from the trackers' state: no
    upstream call per request, and no upstream's text or URL in the answer (upstreams by index only)."""
    service = request.app[SERVICE]
    now = time.time()
    networks = {name: runtime.health(now) or "ok" for name, runtime in service.networks.items()}
    ready = all(state == "ok" for state in networks.values())
    return web.json_response({"status": "ready" if ready else "unavailable", "networks": networks},
                             status=200 if ready else 503)


def metrics_route(exposition: Exposition) -> Handler:
    async def metrics_handler(request: web.Request) -> web.Response:
        response = web.Response(body=await exposition())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    return metrics_handler


def _http_upstream(settings: Settings) -> Callable[[Network, Metrics], Upstream]:
    def build(network: Network, metrics: Metrics) -> Upstream:
        return HttpUpstream(network.name, network.upstreams, timeout=settings.upstream_timeout, metrics=metrics,
                            batch_max=settings.upstream_batch_max,
                            batch_max_bytes=settings.upstream_batch_max_bytes,
                            attempt_timeout=settings.upstream_attempt_timeout)

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
            feeds[name] = feed
    return feeds, relays


class LedgerStorageError(Exception):
    """The ledger's Redis may evict keys and CREDITS_REQUIRE_NOEVICTION is set."""


async def check_ledger_storage(link: RedisLink, require_noeviction: bool) -> None:
    """Warn (or refuse) when the ledger's Redis may evict ledger entries: evicting one gives a key
    its credits back. Every policy but noeviction evicts our keys (they carry a TTL)."""
    try:  # on a cluster, every primary: any of them may hold a key's ledger
        policies = await link.run("credits_config", lambda c: config_values(c, "maxmemory-policy"))
        policy = next((p for p in policies if p != "noeviction"), "noeviction")
    except RedisUnavailable:
        policy = "unknown (CONFIG GET failed)"
    if policy == "noeviction":
        return
    problem = (f"the credit ledger's Redis has maxmemory-policy {policy}: ledger entries may be evicted, "
               "giving keys their credits back; point CREDITS_REDIS_URL at a Redis with noeviction")
    if require_noeviction:
        raise LedgerStorageError(problem + " (CREDITS_REQUIRE_NOEVICTION is set)")
    logging.getLogger("proxy.credits").warning("credits: %s", problem)


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
    pool = {n.name: factory(n, metrics) for n in settings.networks}
    runtimes: dict[str, NetworkRuntime] = {}
    guards: list[IdentityGuard] = []
    shared = {n.name: SharedPolls(worker.run_dir, n.name, settings.head_poll_interval)
              for n in settings.networks} if worker is not None else {}
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
                shared=shared.get(net.name),
            )
            if per_upstream is not None:  # without it, no identity: nothing of the network is cached
                guards.append(IdentityGuard(
                    net.name, per_upstream, declared_chain_id=net.chain_id,
                    interval=settings.identity_check_interval, retry=settings.head_poll_interval, metrics=metrics,
                    on_identity=tracker.set_identity,
                ))
        else:
            tracker = SolanaSlotTracker(net.name, pool[net.name], interval=settings.head_poll_interval,
                                        metrics=metrics, stale_after=settings.head_stale_bound,
                                        shared=shared.get(net.name))
        runtimes[net.name] = NetworkRuntime(net, upstream, tracker, per_upstream)

    def shown_by_sibling(network: str, number: int) -> None:
        runtime = runtimes.get(network)
        if runtime is not None and isinstance(runtime.tracker, EvmHeadTracker):
            runtime.tracker.hint(number, relayed=True)

    shown_relay = ShownRelay(worker.run_dir, worker.index, shown_by_sibling) if worker is not None else None
    if shown_relay is not None:
        for name, runtime in runtimes.items():
            if isinstance(runtime.tracker, EvmHeadTracker):
                runtime.tracker.on_shown.append(functools.partial(shown_relay.tell, name))

    owned_redis = redis is None and settings.redis_url is not None
    client = redis if redis is not None else (
        connect(settings.redis_url, settings.redis_timeout) if settings.redis_url else None
    )
    link = RedisLink(client, timeout=settings.redis_timeout, metrics=metrics) if client is not None else None
    cache = TieredCache(MemoryTier(settings.cache_memory_bytes, clock), RedisTier(link) if link else None, metrics)
    service = Service(settings, runtimes, cache, metrics)
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
    ) if ledger_link is not None else None
    if ledger is None:
        ledger = leased or MemoryLedger()
    gateway = Gateway(settings, service, ledger, metrics, clock.time)

    feeds, relays = _streams(settings, runtimes)

    app = web.Application(client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app[SERVICE] = service
    app[GATEWAY] = gateway
    app[LEDGER] = ledger
    app[WEBSOCKETS] = set()
    app[STREAMS] = Streams(feeds, relays)
    if link is not None:
        app[REDIS] = link

    own_exposition = registry_exposition(metrics.registry)
    exposition = own_exposition if worker is None else (lambda: scrape_all(worker.run_dir))

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        internal = own = None
        if worker is not None:  # before the public port: a scrape reaching any worker finds this one
            own = await start_unix_metrics(own_exposition, metrics_socket(worker.run_dir, str(worker.index)))
        if shown_relay is not None:
            await shown_relay.start()
        if settings.metrics_port is not None:
            internal = await start_metrics_listener(exposition, settings.metrics_host, settings.metrics_port,
                                                    reuse_port=worker is not None)
        if ledger_link is not None and not settings.open_mode:
            await check_ledger_storage(ledger_link, settings.credits_require_noeviction)
        tasks = [asyncio.create_task(g.run(), name=f"identity-{g.network}") for g in guards]
        tasks += [asyncio.create_task(watch_upstream_heads(r.per_upstream, settings.head_poll_interval,
                                                           shared.get(n)),
                                      name=f"upstream-heads-{n}")
                  for n, r in runtimes.items() if r.per_upstream is not None]
        tasks += [asyncio.create_task(r.tracker.run(), name=f"tracker-{n}") for n, r in runtimes.items()]
        if leased is not None:
            tasks.append(asyncio.create_task(leased.run(clock.time), name="credit-leases"))
        # Serve once every upstream's identity was asked and every tracker has tried its first poll
        # (bounded): a fresh start is neither "stale" nor without an identity.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STARTUP_WAIT):
                await asyncio.gather(*(g.checked.wait() for g in guards),
                                     *(r.tracker.attempted.wait() for r in runtimes.values()))
        tasks += [asyncio.create_task(f.run(), name=f"feed-{n}") for n, f in feeds.items()]
        yield
        if internal is not None:
            await internal.cleanup()
        if own is not None:
            await own.cleanup()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(r.close() for r in relays.values()))
        if leased is not None:  # unspent leases go back; journaled debits are written
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(1.0, 2 * settings.credits_redis_timeout)):
                    await leased.close(clock.time())
        await asyncio.gather(*(u.close() for u in pool.values()))
        if owned_redis and link is not None:
            await link.close()
        if ledger_link is not None and ledger_url:
            await ledger_link.close()
        for polls in shared.values():
            polls.close()
        if shown_relay is not None:
            shown_relay.close()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(close_websockets)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if settings.metrics_port is None:  # else /metrics is served by the internal listener only
        app.router.add_get("/metrics", metrics_route(exposition))
    rpc_handler = rpc_route(gateway, metrics, settings)
    for prefix in ("", "/{network}"):
        app.router.add_post(prefix + "/v3/{api_key}", rpc_handler)
        app.router.add_get(prefix + "/ws/v3/{api_key}", guarded(websocket_handler))
    app.router.add_post("/v3", rpc_handler)
    app.router.add_post("/v3/", rpc_handler)
    app.router.add_route("*", "/{tail:.*}", fallback)
    return app
