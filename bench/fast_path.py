"""Benchmark: eth_getStorageAt cache hits through the proxy's fast server against nginx `proxy_cache`
and the floor (an asyncio Protocol on httptools answering from a dict), all in one run.

    .venv/bin/python -m bench.fast_path [--seconds 3] [--rounds 3] [--connections 32]

Rows: the proxy in open mode (one process), with API keys + Redis + credits (one process), with API
keys + credits and no Redis (one process), open with WORKERS=2; nginx proxy_cache with 1 and 2
workers; the floor server. One-process servers run on one core and wrk on the other
(bench.cache_hit's pinning); two-process servers are not pinned. Every round runs every server back
to back; the figures are medians over the rounds and the ratios are medians of each round's ratio.
Needs wrk (apt-get install wrk), Anvil and redis-server (scripts/test.sh); nginx (apt-get install
nginx-light) is optional: without it its rows are skipped, said in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cache_hit  # noqa: E402
from bench.cache_hit import (  # noqa: E402
    KEYED_DAILY_CREDITS,
    Result,
    final_storage_request,
    listening,
    middle,
    post,
    proxy_env,
    table,
    warmed,
)
from bench.throughput import NGINX_CONF, Server, cache_status, measured  # noqa: E402
from tests.support import Anvil, RedisServer, free_port, wait_until  # noqa: E402

FLOOR_SERVER = textwrap.dedent("""
    import asyncio, sys
    import httptools
    try:
        import uvloop
    except ImportError:
        uvloop = None
    ANSWERS = {sys.argv[2].encode(): sys.argv[3].encode()}
    HEAD = b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\nContent-Length: "

    class Floor(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.parser, self.body = transport, httptools.HttpRequestParser(self), []
        def data_received(self, data):
            self.parser.feed_data(data)
        def on_body(self, body):
            self.body.append(body)
        def on_message_complete(self):
            answer = ANSWERS.get(b"".join(self.body), b"{}")
            self.body = []
            self.transport.write(HEAD + str(len(answer)).encode() + b"\\r\\n\\r\\n" + answer)

    async def main():
        server = await asyncio.get_running_loop().create_server(Floor, "127.0.0.1", int(sys.argv[1]))
        await server.serve_forever()

    (uvloop.run if uvloop else asyncio.run)(main())
""")
NGINX_1, NGINX_2 = "nginx proxy_cache (1 worker)", "nginx proxy_cache (2 workers)"
OPEN, KEYED, ALONE, TWO, FLOOR = (
    "proxy open (1 process)",
    "proxy keyed (1 process)",
    "proxy keyed, no Redis (1 process)",
    "proxy open WORKERS=2",
    "floor: Protocol+httptools",
)


def launch(name: str, cmd: list[str], port: int, env: dict[str, str] | None = None, pin: bool = True) -> Server:
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=cache_hit.pinned(cache_hit.SERVER_CPUS) if pin else None,
    )
    wait_until(lambda: listening(port), 30, name)
    return Server(name, proc, f"http://127.0.0.1:{port}/v3/bench")


def nginx(tmp: Path, workers: int, upstream: str) -> Server | None:
    if not shutil.which("nginx"):
        return None
    port = free_port()
    conf = tmp / f"nginx{workers}.conf"
    text = NGINX_CONF.format(
        user_line="user root;" if os.geteuid() == 0 else "", tmp=tmp / f"n{workers}", port=port, upstream=upstream
    )
    (tmp / f"n{workers}").mkdir()
    conf.write_text(textwrap.dedent(text).replace("worker_processes 2;", f"worker_processes {workers};"))
    return launch(NGINX_1 if workers == 1 else NGINX_2, ["nginx", "-c", str(conf)], port, pin=workers == 1)


def start_servers(anvil: Anvil, redis: RedisServer, request: dict[str, object], tmp: Path) -> list[Server]:
    base = proxy_env(anvil.url)
    servers: list[Server] = []
    for name, extra, pin in (
        (OPEN, {}, True),
        (KEYED, {"API_KEYS": "bench", "REDIS_URL": redis.url, "DAILY_CREDITS": KEYED_DAILY_CREDITS}, True),
        (ALONE, {"API_KEYS": "bench", "DAILY_CREDITS": KEYED_DAILY_CREDITS}, True),
        (TWO, {"WORKERS": "2"}, False),
    ):
        port = free_port()
        server = launch(name, [sys.executable, "-m", "proxy"], port, {**base, **extra, "PROXY_PORT": str(port)}, pin)
        servers.append(server)
        warmed(server.url, request)
        for _ in range(40):  # each worker's memory tier (new connections spread over the workers)
            post(server.url, request)
    answer = json.dumps(post(servers[0].url, request), separators=(",", ":"))
    port = free_port()
    servers.append(launch(FLOOR, [sys.executable, "-c", FLOOR_SERVER, str(port), json.dumps(request), answer], port))
    for workers in (1, 2):
        found = nginx(tmp, workers, anvil.url)
        if found is None:
            print("nginx not found (apt-get install nginx-light): its rows and ratios are skipped")
            break
        servers.append(found)
        post(found.url, request)  # fills nginx's cache (committed just after the answer is sent)
        wait_until(
            lambda: cache_status(found.url, json.dumps(request)) == "HIT",  # noqa: B023
            10,
            f"{found.name} to answer from its cache",
        )
    return servers


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=3, help="length of one wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every server back to back")
    parser.add_argument("--connections", type=int, default=32)
    args = parser.parse_args()
    cache_hit.require_wrk()
    anvil, redis = Anvil(), RedisServer()
    tmp = Path(tempfile.mkdtemp(prefix="bench-fast-"))
    servers: list[Server] = []
    try:
        request = final_storage_request(anvil)
        servers = start_servers(anvil, redis, request, tmp)
        body = json.dumps(request)
        rounds = [
            {s.name: measured(s, body, args.seconds, args.connections) for s in servers} for _ in range(args.rounds)
        ]
    finally:
        for server in servers:
            server.proc.terminate()
            server.proc.wait(30)
        redis.stop()
        anvil.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def ratio(a: str, b: str) -> str:
        if b not in rounds[0]:
            return "  -  "
        return f"{middle([r[a].rps / r[b].rps for r in rounds]):.2f}"

    medians = [
        Result(
            name,
            middle([r[name].rps for r in rounds]),
            middle([r[name].p50_ms for r in rounds]),
            middle([r[name].p99_ms for r in rounds]),
            middle([r[name].cpu_us for r in rounds]),
        )
        for name in rounds[0]
    ]
    print(
        f"wrk -t1 -c{args.connections} -d{args.seconds}s, {args.rounds} rounds of every server back to back, "
        f"EVENT_LOOP={os.environ.get('EVENT_LOOP', 'uvloop if installed')} (table: medians)"
    )
    print(table(medians))
    print(f"open hits / nginx 1 worker:        {ratio(OPEN, NGINX_1)}  (target >= 1.0)")
    print(f"keyed hits / open hits:            {ratio(KEYED, OPEN)}  (target >= 0.9)")
    print(f"keyed, no Redis / open hits:       {ratio(ALONE, OPEN)}  (target >= 0.9)")
    print(f"WORKERS=2 / nginx 2 workers:       {ratio(TWO, NGINX_2)}  (target >= 1.0)")
    print(f"floor / nginx 1 worker:            {ratio(FLOOR, NGINX_1)}")
    print(f"open hits / floor:                 {ratio(OPEN, FLOOR)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
