"""Benchmark: how long a client waits for its receipt through the proxy against the node directly,
and how many receipt calls reach the node, for an automining Anvil and one sealing a block a second.

    .venv/bin/python -m bench.receipts [--transactions 20] [--poll 0.1]

Each transaction is sent, then its receipt polled every `--poll` seconds (viem polls at its
client's pollingInterval, ethers every second) until it is non-null. Through the proxy a `null`
receipt is kept UNMINED_TTL at most and never past a new head, so the wait it adds is bounded by
that, not by HEAD_POLL_INTERVAL. Needs Anvil (`bash scripts/test.sh` installs it under .tools/).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import DEV_ACCOUNT, Anvil, settings_for, start_proxy  # noqa: E402

OTHER = "0x" + "44" * 20


async def _rpc(session: aiohttp.ClientSession, url: str, method: str, params: list[Any]) -> Any:
    async with session.post(url, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params}) as resp:
        return (await resp.json())["result"]


async def receipt_waits(session: aiohttp.ClientSession, url: str, count: int, poll: float) -> tuple[list[float], int]:
    """Seconds from each send's answer to its receipt, and the receipt polls made."""
    waits, polls = [], 0
    for _ in range(count):
        tx = await _rpc(session, url, "eth_sendTransaction", [{"from": DEV_ACCOUNT, "to": OTHER, "value": "0x1"}])
        started = time.perf_counter()
        while True:
            polls += 1
            if await _rpc(session, url, "eth_getTransactionReceipt", [tx]) is not None:
                break
            await asyncio.sleep(poll)  # the client's own poll interval
        waits.append(time.perf_counter() - started)
    return waits, polls


def _row(name: str, waits: list[float], polls: int, upstream: int | None) -> str:
    p90 = sorted(waits)[int(0.9 * (len(waits) - 1))]
    node = "-" if upstream is None else str(upstream)
    return f"{name:28} {statistics.median(waits) * 1000:9.1f} {p90 * 1000:9.1f} {polls:7} {node:>14}"


async def run(mode: str, extra: tuple[str, ...], count: int, poll: float) -> list[str]:
    anvil = Anvil(*extra)
    proxy = await start_proxy(
        settings_for(EVM_UPSTREAM=anvil.url, ALLOW_METHODS="eth_sendTransaction", HEAD_POLL_INTERVAL="2")
    )
    try:
        await proxy.head_at(0)
        async with aiohttp.ClientSession() as session:
            direct, direct_polls = await receipt_waits(session, anvil.url, count, poll)
            before = proxy.upstreams["evm"].calls["eth_getTransactionReceipt"]
            through, through_polls = await receipt_waits(session, proxy.url(), count, poll)
            upstream = proxy.upstreams["evm"].calls["eth_getTransactionReceipt"] - before
        return [
            _row(f"{mode}, direct", direct, direct_polls, None),
            _row(f"{mode}, through the proxy", through, through_polls, upstream),
        ]
    finally:
        await proxy.close()
        anvil.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transactions", type=int, default=20)
    parser.add_argument("--poll", type=float, default=0.1, help="the client's receipt poll interval, seconds")
    args = parser.parse_args()
    rows = [f"{'receipt wait':28} {'p50 ms':>9} {'p90 ms':>9} {'polls':>7} {'to the node':>14}"]
    rows += asyncio.run(run("automine", (), args.transactions, args.poll))
    rows += asyncio.run(run("1 s blocks", ("--block-time", "1"), args.transactions, args.poll))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
