"""Real parts for tests: an Anvil node, a private redis-server, a counting upstream, a proxy on a port."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from proxy.app import create_app, http_upstream
from proxy.config import Network, Settings, build_settings
from proxy.http.app_keys import SERVICE, SETTINGS
from proxy.http.listeners import CappedSite
from proxy.metrics import Metrics
from proxy.upstream.pool import HttpUpstream
from proxy.values import Answer

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = Path(__file__).resolve().parent / "contracts"
DEV_ACCOUNT = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266"  # anvil's first funded, unlocked account


def healthy(port: int) -> bool:
    """The proxy on this port answers /healthz."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


# Listening ports are taken below the kernel's ephemeral range (32768 up), where outgoing connections
# never take them, and under pytest-xdist each worker from its own slice: two workers never pick the
# same port before one of them has bound it (bind(0) hands out odd ports only, so a parity split starves one).
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_SLICE = (32000 - 20000) // _WORKERS
_PORTS = random.Random(os.getpid())


def free_port() -> int:
    low = 20000 + _WORKER * _SLICE
    while True:
        port = _PORTS.randrange(low, low + _SLICE)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken
            return port


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll an async predicate with a deadline (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def selector(signature: str) -> str:
    from eth_utils import keccak

    return "0x" + keccak(text=signature)[:4].hex()


def word(value: int | str) -> str:
    if isinstance(value, str):
        value = int(value, 16)
    return format(value, "064x")


def mapping_slot(key_address: str, slot: int) -> str:
    """spec: keccak-256(key left-padded to 32 bytes ++ slot left-padded to 32 bytes)."""
    from eth_utils import keccak

    return "0x" + keccak(bytes.fromhex(word(key_address) + word(slot))).hex()


# --- Anvil ---------------------------------------------------------------------------------


def anvil_binary() -> str:
    candidates = [os.environ.get("ANVIL_BIN"), str(ROOT / ".tools/node_modules/.bin/anvil"), shutil.which("anvil")]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return candidate
    raise RuntimeError("anvil not found: run `bash .ci/run` (it installs @foundry-rs/anvil under .tools/)")


class Anvil:
    def __init__(self, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [anvil_binary(), "--port", str(self.port), "--host", "127.0.0.1", "--silent", *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self._up, 15, "anvil to start")

    def _up(self) -> bool:
        try:
            self.rpc("eth_chainId")
            return True
        except OSError:
            return False

    def rpc(self, method: str, *params: Any) -> Any:
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": list(params)}).encode()
        request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            reply = json.loads(response.read())
        if "error" in reply:
            raise RuntimeError(f"anvil {method}: {reply['error']}")
        return reply["result"]

    def mine(self, blocks: int = 1) -> int:
        self.rpc("anvil_mine", hex(blocks))
        return self.block_number()

    def block_number(self) -> int:
        return int(self.rpc("eth_blockNumber"), 16)

    def send(self, to: str | None, data: str, gas: int | None = None) -> dict[str, Any]:
        tx: dict[str, Any] = {"from": DEV_ACCOUNT, "data": data}
        if to:
            tx["to"] = to
        if gas:
            tx["gas"] = hex(gas)
        tx_hash = self.rpc("eth_sendTransaction", tx)
        receipts: list[dict[str, Any]] = []

        def mined() -> bool:
            receipt = self.rpc("eth_getTransactionReceipt", tx_hash)
            receipts.append(receipt)
            return receipt is not None

        wait_until(mined, 10, "the transaction to be mined")
        return receipts[-1]

    def deploy_store(self) -> str:
        receipt = self.send(None, "0x" + (CONTRACTS / "Store.bin").read_text().strip())
        return str(receipt["contractAddress"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


async def fake_server(app: web.Application) -> TestServer:
    """A test's own HTTP server (a fake node, a relay, a balancer) on a port the kernel picks as it binds
    it (no free_port race with another process). Its close waits at most a second for handlers still
    running: a node told to answer in 30 s, whose caller gave up long ago, holds no test for 30 s more."""
    server = TestServer(app, host="127.0.0.1")
    await server.start_server(shutdown_timeout=1.0)
    return server


@asynccontextmanager
async def serving(handle: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[str]:
    """`handle` as an HTTP server (fake_server, POST /): yields its URL."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/", handle)
    server = await fake_server(app)
    try:
        yield f"http://127.0.0.1:{server.port}/"
    finally:
        await server.close()


@asynccontextmanager
async def balancer(route: Callable[[list[dict[str, Any]]], str]) -> AsyncIterator[str]:
    """A load balancer in front of several nodes: `route` picks the node for each HTTP request (its
    calls); a batch is never split. Yields the balancer's URL."""
    async with aiohttp.ClientSession() as session:

        async def handle(req: web.Request) -> web.Response:
            body = await req.read()
            payload = json.loads(body)
            target = route(payload if isinstance(payload, list) else [payload])
            async with session.post(target, data=body, headers={"Content-Type": "application/json"}) as resp:
                return web.Response(body=await resp.read(), content_type="application/json")

        async with serving(handle) as url:
            yield url


# --- Redis ---------------------------------------------------------------------------------


class RedisServer:
    """A private redis-server on a free port; `stop` and `start` simulate an outage."""

    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra = extra  # more redis-server arguments, e.g. "--maxmemory", "30mb"
        self.start()

    def start(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *self.extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self._up, 10, "redis-server to start")

    def _up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
            sock.sendall(b"FLUSHALL\r\n")
            sock.recv(16)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


# --- a counting pass-through upstream -----------------------------------------------------


class CountingUpstream:
    """Wraps a real upstream and counts the calls that reach it, per method."""

    def __init__(self, inner: HttpUpstream) -> None:
        self.inner = inner
        self.states = inner.states
        self.calls: Counter[str] = Counter()
        self.params: list[tuple[str, Any]] = []
        self.asked: Counter[str] = Counter()
        self.batched: Counter[str] = Counter()  # calls that went inside batches, per method
        self.batches: list[list[tuple[str, Any]]] = []
        self.proofs = 0  # calls asked with a proof header beside them

    async def ask(
        self, index: int, method: str, params: Any, *, timeout: float, budget_wait: float | None = None
    ) -> Answer:
        """One upstream alone (identity probes, per-upstream heads, retries): counted apart."""
        self.asked[method] += 1
        return await self.inner.ask(index, method, params, timeout=timeout, budget_wait=budget_wait)

    async def ask_all(self, index: int, calls: Sequence[tuple[str, Any]], *, timeout: float) -> list[Answer]:
        """One batch to one upstream alone (a proof's parts): each call counted apart, as `ask`."""
        for method, _ in calls:
            self.asked[method] += 1
        return await self.inner.ask_all(index, calls, timeout=timeout)

    async def proven(
        self, method: str, params: Any, block: str, *, index: int | None = None, timeout: float | None = None
    ) -> Answer:
        """A call and the header that shows the answering node's chain (counted apart, as `proofs`)."""
        self.calls[method] += 1
        self.params.append((method, params))
        self.proofs += 1
        answer: Answer = await self.inner.proven(method, params, block, index=index, timeout=timeout)
        return answer

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer:
        self.calls[method] += 1
        self.params.append((method, params))
        answer: Answer = await self.inner.request(method, params, timeout=timeout)
        return answer

    async def batch(self, calls: Sequence[tuple[str, Any]]) -> list[Answer]:
        self._batched(calls)
        result: list[Answer] = await self.inner.batch(calls)
        return result

    async def together(self, calls: Sequence[tuple[str, Any]]) -> list[Answer] | None:
        self._batched(calls)
        result: list[Answer] | None = await self.inner.together(calls)
        return result

    def _batched(self, calls: Sequence[tuple[str, Any]]) -> None:
        for method, params in calls:
            self.calls[method] += 1
            self.params.append((method, params))
        self.batched.update(method for method, _ in calls)
        self.batches.append(list(calls))

    async def close(self) -> None:
        await self.inner.close()


# --- a proxy on a real port ---------------------------------------------------------------


class MemoryTransport(asyncio.Transport):
    """A connection's transport kept in memory: nothing is sent. The last answer written is kept, and
    with `keep` every byte written; closing it tells its protocol the connection is lost."""

    def __init__(self, keep: bool = True) -> None:
        super().__init__()
        self.keep = keep
        self.last = self.written = b""
        self.closed = False
        self.protocol: Any = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.last = bytes(data)
        if self.keep:
            self.written += self.last

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.protocol is not None:
                self.protocol.connection_lost(None)

    def get_write_buffer_size(self) -> int:
        return 0

    def can_write_eof(self) -> bool:
        return False  # no write side to shut: a last answer closes it at once

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Served:
    """The app served as `rpc-proxy` serves it (the fast server in front, aiohttp behind), on a port the
    kernel picks as it binds (`port`, once started: no free_port race with another process)."""

    def __init__(self, app: web.Application) -> None:
        self.runner = web.AppRunner(app, access_log=None, auto_decompress=False)  # as listeners.serve
        self.port = 0
        self.site: CappedSite | None = None

    async def start_server(self) -> None:
        await self.runner.setup()
        settings = self.runner.app[SETTINGS]
        self.site = CappedSite(
            self.runner,
            "127.0.0.1",
            self.port,
            max_connections=settings.max_connections,
            per_ip=settings.max_connections_per_ip,
        )
        await self.site.start()
        self.port = int(self.runner.addresses[0][1])

    async def close(self) -> None:
        await self.runner.cleanup()


@dataclass
class Proxy:
    server: Served
    session: aiohttp.ClientSession
    app: web.Application
    registry: CollectorRegistry
    upstreams: dict[str, CountingUpstream] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def url(self, key: str = "test-key", network: str | None = None) -> str:
        prefix = f"/{network}" if network else ""
        return f"{self.base}{prefix}/v3/{key}"

    def ws_url(self, key: str = "test-key") -> str:
        return f"ws://127.0.0.1:{self.server.port}/ws/v3/{key}"

    async def post(self, body: Any, key: str = "test-key", **kwargs: Any) -> tuple[int, Any, Any]:
        raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with self.session.post(self.url(key, kwargs.pop("network", None)), data=raw, **kwargs) as resp:
            text = await resp.read()
            return resp.status, (json.loads(text) if text else None), resp.headers

    async def call(self, method: str, params: Any, key: str = "test-key", rid: Any = 1) -> dict[str, Any]:
        _status, body, _headers = await self.post(
            {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}, key
        )
        return dict(body)

    async def result(self, method: str, params: Any, key: str = "test-key") -> Any:
        reply = await self.call(method, params, key)
        assert "error" not in reply, reply
        return reply["result"]

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    async def head_at(self, number: int, network: str = "evm", timeout: float = 10.0) -> None:
        """Wait until the head tracker has seen block `number`."""
        tracker = self.app[SERVICE].networks[network].tracker

        async def seen() -> bool:
            head = tracker.head
            return head is not None and head.latest >= number

        await eventually(seen, timeout, f"head tracker at block {number}")

    async def close(self) -> None:
        await self.session.close()
        await self.server.close()


def settings_for(**overrides: str) -> Settings:
    raw = {"HEAD_POLL_INTERVAL": "0.05", "LOG_LEVEL": "WARNING"}
    raw.update(overrides)
    return build_settings(raw)


async def start_proxy(
    settings: Settings,
    *,
    redis: Any = None,
    clock: Any = None,
    upstream_class: type[CountingUpstream] = CountingUpstream,
) -> Proxy:
    registry = CollectorRegistry()
    upstreams: dict[str, CountingUpstream] = {}

    def counting(network: Network, metrics: Metrics) -> CountingUpstream:
        inner = http_upstream(settings)(network, metrics)
        assert isinstance(inner, HttpUpstream)
        upstreams[network.name] = upstream_class(inner)
        return upstreams[network.name]

    app = create_app(settings, upstream_factory=counting, redis=redis, registry=registry, clock=clock)
    server = Served(app)
    await server.start_server()
    session = aiohttp.ClientSession()
    return Proxy(server, session, app, registry, upstreams)


class ProxyFactory(Protocol):
    """The `make_proxy` fixture: starts a proxy (from a built Settings, or from settings_for's
    overrides) that the fixture closes when the test ends, passed or failed."""

    async def __call__(
        self,
        settings: Settings | None = None,
        /,
        *,
        redis: Any = None,
        clock: Any = None,
        upstream_class: type[CountingUpstream] = CountingUpstream,
        **overrides: str,
    ) -> Proxy: ...


class FakeClock:
    """An injected clock: tests move time instead of sleeping."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start
        self.mono = 1000.0

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.mono += seconds
