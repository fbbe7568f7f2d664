"""The sockets the proxy listens on: the public one with its connection cap, the internal metrics
one, and an accept loop that stays quiet (and serving) when file descriptors run out."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import resource
import signal
import socket
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from proxy.config import Listener
from proxy.http.app_keys import FRONT
from proxy.http.front import Front
from proxy.http.front_routes import Exposition
from proxy.http.peer_counts import SETTLE_SECONDS, PeerCounts
from proxy.http.pipeline import KEEPALIVE_TIMEOUT
from proxy.http.ws import close_websockets
from proxy.logs import Throttled
from proxy.request_ids import IDS
from proxy.workers.metrics_merge import PROCESS_HEADER
from proxy.workers.shared_table import SharedCounts

log = logging.getLogger("proxy.listeners")
throttled = Throttled(log)

_BUSY_BODY = b'{"jsonrpc":"2.0","id":null,"error":{"code":-32603,"message":"server busy: too many open connections"}}'
BUSY_RESPONSE = (  # X-Request-Id: each refusal a new one (%s)
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nX-Credits-Charged: 0\r\n"
    b"X-Request-Id: %s\r\nConnection: close\r\nContent-Length: "
    + str(len(_BUSY_BODY)).encode()
    + b"\r\n\r\n"
    + _BUSY_BODY.replace(b"%", b"%%")
)
# Errors accept() meets when the process or the system is out of descriptors or buffers.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _Refused(asyncio.Protocol):
    """A connection over the cap: answered 503 at once and closed, holding nothing."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.WriteTransport, transport)  # uvloop's transports are no asyncio subclass
        writer.write(BUSY_RESPONSE % IDS.new().encode())
        writer.close()


class _Admission(asyncio.Protocol):
    """A connection's first protocol: once its peer address is known, either refused (over the
    per-address cap) or handed to aiohttp's handler, which takes over the transport."""

    def __init__(self, make: Callable[[], Any], peers: PeerCounts) -> None:
        self._make = make
        self._peers = peers

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        address = transport.get_extra_info("peername")  # (uvloop's transports are no asyncio.Transport)
        peer = str(address[0]) if isinstance(address, tuple) and address else ""
        if not self._peers.admits(peer):
            throttled.warning(
                "ip-cap", "refusing connections from one address: %d open (MAX_CONNECTIONS_PER_IP)", self._peers.cap
            )
            _Refused().connection_made(transport)
            return
        handler = self._make()
        self._peers.add(peer, handler)
        transport.set_protocol(handler)
        handler.connection_made(transport)


# Connections the kernel queues for accept (capped by net.core.somaxconn): aiohttp's default of 128
# overflowed under a burst of connections (an outside attack: 1,000 at once), and every client's next
# connection waited for SYN retransmits, 1, 3 and 7 s. uvicorn takes 2048, Go's net/http somaxconn.
# On uvloop (the default) alone: asyncio's accept loop also runs `backlog` accepts a turn, and out of
# descriptors each failed one scheduled a retry of its own (CPython 3.11), thousands of tracebacks.
BACKLOG = 4096


def backlog_for(loop: asyncio.AbstractEventLoop, default: int) -> int:
    return BACKLOG if type(loop).__module__.startswith("uvloop") else default


class CappedSite(web.TCPSite):
    """The public listener: the fast server (front.py) on each connection, which hands WebSocket
    upgrades to aiohttp's handler; a cap on open connections (MAX_CONNECTIONS) and per client
    address (MAX_CONNECTIONS_PER_IP).

    The count is the live connections of both plus those accepted but not yet started: asyncio
    accepts a burst in one batch and starts each connection a loop turn later. Stopping drains the
    fast connections (in-flight requests get `shutdown_timeout`, the runner's by default).
    """

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        max_connections: int,
        reuse_port: bool = False,
        per_ip: int = 0,
        shutdown_timeout: float | None = None,
        run_dir: str | None = None,
    ) -> None:
        super().__init__(runner, host, port, reuse_port=reuse_port)
        self._max_connections = max_connections
        # With workers, MAX_CONNECTIONS_PER_IP is the host's: each worker's count is in the run directory.
        self._peers = PeerCounts(per_ip, SharedCounts(run_dir, "connections-per-ip") if run_dir and per_ip else None)
        self._settling: asyncio.Task[None] | None = None
        self._shutdown_timeout = shutdown_timeout
        self._front: Front | None = None

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; TCPSite.start would bind without the cap
        server = self._runner.server
        assert server is not None
        front = self._front = Front(cast(web.AppRunner, self._runner).app[FRONT], server)
        fast = front.connections
        limit = self._max_connections
        loop = asyncio.get_running_loop()
        starting = [0]
        # Past half the descriptor limit each new connection checks that one more can be opened: out
        # of them, uvloop's accept loop drops new connections without a word (watch_descriptors).
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        crowded = soft_limit // 2 if soft_limit != resource.RLIM_INFINITY else 1 << 62

        def started() -> None:
            starting[0] -= 1

        def protocol() -> asyncio.BaseProtocol:
            open_now = len(server.connections) + len(fast) + starting[0]
            if open_now >= limit:
                throttled.warning("cap", "refusing connections: %d open (MAX_CONNECTIONS)", limit)
                return _Refused()
            if open_now >= crowded and not descriptors_left():
                warn_out_of_descriptors()
            # The transport calls connection_made (which counts the connection) in the loop turn
            # right after this one; until then it is counted here.
            starting[0] += 1
            loop.call_soon(started)
            return _Admission(front.protocol, self._peers) if self._peers.cap else front.protocol()

        self._server = await loop.create_server(
            protocol,
            self._host,
            self._port,
            backlog=backlog_for(loop, self._backlog),
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        if self._peers.shared is not None:
            self._settling = loop.create_task(self._settle())

    async def _settle(self) -> None:
        """The connections this worker closed leave the shared count within SETTLE_SECONDS."""
        while True:
            await asyncio.sleep(SETTLE_SECONDS)
            self._peers.settle()

    @property
    def front(self) -> Front | None:
        """The fast server's shared side, once started."""
        return self._front

    @property
    def open_connections(self) -> int:
        return len(self._front.connections) if self._front is not None else 0

    async def stop(self) -> None:
        if self._settling is not None:
            self._settling.cancel()
        await super().stop()  # no new connections
        if self._front is not None:
            timeout = self._shutdown_timeout
            if timeout is None:
                timeout = getattr(self._runner, "_shutdown_timeout", 60.0)
            # One drain within SHUTDOWN_TIMEOUT, the fast connections and the WebSockets together: the
            # runner's own on_shutdown (close_websockets again) then finds every socket drained.
            app = cast(web.AppRunner, self._runner).app
            await asyncio.gather(self._front.shutdown(timeout), close_websockets(app, timeout))


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio logs a traceback for every failed accept(); out of descriptors that is thousands a
    second. Those become one warning per interval (asyncio retries accept by itself, and
    established connections keep being served); anything else goes to the default handler."""
    exc = context.get("exception")
    if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
        throttled.warning("accept", "cannot accept connections: %s; established clients are still served", exc.strerror)
        return
    loop.default_exception_handler(context)


AFTER_DRAIN = 1.0  # seconds aiohttp's handlers (WebSockets, closed by the drain) get to end after it
DESCRIPTOR_CHECK_SECONDS = 1.0
DESCRIPTOR_MARGIN = 8  # descriptors below the soft limit that count as out of them (libuv keeps one in reserve)


def out_of_descriptors(open_now: int, soft_limit: int) -> bool:
    """Pure: whether a process holding `open_now` descriptors can no longer accept a connection."""
    return soft_limit != resource.RLIM_INFINITY and open_now >= soft_limit - DESCRIPTOR_MARGIN


def descriptors_left() -> bool:
    """Whether the process can still open a descriptor: one dup() made and closed (two system calls)."""
    try:
        os.close(os.dup(0))
    except OSError as exc:
        return exc.errno not in _RESOURCE_ERRNOS
    return True


def warn_out_of_descriptors() -> None:
    reason = os.strerror(errno.EMFILE)
    throttled.warning("accept", "cannot accept connections: %s; established clients are still served", reason)


async def watch_descriptors() -> None:
    """The accept-error warning for uvloop, whose accept loop never reaches quiet_accept_errors: out of
    descriptors libuv accepts and closes new connections itself (its EMFILE reserve), silently. So the
    process's own count is read once a second, and the same throttled warning logged when it is out."""
    try:
        os.listdir("/proc/self/fd")
    except OSError:
        return  # no /proc (not Linux): nothing to count with
    while True:
        await asyncio.sleep(DESCRIPTOR_CHECK_SECONDS)
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if out_of_descriptors(len(os.listdir("/proc/self/fd")), soft_limit):
            warn_out_of_descriptors()


def registry_exposition(registry: CollectorRegistry) -> Exposition:
    async def exposition() -> bytes:
        return generate_latest(registry)

    return exposition


def metrics_app(exposition: Exposition, app: web.Application, *, own: bool = False) -> web.Application:
    """`app` as the internal listener's application: /metrics and what `app` serves. `own`: a process's own
    registry for the sibling that merges a scrape, its pid said (what it counted outlives it)."""
    headers = {"Content-Type": CONTENT_TYPE_LATEST}
    if own:
        headers[PROCESS_HEADER] = str(os.getpid())

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=await exposition(), headers=headers)

    app.router.add_get("/metrics", metrics)
    return app


class CannotListen(Exception):
    """A listener could not bind: its message names the setting, the address and the reason."""


async def bind(site: web.BaseSite, listener: Listener) -> None:
    """Start a listener's site; a failed bind (a taken port, an address not here) is CannotListen
    naming that listener, not the public port."""
    try:
        await site.start()
    except OSError as exc:
        # uvloop's error has no strerror, only an errno and its own sentence: the system's words for both loops.
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        if isinstance(exc, socket.gaierror) or (exc.errno or 0) < 0:  # getaddrinfo's codes are negative
            reason = f"the host does not resolve to an address here ({exc.strerror or exc.errno})"
        raise CannotListen(f"cannot listen on {listener}: {reason}") from exc


async def start_metrics_listener(
    exposition: Exposition, app: web.Application, host: str, port: int, *, reuse_port: bool = False
) -> web.AppRunner:
    """METRICS_PORT, served by `app`: one that answers as the public port does (aiohttp_routes.answering_app)."""
    runner = web.AppRunner(metrics_app(exposition, app), access_log=None, auto_decompress=False)
    await runner.setup()
    await bind(web.TCPSite(runner, host, port, reuse_port=reuse_port), Listener("METRICS_PORT", host, port))
    return runner


async def start_unix_metrics(exposition: Exposition, path: str) -> web.AppRunner:
    """A worker's own registry, for the sibling that merges a scrape (WORKERS > 1)."""
    runner = web.AppRunner(metrics_app(exposition, web.Application(), own=True), access_log=None, auto_decompress=False)
    await runner.setup()
    await web.UnixSite(runner, path).start()
    return runner


async def serve(
    app: web.Application,
    host: str,
    port: int,
    *,
    max_connections: int,
    shutdown_timeout: float,
    on_listening: Callable[[], None],
    reuse_port: bool = False,
    per_ip: int = 0,
    run_dir: str | None = None,
) -> None:
    """Run `app` until SIGTERM or SIGINT, then drain it (in-flight requests get `shutdown_timeout`)."""
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(quiet_accept_errors)
    stop = asyncio.Event()
    received: list[signal.Signals] = []

    def stopping(sig: signal.Signals) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping, sig)
    # keepalive_timeout as web.run_app sets it: an idle connection, or one whose request headers
    # never complete, is closed after 75 s (aiohttp's own default is an hour).
    # auto_decompress off: a body is decoded by the proxy's own rules on either server (front_routes.py).
    # shutdown_timeout: what aiohttp's handlers get after the one drain (CappedSite.stop), which closed them.
    runner = web.AppRunner(
        app,
        access_log=None,
        shutdown_timeout=AFTER_DRAIN,
        keepalive_timeout=KEEPALIVE_TIMEOUT,
        auto_decompress=False,
    )
    await runner.setup()
    watcher: asyncio.Task[None] | None = None
    try:
        site = CappedSite(
            runner,
            host,
            port,
            max_connections=max_connections,
            reuse_port=reuse_port,
            per_ip=per_ip,
            shutdown_timeout=shutdown_timeout,
            run_dir=run_dir,
        )
        await bind(site, Listener("PROXY_PORT", host, port))
        # What was built until now (modules, tables, the app) lives as long as the process: frozen, the
        # collector's full passes no longer walk it (46 -> about 10 ms each; README "Benchmark"). The
        # startup's garbage is collected first, so none of it is kept forever.
        gc.collect()
        gc.freeze()
        on_listening()
        watcher = loop.create_task(watch_descriptors())
        await stop.wait()
        # An operator (or Kubernetes) sent the signal: say so, and say when the drain is over.
        open_connections = len(runner.server.connections) if runner.server is not None else 0
        open_connections += site.open_connections
        log.info(
            "%s received: shutting down; no new connections, %d open connection(s) get up to %gs "
            "(SHUTDOWN_TIMEOUT) to finish",
            received[0].name,
            open_connections,
            shutdown_timeout,
        )
    finally:
        if watcher is not None:
            watcher.cancel()
        started = loop.time()
        await runner.cleanup()
    if received:
        elapsed = loop.time() - started
        drained = "drained" if elapsed < shutdown_timeout else "SHUTDOWN_TIMEOUT reached, the rest cancelled"
        log.info("shut down in %.2fs: in-flight requests %s, WebSockets closed", elapsed, drained)
