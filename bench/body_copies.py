"""Benchmark: how many copies of a request's body a proxy process holds while the request is made.

    .venv/bin/python -m bench.body_copies [--connections 5] [--body-mb 4]

A `python -m proxy` process (memory tier off) in front of a fake node (tests/fake_evm.py) that holds
every eth_call 20 s. --connections clients each send one eth_call whose calldata is --body-mb MB of
hex, and read nothing (5 are all made at once; of more, some wait for room, holding fewer copies).
Printed: the process's peak RSS growth while the calls are made, and that growth per request in
bodies (1.0: the body is held once). The baseline, in the same run: the same clients sending calls
of 1 byte of calldata (what a request costs beside its body), subtracted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from pathlib import Path

from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fake_evm import FakeEvm  # noqa: E402
from tests.memory_fill import ProxyProcess, rss_bytes  # noqa: E402

HELD_SECONDS = 20.0


class SlowEvm(FakeEvm):
    """A FakeEvm whose eth_call answers wait HELD_SECONDS: the calls are being made meanwhile."""

    async def _handle(self, request: web.Request) -> web.Response:
        if b"eth_call" in await request.read():
            await asyncio.sleep(HELD_SECONDS)
        return await super()._handle(request)


def request(i: int, data_bytes: int) -> bytes:
    call = {
        "jsonrpc": "2.0",
        "id": i,
        "method": "eth_call",
        "params": [{"to": "0x" + "11" * 20, "data": "0x" + f"{i % 256:02x}" * data_bytes}, "latest"],
    }
    body = json.dumps(call).encode()
    head = f"POST /v3/bench HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


async def growth(upstream: str, connections: int, data_bytes: int) -> int:
    """Peak RSS growth of a fresh proxy process while `connections` calls of `data_bytes` are made."""
    proxy = ProxyProcess(upstream, 1)
    socks: list[socket.socket] = []
    try:
        await asyncio.sleep(1)
        before = rss_bytes(proxy.proc.pid)
        loop = asyncio.get_running_loop()
        for i in range(connections):
            sock = socket.create_connection(("127.0.0.1", proxy.port))
            socks.append(sock)
            await loop.run_in_executor(None, sock.sendall, request(i, data_bytes))
        peak = before
        for _ in range(40):
            await asyncio.sleep(0.25)
            peak = max(peak, rss_bytes(proxy.proc.pid))
        return peak - before
    finally:
        for sock in socks:
            sock.close()
        proxy.stop()


async def main(connections: int, body_mb: float) -> None:
    node = await SlowEvm().start()
    try:
        data_bytes = int(body_mb * 1_000_000) // 2
        base = await growth(node.url, connections, 1)
        big = await growth(node.url, connections, data_bytes)
    finally:
        await node.close()
    body = len(request(0, data_bytes))
    print(f"{connections} calls of {body / 1e6:.1f} MB bodies, made at once (a node holding them {HELD_SECONDS:.0f} s)")
    print(f"  baseline (1-byte calldata): RSS +{base / 1e6:.1f} MB")
    held = (big - base) / connections / body
    print(f"  large bodies: RSS +{big / 1e6:.1f} MB; less the baseline, {held:.2f} bodies held per request")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=5)
    parser.add_argument("--body-mb", type=float, default=4.0)
    args = parser.parse_args()
    asyncio.run(main(args.connections, args.body_mb))
