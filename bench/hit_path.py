"""Benchmark: the instructions of a cache hit's own path, open and keyed, counted by callgrind inside
the serving process and nowhere else.

    .venv/bin/python -m bench.hit_path [--hits 10000] [--only open|keyed|alone]

The proxy runs in a child process under callgrind with collection off; once its cache holds the
answer (a real request through its socket), wrk's eth_getStorageAt request is fed to a connection's
`data_received` through an in-memory transport, `--hits` times in a row, and only that stretch is
counted (callgrind's collection follows `functools.reduce`, which drives it). So the figure is the
hit's own code, from the request's bytes to the answer's, with neither the loop's system calls nor
time-driven background work in it. That is what `bench.hit_cpu` cannot separate: under callgrind a
keyed proxy's once-a-second ledger work (its reports, the exhausted set) falls on fifty times fewer
requests than at full speed. Keyed: API keys, Redis, every hit charged 80 credits from a lease large
enough that no top-up falls in the window (a top-up is a background task; `bench.fast_path` counts
it in throughput). Alone: API keys without Redis, each hit charged from the process's own count.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cache_hit import KEYED_DAILY_CREDITS, final_storage_request, proxy_env  # noqa: E402
from tests.support import Anvil, MemoryTransport, RedisServer, free_port  # noqa: E402

BATCH = 32  # requests fed between two checks of the transport


def serve(settings_env: dict[str, str], request: bytes, hits: int, key: str) -> None:
    """The child: the proxy in this process; `hits` hits fed to one connection once it is warm."""
    from proxy.config import build_settings
    from proxy.http import front as front_module
    from proxy.server import run_server

    fronts: list[Any] = []
    made = front_module.Front.__init__

    def catch(self: Any, *args: Any, **kwargs: Any) -> None:  # the listener's Front, caught as it is made
        made(self, *args, **kwargs)
        fronts.append(self)

    front_module.Front.__init__ = catch  # type: ignore[method-assign]
    settings = build_settings(settings_env)
    path = f"/v3/{key}"
    wire = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{settings.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(request)}\r\n\r\n"
    ).encode() + request

    def answered() -> bool:
        post = urllib.request.Request(
            f"http://127.0.0.1:{settings.port}{path}", data=request, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(post, timeout=60) as reply:
            return reply.headers.get("X-Cache") == "HIT"

    async def drive() -> None:
        loop = asyncio.get_running_loop()
        while not await loop.run_in_executor(None, answered):  # the entry, once the tracker has a head
            await asyncio.sleep(0.2)
        protocol = fronts[0].protocol()
        transport = MemoryTransport(keep=False)
        protocol.connection_made(transport)
        for _ in range(100):  # warm: the memos, the interpreter's specialised code, the key's lease
            for _ in range(BATCH):
                protocol.data_received(wire)
            await asyncio.sleep(0)

        def batch(done: int, _: int) -> int:
            for _ in range(BATCH):
                protocol.data_received(wire)
            return done + BATCH

        counted = functools.reduce(batch, range(hits // BATCH), 0)  # the counted stretch
        ok = transport.last.startswith(b"HTTP/1.1 200 ") and b"X-Cache: HIT" in transport.last
        print(json.dumps({"hits": counted, "ok": ok}), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    run_server(settings, on_listening=lambda: asyncio.get_running_loop().create_task(drive()))


def counted(mode_env: dict[str, str], request: bytes, hits: int, key: str) -> float:
    """Instructions per hit in one child under callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/callgrind.out"
        child = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--collect-atstart=no",
                "--toggle-collect=functools_reduce",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-m",
                "bench.hit_path",
                "--child",
                json.dumps({"env": mode_env, "request": request.decode(), "hits": hits, "key": key}),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        report = [line for line in child.stdout.splitlines() if line.startswith("{")]
        if not report or not json.loads(report[-1])["ok"]:
            raise SystemExit(f"the counted requests were not all cache hits:\n{child.stdout}\n{child.stderr[-2000:]}")
        total = re.search(r"^(?:summary|totals): (\d+)", Path(out).read_text(), re.M)
        if total is None:
            raise SystemExit(f"no totals in callgrind's dump:\n{child.stderr[-2000:]}")
        return int(total.group(1)) / json.loads(report[-1])["hits"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hits", type=int, default=10_000, help="hits counted per mode")
    parser.add_argument("--only", choices=("open", "keyed", "alone"), help="count one mode only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        job = json.loads(args.child)
        serve(job["env"], job["request"].encode(), job["hits"], job["key"])
        return 0
    anvil = Anvil()
    redis = RedisServer()
    counts: dict[str, float] = {}
    try:
        request = json.dumps(final_storage_request(anvil)).encode()
        base = {
            "EVM_UPSTREAM": anvil.url,
            "LOG_LEVEL": "WARNING",
            "HEAD_POLL_INTERVAL": "3600",
            "EVENT_LOOP": proxy_env(anvil.url).get("EVENT_LOOP", "asyncio"),
        }
        keyed = {"API_KEYS": "bench", "DAILY_CREDITS": KEYED_DAILY_CREDITS}
        modes = {
            "open": {},
            "keyed": {**keyed, "REDIS_URL": redis.url, "CREDITS_LEASE_MAX": KEYED_DAILY_CREDITS},
            "alone": keyed,
        }  # keyed: one lease, the whole balance; alone: no Redis, the process's own count
        for mode, extra in modes.items():
            if args.only and mode != args.only:
                continue
            counts[mode] = counted({**base, **extra, "PROXY_PORT": str(free_port())}, request, args.hits, "bench")
    finally:
        redis.stop()
        anvil.stop()
    for mode, count in counts.items():
        print(
            f"{count:,.0f} instructions per {mode} hit's own path over {args.hits} hits "
            f"(EVENT_LOOP={base['EVENT_LOOP']})"
        )
    for mode in ("keyed", "alone"):
        if mode in counts and "open" in counts:
            print(f"{mode} / open: {counts[mode] / counts['open']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
