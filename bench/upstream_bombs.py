"""Benchmark: what a hostile upstream's reply costs a proxy process, per attack and path.

    .venv/bin/python -m bench.upstream_bombs [--rounds N]

A `python -m proxy` process runs in front of tests/fault_relay.BombRelay (itself in front of a fake
EVM node). For each bomb (a gzip bomb of ~400 KB inflating to 400 MB; 300 MB chunked, until close,
or with a declared Content-Length) and each path (a call alone, a proven read, a client batch of
three reads), the bomb answers the path's upstream request; printed: the reply the client got, the
bytes the relay managed to write before the proxy dropped it, the seconds to the answer, and the
proxy's RSS before and after (absolute: the behaviour before the bound cannot run beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from tests.fake_evm import FakeEvm  # noqa: E402
from tests.fault_relay import BOMBS, BombRelay, Calls, gzip_bomb  # noqa: E402
from tests.memory_fill import ProxyProcess, rss_bytes, wait_for_head  # noqa: E402

MIB = 2**20
ADDRESS = "0x" + "ab" * 20


def storage(slot: int, rid: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": "eth_getStorageAt", "params": [ADDRESS, hex(slot), "0x1"]}


def asks_slot(slot: int) -> Callable[[Calls, bool], bool]:
    return lambda calls, _b: any(
        c.get("method") == "eth_getStorageAt" and int(c["params"][1], 16) == slot for c in calls
    )


def paths(slot: int) -> list[tuple[str, Any, Callable[[Calls, bool], bool]]]:
    single = {"jsonrpc": "2.0", "id": 1, "method": "eth_estimateGas", "params": [{"to": ADDRESS}]}
    return [
        ("single", single, lambda calls, _b: any(c.get("method") == "eth_estimateGas" for c in calls)),
        ("proven", storage(slot), asks_slot(slot)),
        ("batch", [storage(slot + i, i) for i in range(1, 4)], asks_slot(slot + 1)),
    ]


def outcome(reply: Any) -> str:
    items = reply if isinstance(reply, list) else [reply]
    codes = sorted({str((item.get("error") or {}).get("code", "result")) for item in items})
    return "/".join(codes)


async def run(rounds: int) -> None:
    gzip_bomb()
    node = await FakeEvm().start()
    relay = await BombRelay(node.url).start()
    proxy = ProxyProcess(relay.url, 64 * MIB)
    try:
        async with aiohttp.ClientSession() as session:
            await wait_for_head(proxy, session)
            start = rss_bytes(proxy.proc.pid)
            print(f"proxy RSS at start: {start / MIB:.0f} MB")
            print(
                f"{'bomb':9} {'path':7} {'reply':>8} {'relay sent MB':>14} {'seconds':>8} "
                f"{'RSS before':>11} {'RSS after':>10}"
            )
            slot = 100
            for _ in range(rounds):
                for bomb in BOMBS:
                    slot += 10
                    for name, body, match in paths(slot):
                        before = rss_bytes(proxy.proc.pid)
                        asked = len(relay.requests)
                        relay.arm(bomb, match)
                        started = time.perf_counter()
                        async with session.post(proxy.url, json=body) as response:
                            reply = await response.json(content_type=None)
                        seconds = time.perf_counter() - started
                        bombed = [r for r in relay.requests[asked:] if r.bomb]
                        while not all(r.exploded for r in bombed):  # until the relay's writes fail
                            await asyncio.sleep(0.01)
                        sent = sum(r.bomb_sent for r in bombed)
                        after = rss_bytes(proxy.proc.pid)
                        print(
                            f"{bomb:9} {name:7} {outcome(reply):>8} {sent / MIB:>14.1f} {seconds:>8.2f} "
                            f"{before / MIB:>10.0f}M {after / MIB:>9.0f}M"
                        )
            end = rss_bytes(proxy.proc.pid)
            print(f"proxy RSS at end: {end / MIB:.0f} MB (grew {(end - start) / MIB:.0f} MB)")
    finally:
        proxy.stop()
        await relay.close()
        await node.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="times each bomb meets each path")
    asyncio.run(run(parser.parse_args().rounds))


if __name__ == "__main__":
    main()
