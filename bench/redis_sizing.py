"""Benchmark: what one cached answer costs in Redis, by method (for sizing `maxmemory`).

    .venv/bin/python -m bench.redis_sizing [--storage N]

Runs the proxy in front of Anvil, the in-repo fake Solana node and a private redis-server, asks
each first-class method for a few answers, then reads `MEMORY USAGE` of every `rcp:c:*` key the
method left, beside the key's and the value's own lengths. Then N distinct eth_getStorageAt answers
show what Redis's `used_memory` grows by per entry, tables included (what `maxmemory` counts).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from tests.fake_solana import TOKEN_ACCOUNT, FakeSolana  # noqa: E402
from tests.support import (  # noqa: E402
    DEV_ACCOUNT,
    Anvil,
    Proxy,
    RedisServer,
    selector,
    settings_for,
    start_proxy,
    word,
)

GIB = 2**30


def usage_row(method: str, client: redis.Redis, keys: list[bytes]) -> str:
    sizes = [(len(k), len(client.get(k) or b""), int(client.memory_usage(k, samples=0) or 0)) for k in keys]
    n = len(sizes)
    if n == 0:  # the method's answers were not stored (not cacheable as asked): nothing to size
        return f"{method:34} {0:>4}  (nothing stored)"
    key, value, usage = (sum(s[i] for s in sizes) / n for i in range(3))
    return (
        f"{method:34} {n:>4} {key:>9.0f} {value:>10.0f} {usage:>13.0f} {usage - key - value:>9.0f} "
        f"{GIB / usage:>14,.0f}"
    )


async def measure(storage: int) -> None:
    anvil, server, solana = Anvil(), RedisServer(), await FakeSolana().start()
    proxy: Proxy | None = None
    try:
        store = anvil.deploy_store()
        logs_block = anvil.send(store, selector("emitMany(uint256)") + word(3))["blockNumber"]
        receipts_blocks = [anvil.send(store, selector("setX(uint256)") + word(i))["blockNumber"] for i in range(5)]
        anvil.mine(70)  # everything above is final now: immutable entries, as most are in production
        final = hex(anvil.block_number() - 70)
        # A generous Redis timeout: on a busy host the default 0.25 s would skip some stores.
        proxy = await start_proxy(
            settings_for(EVM_UPSTREAM=anvil.url, SOLANA_UPSTREAM=solana.url, REDIS_URL=server.url, REDIS_TIMEOUT="5")
        )
        await proxy.head_at(anvil.block_number())
        hashes = [anvil.rpc("eth_getBlockByNumber", hex(n), False)["hash"] for n in range(1, 6)]
        call = {"from": DEV_ACCOUNT, "to": store}
        methods: dict[str, Callable[[Proxy], Awaitable[Any]]] = {
            "eth_getStorageAt": lambda p: asyncio.gather(
                *(p.call("eth_getStorageAt", [store, hex(i), final]) for i in range(5))
            ),
            "eth_call": lambda p: asyncio.gather(
                *(p.call("eth_call", [{**call, "data": selector(f)}, final]) for f in ("x()", "boom()"))
            ),
            "eth_getLogs (3 logs)": lambda p: p.call(
                "eth_getLogs", [{"address": store, "fromBlock": logs_block, "toBlock": logs_block}]
            ),
            "eth_getBlockReceipts (1 tx)": lambda p: asyncio.gather(
                *(p.call("eth_getBlockReceipts", [b]) for b in receipts_blocks)
            ),
            "eth_getUncleByBlockHashAndIndex": lambda p: asyncio.gather(
                *(p.call("eth_getUncleByBlockHashAndIndex", [h, "0x0"]) for h in hashes)
            ),
            "getTokenAccountBalance": lambda p: p.call("getTokenAccountBalance", [TOKEN_ACCOUNT]),
            "getLargestAccounts (20 accounts)": lambda p: asyncio.gather(
                p.call("getLargestAccounts", []), p.call("getLargestAccounts", [{"filter": "circulating"}])
            ),
        }
        client = redis.Redis(host="127.0.0.1", port=server.port)
        print(
            f"{'method (sample answers)':34} {'keys':>4} {'key bytes':>9} {'value bytes':>10} "
            f"{'MEMORY USAGE':>13} {'overhead':>9} {'entries / GiB':>14}"
        )
        for method, ask in methods.items():
            before = set(client.scan_iter("rcp:c:*"))
            await ask(proxy)
            print(usage_row(method, client, sorted(set(client.scan_iter("rcp:c:*")) - before)), flush=True)

        client.flushall()
        used = int(client.info("memory")["used_memory"])
        for start in range(0, storage, 100):
            batch = range(start, min(start + 100, storage))
            await proxy.post(
                [
                    {"jsonrpc": "2.0", "id": i, "method": "eth_getStorageAt", "params": [store, hex(1000 + i), final]}
                    for i in batch
                ]
            )
        held = len(list(client.scan_iter("rcp:c:*", count=1000)))
        grown = int(client.info("memory")["used_memory"]) - used
        print(
            f"\n{held:,} eth_getStorageAt entries: used_memory grew {grown / 2**20:.1f} MiB, "
            f"{grown / held:.0f} bytes per entry (tables included), {GIB * held / grown:,.0f} entries per GiB"
        )
    finally:
        try:
            if proxy is not None:
                await proxy.close()  # may raise on a busy host (Redis's close timing out): stop the rest anyway
        finally:
            await solana.close()
            server.stop()
            anvil.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", type=int, default=20_000, help="eth_getStorageAt entries for used_memory")
    args = parser.parse_args()
    asyncio.run(measure(args.storage))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
