"""Benchmark: tenant isolation. One proxy process (`python -m proxy`, two API keys, Redis with an
evicting `maxmemory`) in front of Anvil; a victim key runs a steady workload (eth_chainId, hits on
warm eth_getStorageAt entries, eth_getBalance misses) alone, then while an attacker key runs each of
issue 19's attacks (items 1, 3 and 4; item 2, log fan-out, is its own benchmark: bench/fanout.py):

1. `logs-batch`: batches of 100 eth_getLogs over one cached range of ~10,000 logs (~5 MB each).
3. `cache-wipe`: eth_call with a state override whose code returns 24 KiB, at a final block, then
   distinct large eth_getLogs answers: client-sized answers that once filled both tiers.
4. `wide-logs`: a batch of 100 cold eth_getLogs of ~200 chunks each (distinct filters).

Printed per phase: the victim's p50/p99 latency and its hit ratio on its warm entries, the
attacker's upstream calls per 1,000 credits it was charged, the worker's peak RSS and Redis
evictions. The attacker runs in its own thread and event loop, so its large answers are not read on
the loop that times the victim.

    .venv/bin/python -m bench.isolation [--seconds 8] [--root PATH]

`--root` runs the proxy from another checkout (e.g. a worktree of main) for a before/after.
Needs Anvil (`bash scripts/test.sh` installs it under .tools/) and redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import Anvil, RedisServer, free_port, healthy, selector, wait_until, word  # noqa: E402

ATTACKER, VICTIM = "attacker-secret", "victim-secret"
LOGS_PER_TX, LOG_TXS = 500, 20  # the cached range of item 1: 10,000 logs
WIDE_CHUNK, WIDE_BLOCKS = 10, 2_000  # item 4: ranges of ~200 chunks
ATTACK_METHODS = ("eth_getLogs", "eth_call")  # the victim sends neither
SLOW = re.compile(r"took ([0-9.]+) seconds")  # asyncio's slow-callback warning


@dataclass
class Chain:
    anvil: Anvil
    store: str
    first: int  # the blocks holding item 1's logs
    last: int
    latest: int


def build_chain(anvil: Anvil) -> Chain:
    store = anvil.deploy_store()
    blocks = [
        int(anvil.send(store, selector("emitMany(uint256)") + word(LOGS_PER_TX), gas=15_000_000)["blockNumber"], 16)
        for _ in range(LOG_TXS)
    ]
    latest = anvil.mine(WIDE_BLOCKS + 100)
    return Chain(anvil, store, blocks[0], blocks[-1], latest)


@dataclass
class Phase:
    name: str
    latencies: list[float] = field(default_factory=list)
    warm: int = 0
    warm_hits: int = 0
    credits: int = 0
    upstream: float = 0.0
    rss_peak_kb: int = 0
    evictions: int = 0
    attacker_errors: int = 0


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def upstream_calls(base: str) -> float:
    """Upstream calls of the attacker's methods so far, from the proxy's own histogram counts."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("rpc_proxy_upstream_request_duration_seconds_count")
        and any(f'method="{m}"' in line for m in ATTACK_METHODS)
    )


async def victim(session: aiohttp.ClientSession, url: str, chain: Chain, phase: Phase, stop: threading.Event) -> None:
    rng = random.Random(1)
    calls: list[Callable[[], tuple[dict[str, Any], bool]]] = [
        lambda: ({"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}, False),
        lambda: (
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "eth_getStorageAt",
                "params": [chain.store, hex(rng.randrange(200)), hex(chain.first)],
            },
            True,
        ),
        lambda: (
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "eth_getBalance",
                "params": [f"0x{rng.getrandbits(160):040x}", hex(rng.randrange(chain.latest - 100))],
            },
            False,
        ),
    ]
    n = 0
    while not stop.is_set():
        body, warm = calls[n % len(calls)]()
        n += 1
        started = time.perf_counter()
        async with session.post(url, json=body) as resp:
            await resp.read()
            cache = resp.headers.get("X-Cache")
        phase.latencies.append(time.perf_counter() - started)
        if warm:
            phase.warm += 1
            phase.warm_hits += cache == "HIT"
        await asyncio.sleep(0.005)


Attack = Callable[[aiohttp.ClientSession, str, Chain, Phase, threading.Event], Awaitable[None]]


async def post(session: aiohttp.ClientSession, url: str, body: Any, phase: Phase) -> None:
    try:
        async with session.post(url, data=json.dumps(body), timeout=aiohttp.ClientTimeout(total=120)) as resp:
            raw = await resp.read()
            phase.credits += int(resp.headers.get("X-Credits-Charged", "0"))
        phase.attacker_errors += raw.count(b'"error"')
    except (aiohttp.ClientError, TimeoutError):
        phase.attacker_errors += 1


def logs(first: int, last: int, address: str, rid: int = 1) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": rid,
        "method": "eth_getLogs",
        "params": [{"address": address, "fromBlock": hex(first), "toBlock": hex(last)}],
    }


async def logs_batch(
    session: aiohttp.ClientSession, url: str, chain: Chain, phase: Phase, stop: threading.Event
) -> None:
    await post(session, url, logs(chain.first, chain.last, chain.store), phase)  # warm: ~10,000 logs
    while not stop.is_set():
        await post(session, url, [logs(chain.first, chain.last, chain.store, i) for i in range(100)], phase)


async def cache_wipe(
    session: aiohttp.ClientSession, url: str, chain: Chain, phase: Phase, stop: threading.Event
) -> None:
    target = "0x" + "ab" * 20
    code = "0x616000" + "6000f3"  # PUSH2 0x6000 PUSH1 0 RETURN: 24 KiB, as the client chose
    n = 0
    while not stop.is_set():
        calls = [
            {
                "jsonrpc": "2.0",
                "id": i,
                "method": "eth_call",
                "params": [{"to": target, "data": f"0x{n + i:064x}"}, hex(chain.first), {target: {"code": code}}],
            }
            for i in range(50)
        ]
        calls += [logs(b, b + 1, chain.store, 100 + b) for b in range(chain.first + n % 5, chain.last - 1, 2)]
        await post(session, url, calls, phase)
        n += 50


async def wide_logs(
    session: aiohttp.ClientSession, url: str, chain: Chain, phase: Phase, stop: threading.Event
) -> None:
    n = 0
    while not stop.is_set():
        await post(session, url, [logs(0, WIDE_CHUNK * 199, f"0x{n + i + 1:040x}", i) for i in range(100)], phase)
        n += 100


def attacker_thread(attack: Attack, url: str, chain: Chain, phase: Phase, stop: threading.Event) -> threading.Thread:
    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            await attack(session, url, chain, phase, stop)

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.start()
    return thread


async def run_phase(
    name: str, attack: Attack | None, base: str, chain: Chain, pid: int, cache: redis.Redis, seconds: float
) -> Phase:
    phase = Phase(name)
    stop = threading.Event()
    evicted = int(cache.info("stats")["evicted_keys"])
    upstream = upstream_calls(base)
    thread = attacker_thread(attack, f"{base}/v3/{ATTACKER}", chain, phase, stop) if attack else None
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(victim(session, f"{base}/v3/{VICTIM}", chain, phase, stop))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            phase.rss_peak_kb = max(phase.rss_peak_kb, rss_kb(pid))
            await asyncio.sleep(0.1)
        stop.set()
        await task
    if thread is not None:
        while thread.is_alive():  # the attacker's last request finishes on its own
            phase.rss_peak_kb = max(phase.rss_peak_kb, rss_kb(pid))
            await asyncio.sleep(0.1)
    phase.upstream = upstream_calls(base) - upstream
    phase.evictions = int(cache.info("stats")["evicted_keys"]) - evicted
    return phase


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else 0.0


async def warm_victim(base: str, chain: Chain) -> None:
    async with aiohttp.ClientSession() as session:
        for slot in range(200):
            body = {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "eth_getStorageAt",
                "params": [chain.store, hex(slot), hex(chain.first)],
            }
            async with session.post(f"{base}/v3/{VICTIM}", json=body) as resp:
                await resp.read()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout whose proxy is run")
    parser.add_argument("--redis-maxmemory", default="16mb")
    parser.add_argument("--cache-memory", default=str(16 << 20), help="CACHE_MEMORY_BYTES of the proxy")
    parser.add_argument(
        "--slow-callbacks",
        action="store_true",
        help="run the proxy in asyncio debug mode and print the longest callback of each phase "
        "(asyncio's slow-callback detection, 50 ms threshold; debug mode slows the proxy)",
    )
    args = parser.parse_args()
    anvil = Anvil("--gas-limit", "100000000")
    cache_server = RedisServer("--maxmemory", args.redis_maxmemory, "--maxmemory-policy", "allkeys-lru")
    proc: subprocess.Popen[bytes] | None = None
    try:
        chain = build_chain(anvil)
        port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": str(args.root),
            "EVM_UPSTREAM": anvil.url,
            "REDIS_URL": cache_server.url,
            "API_KEYS": f"{ATTACKER},{VICTIM}",
            "PROXY_PORT": str(port),
            "GETLOGS_CHUNK_BLOCKS": str(WIDE_CHUNK),
            "CACHE_MEMORY_BYTES": args.cache_memory,
            "HEAD_POLL_INTERVAL": "0.5",
            "LOG_LEVEL": "ERROR",
            "SHUTDOWN_TIMEOUT": "1",
            "DAILY_CREDITS": str(10**12),
        }
        # Kept with --slow-callbacks, whose warnings name the slow callbacks.
        log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="isolation-proxy-",
            suffix=".log",
            delete=not args.slow_callbacks,
        )
        if args.slow_callbacks:
            env.update(PYTHONASYNCIODEBUG="1", LOG_LEVEL="WARNING")
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy"], cwd=args.root, env=env, stdout=subprocess.DEVNULL, stderr=log
        )
        wait_until(lambda: healthy(port), 30, "the proxy to start")
        base = f"http://127.0.0.1:{port}"
        time.sleep(2)  # the head tracker's first polls and the chain identity
        await warm_victim(base, chain)
        cache = redis.Redis.from_url(cache_server.url)
        print(
            f"proxy from {args.root}; Anvil {chain.latest + 1} blocks, {LOGS_PER_TX * LOG_TXS} logs in blocks "
            f"{chain.first}-{chain.last}; Redis maxmemory {args.redis_maxmemory} allkeys-lru; "
            f"CACHE_MEMORY_BYTES={args.cache_memory}; "
            f"GETLOGS_CHUNK_BLOCKS={WIDE_CHUNK}; {args.seconds:g} s per phase"
        )
        print(
            f"{'phase':<12} {'victim p50 ms':>13} {'p99 ms':>8} {'max ms':>8} {'warm hits':>9} "
            f"{'atk upstream/1k cr':>18} {'atk credits':>11} {'RSS MB':>7} {'evictions':>9}"
            + (f" {'slowest cb ms':>9}" if args.slow_callbacks else "")
        )
        phases: list[tuple[str, Attack | None]] = [
            ("none", None),
            ("logs-batch", logs_batch),
            ("cache-wipe", cache_wipe),
            ("wide-logs", wide_logs),
        ]
        for name, attack in phases:
            if proc.poll() is not None:
                print(f"{name:<12} the proxy exited (code {proc.returncode})")
                break
            seen = Path(log.name).stat().st_size
            phase = await run_phase(name, attack, base, chain, proc.pid, cache, args.seconds)
            with open(log.name, "rb") as text:
                text.seek(seen)
                slowest = max((float(m) for m in SLOW.findall(text.read().decode(errors="replace"))), default=0.0)
            per_1k = phase.upstream / phase.credits * 1000 if phase.credits else 0.0
            warm = phase.warm_hits / phase.warm if phase.warm else 0.0
            print(
                f"{name:<12} {statistics.median(phase.latencies) * 1000:>13.1f} "
                f"{quantile(phase.latencies, 0.99) * 1000:>8.1f} {max(phase.latencies) * 1000:>8.1f} "
                f"{warm:>9.0%} {per_1k:>18.1f} {phase.credits:>11} {phase.rss_peak_kb / 1024:>7.0f} "
                f"{phase.evictions:>9}" + (f" {slowest * 1000:>9.0f}" if args.slow_callbacks else "")
            )
        if args.slow_callbacks:
            print(f"proxy log (slow callbacks named): {log.name}")
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        cache_server.stop()
        anvil.stop()


if __name__ == "__main__":
    asyncio.run(main())
