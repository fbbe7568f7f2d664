"""Benchmark: cache-hit throughput with API keys, Redis and credits (the real deployment) against
open-mode hits, measured in the same run in back-to-back pairs.

    .venv/bin/python -m bench.keyed_hits [--seconds 3] [--rounds 11] [--connections 64] [--instructions N]

Needs wrk (Debian package `wrk`), redis-server and Anvil (`bash scripts/test.sh` installs them).
Each proxy is one process; with keys, every hit is charged through the key's credit lease.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.cache_hit import (
    KEYED_DAILY_CREDITS,
    Result,
    final_storage_request,
    fixed_body_script,
    instructions_per_request,
    median,
    middle,
    paired_rounds_parser,
    require_wrk,
    start,
    table,
    warmed,
    wrk,
)
from tests.support import Anvil, RedisServer, free_port


def main() -> int:
    args = paired_rounds_parser(11, "open and keyed", "open and per keyed hit").parse_args()
    require_wrk()

    anvil = Anvil()
    redis = RedisServer()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        request = final_storage_request(anvil)
        open_port, keyed_port = free_port(), free_port()
        base = {**os.environ, "EVM_UPSTREAM": anvil.url, "LOG_FORMAT": "json"}
        open_env = {**base, "PROXY_PORT": str(open_port)}
        # A balance no run spends: every round's calls are charged, none refused.
        keyed_env = {
            **base,
            "PROXY_PORT": str(keyed_port),
            "API_KEYS": "bench",
            "REDIS_URL": redis.url,
            "DAILY_CREDITS": KEYED_DAILY_CREDITS,
        }
        open_proc = start([sys.executable, "-m", "proxy"], open_port, open_env)
        procs.append(open_proc)
        keyed_proc = start([sys.executable, "-m", "proxy"], keyed_port, keyed_env)
        procs.append(keyed_proc)
        open_url = f"http://127.0.0.1:{open_port}/v3/bench"
        keyed_url = f"http://127.0.0.1:{keyed_port}/v3/bench"
        for url in (open_url, keyed_url):
            warmed(url, request)

        body = json.dumps(request)
        opens: list[Result] = []
        keyeds: list[Result] = []
        for _ in range(args.rounds):
            opens.append(
                wrk(
                    "proxy, open mode, cache hit",
                    open_url,
                    fixed_body_script(body),
                    args.seconds,
                    args.connections,
                    open_proc.pid,
                )
            )
            keyeds.append(
                wrk(
                    "proxy, keys+redis+credits, cache hit",
                    keyed_url,
                    fixed_body_script(body),
                    args.seconds,
                    args.connections,
                    keyed_proc.pid,
                )
            )
        counts: tuple[float, float] | None = None
        if args.instructions:
            counted = []
            for env in (open_env, keyed_env):
                port = free_port()
                slow_env = {**env, "PROXY_PORT": str(port), "HEAD_POLL_INTERVAL": "3600"}  # callgrind is slow
                counted.append(
                    instructions_per_request(
                        [sys.executable, "-m", "proxy"], port, slow_env, body.encode(), args.instructions
                    )
                )
            counts = (counted[0], counted[1])
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        redis.stop()
        anvil.stop()

    ratios = sorted(k.rps / o.rps for k, o in zip(keyeds, opens, strict=True))
    print(
        f"wrk -t1 -c{args.connections} -d{args.seconds}s, one process each, "
        f"{args.rounds} back-to-back pairs of open and keyed hit rounds (table: medians)"
    )
    print(
        "keyed rounds req/s: "
        + ", ".join(f"{r.rps:.0f}" for r in keyeds)
        + " | open rounds req/s: "
        + ", ".join(f"{r.rps:.0f}" for r in opens)
    )
    print("pair ratios (sorted): " + ", ".join(f"{r:.2f}" for r in ratios))
    print(table([median(opens), median(keyeds)]))
    print(f"keyed hit throughput / open hit:  {middle(ratios):.2f}  (median of pair ratios; target >= 0.90)")
    if counts is not None:
        print(
            f"instructions per hit (callgrind, {args.instructions} sequential requests): "
            f"open {counts[0]:,.0f}, keyed {counts[1]:,.0f}, keyed / open {counts[1] / counts[0]:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
