"""Benchmark: chunked eth_getLogs. An indexer makes two passes over a chain with sliding eth_getLogs
windows that overlap by half (and a dapp reads a few inner ranges), through the proxy with chunks
(GETLOGS_CHUNK_BLOCKS) and, as the baseline in the same run, with chunking off (0: each range is its
own cache entry). Reported per pass: client calls, upstream eth_getLogs calls and credits (255 each)
per 1,000 client calls, credits saved, and p50/p99 latency. Every answer is checked against the node.

Then a block follower: for each of the last blocks, eth_getBlockReceipts of the block and eth_getLogs
of it, in that order (its logs are answered from the held receipts) against the other order (the
baseline: nothing is held when the logs are asked); upstream calls per 1,000 client calls.

    .venv/bin/python -m bench.chunked_logs [--blocks 3000] [--window 1000] [--chunk 1000]

Needs Anvil (`bash scripts/test.sh` installs it under .tools/).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import Anvil, selector, settings_for, start_proxy, word  # noqa: E402

GETLOGS_CREDITS = 255  # spec: eth_getLogs costs the same upstream whatever its range


def build_chain(anvil: Anvil, blocks: int, every: int) -> str:
    """A Store contract emitting 5 logs every `every` blocks over `blocks` blocks, then 100 more."""
    store = anvil.deploy_store()
    while anvil.block_number() < blocks:
        anvil.send(store, selector("emitMany(uint256)") + word(5))
        anvil.mine(every - 1)
    anvil.mine(100)
    return store


def windows(latest: int, width: int) -> list[tuple[int, int]]:
    """An indexer's windows [n, n+width-1], stepping by half a window, up to the head."""
    step = max(1, width // 2)
    return [(n, min(n + width - 1, latest)) for n in range(0, latest + 1, step)]


async def run_pass(proxy: Any, anvil: Anvil, store: str, ranges: list[tuple[int, int]]) -> dict[str, float]:
    upstream = proxy.upstreams["evm"]
    before = upstream.calls["eth_getLogs"]
    latencies = []
    answers = []
    for first, last in ranges:
        log_filter = {"address": store, "fromBlock": hex(first), "toBlock": hex(last)}
        started = time.perf_counter()
        reply = await proxy.call("eth_getLogs", [log_filter])
        latencies.append(time.perf_counter() - started)
        answers.append((log_filter, reply))
    calls = upstream.calls["eth_getLogs"] - before
    for log_filter, reply in answers:  # outside the timing: the proxy's answers equal the node's
        assert reply.get("result") == anvil.rpc("eth_getLogs", log_filter), (log_filter, reply.get("error"))
    latencies.sort()
    return {
        "client": len(ranges),
        "upstream_per_1000": calls / len(ranges) * 1000,
        "credits_per_1000": calls * GETLOGS_CREDITS / len(ranges) * 1000,
        "saved_pct": 100 * (1 - calls / len(ranges)),
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
    }


async def mode(
    anvil: Anvil, store: str, chunk: int, ranges: list[tuple[int, int]], inner: list[tuple[int, int]]
) -> list[tuple[str, dict[str, float]]]:
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, GETLOGS_CHUNK_BLOCKS=str(chunk)))
    try:
        await proxy.head_at(anvil.block_number())
        return [
            ("indexer pass 1", await run_pass(proxy, anvil, store, ranges)),
            ("indexer pass 2", await run_pass(proxy, anvil, store, ranges)),
            ("inner ranges", await run_pass(proxy, anvil, store, inner)),
        ]
    finally:
        await proxy.close()


async def follower(anvil: Anvil, store: str, blocks: int, receipts_first: bool) -> dict[str, float]:
    """eth_getBlockReceipts and eth_getLogs of each of the last `blocks` blocks, in one order or the other."""
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url))
    try:
        latest = anvil.block_number()
        await proxy.head_at(latest)
        upstream = proxy.upstreams["evm"]
        latencies = []
        answers = []
        for number in range(latest - blocks + 1, latest + 1):
            log_filter = {"address": store, "fromBlock": hex(number), "toBlock": hex(number)}
            calls = [("eth_getBlockReceipts", [hex(number)]), ("eth_getLogs", [log_filter])]
            for method, params in calls if receipts_first else calls[::-1]:
                started = time.perf_counter()
                reply = await proxy.call(method, params)
                if method == "eth_getLogs":
                    latencies.append(time.perf_counter() - started)
                    answers.append((log_filter, reply))
        for log_filter, reply in answers:
            assert reply.get("result") == anvil.rpc("eth_getLogs", log_filter), reply
        client = 2 * blocks
        total = upstream.calls["eth_getBlockReceipts"] + upstream.calls["eth_getLogs"]
        return {
            "upstream_per_1000": total / client * 1000,
            "logs_per_1000": upstream.calls["eth_getLogs"] / client * 1000,
            "p50_ms": statistics.median(latencies) * 1000,
        }
    finally:
        await proxy.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=3000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=1000)
    parser.add_argument("--every", type=int, default=25, help="blocks between blocks with events")
    parser.add_argument("--follow", type=int, default=200, help="blocks the follower reads")
    args = parser.parse_args()
    anvil = Anvil()
    try:
        store = build_chain(anvil, args.blocks, args.every)
        latest = anvil.block_number()
        ranges = windows(latest, args.window)
        # A dapp's reads inside what the indexer covered: 100-block ranges every 250 blocks.
        inner = [(n, n + 99) for n in range(0, latest - 200, 250)]
        print(
            f"chain: {latest + 1} blocks, logs every {args.every}; windows of {args.window} stepping "
            f"{max(1, args.window // 2)}; GETLOGS_CHUNK_BLOCKS={args.chunk} vs 0"
        )
        print(
            f"{'mode':<10} {'workload':<16} {'client':>6} {'upstream/1k':>11} {'credits/1k':>10} "
            f"{'saved %':>8} {'p50 ms':>7} {'p99 ms':>7}"
        )
        for chunk in (args.chunk, 0):
            for name, row in await mode(anvil, store, chunk, ranges, inner):
                label = f"chunk={chunk}"
                print(
                    f"{label:<10} {name:<16} {row['client']:>6.0f} {row['upstream_per_1000']:>11.0f} "
                    f"{row['credits_per_1000']:>10.0f} {row['saved_pct']:>8.1f} {row['p50_ms']:>7.2f} "
                    f"{row['p99_ms']:>7.2f}"
                )
        print(f"follower over the last {args.follow} blocks (eth_getBlockReceipts + eth_getLogs of each):")
        print(f"{'order':<18} {'upstream/1k':>11} {'eth_getLogs upstream/1k':>23} {'logs p50 ms':>11}")
        for receipts_first in (True, False):
            row = await follower(anvil, store, args.follow, receipts_first)
            order = "receipts, logs" if receipts_first else "logs, receipts"
            print(f"{order:<18} {row['upstream_per_1000']:>11.0f} {row['logs_per_1000']:>23.0f} {row['p50_ms']:>11.2f}")
    finally:
        anvil.stop()


if __name__ == "__main__":
    asyncio.run(main())
