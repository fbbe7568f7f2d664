"""Benchmark: upstream selection and hedging. One Anvil behind three fault relays (one per upstream
URL, so each upstream's calls are counted where a provider counts them):

- calls per upstream under each selection policy (`priority`, `weighted` 3:1:1, `fastest` with the
  first upstream 20 ms slower than the others), for the same sequence of cache misses;
- p50/p99 latency of cache misses when the first upstream is slow on a tenth of the calls (300 ms),
  without hedging and with `hedge_after_ms = 50`, measured in the same run;
- the upstream calls it takes to keep 1,000 final `eth_getLogs` answers without checks, with
  `confirm_immutable = 2` and with `confirm_logs_bloom = true`: one filter over 10-block ranges, and
  many filters over the same blocks (the bloom check reads their headers from the cache).

    .venv/bin/python -m bench.upstreams [--calls 300]

Needs Anvil (`bash scripts/test.sh` installs it under .tools/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fault_relay import FaultRelay  # noqa: E402
from tests.support import Anvil, selector, settings_for, start_proxy, word  # noqa: E402


def _networks(directory: str, urls: list[str], weights: list[int], **fields: Any) -> str:
    entries = ", ".join(f'{{url = "{u}", weight = {w}}}' for u, w in zip(urls, weights, strict=True))
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())
    path = Path(directory) / f"networks-{secrets.token_hex(4)}.toml"
    path.write_text(f'[networks.evm]\nfamily = "evm"\n{extra}upstreams = [{entries}]\n')
    return str(path)


def _miss() -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": ["0x" + secrets.token_hex(20), "latest"]}


async def _run(relays: list[FaultRelay], networks: str, calls: int, slow_share: float = 0.0) -> list[float]:
    """Send `calls` cache misses one at a time; the first relay is slow (300 ms) on `slow_share` of them."""
    proxy = await start_proxy(settings_for(NETWORKS_FILE=networks))
    rng = random.Random(42)
    latencies = []
    try:
        await proxy.head_at(0)
        for relay in relays:
            relay.calls.clear()
        for _ in range(calls):
            if rng.random() < slow_share:
                relays[0].inject("slow", method="eth_getBalance", delay=0.3)
            started = time.perf_counter()
            status, body, _ = await proxy.post(_miss())
            latencies.append(time.perf_counter() - started)
            assert status == 200 and "result" in body, body
        for relay in relays:
            relay.clear()
        return latencies
    finally:
        await proxy.close()


async def _integrity_cost(anvil: Anvil, relays: list[FaultRelay], directory: str, urls: list[str]) -> None:
    """Upstream calls per 1,000 final eth_getLogs answers kept, per integrity setting, for two workloads:
    one filter over 50 ranges of 10 blocks (one chunk read and checked), and 50 filters (the store's
    address and one other) over one range: each a chunk of its own to read and check, over the same
    final blocks, whose headers the bloom check takes from the cache once it holds them."""
    store = anvil.deploy_store()
    first = anvil.block_number() + 1
    for _ in range(50):
        anvil.send(store, selector("emitMany(uint256)") + word(1))
        anvil.mine(9)
    anvil.mine(100)
    answers = 50
    workloads = {
        "one filter": [
            {"address": store, "fromBlock": hex(first + 10 * i), "toBlock": hex(first + 10 * i + 9)}
            for i in range(answers)
        ],
        "50 filters": [
            {"address": [store, "0x" + secrets.token_hex(20)], "fromBlock": hex(first), "toBlock": hex(first + 9)}
            for _ in range(answers)
        ],
    }
    print("\nupstream calls (batches unrolled) per 1,000 kept eth_getLogs answers")
    print("integrity check        one filter, 50 ranges     50 filters, one range")
    base: dict[str, float] = {}
    for label, fields in (
        ("none", {}),
        ("confirm_immutable = 2", {"confirm_immutable": 2}),
        ("confirm_logs_bloom", {"confirm_logs_bloom": True}),
    ):
        cells = []
        for workload, filters in workloads.items():
            proxy = await start_proxy(
                settings_for(NETWORKS_FILE=_networks(directory, urls, [1, 1, 1], **fields), HEAD_POLL_INTERVAL="60")
            )
            try:
                await proxy.head_at(anvil.block_number())
                before = sum(len(r.calls) for r in relays)
                for log_filter in filters:
                    status, body, _ = await proxy.post(
                        {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [log_filter]}
                    )
                    assert status == 200 and len(body["result"]) == 1, body
                calls = (sum(len(r.calls) for r in relays) - before) * 1000 / answers
            finally:
                await proxy.close()
            base.setdefault(workload, calls)
            cells.append(f"{calls:8.0f} ({calls / base[workload]:5.1f}x)")
        print(f"{label:<22} {cells[0]:>21} {cells[1]:>25}")


def _counts(relays: list[FaultRelay]) -> list[int]:
    return [sum(1 for c in r.calls if c.get("method") == "eth_getBalance") for r in relays]


def _p(latencies: list[float], q: float) -> float:
    return statistics.quantiles(latencies, n=100)[int(q) - 1] * 1000


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    anvil = Anvil()
    relays = [await FaultRelay(anvil.url).start() for _ in range(3)]
    urls = [r.url for r in relays]
    try:
        with tempfile.TemporaryDirectory() as directory:
            print("policy     calls to upstream #0  #1  #2")
            for policy in ("priority", "weighted", "fastest"):
                if policy == "fastest":
                    relays[0].inject("slow", method="eth_getBalance", times=None, delay=0.02)
                await _run(relays, _networks(directory, urls, [3, 1, 1], selection=policy), args.calls)
                counts = _counts(relays)
                print(f"{policy:<10} {counts[0]:>20} {counts[1]:>3} {counts[2]:>3}")
            print("\nfirst upstream slow (300 ms) on 10% of calls: miss latency, ms")
            print("hedging            p50     p99")
            rows = {}
            for label, fields in (("off", {}), ("after 50 ms", {"hedge_after_ms": 50})):
                latencies = await _run(relays, _networks(directory, urls, [1, 1, 1], **fields), args.calls, 0.1)
                rows[label] = (_p(latencies, 50), _p(latencies, 99))
                print(f"{label:<15} {rows[label][0]:6.2f} {rows[label][1]:7.2f}")
            print(f"p99 with hedging / without: {rows['after 50 ms'][1] / rows['off'][1]:.2f}x")
            await _integrity_cost(anvil, relays, directory, urls)
    finally:
        for relay in relays:
            await relay.close()
        anvil.stop()


if __name__ == "__main__":
    asyncio.run(main())
