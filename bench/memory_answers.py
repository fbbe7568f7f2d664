"""Benchmark: what answers waiting for clients that read nothing cost a proxy process, from outside.

    .venv/bin/python -m bench.memory_answers [--answer-mb 4] [--connections 4] [--requests 40] [--keys 1]
        [--ws-connections 3] [--ws-requests 30] [--hold 10] [--set NAME=VALUE ...]

A `python -m proxy` process with two API keys (attacker, victim) in front of a real Anvil whose
contract returns as many zero bytes as asked (tests/answer_attack.py). Two attacks, each on a fresh
process: --connections raw HTTP sockets of the attacker's key, each pipelining --requests misses of
--answer-mb MB and reading nothing (spread over --keys keys of the attacker's, in turn); then
--ws-connections WebSockets sending --ws-requests each (none: skipped). For --hold seconds the
victim's key makes distinct small calls one after another. Printed per attack:
the process's RSS before, at its peak, and after the attacker's sockets close; the answers' bytes the
process counts as made and not taken (rpc_proxy_answer_bytes_pending, at the peak); RSS per MB of
answer in flight (the peak's growth over that count); and the victim's median and p95 latency.
--set passes a setting to the proxy (e.g. --set MAX_PENDING_ANSWER_BYTES=16777216).

With --copies, instead: one miss of --answer-mb MB through a proxy in this process (the node is
Anvil, the client a socket that reads nothing), traced with tracemalloc: the peak of the bytes
allocated from the upstream's socket to the client's, and those still held once it is written (its
cache entry, and what the transport holds), each in answers' sizes (S).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.answer_attack import (  # noqa: E402
    http_attack,
    p95,
    post,
    rss,
    silent,
    start_node,
    start_proxy,
    victim_latencies,
    ws_attack,
    zero_call,
)
from tests.memory_fill import ProxyProcess  # noqa: E402
from tests.support import Anvil, settings_for  # noqa: E402
from tests.support import start_proxy as start_in_process  # noqa: E402

MB = 1_000_000
MIB = 2**20


async def attack_once(
    node: Anvil, name: str, start: Callable[[int], list], hold: float, settings: dict[str, str], keys: int = 1
) -> None:
    proxy = start_proxy(node, keys, **settings)
    try:
        await victim_latencies(proxy, 0.5)  # warm: the head known, the connection pools open
        before = rss(proxy)
        loop = asyncio.get_running_loop()
        socks = await loop.run_in_executor(None, start, proxy.port)
        peak, pending = before, 0.0
        victim = asyncio.ensure_future(victim_latencies(proxy, hold))
        while not victim.done():
            now = rss(proxy)
            if now > peak:
                peak, pending = now, proxy.metrics().get("rpc_proxy_answer_bytes_pending", 0.0)
            await asyncio.sleep(0.1)
        latencies = await victim
        for sock in socks:
            sock.close()
        after = await settled(proxy)
        per_mb = (peak - before) / pending if pending else float("nan")
        print(
            f"{name:10} {before / MIB:8.0f} {peak / MIB:8.0f} {(peak - before) / MIB:+8.0f} {after / MIB:8.0f} "
            f"{(after - before) / MIB:+8.0f} {pending / MIB:10.1f} {per_mb:9.1f} "
            f"{statistics.median(latencies) * 1000:9.1f} {p95(latencies) * 1000:9.1f} {len(latencies):6}",
            flush=True,
        )
    finally:
        proxy.stop()


async def settled(proxy: ProxyProcess, seconds: float = 10.0) -> int:
    """RSS once the count of answers is back to none and RSS has stopped falling (or `seconds`)."""
    deadline = time.monotonic() + seconds
    last = rss(proxy)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = rss(proxy)
        if now >= last and not proxy.metrics().get("rpc_proxy_answer_bytes_pending", 0.0):
            return now
        last = now
    return last


async def copies(node: Anvil, size: int, runs: int = 3) -> None:
    proxy = await start_in_process(settings_for(EVM_UPSTREAM=node.url, API_KEYS="attacker,victim"))
    loop = asyncio.get_running_loop()
    try:
        await proxy.post(zero_call(1, 1000), key="victim")  # warm: the head known, the pools open
        for run in range(runs):
            gc.collect()
            tracemalloc.start()
            sock = silent(proxy.server.port)
            request = post(json.dumps(zero_call(100 + run, size)).encode(), "attacker")
            await loop.run_in_executor(None, sock.sendall, request)
            deadline = time.monotonic() + 30
            while (proxy.registry.get_sample_value("rpc_proxy_answer_bytes_pending") or 0) < size:
                assert time.monotonic() < deadline, "the answer was never made"
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)
            held, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            sock.close()
            print(f"answer of {size / MB:g} MB: peak {peak / size:.2f} S, held once written {held / size:.2f} S")
    finally:
        await proxy.session.close()
        await proxy.server.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answer-mb", type=float, default=4.0)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--keys", type=int, default=1)
    parser.add_argument("--ws-connections", type=int, default=3)
    parser.add_argument("--ws-requests", type=int, default=30)
    parser.add_argument("--hold", type=float, default=10.0)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--copies", action="store_true")
    args = parser.parse_args()
    settings = dict(item.split("=", 1) for item in args.set)
    size = int(args.answer_mb * MB)
    node = start_node()
    try:
        if args.copies:
            await copies(node, size)
            return
        print(
            f"answers of {args.answer_mb:g} MB; settings {settings or 'defaults'}\n"
            f"{'attack':10} {'RSS MiB':>8} {'peak':>8} {'growth':>8} {'closed':>8} {'left':>8} "
            f"{'held MiB':>10} {'RSS/MB':>9} {'p50 ms':>9} {'p95 ms':>9} {'calls':>6}"
        )
        http = lambda port: http_attack(port, args.connections, args.requests, size, args.keys)  # noqa: E731
        ws = lambda port: ws_attack(port, args.ws_connections, args.ws_requests, size)  # noqa: E731
        name = f"http {args.connections}x{args.requests}" + (f"/{args.keys}k" if args.keys > 1 else "")
        await attack_once(node, name, http, args.hold, settings, args.keys)
        if args.ws_connections:
            await attack_once(node, f"ws {args.ws_connections}x{args.ws_requests}", ws, args.hold, settings)
    finally:
        node.stop()


if __name__ == "__main__":
    asyncio.run(main())
