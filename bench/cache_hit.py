"""Benchmark: cache-hit throughput and latency against a bare aiohttp baseline, and the miss-path
overhead against calling the upstream directly. Everything runs on loopback, measured in one run.

    .venv/bin/python -m bench.cache_hit [--seconds 3] [--rounds 15] [--connections 64] [--instructions N]

Needs wrk (Debian package `wrk`) and Anvil (`bash scripts/test.sh` installs it under .tools/).
Each server under test is one process, as the proxy is, and wrk drives each the same way.
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import Anvil, free_port, wait_until  # noqa: E402

BARE_SERVER = textwrap.dedent("""
    import sys
    from aiohttp import web
    BODY = sys.argv[2].encode()
    async def handle(request):
        await request.read()
        return web.Response(body=BODY, content_type="application/json")
    app = web.Application()
    app.router.add_post("/v3/{key}", handle)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
""")


@dataclass
class Result:
    name: str
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us: float = 0.0  # the server's CPU time per request: steady where wall-clock throughput is not


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc); time the VM was descheduled is not in it."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ms(text: str) -> float:
    """wrk's durations: 812.00us, 2.75ms, 1.02s, 1.00m."""
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise ValueError(f"unexpected wrk duration {text!r}")
    return float(match.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}[match.group(2)]


def wrk(name: str, url: str, script: str, seconds: int, connections: int, pid: int | None = None) -> Result:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as handle:
        handle.write(script)
    cpu_before = cpu_seconds(pid) if pid else 0.0
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", handle.name, url],
            capture_output=True,
            text=True,
            check=True,
            preexec_fn=pinned(CLIENT_CPUS),
        ).stdout
    finally:
        os.unlink(handle.name)
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if non_2xx:
        raise SystemExit(f"{name}: {non_2xx.group(1)} error responses\n{out}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    cpu_us = (cpu_seconds(pid) - cpu_before) / total * 1e6 if pid else 0.0
    p50 = _ms(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    return Result(name, rps, p50, p99, cpu_us)


def fixed_body_script(body: str) -> str:
    return f'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\nwrk.body = {json.dumps(body)}\n'


def unique_storage_script(address: str, block: str) -> str:
    """Every request a different storage position: every one a cache miss."""
    return textwrap.dedent(f"""
        counter = 0
        request = function()
          counter = counter + 1
          local body = string.format(
            '{{"jsonrpc":"2.0","id":%d,"method":"eth_getStorageAt","params":["{address}","0x%x","{block}"]}}',
            counter, counter + 1000000)
          return wrk.format("POST", nil, {{["Content-Type"] = "application/json"}}, body)
        end
    """)


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return dict(json.loads(response.read()))


# Servers on one core, wrk on the other: left to the scheduler, the two sometimes share a core and
# sometimes not, which splits a round's throughput into two modes tens of percent apart.
SERVER_CPUS, CLIENT_CPUS = ({1}, {0}) if (os.cpu_count() or 1) >= 2 else (None, None)


def pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def listening(port: int) -> bool:
    try:
        post(f"http://127.0.0.1:{port}/v3/bench", {"jsonrpc": "2.0", "id": 0, "method": "eth_chainId"})
        return True
    except OSError:
        return False


def start(
    cmd: list[str], port: int, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pinned(SERVER_CPUS)
    )
    wait_until(lambda: listening(port), 20, " ".join(cmd[:3]))
    return proc


class OneWrite(http.client.HTTPConnection):
    """A keep-alive connection that sends each request's head and body in one write, as wrk does
    (http.client writes them apart, so a server reads many requests in two parts)."""

    def _send_output(self, message_body: Any = None, encode_chunked: bool = False) -> None:
        self._buffer.extend((b"", b""))  # type: ignore[attr-defined]
        head = b"\r\n".join(self._buffer)  # type: ignore[attr-defined]
        del self._buffer[:]  # type: ignore[attr-defined]
        self.send(head + (message_body or b""))


def instructions_per_request(
    cmd: list[str],
    port: int,
    env: dict[str, str],
    body: bytes,
    requests: int,
    keep: str | None = None,
    one_write: bool = False,
) -> float:
    """User-space instructions one server spends per request, counted by callgrind over `requests`
    sequential keep-alive requests: the same from run to run, whatever else the host is doing.
    `keep`: where callgrind's dump is copied (for callgrind_annotate); `one_write`: each request
    sent in one write (OneWrite)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/callgrind.out"
        proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *cmd],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            conn = (OneWrite if one_write else http.client.HTTPConnection)("127.0.0.1", port, timeout=60)

            def send(count: int) -> bool:
                """Whether every answer was a cache hit (the bare server's always are)."""
                hits = True
                for _ in range(count):
                    conn.request("POST", "/v3/bench", body, {"Content-Type": "application/json"})
                    response = conn.getresponse()
                    response.read()
                    if response.status != 200:
                        raise SystemExit(f"HTTP {response.status} under callgrind")
                    hits = hits and response.getheader("X-Cache", "HIT") == "HIT"
                return hits

            wait_until(lambda: listening(port), 300, "the server to answer under callgrind")
            # Warm: the entry (once the tracker has a head), the memos, the interpreter's specialised code.
            wait_until(lambda: send(100), 300, "answers from the cache under callgrind")
            total = counted(proc.pid, tmp, lambda: send(requests), "a cache hit", keep)
        finally:
            proc.terminate()
            proc.wait(60)
    return total / requests


def counted(pid: int, tmp: str, send: Callable[[], bool], what: str, keep: str | None = None) -> int:
    """Instructions a process under callgrind (its dumps in `tmp`) spends while `send` runs: its
    counters zeroed before, dumped after (and the dump copied to `keep`)."""
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    if not send():
        raise SystemExit(f"a counted request was not {what}")
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    dump = max(Path(tmp).glob("callgrind.out.*"), key=lambda path: path.stat().st_mtime)
    total = re.search(r"^(?:summary|totals): (\d+)", dump.read_text(), re.M)
    if total is None:
        raise SystemExit(f"no totals in {dump}")
    if keep:
        shutil.copyfile(dump, keep)
    return int(total.group(1))


def middle(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def median(results: list[Result]) -> Result:
    """Median throughput and latency, and the median CPU per request, over the rounds."""
    by_rps = sorted(results, key=lambda r: r.rps)[len(results) // 2]
    return Result(by_rps.name, by_rps.rps, by_rps.p50_ms, by_rps.p99_ms, middle([r.cpu_us for r in results]))


def table(rows: list[Result]) -> str:
    lines = [f"{'':34} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/req':>11}"]
    lines += [
        f"{r.name:34} {r.rps:9.0f} {r.p50_ms:8.2f} {r.p99_ms:8.2f} "
        f"{(f'{r.cpu_us:11.1f}' if r.cpu_us else '          -')}"
        for r in rows
    ]
    return "\n".join(lines)


def paired_rounds_parser(rounds: int, pair: str, instructions: str) -> argparse.ArgumentParser:
    """The options every paired-rounds benchmark takes: round length, connections, pairs, callgrind."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=3, help="length of one round")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument(
        "--rounds",
        type=int,
        default=rounds,
        help=f"pairs of back-to-back {pair} rounds; the median pair ratio is the figure",
    )
    parser.add_argument(
        "--instructions",
        type=int,
        default=0,
        metavar="N",
        help=f"also count instructions per {instructions} under callgrind over N requests",
    )
    return parser


# The keyed rows' daily balance: a plan's size (DAILY_CREDITS defaults to 3,000,000), yet more than
# any run here spends (wrk's figures stop a bench at the first refusal). Balances past 2**30 would
# take CPython's multi-digit integer arithmetic on every paid hit, which no real plan needs.
KEYED_DAILY_CREDITS = str(10**9)


def proxy_env(upstream: str) -> dict[str, str]:
    """The environment of a benchmarked proxy: no access log, uvloop when installed (unless EVENT_LOOP is set)."""
    env = {**os.environ, "EVM_UPSTREAM": upstream, "LOG_FORMAT": "json", "ACCESS_LOG": "false"}
    if "EVENT_LOOP" not in os.environ and importlib.util.find_spec("uvloop") is not None:
        env["EVENT_LOOP"] = "uvloop"
    return env


def require_wrk() -> None:
    if not shutil.which("wrk"):
        raise SystemExit("wrk not found: apt-get install wrk")


def final_storage_request(anvil: Anvil) -> dict[str, Any]:
    """A storage read (slot 0 of a deployed Store, 7) at a block made final: its answer is immutable."""
    store = anvil.deploy_store()
    block = hex(anvil.block_number())
    anvil.mine(70)
    return {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [store, "0x0", block]}


def warmed(url: str, request: dict[str, object]) -> None:
    """Wait until the proxy answers the request right (from a tracked head), so the next ones hit."""
    wait_until(
        lambda: post(url, request).get("result") == "0x" + format(7, "064x"),
        20,
        "the proxy to answer from a tracked head",
    )


def main() -> int:
    parser = paired_rounds_parser(15, "baseline and hit", "hit and per bare answer")
    parser.add_argument("--access-log", action="store_true", help="run the proxy with ACCESS_LOG=true")
    args = parser.parse_args()
    require_wrk()

    anvil = Anvil()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        request = final_storage_request(anvil)
        proxy_port, bare_port = free_port(), free_port()
        env = {
            **os.environ,
            "EVM_UPSTREAM": anvil.url,
            "PROXY_PORT": str(proxy_port),
            "ACCESS_LOG": "true" if args.access_log else "false",
            "LOG_FORMAT": "json",
        }
        proxy_proc = start([sys.executable, "-m", "proxy"], proxy_port, env)
        procs.append(proxy_proc)
        proxy_url = f"http://127.0.0.1:{proxy_port}/v3/bench"
        warmed(proxy_url, request)  # the entry is in memory, with the right answer
        answer = json.dumps(post(proxy_url, request), separators=(",", ":"))
        bare_proc = start([sys.executable, "-c", BARE_SERVER, str(bare_port), answer], bare_port)
        procs.append(bare_proc)

        body = json.dumps(request)
        # Rounds come in back-to-back pairs (baseline, then hit) and each pair gives one ratio: the
        # speed of a shared 2-core host drifts by tens of percent over seconds, and a pair's two
        # rounds share most of that drift. The median of the pair ratios is the figure.
        bares, hits = [], []
        for _ in range(args.rounds):
            bares.append(
                wrk(
                    "bare aiohttp (fixed body)",
                    f"http://127.0.0.1:{bare_port}/v3/bench",
                    fixed_body_script(body),
                    args.seconds,
                    args.connections,
                    bare_proc.pid,
                )
            )
            hits.append(
                wrk(
                    "proxy, cache hit",
                    proxy_url,
                    fixed_body_script(body),
                    args.seconds,
                    args.connections,
                    proxy_proc.pid,
                )
            )
        bare, hit = median(bares), median(hits)
        store, _slot, block = request["params"]
        miss_script = unique_storage_script(store, block)
        direct = wrk("anvil direct (every call new)", anvil.url, miss_script, args.seconds, args.connections)
        miss = wrk(
            "proxy, cache miss (every call new)", proxy_url, miss_script, args.seconds, args.connections, proxy_proc.pid
        )
        counts: tuple[float, float] | None = None
        if args.instructions:
            # The tracker polls on a wall clock, which callgrind slows fifty times: poll once, at start.
            counted_bare_port, counted_proxy_port = free_port(), free_port()
            counted_proxy_env = {**env, "PROXY_PORT": str(counted_proxy_port), "HEAD_POLL_INTERVAL": "3600"}
            counts = (
                instructions_per_request(
                    [sys.executable, "-c", BARE_SERVER, str(counted_bare_port), answer],
                    counted_bare_port,
                    dict(os.environ),
                    body.encode(),
                    args.instructions,
                ),
                instructions_per_request(
                    [sys.executable, "-m", "proxy"],
                    counted_proxy_port,
                    counted_proxy_env,
                    body.encode(),
                    args.instructions,
                ),
            )
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        anvil.stop()

    pair_ratios = sorted(h.rps / b.rps for h, b in zip(hits, bares, strict=True))
    cpu_ratios = [b.cpu_us / h.cpu_us for h, b in zip(hits, bares, strict=True)]
    print(
        f"wrk -t1 -c{args.connections} -d{args.seconds}s, one process each, proxy ACCESS_LOG={args.access_log}, "
        f"{args.rounds} back-to-back pairs of bare and hit rounds (table: medians)"
    )
    print(
        "hit rounds req/s: "
        + ", ".join(f"{r.rps:.0f}" for r in hits)
        + " | bare rounds req/s: "
        + ", ".join(f"{r.rps:.0f}" for r in bares)
    )
    print("pair ratios (sorted): " + ", ".join(f"{r:.2f}" for r in pair_ratios))
    print(table([bare, hit, direct, miss]))
    print(f"hit throughput / bare baseline:  {middle(pair_ratios):.2f}  (median of pair ratios; target >= 0.70)")
    print(f"bare CPU / hit CPU per request:  {middle(cpu_ratios):.2f}  (median of pairs)")
    if counts is not None:
        print(
            f"instructions per request (callgrind, {args.instructions} sequential requests): "
            f"bare {counts[0]:,.0f}, hit {counts[1]:,.0f}, bare / hit {counts[0] / counts[1]:.2f}"
        )
    print(f"hit p50 latency vs bare:         {hit.p50_ms - bare.p50_ms:+.2f} ms")
    print(f"miss throughput / direct:        {miss.rps / direct.rps:.2f}")
    print(f"miss-path overhead (p50):        {miss.p50_ms - direct.p50_ms:+.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
