"""Benchmark: the proxy's own CPU per cache miss, as instructions counted by callgrind (steady under
load, unlike wall-clock figures), or as a cProfile of the same loop.

    .venv/bin/python -m bench.miss_cpu [--requests 300] [--redis] [--profile FILE]

Each request reads a storage position not read before, sent one at a time on one keep-alive
connection, so every one is a miss that goes to the node (Anvil). Only the proxy's process is
counted. `--redis`: with a private redis-server as the shared tier (REDIS_URL). `--profile FILE`:
the proxy runs under cProfile instead of callgrind, and FILE gets its stats (pstats format).
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cache_hit import counted, final_storage_request, listening, proxy_env  # noqa: E402
from tests.support import Anvil, RedisServer, free_port, wait_until  # noqa: E402


class Misses:
    """Sequential misses on one keep-alive connection: each call a storage position never read."""

    def __init__(self, port: int, request: dict[str, object]) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.store, _slot, self.block = request["params"]  # type: ignore[misc]
        self.counter = 1_000_000

    def send(self, count: int) -> bool:
        """Whether every answer came from the node (no hit, no error)."""
        misses = True
        for _ in range(count):
            self.counter += 1
            body = json.dumps(
                {
                    "jsonrpc": "2.0",
                    "id": self.counter,
                    "method": "eth_getStorageAt",
                    "params": [self.store, hex(self.counter), self.block],
                }
            ).encode()
            self.conn.request("POST", "/v3/bench", body, {"Content-Type": "application/json"})
            response = self.conn.getresponse()
            answer = json.loads(response.read())
            misses = (
                misses and response.status == 200 and "result" in answer and response.getheader("X-Cache") == "MISS"
            )
        return misses


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300, help="misses counted")
    parser.add_argument("--redis", action="store_true", help="with a redis-server as the shared tier")
    parser.add_argument("--profile", metavar="FILE", help="cProfile the proxy into FILE instead of callgrind")
    parser.add_argument("--keep", metavar="FILE", help="copy callgrind's dump to FILE (for callgrind_annotate)")
    args = parser.parse_args()
    anvil = Anvil()
    redis = RedisServer() if args.redis else None
    env = {**proxy_env(anvil.url), "HEAD_POLL_INTERVAL": "30"}  # few polls among the counted calls
    if redis is not None:
        env["REDIS_URL"] = redis.url
    port = free_port()
    env["PROXY_PORT"] = str(port)
    try:
        request = final_storage_request(anvil)
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/callgrind.out"
            if args.profile:
                cmd = [sys.executable, "-m", "cProfile", "-o", args.profile, "-m", "proxy"]
            else:
                cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m", "proxy"]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_until(lambda: listening(port), 300, "the proxy to answer")
                misses = Misses(port, request)
                wait_until(lambda: misses.send(50), 300, "misses answered by the node")  # warm
                if args.profile:
                    misses.send(args.requests)
                    proc.send_signal(signal.SIGINT)
                    proc.wait(60)
                    print(f"cProfile of the proxy over {args.requests} misses (and start-up) in {args.profile}")
                    return 0
                total = counted(proc.pid, tmp, lambda: misses.send(args.requests), "a miss", args.keep)
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(60)
    finally:
        anvil.stop()
        if redis is not None:
            redis.stop()
    print(
        f"{total / args.requests:,.0f} instructions per miss over {args.requests} sequential misses "
        f"(EVENT_LOOP={env.get('EVENT_LOOP', 'asyncio')}, {'memory + redis' if redis else 'memory only'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
