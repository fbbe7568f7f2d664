"""A process's memory is bounded by configured bytes whatever its clients do: an attacker key's
clients that ask for 4 MB answers and read none of them grow a `python -m proxy` process's RSS by
less than 512 MB (before the byte bounds: +1.3 GB over HTTP, +0.9 GB over WebSocket), give most of
it back once they close, and another key's calls stay under 1 s at p95 all the while. Measured from
outside: RSS from /proc, a real Anvil returning the answers (tests/answer_attack.py)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator

import pytest

from tests.answer_attack import http_attack, p95, peak_rss, rss, start_node, start_proxy, victim_latencies, ws_attack
from tests.memory_fill import ProxyProcess
from tests.support import Anvil, wait_until

pytestmark = pytest.mark.slow

MIB = 2**20
ANSWER = 4_000_000  # bytes of an answer's result (hex)
GROWTH = 512 * MIB  # what the attack may add to the process's RSS
LEFT = 256 * MIB  # and leave once its sockets close


@pytest.fixture(scope="module")
def node() -> Iterator[Anvil]:
    node = start_node()
    yield node
    node.stop()


@pytest.fixture
def proxy(node: Anvil) -> Iterator[ProxyProcess]:
    proxy = start_proxy(node)
    yield proxy
    proxy.stop()


async def attacked(proxy: ProxyProcess, attack: Callable[[int], list[socket.socket]]) -> None:
    await victim_latencies(proxy, 0.3)  # warm: its head known, its pools open
    before = rss(proxy)
    loop = asyncio.get_running_loop()
    socks = await loop.run_in_executor(None, attack, proxy.port)
    try:
        latencies, peak = await asyncio.gather(victim_latencies(proxy, 6.0), peak_rss(proxy, 6.0))
    finally:
        for sock in socks:
            sock.close()
    assert peak - before < GROWTH, f"RSS grew {(peak - before) / MIB:.0f} MiB"
    assert p95(latencies) < 1.0, f"the victim's p95: {p95(latencies):.2f} s"

    def released() -> bool:
        return rss(proxy) - before < LEFT and not proxy.metrics().get("rpc_proxy_answer_bytes_pending")

    wait_until(released, 30, "the attacker's answers to be released")


async def test_http_clients_that_read_no_answers_are_bounded_in_bytes(proxy: ProxyProcess) -> None:
    # 4 connections each pipelining 40 misses of 4 MB, reading nothing (before: +1,273 MB).
    await attacked(proxy, lambda port: http_attack(port, 4, 40, ANSWER))


async def test_websockets_that_read_no_answers_are_bounded_in_bytes(proxy: ProxyProcess) -> None:
    # 3 sockets each sending 30 calls for 4 MB answers, reading nothing (before: +902 MB).
    await attacked(proxy, lambda port: ws_attack(port, 3, 30, ANSWER))
