"""Benchmark: the proxy's own CPU per cache hit, open and keyed, as instructions counted by callgrind
(steady under load, unlike wall-clock figures).

    .venv/bin/python -m bench.hit_cpu [--requests 2000] [--only open|keyed] [--keep PREFIX]

The same eth_getStorageAt hit, sent one at a time on one keep-alive connection (each request in one
write, as wrk sends it), to the proxy in open mode and to the proxy with an API key, Redis and
credits (every hit charged through the key's lease). Only the proxy's process is counted, from
after a warm-up to the last answer. `--keep PREFIX`: callgrind's dumps are copied to PREFIX.open
and PREFIX.keyed (for callgrind_annotate).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cache_hit import KEYED_DAILY_CREDITS, final_storage_request, instructions_per_request, proxy_env  # noqa: E402
from tests.support import Anvil, RedisServer, free_port  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000, help="hits counted per mode")
    parser.add_argument("--only", choices=("open", "keyed"), help="count one mode only")
    parser.add_argument("--keep", metavar="PREFIX", help="copy callgrind's dumps to PREFIX.open, PREFIX.keyed")
    args = parser.parse_args()
    anvil = Anvil()
    redis = RedisServer()
    counts: dict[str, float] = {}
    try:
        body = json.dumps(final_storage_request(anvil)).encode()
        base = {**proxy_env(anvil.url), "HEAD_POLL_INTERVAL": "3600"}  # callgrind is slow: few polls
        modes = {
            "open": {},
            "keyed": {"API_KEYS": "bench", "REDIS_URL": redis.url, "DAILY_CREDITS": KEYED_DAILY_CREDITS},
        }
        for mode, extra in modes.items():
            if args.only and mode != args.only:
                continue
            port = free_port()
            env = {**base, **extra, "PROXY_PORT": str(port)}
            keep = f"{args.keep}.{mode}" if args.keep else None
            counts[mode] = instructions_per_request(
                [sys.executable, "-m", "proxy"], port, env, body, args.requests, keep=keep, one_write=True
            )
    finally:
        redis.stop()
        anvil.stop()
    loop = base.get("EVENT_LOOP", "asyncio")
    for mode, count in counts.items():
        print(f"{count:,.0f} instructions per {mode} hit over {args.requests} sequential hits (EVENT_LOOP={loop})")
    if len(counts) == 2:
        print(f"keyed / open: {counts['keyed'] / counts['open']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
