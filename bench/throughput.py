"""Benchmark: open-mode eth_getStorageAt cache-hit throughput with all cores, against nginx
proxy_cache (2 workers) in front of the same upstream and a bare aiohttp server, all in one run.

    flock /work/wt/heavy.lock .venv/bin/python -m bench.throughput [--seconds 3] [--rounds 5] [--connections 64]

Needs wrk and nginx (Debian: `apt-get install -y wrk nginx-light`) and Anvil (`bash scripts/test.sh`
installs it under .tools/); uvloop rows need `pip install '.[fast]'`. Nothing is pinned: every server
and wrk share the host's cores, as they would in production, and each round runs every server back to
back, so a round's ratios share the host's drift; the figures are the medians over the rounds.
CPU per request is the user + system time of all the server's processes (workers and supervisor, or
nginx's master and workers) over a round, divided by the requests answered: a 2-core host cannot show
N-core scaling, but CPU per request says what each core can do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cache_hit  # noqa: E402
from bench.cache_hit import (  # noqa: E402
    BARE_SERVER,
    Result,
    cpu_seconds,
    final_storage_request,
    fixed_body_script,
    listening,
    middle,
    post,
    table,
    warmed,
    wrk,
)
from tests.support import Anvil, free_port, wait_until  # noqa: E402

# bench.cache_hit pins wrk to one core and its one-process servers to the other; here the servers
# have several processes, so nothing is pinned (wrk reads this at each run).
cache_hit.CLIENT_CPUS = None

NGINX_CONF = """
{user_line}
worker_processes 2;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log error;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    proxy_cache_path {tmp}/cache keys_zone=rpc:10m;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            rewrite ^ / break;  # the node answers JSON-RPC on /
            proxy_pass {upstream};
            proxy_http_version 1.1;
            proxy_cache rpc;
            proxy_cache_methods POST;
            proxy_cache_key "$request_uri|$request_body";
            proxy_cache_valid 200 10m;
            client_body_buffer_size 64k;
            add_header X-Cache $upstream_cache_status;
        }}
    }}
}}
"""


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    url: str

    def pids(self) -> list[int]:
        """The server's process and its children (workers), from /proc."""
        found = [self.proc.pid]
        with contextlib.suppress(OSError):
            found += [int(p) for p in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()]
        return found

    def cpu(self) -> float:
        total = 0.0
        for pid in self.pids():
            try:
                total += cpu_seconds(pid)
            except OSError:
                continue
        return total


def require_tools() -> None:
    missing = [tool for tool in ("wrk", "nginx") if not shutil.which(tool)]
    if missing:
        raise SystemExit(f"{' and '.join(missing)} not found: apt-get install -y wrk nginx-light")


def launch(
    name: str,
    cmd: list[str],
    port: int,
    url: str,
    env: dict[str, str] | None = None,
    ready: Callable[[], bool] | None = None,
) -> Server:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(ready or (lambda: listening(port)), 30, name)
    return Server(name, proc, url)


def cache_status(url: str, body: str) -> str | None:
    request = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.headers.get("X-Cache")


def measured(server: Server, body: str, seconds: int, connections: int) -> Result:
    before = server.cpu()
    result = wrk(server.name, server.url, fixed_body_script(body), seconds, connections)
    total = result.rps * seconds
    result.cpu_us = (server.cpu() - before) / total * 1e6 if total else 0.0
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=3, help="length of one wrk run")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every server back to back")
    parser.add_argument("--connections", type=int, default=64)
    args = parser.parse_args()
    require_tools()
    try:
        import uvloop  # noqa: F401

        loops = ["asyncio", "uvloop"]
    except ImportError:
        loops = ["asyncio"]
        print("uvloop not installed (pip install '.[fast]'): the uvloop rows are left out")

    anvil = Anvil()
    servers: list[Server] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    try:
        request = final_storage_request(anvil)
        body = json.dumps(request)
        for loop in loops:
            for workers in (1, 2):
                port = free_port()
                env = {
                    **os.environ,
                    "EVM_UPSTREAM": anvil.url,
                    "PROXY_PORT": str(port),
                    "WORKERS": str(workers),
                    "EVENT_LOOP": loop,
                    "ACCESS_LOG": "false",
                    "LOG_FORMAT": "json",
                }
                url = f"http://127.0.0.1:{port}/v3/bench"
                server = launch(f"proxy WORKERS={workers} {loop}", [sys.executable, "-m", "proxy"], port, url, env)
                servers.append(server)
                warmed(url, request)
                for _ in range(20 * workers):  # each worker's memory tier (new connections spread over them)
                    post(url, request)
        answer = json.dumps(post(servers[0].url, request), separators=(",", ":"))
        bare_port = free_port()
        servers.append(
            launch(
                "bare aiohttp (1 process)",
                [sys.executable, "-c", BARE_SERVER, str(bare_port), answer],
                bare_port,
                f"http://127.0.0.1:{bare_port}/v3/bench",
            )
        )
        nginx_port = free_port()
        (tmp / "nginx.conf").write_text(
            textwrap.dedent(
                NGINX_CONF.format(
                    # Run as root, nginx's workers would be `nobody`, shut out of the private temp directory.
                    user_line="user root;" if os.geteuid() == 0 else "",
                    tmp=tmp,
                    port=nginx_port,
                    upstream=anvil.url,
                )
            )
        )
        nginx_url = f"http://127.0.0.1:{nginx_port}/v3/bench"
        servers.append(
            launch(
                "nginx proxy_cache (2 workers)",
                ["nginx", "-c", str(tmp / "nginx.conf")],
                nginx_port,
                nginx_url,
                ready=lambda: listening(nginx_port),
            )
        )
        post(nginx_url, request)  # fills nginx's cache
        if cache_status(nginx_url, body) != "HIT":
            raise SystemExit("nginx does not answer the request from its cache")

        rounds: list[dict[str, Result]] = []
        for _ in range(args.rounds):
            rounds.append({s.name: measured(s, body, args.seconds, args.connections) for s in servers})
    finally:
        for server in servers:
            server.proc.terminate()
            server.proc.wait(30)
        anvil.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def ratio(a: str, b: str, field: str = "rps") -> float:
        return middle([getattr(r[a], field) / getattr(r[b], field) for r in rounds])

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
    nginx, bare = "nginx proxy_cache (2 workers)", "bare aiohttp (1 process)"
    print(
        f"wrk -t1 -c{args.connections} -d{args.seconds}s, {args.rounds} rounds of every server back to back, "
        f"{os.cpu_count()} CPUs shared by servers and wrk (table: medians)"
    )
    print(table(medians))
    for loop in loops:
        one, two = f"proxy WORKERS=1 {loop}", f"proxy WORKERS=2 {loop}"
        print(f"[{loop}] WORKERS=2 / nginx (2 workers):     {ratio(two, nginx):.2f}  (target >= 0.35)")
        print(f"[{loop}] WORKERS=2 / WORKERS=1:             {ratio(two, one):.2f}")
        print(f"[{loop}] WORKERS=1 / bare aiohttp (req/s):  {ratio(one, bare):.2f}")
        print(
            f"[{loop}] per-core hits vs bare (bare CPU / proxy CPU per request): "
            f"WORKERS=1 {1 / ratio(one, bare, 'cpu_us'):.2f}, WORKERS=2 {1 / ratio(two, bare, 'cpu_us'):.2f}  "
            "(target >= 0.9)"
        )
    if "uvloop" in loops:
        uv = ratio("proxy WORKERS=2 uvloop", "proxy WORKERS=2 asyncio")
        print(f"uvloop / asyncio, WORKERS=2 req/s:             {uv:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
