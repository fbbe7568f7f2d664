"""Benchmark: what a verified miss costs, per method, against the same miss with verify = "off".

    .venv/bin/python -m bench.verify [--blocks 20]

Anvil gets a Store contract and `--blocks` blocks of two logs each, then enough blocks that all are
final. Two proxies run in this process, one NETWORKS_FILE each (`verify = "off"` and `"auto"`), each
over its own relay to the same Anvil (tests/lying_relay.py, honest), which counts the calls it
relays. For each method the proxy is asked once per block (each a miss: another block, another
key), after one warm-up call at another block (the header chain's checkpoint). Printed per method
and mode: this process's CPU time per miss (the proxy and its test client: the client's share is the
same in both modes, so the difference is the proof's), the upstream calls per miss, head polls
left out (calls with a block tag, eth_blockNumber, eth_chainId, eth_syncing), and the round trips to
the node they took (a batch is one).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.http.app_keys import SERVICE  # noqa: E402
from tests.lying_relay import LyingRelay  # noqa: E402
from tests.support import DEV_ACCOUNT, Anvil, Proxy, eventually, selector, settings_for, start_proxy, word  # noqa: E402

POLLS = frozenset({"eth_blockNumber", "eth_chainId", "eth_syncing", "net_version", "web3_clientVersion"})
TAGS = frozenset({"latest", "finalized", "safe", "earliest", "pending"})


def calls_of(store: str) -> dict[str, Any]:
    return {
        "eth_getStorageAt": lambda b: [store, "0x0", hex(b)],
        "eth_getBalance": lambda b: [DEV_ACCOUNT, hex(b)],
        "eth_getTransactionCount": lambda b: [DEV_ACCOUNT, hex(b)],
        "eth_getCode": lambda b: [store, hex(b)],
        "eth_getProof": lambda b: [store, ["0x" + "00" * 32], hex(b)],
        "eth_getBlockByNumber": lambda b: [hex(b), False],
        # Before eth_getBlockReceipts: a block's held receipts answer its logs (a hit).
        "eth_getLogs": lambda b: [{"address": store, "fromBlock": hex(b), "toBlock": hex(b)}],
        "eth_getBlockReceipts": lambda b: [hex(b)],
    }


def _counted(call: dict[str, Any]) -> bool:
    """A call of the miss's own: not a head poll."""
    return call.get("method") not in POLLS and not any(
        p in TAGS for p in call.get("params") or [] if isinstance(p, str)
    )


def counted(relay: LyingRelay) -> tuple[int, int]:
    """The calls relayed but head polls, and the requests (round trips to the node) they went in."""
    return sum(1 for c in relay.calls if _counted(c)), sum(1 for post in relay.posts if any(map(_counted, post)))


async def start(anvil: Anvil, mode: str, folder: Path, final: int) -> tuple[Proxy, LyingRelay]:
    relay = await LyingRelay(anvil.url).start()
    path = folder / f"networks-{mode}.toml"
    path.write_text(f'[networks.evm]\nfamily = "evm"\nverify = "{mode}"\nupstreams = ["{relay.url}"]\n')
    proxy = await start_proxy(settings_for(NETWORKS_FILE=str(path), HEAD_POLL_INTERVAL="0.5"))

    async def is_final() -> bool:
        head = proxy.app[SERVICE].networks["evm"].tracker.head
        return head is not None and head.finalized >= final and bool(head.final_hash)

    await eventually(is_final, 20.0, "the blocks final")
    return proxy, relay


async def measure(
    proxy: Proxy, relay: LyingRelay, method: str, params: Any, blocks: list[int]
) -> tuple[float, float, float]:
    """(CPU µs per miss, upstream calls per miss, round trips to the node per miss)."""
    await proxy.post({"jsonrpc": "2.0", "id": 0, "method": method, "params": params(blocks[0] - 1)})  # warm-up
    relay.calls.clear()
    relay.posts.clear()
    cpu = time.process_time()
    for block in blocks:
        _, body, headers = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params(block)})
        assert "result" in body and headers["X-Cache"] == "MISS", (method, body, dict(headers))
    spent = time.process_time() - cpu
    calls, trips = counted(relay)
    return spent / len(blocks) * 1e6, calls / len(blocks), trips / len(blocks)


async def main(blocks: int) -> None:
    anvil = Anvil()
    try:
        store = anvil.deploy_store()
        anvil.mine(3)
        first = anvil.block_number() + 1
        for _ in range(blocks):
            anvil.send(store, selector("emitMany(uint256)") + word(2))
        numbers = list(range(first, first + blocks))
        anvil.mine(100)
        results: dict[str, Counter[str]] = {}
        with tempfile.TemporaryDirectory() as folder:
            for mode in ("off", "auto"):
                proxy, relay = await start(anvil, mode, Path(folder), numbers[-1])
                try:
                    for method, params in calls_of(store).items():
                        cpu, upstream, trips = await measure(proxy, relay, method, params, numbers)
                        results.setdefault(method, Counter())[f"{mode}_cpu"] = round(cpu)
                        results[method][f"{mode}_calls"] = round(upstream, 2)  # type: ignore[assignment]
                        results[method][f"{mode}_trips"] = round(trips, 2)  # type: ignore[assignment]
                finally:
                    await proxy.close()
                    await relay.close()
        print(
            f"{'method':<26} {'off µs':>8} {'auto µs':>8} {'extra µs':>9} {'off calls':>10} {'auto calls':>11} "
            f"{'off trips':>10} {'auto trips':>11}"
        )
        for method, row in results.items():
            extra = row["auto_cpu"] - row["off_cpu"]
            print(
                f"{method:<26} {row['off_cpu']:>8} {row['auto_cpu']:>8} {extra:>9} "
                f"{row['off_calls']:>10} {row['auto_calls']:>11} {row['off_trips']:>10} {row['auto_trips']:>11}"
            )
    finally:
        anvil.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=20, help="misses per method and mode (one per block)")
    asyncio.run(main(parser.parse_args().blocks))
