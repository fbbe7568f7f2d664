"""Benchmark: cache hits on one pipelined WebSocket: calls/s and the proxy's CPU per call.

    .venv/bin/python -m bench.ws_pipelined [--seconds 3] [--rounds 5] [--inflight 64] [--keyed]

One socket holds `--inflight` calls in flight (a new one is sent as each answer arrives), every call
the same final `eth_getStorageAt` (a memory hit). The client (a raw socket that counts answer frames,
uvloop when installed) runs on one core and the proxy on the other, as in bench.cache_hit. Medians
over the rounds; the proxy's CPU per call is the steadier figure on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cache_hit import (  # noqa: E402
    CLIENT_CPUS,
    cpu_seconds,
    final_storage_request,
    middle,
    proxy_env,
    start,
    warmed,
)
from tests.support import Anvil, free_port  # noqa: E402


def frame(text: bytes) -> bytes:
    """A client's text frame (masked, as RFC 6455 section 5.3 requires; a zero mask leaves the bytes as they are)."""
    size = len(text)
    length = bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + size.to_bytes(2, "big")
    return b"\x81" + length + b"\0\0\0\0" + text


class Pipeline(asyncio.Protocol):
    """One socket: after the handshake, a new call as each answer's frame arrives. Frames are counted
    from their headers, so the client's own cost per call is a few microseconds."""

    def __init__(self, call: bytes, inflight: int) -> None:
        self.call, self.inflight = frame(call), inflight
        self.buffer = b""
        self.upgraded = False
        self.answered = 0
        self.sample = b""
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        if not self.upgraded:
            head, found, buffer = buffer.partition(b"\r\n\r\n")
            if not found:
                self.buffer = head
                return
            if not head.startswith(b"HTTP/1.1 101"):
                raise SystemExit(f"no upgrade: {head!r}")
            self.upgraded = True
            self.ready.set_result(None)
            self.transport.write(self.call * self.inflight)
        answered, at = 0, 0
        while len(buffer) - at >= 2:
            size, start = buffer[at + 1] & 0x7F, at + 2
            if size == 126:
                if len(buffer) - at < 4:
                    break
                size, start = int.from_bytes(buffer[at + 2 : at + 4], "big"), at + 4
            if len(buffer) < start + size:
                break
            if not self.sample:
                self.sample = buffer[start : start + size]
            at = start + size
            answered += 1
        self.buffer = buffer[at:]
        if answered:
            self.answered += answered
            self.transport.write(self.call * answered)


async def pipelined(port: int, path: str, request: dict[str, object], seconds: float, inflight: int) -> int:
    """Answers received in `seconds` with `inflight` calls always in flight on one socket."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(
        lambda: Pipeline(json.dumps(request).encode(), inflight), "127.0.0.1", port
    )
    transport.write(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    await asyncio.wait_for(protocol.ready, 10)
    started = protocol.answered
    await asyncio.sleep(seconds)
    answered = protocol.answered - started
    transport.close()
    if b'"result"' not in protocol.sample:
        raise SystemExit(f"unexpected answer: {protocol.sample!r}")
    return answered


def run(coroutine: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inflight", type=int, default=64)
    parser.add_argument("--keyed", action="store_true", help="with an API key (credits charged per call)")
    args = parser.parse_args()
    if CLIENT_CPUS:
        os.sched_setaffinity(0, CLIENT_CPUS)
    anvil = Anvil()
    env = proxy_env(anvil.url)
    key = "bench"
    if args.keyed:
        env.update(API_KEYS=key, DAILY_CREDITS=str(10**15))  # never exhausted (memory ledger)
    proc: subprocess.Popen[bytes] | None = None
    try:
        request = final_storage_request(anvil)
        port = free_port()
        proc = start([sys.executable, "-m", "proxy"], port, {**env, "PROXY_PORT": str(port)})
        warmed(f"http://127.0.0.1:{port}/v3/{key}", request)
        rates, cpus = [], []
        for _ in range(args.rounds):
            before, started = cpu_seconds(proc.pid), time.perf_counter()
            answered = run(pipelined(port, f"/ws/v3/{key}", request, args.seconds, args.inflight))
            elapsed, cpu = time.perf_counter() - started, cpu_seconds(proc.pid) - before
            rates.append(answered / elapsed)
            cpus.append(cpu / answered * 1e6)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        anvil.stop()
    print(
        f"one WebSocket, {args.inflight} hits in flight, {args.rounds} rounds of {args.seconds:g}s "
        f"({'keyed' if args.keyed else 'open'} mode, EVENT_LOOP={env.get('EVENT_LOOP', 'asyncio')}): "
        f"median {middle(rates):,.0f} calls/s, {middle(cpus):.1f} us proxy CPU per call "
        f"(rounds: {', '.join(f'{r:,.0f}' for r in rates)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
