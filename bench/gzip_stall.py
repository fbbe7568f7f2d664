"""Benchmark: what compressing a large answer costs the other clients of a proxy process, from outside.

    .venv/bin/python -m bench.gzip_stall [--answer-mb 30] [--rounds 5]

A `python -m proxy` process in front of a fake node (tests/fake_evm.py) whose eth_call answers are
--answer-mb / 10 MB of hex. One client fetches a batch of 10 such calls (a batch answer is never
cached, so it is compressed at each request) --rounds times, while another makes small calls one
after another; printed per run: the small calls' median and worst latency. The baseline, in the same
run: the batch fetched with `Accept-Encoding: identity` (nothing compressed).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fake_evm import FakeEvm  # noqa: E402
from tests.memory_fill import ProxyProcess, big_call  # noqa: E402

SMALL = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}


async def run(proxy: ProxyProcess, encoding: str, rounds: int, first: int) -> list[float]:
    """The small calls' latencies while `rounds` batches are fetched with `encoding`."""
    latencies: list[float] = []
    done = asyncio.Event()
    async with aiohttp.ClientSession() as big, aiohttp.ClientSession() as small:

        async def fetch() -> None:
            for r in range(rounds):
                batch = [big_call(first + r * 10 + i) for i in range(10)]
                async with big.post(proxy.url, json=batch, headers={"Accept-Encoding": encoding}) as resp:
                    assert resp.status == 200 and len(await resp.read()) > 0
            done.set()

        fetching = asyncio.ensure_future(fetch())
        while not done.is_set():
            started = time.perf_counter()
            async with small.post(proxy.url, json=SMALL) as resp:
                assert resp.status == 200
                await resp.read()
            latencies.append(time.perf_counter() - started)
        await fetching
    return latencies


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answer-mb", type=float, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    node = await FakeEvm(call_result_bytes=int(args.answer_mb * 100_000)).start()
    proxy = ProxyProcess(node.url, 1 << 26, MAX_RESPONSE_BYTES=str(int(args.answer_mb * 2_000_000)))
    try:
        print(f"batch answer ~{args.answer_mb:g} MB, {args.rounds} rounds each; small calls' latency in ms")
        figures = {}
        for n, encoding in enumerate(("identity", "gzip")):
            latencies = await run(proxy, encoding, args.rounds, 1000 * (n + 1))
            figures[encoding] = (statistics.median(latencies), max(latencies))
            print(
                f"{encoding:>8}: {len(latencies)} calls, median {statistics.median(latencies) * 1000:.1f}, "
                f"worst {max(latencies) * 1000:.1f}"
            )
        (gzip_median, gzip_worst), (plain_median, plain_worst) = figures["gzip"], figures["identity"]
        print(f"gzip / identity: median {gzip_median / plain_median:.2f}x, worst {gzip_worst / plain_worst:.2f}x")
    finally:
        proxy.proc.terminate()
        proxy.proc.wait(10)
        await node.close()


if __name__ == "__main__":
    asyncio.run(main())
