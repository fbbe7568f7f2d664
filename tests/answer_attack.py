"""Attack a `python -m proxy` process with clients that ask for large answers and read none of them,
and read what it costs the process (VmRSS from /proc) and what another key's calls wait meanwhile.

Shared by tests/test_answer_memory.py and bench/memory_answers.py: a real Anvil whose contract at
RETURNER returns as many zero bytes as its calldata's first word says, two API keys (attacker,
victim), raw HTTP sockets that pipeline misses and read nothing, raw WebSockets that do the same."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import aiohttp

from tests.memory_fill import ProxyProcess, rss_bytes
from tests.support import Anvil
from tests.ws_client import frame

RETURNER = "0x" + "5e" * 20
# PUSH1 0, CALLDATALOAD, PUSH1 0, RETURN: the first calldata word's count of (zero) memory bytes.
RETURNER_CODE = "0x60003560" + "00f3"
KEYS = ("attacker", "victim")


def attackers(keys: int) -> list[str]:
    """The attacker's `keys` API keys: "attacker", then "attacker1", "attacker2", ..."""
    return [KEYS[0]] + [f"{KEYS[0]}{i}" for i in range(1, keys)]


def start_node() -> Anvil:
    """Anvil with the returning contract; a block gas limit that lets it return megabytes."""
    node = Anvil("--gas-limit", "1000000000", "--code-size-limit", "1000000")
    node.rpc("anvil_setCode", RETURNER, RETURNER_CODE)
    return node


def zero_call(i: int, answer_bytes: int) -> dict[str, Any]:
    """A distinct call (a miss) whose result is `answer_bytes` of hex: "0x" and half as many zero bytes."""
    data = "0x" + format(answer_bytes // 2, "064x") + format(i, "064x")
    return {"jsonrpc": "2.0", "id": i, "method": "eth_call", "params": [{"to": RETURNER, "data": data}, "latest"]}


def start_proxy(node: Anvil, keys: int = 1, **settings: str) -> ProxyProcess:
    """A proxy process with the victim's key and `keys` of the attacker's."""
    return ProxyProcess(node.url, 64 * 1024 * 1024, API_KEYS=",".join([*attackers(keys), KEYS[1]]), **settings)


def post(body: bytes, key: str) -> bytes:
    head = f"POST /v3/{key} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def silent(port: int) -> socket.socket:
    """A client socket with a tiny receive window: what the proxy writes stays in its own buffers."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    return sock


def http_attack(port: int, connections: int, requests: int, answer_bytes: int, keys: int = 1) -> list[socket.socket]:
    """`connections` sockets of the attacker's (spread over its `keys` keys in turn), each pipelining
    `requests` misses, reading nothing."""
    socks = []
    names = attackers(keys)
    for c in range(connections):
        sock = silent(port)
        first = (c + 1) * 1_000_000 + int(time.time() * 1000) % 1_000_000 * 1000  # distinct across runs
        data = b"".join(
            post(json.dumps(zero_call(first + i, answer_bytes)).encode(), names[c % keys]) for i in range(requests)
        )
        sock.sendall(data)
        socks.append(sock)
    return socks


def ws_attack(port: int, connections: int, requests: int, answer_bytes: int) -> list[socket.socket]:
    """`connections` WebSockets of the attacker's key, each sending `requests` misses, reading nothing."""
    socks = []
    for c in range(connections):
        sock = silent(port)
        sock.sendall(
            f"GET /ws/v3/{KEYS[0]} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        sock.settimeout(10)
        assert b" 101 " in sock.recv(1024)
        first = (c + 1) * 1_000_000 + int(time.time() * 1000) % 1_000_000 * 1000 + 500_000
        calls = [json.dumps(zero_call(first + i, answer_bytes)).encode() for i in range(requests)]
        sock.sendall(b"".join(frame(call) for call in calls))
        socks.append(sock)
    return socks


async def victim_latencies(proxy: ProxyProcess, seconds: float, answer_bytes: int = 2_000) -> list[float]:
    """The victim key's calls (distinct misses), one after another for `seconds`: each one's time."""
    url = f"http://127.0.0.1:{proxy.port}/v3/{KEYS[1]}"
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        i = 0
        while time.monotonic() < deadline:
            i += 1
            started = time.monotonic()
            async with session.post(url, json=zero_call(9_000_000_000 + i, answer_bytes)) as response:
                reply = await response.json(content_type=None)
                assert response.status == 200 and "result" in reply, reply
            latencies.append(time.monotonic() - started)
    return latencies


def p95(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]


def rss(proxy: ProxyProcess) -> int:
    return rss_bytes(proxy.proc.pid)


async def peak_rss(proxy: ProxyProcess, seconds: float) -> int:
    """The largest VmRSS seen over `seconds`, read every 50 ms."""
    peak = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, rss(proxy))
        await asyncio.sleep(0.05)
    return peak
