from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import pytest
import uvloop

from tests.fake_solana import FakeSolana
from tests.fault_relay import FaultRelay
from tests.support import Anvil, Proxy, RedisServer, settings_for, start_proxy


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
async def evm_proxy(anvil: Anvil) -> AsyncIterator[Proxy]:
    """The proxy in front of a fresh Anvil, open mode, memory tier only."""
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url))
    yield proxy
    await proxy.close()
