"""Benchmark: bytes and CPU per cache hit with gzip, for answers the size of a large eth_getLogs and
of a block's receipts: the body sent plain, gzip computed whole on every hit, and the spliced gzip
the proxy sends (the result deflated once, kept, and only framed per hit: compression.py).

    .venv/bin/python -m bench.compression [--hits 50]

Pure CPU in this process (no server, no network), so the figures do not depend on a shared host's load
as much as the HTTP benchmarks'; the per-hit HTTP cost comes on top (bench.cache_hit).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.http.compression import Compressor, gzip_whole  # noqa: E402
from proxy.rpc import jsonrpc  # noqa: E402


def _log(i: int) -> dict[str, object]:
    return {
        "address": "0x" + f"{i % 7:040x}",
        "topics": ["0x" + f"{i * 31 + t:064x}" for t in range(3)],
        "data": "0x" + f"{i * 977:064x}" * 2,
        "blockNumber": hex(19_000_000 + i // 50),
        "transactionHash": "0x" + f"{i * 7919:064x}",
        "transactionIndex": hex(i % 50),
        "blockHash": "0x" + f"{i // 50 * 104729:064x}",
        "logIndex": hex(i),
        "removed": False,
    }


def per_hit(label: str, work: object, hits: int) -> tuple[str, float]:
    started = time.process_time()
    for rid in range(hits):
        work(rid)  # type: ignore[operator]
    return label, (time.process_time() - started) / hits * 1e6


def row(name: str, payload: bytes, hits: int) -> str:
    compressor = Compressor(1, 256 << 20)
    compressor.gzip(jsonrpc.encode_result(0, payload))  # the miss: deflated once and kept
    body = jsonrpc.encode_result(1, payload)
    packed = compressor.gzip(body)
    assert gzip.decompress(packed) == body
    timings = [
        per_hit("plain", lambda rid: jsonrpc.encode_result(rid, payload), hits),
        per_hit("gzip whole", lambda rid: gzip_whole(jsonrpc.encode_result(rid, payload)), max(hits // 10, 3)),
        per_hit("spliced", lambda rid: compressor.gzip(jsonrpc.encode_result(rid, payload)), hits),
    ]
    cpu = ", ".join(f"{label} {us:,.0f}" for label, us in timings)
    return f"{name:22} {len(body):10,} {len(packed):11,} {len(body) / len(packed):6.1f}   {cpu}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hits", type=int, default=50)
    args = parser.parse_args()
    print(f"{'answer':22} {'bytes':>10} {'gzip bytes':>11} {'ratio':>6}   {'CPU us per hit':>28}")
    for name, count in (("eth_getLogs 3 MB", 6_000), ("block receipts 600 KB", 1_200)):
        print(row(name, json.dumps([_log(i) for i in range(count)], separators=(",", ":")).encode(), args.hits))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
