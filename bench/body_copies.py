"""Benchmark: how many copies of a request's body a proxy process holds while the request is made.

    .venv/bin/python -m bench.body_copies [--connections 5] [--body-mb 4] [--pipelined 1]

A `python -m proxy` process (memory tier off) in front of a fake node (tests/fake_evm.py) that holds
every eth_call 20 s. --connections clients each send one eth_call whose calldata is --body-mb MB of
hex, and read nothing (5 are all made at once; of more, some wait for room, holding fewer copies).
Printed: the process's peak RSS growth while the calls are made, and that growth per request in
bodies (1.0: the body is held once). The baseline, in the same run: the same clients sending calls
of 1 byte of calldata (what a request costs beside its body), subtracted. With --pipelined N each
client sends N such calls back to back on its connection: beside the RSS, the peak of
`rpc_proxy_answer_bytes_pending` (what the proxy counts: answers and the bodies of calls being made)
and the RSS growth over it (1.0: every byte held is counted).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
SEND_SECONDS = 5.0


class SlowEvm(FakeEvm):
    """A FakeEvm whose eth_call answers wait HELD_SECONDS: the calls are being made meanwhile."""

    async def _handle(self, request: web.Request) -> web.Response:
        if b"eth_call" in await request.read():
            await asyncio.sleep(HELD_SECONDS)
        return await super()._handle(request)


def request(i: int, data_bytes: int, pipelined: int = 1) -> bytes:
    return b"".join(one_request(i * pipelined + j, data_bytes) for j in range(pipelined))


def one_request(i: int, data_bytes: int) -> bytes:
    call = {
        "jsonrpc": "2.0",
        "id": i,
        "method": "eth_call",
        "params": [{"to": "0x" + "11" * 20, "data": "0x" + f"{i % 256:02x}" * data_bytes}, "latest"],
    }
    body = json.dumps(call).encode()
    head = f"POST /v3/bench HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


async def growth(upstream: str, connections: int, data_bytes: int, pipelined: int = 1) -> tuple[int, float]:
    """Peak RSS growth of a fresh proxy process while `connections` x `pipelined` calls of
    `data_bytes` are sent, and the peak of its answer-bytes gauge."""
    proxy = ProxyProcess(upstream, 1)
    socks: list[socket.socket] = []
    try:
        await asyncio.sleep(1)
        before = rss_bytes(proxy.proc.pid)
        loop = asyncio.get_running_loop()
        for _ in range(connections):
            sock = socket.create_connection(("127.0.0.1", proxy.port))
            sock.setblocking(False)
            socks.append(sock)
        # All at once, for at most SEND_SECONDS: what the proxy does not read stays with the kernel.
        await asyncio.gather(
            *(send_some(loop, sock, request(i, data_bytes, pipelined)) for i, sock in enumerate(socks))
        )
        peak, gauge = before, 0.0
        for _ in range(40):
            await asyncio.sleep(0.25)
            peak = max(peak, rss_bytes(proxy.proc.pid))
            gauge = max(gauge, await loop.run_in_executor(None, pending, proxy))
        return peak - before, gauge
    finally:
        for sock in socks:
            sock.close()
        proxy.stop()


async def send_some(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes) -> None:
    """`data` sent while the proxy reads it, for at most SEND_SECONDS (a proxy that pauses reading
    leaves the rest unsent: its client would wait)."""
    with contextlib.suppress(TimeoutError, OSError):  # the proxy still reading, or it refused the rest (503)
        await asyncio.wait_for(loop.sock_sendall(sock, data), SEND_SECONDS)


def pending(proxy: ProxyProcess) -> float:
    return proxy.metrics().get("rpc_proxy_answer_bytes_pending", 0.0)


async def main(connections: int, body_mb: float, pipelined: int) -> None:
    node = await SlowEvm().start()
    try:
        data_bytes = int(body_mb * 1_000_000) // 2
        base, _ = await growth(node.url, connections, 1, pipelined)
        big, gauge = await growth(node.url, connections, data_bytes, pipelined)
    finally:
        await node.close()
    body = len(one_request(0, data_bytes))
    print(
        f"{connections} connections x {pipelined} calls of {body / 1e6:.1f} MB bodies"
        f" (a node holding them {HELD_SECONDS:.0f} s)"
    )
    print(f"  baseline (1-byte calldata): RSS +{base / 1e6:.1f} MB")
    held = (big - base) / connections / pipelined / body
    print(f"  large bodies: RSS +{big / 1e6:.1f} MB; less the baseline, {held:.2f} bodies held per request sent")
    print(f"  answer-bytes gauge peak {gauge / 1e6:.1f} MB; RSS growth over it {(big - base) / max(gauge, 1):.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=5)
    parser.add_argument("--body-mb", type=float, default=4.0)
    parser.add_argument("--pipelined", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(main(args.connections, args.body_mb, args.pipelined))
