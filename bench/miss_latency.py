"""Benchmark: what a cache miss adds to the node's own latency, at concurrency 1 and 32.

    .venv/bin/python -m bench.miss_latency [--seconds 3] [--rounds 3]

Every request reads a storage position not read before (wrk's script counts them), so every one is a
miss that goes to the node; the same script runs directly against the node (Anvil). One proxy
process (EVENT_LOOP=uvloop when installed), pinned like bench.cache_hit. Medians over the rounds,
which alternate proxy and direct. Needs wrk (apt-get install wrk) and Anvil (scripts/test.sh).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cache_hit import (  # noqa: E402
    Result,
    final_storage_request,
    median,
    proxy_env,
    require_wrk,
    start,
    table,
    unique_storage_script,
    warmed,
    wrk,
)
from tests.support import Anvil, free_port  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=3, help="length of one wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating proxy and direct rounds")
    args = parser.parse_args()
    require_wrk()
    anvil = Anvil()
    proc: subprocess.Popen[bytes] | None = None
    env = proxy_env(anvil.url)
    rows: list[Result] = []
    try:
        request = final_storage_request(anvil)
        port = free_port()
        proc = start([sys.executable, "-m", "proxy"], port, {**env, "PROXY_PORT": str(port)})
        url = f"http://127.0.0.1:{port}/v3/bench"
        warmed(url, request)
        store, _slot, block = request["params"]  # type: ignore[index]
        for concurrency in (1, 32):
            proxied: list[Result] = []
            direct: list[Result] = []
            for round_ in range(args.rounds):
                # A fresh range of positions per run: never a hit, never one the node has read.
                base = (concurrency * 10 + round_) * 1_000_000
                for name, target, offset, into, pid in (
                    (f"anvil direct, c={concurrency}", anvil.url, base, direct, None),
                    (f"proxy miss, c={concurrency}", url, base + 2**30, proxied, proc.pid),
                ):
                    script = unique_storage_script(store, block).replace("counter + 1000000", f"counter + {offset}")
                    into.append(wrk(name, target, script, args.seconds, concurrency, pid))
            rows += [median(direct), median(proxied)]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        anvil.stop()
    print(
        f"wrk -t1 -d{args.seconds}s, every call a new storage position, {args.rounds} alternating rounds "
        f"(table: medians), EVENT_LOOP={env.get('EVENT_LOOP', 'asyncio')}"
    )
    print(table(rows))
    for i in range(0, len(rows), 2):
        node, proxy = rows[i], rows[i + 1]
        print(
            f"{proxy.name}: adds {proxy.p50_ms - node.p50_ms:+.2f} ms p50, {proxy.p99_ms - node.p99_ms:+.2f} ms p99 "
            f"to the node's own (target at c=1: <= +0.30 ms p50)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
