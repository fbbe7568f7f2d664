"""Benchmark: the CPU cost of proving what a node says about a final block, in this process.

    .venv/bin/python -m bench.verify_primitives [--receipts 5,50,200] [--seconds 0.5]

Prints µs per call, the median of five runs, for: keccak-256 of 32 and 532 bytes (the proxy's,
safe-pysha3; pycryptodome and eth_hash where installed, for comparison), a Prague header's hash from
its JSON fields, an account and three storage slots checked from an eth_getProof reply,
receiptsRoot (and transactionsRoot) of blocks of N receipts, and one transaction's sender recovered
from its signature. Needs Anvil
(`bash scripts/test.sh` installs it under .tools/) for the proofs and the receipts; the header comes
from tests/fixtures/anvil_headers.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.chain.fields import keccak256  # noqa: E402
from proxy.chain.headers import header_hash, verify_header  # noqa: E402
from proxy.chain.receipts_root import receipts_root  # noqa: E402
from proxy.chain.senders import sender  # noqa: E402
from proxy.chain.transactions_root import transactions_root  # noqa: E402
from proxy.chain.trie_proof import verify_account  # noqa: E402
from tests.support import DEV_ACCOUNT, Anvil, mapping_slot, selector, word  # noqa: E402


def per_call_us(work: Callable[[], object], seconds: float) -> float:
    """Median over five runs of the µs one call takes, each run about `seconds` long."""
    calls = 1
    while True:  # size a run
        started = time.perf_counter()
        for _ in range(calls):
            work()
        if time.perf_counter() - started > seconds / 5:
            break
        calls *= 2
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            work()
        runs.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(runs)


def _receipts_block(node: Anvil, store: str, count: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A block of `count` transactions, a third of them emitting two logs; its receipts and transactions."""
    node.rpc("evm_setAutomine", False)
    for index in range(count):
        payload = selector("emitMany(uint256)") + word(2) if index % 3 == 0 else selector("setX(uint256)") + word(index)
        node.rpc("eth_sendTransaction", {"from": DEV_ACCOUNT, "to": store, "data": payload, "gas": hex(100_000)})
    node.mine(1)
    node.rpc("evm_setAutomine", True)
    block = node.rpc("eth_getBlockByNumber", "latest", True)
    receipts = node.rpc("eth_getBlockReceipts", block["number"])
    assert len(receipts) == count and receipts_root(receipts).hex() == block["receiptsRoot"][2:]
    return receipts, block["transactions"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--receipts", default="5,50,200", help="block sizes, comma-separated")
    parser.add_argument("--seconds", type=float, default=0.5, help="time per figure")
    args = parser.parse_args()
    rows: list[tuple[str, float]] = []
    short, long = b"\x11" * 32, b"\x22" * 532
    rows.append(("keccak-256, 32 B (safe-pysha3, the proxy's)", per_call_us(lambda: keccak256(short), args.seconds)))
    rows.append(("keccak-256, 532 B (safe-pysha3, the proxy's)", per_call_us(lambda: keccak256(long), args.seconds)))
    try:  # for comparison, where installed (the test extras' web3 brings both)
        from Crypto.Hash import keccak

        rows.append(
            (
                "keccak-256, 32 B (pycryptodome)",
                per_call_us(lambda: keccak.new(data=short, digest_bits=256).digest(), args.seconds),
            )
        )
    except ImportError:
        pass
    try:
        from eth_hash.auto import keccak as eth_keccak

        rows.append(("keccak-256, 32 B (eth_hash)", per_call_us(lambda: eth_keccak(short), args.seconds)))
    except ImportError:
        pass
    header = json.loads((ROOT / "tests/fixtures/anvil_headers.json").read_text())["prague"]
    rows.append(("header hash from JSON fields (Prague)", per_call_us(lambda: header_hash(header), args.seconds)))
    rows.append(("header verified (hash + record)", per_call_us(lambda: verify_header(header), args.seconds)))
    node = Anvil()
    try:
        store = node.deploy_store()
        for slot in range(100, 400):  # a storage trie a few levels deep
            node.rpc("anvil_setStorageAt", store, "0x" + word(slot), "0x" + word(slot + 1))
        node.mine(1)
        block = node.rpc("eth_getBlockByNumber", "latest", False)
        root = verify_header(block).state_root
        keys = ["0x" + word(0), mapping_slot(DEV_ACCOUNT, 1), "0x" + word(250)]
        reply = node.rpc("eth_getProof", store, keys, block["number"])
        depth = len(reply["storageProof"][2]["proof"])
        rows.append(
            (
                f"account + 3 slots proven ({len(reply['accountProof'])}+{depth} nodes)",
                per_call_us(lambda: verify_account(root, reply, store, keys), args.seconds),
            )
        )
        for count in (int(size) for size in args.receipts.split(",")):
            receipts, transactions = _receipts_block(node, store, count)
            rows.append(
                (f"receiptsRoot of {count} receipts", per_call_us(lambda r=receipts: receipts_root(r), args.seconds))
            )  # type: ignore[misc]
            rows.append(
                (
                    f"transactionsRoot of {count} transactions",
                    per_call_us(lambda t=transactions: transactions_root(t), args.seconds),
                )
            )  # type: ignore[misc]
        rows.append(
            ("sender recovered (secp256k1, coincurve)", per_call_us(lambda t=transactions[0]: sender(t), args.seconds))
        )  # type: ignore[misc]
    finally:
        node.stop()
    for name, micros in rows:
        print(f"{name:48} {micros:10.1f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
