"""Benchmark: what a cache miss adds to the node's own latency, at concurrency 1 and 32.

    .venv/bin/python -m bench.miss_latency [--seconds 3] [--rounds 3] [--concurrency 1,32] [--before DIR] [--floor]

Every request reads a storage position not read before (wrk's script counts them), so every one is a
miss that goes to the node; the same script runs directly against the node (Anvil). One proxy
process (EVENT_LOOP=uvloop when installed), pinned like bench.cache_hit. Medians over the rounds,
which alternate proxy and direct. `--before DIR`: a second proxy, run from another tree (`git archive REV
proxy bench tests`), in the same rounds; `--floor`: bench.floor_relay too, the least a relay on this
stack adds. Needs wrk (apt-get install wrk) and Anvil (scripts/test.sh).
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
    parser.add_argument("--concurrency", default="1,32", help="wrk connections, one run per figure (1,32)")
    parser.add_argument("--before", type=Path, help="a second proxy run from this tree (git archive REV), same rounds")
    parser.add_argument("--floor", action="store_true", help="also bench.floor_relay: this stack's least miss")
    args = parser.parse_args()
    require_wrk()
    anvil = Anvil()
    procs: list[subprocess.Popen[bytes]] = []
    env = proxy_env(anvil.url)
    rows: list[Result] = []
    try:
        request = final_storage_request(anvil)
        store, _slot, block = request["params"]  # type: ignore[index]
        servers: list[tuple[str, str, subprocess.Popen[bytes]]] = []
        for name, cmd, cwd in (
            ("proxy miss", [sys.executable, "-m", "proxy"], None),
            ("before miss", [sys.executable, "-m", "proxy"], args.before),
            ("floor relay", [sys.executable, "-m", "bench.floor_relay"], ROOT if args.floor else None),
        ):
            if name != "proxy miss" and cwd is None:
                continue
            port = free_port()
            command = [*cmd, str(port), anvil.url] if name == "floor relay" else cmd
            procs.append(start(command, port, {**env, "PROXY_PORT": str(port)}, cwd))
            url = f"http://127.0.0.1:{port}/v3/bench"
            warmed(url, request)
            servers.append((name, url, procs[-1]))
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            results: list[list[Result]] = [[] for _ in range(len(servers) + 1)]
            for round_ in range(args.rounds):
                # A fresh range of positions per run and per server: never a hit, never one the node has read.
                base = (concurrency * 10 + round_) * 1_000_000
                runs = [(f"anvil direct, c={concurrency}", anvil.url, None)]
                runs += [(f"{name}, c={concurrency}", url, proc.pid) for name, url, proc in servers]
                for i, (name, target, pid) in enumerate(runs):
                    offset = base + i * 2**30
                    script = unique_storage_script(store, block).replace("counter + 1000000", f"counter + {offset}")
                    results[i].append(wrk(name, target, script, args.seconds, concurrency, pid))
            rows += [median(runs) for runs in results]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        anvil.stop()
    print(
        f"wrk -t1 -d{args.seconds}s, every call a new storage position, {args.rounds} alternating rounds "
        f"(table: medians), EVENT_LOOP={env.get('EVENT_LOOP', 'asyncio')}"
    )
    print(table(rows))
    node = rows[0]
    for row in rows:
        if row.name.startswith("anvil direct"):
            node = row
            continue
        print(
            f"{row.name}: adds {row.p50_ms - node.p50_ms:+.2f} ms p50, {row.p99_ms - node.p99_ms:+.2f} ms p99 "
            f"to the node's own (target at c=1: <= +0.25 ms p50)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
