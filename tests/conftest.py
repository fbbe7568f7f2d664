from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import pytest
import uvloop

from proxy.config import Settings
from tests.fake_solana import FakeSolana
from tests.fault_relay import FaultRelay
from tests.support import (
    Anvil,
    CountingUpstream,
    Proxy,
    ProxyFactory,
    RedisServer,
    settings_for,
    start_proxy,
)


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """In-process proxies run on uvloop, the serving processes' default event loop (EVENT_LOOP);
    TEST_EVENT_LOOP=asyncio runs them on the standard loop instead."""
    if os.environ.get("TEST_EVENT_LOOP") == "asyncio":
        return {"asyncio": asyncio.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
async def relays(anvil: Anvil) -> AsyncIterator[list[FaultRelay]]:
    """Two fault relays in front of the test's Anvil: two upstreams whose calls are counted."""
    started = [await FaultRelay(anvil.url).start() for _ in range(2)]
    yield started
    for relay in started:
        await relay.close()


@pytest.fixture
def anvil() -> Iterator[Anvil]:
    """A fresh Anvil node per test: tests mine, reorg and deploy freely."""
    node = Anvil()
    yield node
    node.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    if redis_server.proc is None:
        redis_server.start()
    redis_server.flush()
    yield redis_server.url
    if redis_server.proc is None:
        redis_server.start()  # a test that stopped it leaves it running for the next


@pytest.fixture
async def solana() -> AsyncIterator[FakeSolana]:
    node = await FakeSolana().start()
    yield node
    await node.close()


@pytest.fixture
async def evm_proxy(anvil: Anvil, make_proxy: ProxyFactory) -> Proxy:
    """The proxy in front of a fresh Anvil, open mode, memory tier only."""
    return await make_proxy(EVM_UPSTREAM=anvil.url)


@pytest.fixture
async def make_proxy() -> AsyncIterator[ProxyFactory]:
    """Starts proxies for a test and closes every one it started when the test ends, passed or
    failed, the last started first: a test whose proxy lives as long as the test needs no
    try/finally. `make_proxy(settings)` takes a built Settings; `make_proxy(EVM_UPSTREAM=...)`
    builds one with settings_for."""
    started: list[Proxy] = []

    async def make(
        settings: Settings | None = None,
        /,
        *,
        redis: Any = None,
        clock: Any = None,
        upstream_class: type[CountingUpstream] = CountingUpstream,
        **overrides: str,
    ) -> Proxy:
        if settings is not None and overrides:
            raise TypeError("make_proxy takes a built Settings or settings_for overrides, not both")
        built = settings if settings is not None else settings_for(**overrides)
        proxy = await start_proxy(built, redis=redis, clock=clock, upstream_class=upstream_class)
        started.append(proxy)
        return proxy

    yield make
    # Every proxy is closed even when an earlier close fails; the first failure is raised after.
    failure: BaseException | None = None
    for proxy in reversed(started):
        try:
            await proxy.close()
        except BaseException as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
