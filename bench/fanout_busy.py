"""Benchmark: log fan-out on a busy block (issue 19, item 2), with the proxy in its own process.

Two rounds against one `python -m proxy` (two API keys) in front of Anvil:
- reader: one WebSocket of key A with `--subs` wildcard `logs` subscriptions reads every
  notification of one block of `--logs` logs: notifications per second, end to end;
- silent: `--silent` WebSockets of key A, each with `--subs` wildcard subscriptions, never read;
  one block of `--silent-logs` logs, then blocks until they are closed (1008, WS_MAX_LAG).
Meanwhile key B's HTTP calls (eth_blockNumber, a cached eth_getBalance) run back to back: their
p50/p99/max latency, timed from when each was due, and the worker's RSS before and after.

    .venv/bin/python -m bench.fanout_busy [--subs 100] [--logs 300] [--silent 100] [--silent-logs 2000]
        [--only reader|silent] [--proxy-dir CHECKOUT]

Needs Anvil (`bash scripts/test.sh` installs it under .tools/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import Anvil, free_port, healthy, selector, wait_until, word  # noqa: E402
from tests.ws_client import silent_socket  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def victim(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: list[float]) -> None:
    due = time.perf_counter()
    calls = [("eth_blockNumber", []), ("eth_getBalance", ["0x" + "42" * 20, "0x1"])]
    while not stop.is_set():
        for method, params in calls:
            due += 0.01
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            async with session.post(url, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params}) as r:
                assert "result" in await r.json()
            out.append(time.perf_counter() - due)
            due = max(due, time.perf_counter() - 0.01)


def summary(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"key B: {len(ordered)} calls, p50 {statistics.median(ordered) * 1000:.1f} ms, "
        f"p99 {p99 * 1000:.1f} ms, max {ordered[-1] * 1000:.1f} ms"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subs", type=int, default=100)
    parser.add_argument("--logs", type=int, default=300)
    parser.add_argument("--silent", type=int, default=100)
    parser.add_argument("--silent-logs", type=int, default=2000)
    parser.add_argument("--only", choices=("reader", "silent"), help="run one round")
    parser.add_argument("--proxy-dir", default=str(ROOT), help="checkout whose proxy runs (a before/after)")
    args = parser.parse_args()
    anvil = Anvil("--gas-limit", "100000000")
    port = free_port()
    env = {
        **os.environ,
        "EVM_UPSTREAM": anvil.url,
        "PROXY_PORT": str(port),
        "API_KEYS": "key-a,key-b",
        "DAILY_CREDITS": str(10**15),
        "WS_MAX_LAG": "5",
        "HEAD_POLL_INTERVAL": "0.2",
        "LOG_LEVEL": "ERROR",
    }
    proc = subprocess.Popen([sys.executable, "-m", "proxy"], env=env, cwd=args.proxy_dir, stderr=subprocess.DEVNULL)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    url = f"http://127.0.0.1:{port}/v3/key-b"
    try:
        wait_until(lambda: healthy(port), 20, "the proxy to listen")
        store = anvil.deploy_store()
        await asyncio.sleep(1)  # the tracker sees the deploy's block

        if args.only != "silent":
            await reader_round(session, port, url, anvil, store, args)
        if args.only != "reader":
            await silent_round(session, port, url, anvil, store, args, proc.pid)
    finally:
        await session.close()
        proc.terminate()
        proc.wait(20)
        anvil.stop()


async def reader_round(
    session: aiohttp.ClientSession, port: int, url: str, anvil: Anvil, store: str, args: argparse.Namespace
) -> None:
    emit = selector("emitMany(uint256)")
    ws = await session.ws_connect(f"ws://127.0.0.1:{port}/ws/v3/key-a", max_msg_size=0)
    for rid in range(args.subs):
        await ws.send_str(json.dumps({"jsonrpc": "2.0", "id": rid, "method": "eth_subscribe", "params": ["logs", {}]}))
    for _ in range(args.subs):
        await ws.receive(timeout=30)
    stop, latencies = asyncio.Event(), []
    timing = asyncio.create_task(victim(session, url, stop, latencies))
    expected = args.subs * args.logs
    started = time.perf_counter()
    await asyncio.to_thread(anvil.send, store, emit + word(args.logs), 90_000_000)
    for _ in range(expected):
        message = await ws.receive(timeout=60)
        assert message.type is aiohttp.WSMsgType.TEXT, message
    elapsed = time.perf_counter() - started
    stop.set()
    await timing
    await ws.close()
    print(
        f"reader: {args.subs} wildcard subscriptions, one {args.logs}-log block: {expected:,} notifications "
        f"in {elapsed:.2f} s = {expected / elapsed:,.0f}/s (block mined to last notification read)"
    )
    print("  " + summary(latencies))


async def silent_round(
    session: aiohttp.ClientSession, port: int, url: str, anvil: Anvil, store: str, args: argparse.Namespace, pid: int
) -> None:
    emit = selector("emitMany(uint256)")
    sockets: list[socket.socket] = [await silent_socket(port, "key-a", args.subs) for _ in range(args.silent)]
    await asyncio.sleep(2)
    before = rss_mb(pid)
    stop, latencies = asyncio.Event(), []
    timing = asyncio.create_task(victim(session, url, stop, latencies))
    await asyncio.to_thread(anvil.send, store, emit + word(args.silent_logs), 90_000_000)
    peak = before
    for _ in range(20):
        await asyncio.sleep(0.5)
        peak = max(peak, rss_mb(pid))
        await asyncio.to_thread(anvil.mine, 1)
    stop.set()
    await timing
    for sock in sockets:
        sock.close()
    print(
        f"silent: {args.silent} sockets x {args.subs} wildcard subscriptions, one {args.silent_logs}-log "
        f"block: worker RSS {before:.0f} MB before, peak {peak:.0f} MB (+{peak - before:.0f} MB)"
    )
    print("  " + summary(latencies))


if __name__ == "__main__":
    asyncio.run(main())
