"""Benchmark: what a CACHE_MEMORY_BYTES bound holds in a proxy process, measured from outside.

    .venv/bin/python -m bench.memory_bound [--bound BYTES] [--small N] [--big N] [--entry-cost] [--memos]

Two `python -m proxy` processes run side by side in front of one fake EVM node (tests/fake_evm.py)
and are sent the same distinct finalized calls: one bounded at --bound, one with
CACHE_MEMORY_BYTES=1, which holds nothing. The difference of their RSS is what the tier holds; it
is printed beside the setting, the rpc_proxy_cache_memory_bytes metric and the entries held.
Scenarios: N small answers (eth_getStorageAt, a 32-byte word each), N answers of 100 KB (eth_call),
and both in turn in the same processes (small, then large). With --entry-cost it also measures,
in this process, what one entry costs (tracemalloc and RSS over many entries) against what the tier
counts for it: the measurement the tier's accounting was derived from. With --memos, what the
service's memos of validated calls and plans hold per distinct call, traced in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.cache.tiers import MemoryTier, cache_key  # noqa: E402
from proxy.rpc.jsonrpc import dumps  # noqa: E402
from proxy.service import MEMO_SIZE  # noqa: E402
from proxy.values import Answer  # noqa: E402
from tests.fake_evm import FakeEvm  # noqa: E402
from tests.memory_fill import Reading, big_call, fill_side_by_side, rss_bytes, storage_call  # noqa: E402
from tests.support import CountingUpstream, FakeClock, settings_for, start_proxy  # noqa: E402

MIB = 2**20
Phase = tuple[Callable[[], Iterator[dict[str, Any]]], int, int]


def row(name: str, bound: int, bounded: Reading, baseline: Reading) -> str:
    held = bounded.rss - baseline.rss
    return (
        f"{name:28} {bound / MIB:8.1f} {bounded.metric_bytes / MIB:10.2f} {bounded.entries:9.0f} "
        f"{bounded.rss / MIB:11.1f} {baseline.rss / MIB:12.1f} {held / MIB:9.1f} {held / bound:12.2f}"
    )


async def side_by_side(bound: int, small: int, big: int) -> None:
    small_phase: Phase = (lambda: map(storage_call, range(1, small + 1)), 100, 4)
    big_phase: Phase = (lambda: map(big_call, range(big)), 10, 2)
    print(
        f"{'scenario':28} {'bound MiB':>8} {'metric MiB':>10} {'entries':>9} {'RSS MiB':>11} "
        f"{'baseline MiB':>12} {'held MiB':>9} {'held / bound':>12}"
    )
    [(bounded, baseline)] = await fill_side_by_side(bound, [small_phase])
    print(row(f"{small:,} small answers", bound, bounded, baseline), flush=True)
    [(bounded, baseline)] = await fill_side_by_side(bound, [big_phase])
    print(row(f"{big:,} answers of 100 KB", bound, bounded, baseline), flush=True)
    readings = await fill_side_by_side(bound, [small_phase, big_phase])
    print(row("small, then 100 KB (same)", bound, *readings[1]), flush=True)


KINDS: dict[str, tuple[int, Callable[[int], bytes]]] = {  # entries, and the payload of entry i
    "32-byte word (eth_getStorageAt)": (100_000, lambda i: dumps("0x" + format(i, "064x"))),
    "1 KB answer": (20_000, lambda i: dumps(format(i, "064x") * 16)),
    "100 KB answer": (500, lambda i: dumps(format(i, "064x") * 1_600)),
}


def fill(kind: str) -> MemoryTier:
    count, payload = KINDS[kind]
    tier = MemoryTier(2**40, FakeClock())
    for i in range(count):
        key = cache_key("evm", "eth_getStorageAt", ["0x" + "ab" * 20, "0x" + format(i, "064x"), {"n": 123}])
        tier.set(key, (payload(i), False), math.inf)  # payloads straight from orjson, as upstream answers are
    return tier


def rss_growth(kind: str) -> int:
    """How much this process's RSS grows while filling a tier with `kind` (run it in a fresh process)."""
    gc.collect()
    before = rss_bytes()
    tier = fill(kind)
    grown = rss_bytes() - before
    del tier
    return grown


def entry_cost(kind: str) -> str:
    """Per entry: what tracemalloc sees, what RSS grows by (in a fresh process), what the tier counts."""
    count = KINDS[kind][0]
    grown = subprocess.run(
        [sys.executable, "-m", "bench.memory_bound", "--rss-growth", kind],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tier = fill(kind)
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return (
        f"{kind:34} {count:>8,} {traced / count:>12.0f} {int(grown) / count:>10.0f} "
        f"{tier.bytes_used / count:>12.0f} {tier.bytes_used / traced:>9.3f}"
    )


def entry_costs() -> None:
    print(
        f"{'entries (key: a storage slot)':34} {'count':>8} {'tracemalloc':>12} {'RSS':>10} "
        f"{'counted':>12} {'counted / traced':>9}   (bytes per entry)"
    )
    for kind in KINDS:
        print(entry_cost(kind), flush=True)


class QuietUpstream(CountingUpstream):
    """Counts nothing and keeps no params, so only the proxy's own memory is traced."""

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer:
        answer: Answer = await self.inner.request(method, params, timeout=timeout)
        return answer


def logs_call(i: int) -> dict[str, Any]:
    """A distinct eth_getLogs filter whose params are about 490 bytes of JSON (memos keep up to 512)."""
    log_filter = {
        "address": ["0x" + format(i * 10 + j, "040x") for j in range(8)],
        "fromBlock": "0x1",
        "toBlock": "0x2",
        "topics": ["0x" + format(i, "064x")],
    }
    return {"jsonrpc": "2.0", "id": i, "method": "eth_getLogs", "params": [log_filter]}


async def memo_cost(make: Callable[[int], dict[str, Any]]) -> float:
    """Bytes the proxy keeps per distinct call while its memos fill (nothing cached): traced in process."""
    node = await FakeEvm().start()
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=node.url, CACHE_MEMORY_BYTES="1"), upstream_class=QuietUpstream)
    try:
        await proxy.head_at(node.chain.latest)

        async def send(first: int, last: int) -> None:
            for start in range(first, last, 100):
                await proxy.post([make(i) for i in range(start, min(start + 100, last))])

        await send(1, 200)  # warm: connections, label sets, the interpreter's caches
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        await send(200, 9_900)  # below MEMO_SIZE: the memos fill and are not yet started over
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) / 9_700
    finally:
        tracemalloc.stop()
        await proxy.close()
        await node.close()


async def memo_costs() -> None:
    for name, make in (("eth_getStorageAt", storage_call), ("eth_getLogs, 490-byte params", logs_call)):
        per_call = await memo_cost(make)
        print(
            f"memos, {name:30} {per_call:6.0f} bytes per distinct call, "
            f"{per_call * MEMO_SIZE / MIB:5.1f} MiB when full ({MEMO_SIZE:,} calls)",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bound", type=int, default=8 * MIB, help="CACHE_MEMORY_BYTES of the bounded process")
    parser.add_argument("--small", type=int, default=150_000, help="distinct small answers sent")
    parser.add_argument("--big", type=int, default=2_000, help="distinct 100 KB answers sent")
    parser.add_argument("--entry-cost", action="store_true", help="also measure one entry's cost in this process")
    parser.add_argument("--memos", action="store_true", help="also measure what the service's memos hold when full")
    parser.add_argument("--rss-growth", choices=KINDS, help=argparse.SUPPRESS)  # one fresh process's measurement
    args = parser.parse_args()
    if args.rss_growth:
        print(rss_growth(args.rss_growth))
        return 0
    if args.entry_cost:
        entry_costs()
        print()
    if args.memos:
        asyncio.run(memo_costs())
        print()
    if args.small and args.big:  # --small 0 or --big 0: only the in-process measurements
        asyncio.run(side_by_side(args.bound, args.small, args.big))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
