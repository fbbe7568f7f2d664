"""Benchmark: newHeads + logs fan-out. For N subscribers (each on its own WebSocket, subscribed to
newHeads and to logs of one contract), mine blocks that each emit one event and measure the time
from the block being mined to every subscriber holding its head and its log, and the upstream calls
made per block. Everything runs on loopback, in one run; the clients share the proxy's process.

    .venv/bin/python -m bench.fanout [--subscribers 1,50,200] [--blocks 20]

Needs Anvil (`bash scripts/test.sh` installs it under .tools/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import Anvil, selector, settings_for, start_proxy, word  # noqa: E402


async def round_for(anvil: Anvil, store: str, subscribers: int, blocks: int) -> dict[str, float]:
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, HEAD_POLL_INTERVAL="0.05"))
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    sockets = []
    try:
        await proxy.head_at(anvil.block_number())
        for _ in range(subscribers):
            ws = await session.ws_connect(proxy.ws_url())
            for rid, params in ((1, ["newHeads"]), (2, ["logs", {"address": store}])):
                await ws.send_str(
                    json.dumps({"jsonrpc": "2.0", "id": rid, "method": "eth_subscribe", "params": params})
                )
                await ws.receive(timeout=10)
            sockets.append(ws)
        upstream = proxy.upstreams["evm"]
        upstream.batched.clear()
        started = time.process_time()
        latencies = []
        for _ in range(blocks):
            mined = time.perf_counter()
            await asyncio.to_thread(anvil.send, store, selector("emitMany(uint256)") + word(1))
            for ws in sockets:
                for _ in range(2):  # its head and its log
                    await ws.receive(timeout=30)
            latencies.append(time.perf_counter() - mined)
        cpu = time.process_time() - started
        # The feed's own reads (the tracker's polls are the same with or without subscribers).
        per_block = (upstream.batched["eth_getBlockByHash"] + upstream.batched["eth_getLogs"]) / blocks
        return {
            "subscribers": subscribers,
            "p50_ms": statistics.median(latencies) * 1000,
            "max_ms": max(latencies) * 1000,
            "cpu_us_per_notification": cpu / (blocks * subscribers * 2) * 1e6,  # clients' CPU included
            "feed_calls_per_block": per_block,
        }
    finally:
        for ws in sockets:
            await ws.close()
        await session.close()
        await proxy.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subscribers", default="1,50,200")
    parser.add_argument("--blocks", type=int, default=20)
    args = parser.parse_args()
    anvil = Anvil()
    try:
        store = anvil.deploy_store()
        print("subscribers  p50 ms  max ms  cpu us/notification  header+log fetches per block")
        for count in (int(c) for c in args.subscribers.split(",")):
            row = await round_for(anvil, store, count, args.blocks)
            print(
                f"{row['subscribers']:>11}  {row['p50_ms']:6.1f}  {row['max_ms']:6.1f}  "
                f"{row['cpu_us_per_notification']:19.1f}  {row['feed_calls_per_block']:.1f}"
            )
    finally:
        anvil.stop()


if __name__ == "__main__":
    asyncio.run(main())
