"""Runs the three workloads through the proxy (with a counting relay in front of Anvil) and against Anvil
directly, and prints what each cost the upstream. See bench/workloads/__init__.py."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.workloads import dapp, indexer, wallet  # noqa: E402
from bench.workloads.chain import Chain, ChainSpec, Miner, build_chain  # noqa: E402
from bench.workloads.report import Row, by_method, latency, pricer, table  # noqa: E402
from bench.workloads.rpc import Target  # noqa: E402
from tests.support import Anvil, RedisServer, free_port, wait_until  # noqa: E402

Workload = Callable[[Target], Awaitable[None]]


def listening(url: str) -> bool:
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=1).read()
        return True
    except OSError as exc:
        return hasattr(exc, "code")  # an HTTP error is an answer


class ProxyUnderTest:
    """A proxy process with its own fresh redis-server, in front of the counting relay."""

    def __init__(self, relay_url: str, env: dict[str, str]) -> None:
        self.redis = RedisServer()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v3/bench"
        self.log = tempfile.NamedTemporaryFile(prefix="proxy-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy"],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "EVM_UPSTREAM": relay_url,
                "PROXY_PORT": str(port),
                "REDIS_URL": self.redis.url,
                "LOG_LEVEL": "WARNING",
                **env,
            },
        )
        wait_until(lambda: listening(f"http://127.0.0.1:{port}/readyz"), 30, "the proxy to listen")

    async def tracking(self, session: aiohttp.ClientSession) -> None:
        """Returns once the head tracker has a head (before it, tags are forwarded uncached)."""
        body = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": ["0x" + "ee" * 20, "0x0", "latest"]}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            async with session.post(self.url, json=body) as resp:
                if resp.headers.get("X-Cache") != "BYPASS":
                    return
            await asyncio.sleep(0.1)
        raise TimeoutError("the proxy's head tracker never got a head")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.redis.stop()
        self.log.close()
        os.unlink(self.log.name)


async def relay_counts(session: aiohttp.ClientSession, relay: str) -> Counter[str]:
    async with session.get(relay + "counts") as resp:
        return Counter(await resp.json())


async def measure(name: str, workload: Workload, relay: str, chain: Chain, env: dict[str, str]) -> list[Row]:
    """One workload through a fresh proxy, then against the node directly; a row per phase."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        proxy = ProxyUnderTest(relay, env)
        snapshots: list[Counter[str]] = []

        async def snapshot(_phase: str) -> None:
            snapshots.append(await relay_counts(session, relay))

        try:
            await proxy.tracking(session)
            through = Target(session, proxy.url, on_phase=snapshot)
            started = time.monotonic()
            await workload(through)
            print(f"{name}: through the proxy in {time.monotonic() - started:.1f} s", flush=True)
        finally:
            proxy.stop()
        direct = Target(session, chain.url)
        started = time.monotonic()
        await workload(direct)
        print(f"{name}: against the node in {time.monotonic() - started:.1f} s", flush=True)
    return [
        Row(
            phase.name,
            phase.calls,
            snapshots[i + 1] - snapshots[i],
            latency(phase),
            latency(direct.phases[i]),
            phase.errors,
        )
        for i, phase in enumerate(through.phases)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=3000, help="chain length (default 3000)")
    parser.add_argument("--event-every", type=int, default=3, help="every n-th block holds Transfers (default 3)")
    parser.add_argument("--window", type=int, default=500, help="indexer eth_getLogs window, blocks (default 500)")
    parser.add_argument("--clients", type=int, default=50, help="dapp pages (default 50)")
    parser.add_argument("--seconds", type=float, default=30.0, help="dapp duration (default 30)")
    parser.add_argument("--poll", type=float, default=4.0, help="dapp polling interval, s (ethers default 4)")
    parser.add_argument("--addresses", type=int, default=1000, help="wallet addresses (default 1000)")
    parser.add_argument("--views", type=int, default=3, help="wallet views (default 3)")
    parser.add_argument("--only", choices=["indexer", "dapp", "wallet"], action="append", help="run only these")
    parser.add_argument(
        "--proxy-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for the proxy process (repeatable)",
    )
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.proxy_env)
    only = set(args.only or ["indexer", "dapp", "wallet"])

    spec = ChainSpec(blocks=args.blocks, event_every=args.event_every, holders=max(args.addresses, 1000))
    anvil = Anvil()
    relay_port = free_port()
    relay_proc = subprocess.Popen(
        [sys.executable, "-m", "bench.workloads.relay", anvil.url, str(relay_port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    relay = f"http://127.0.0.1:{relay_port}/"
    try:
        started = time.monotonic()
        chain = build_chain(anvil.url, spec)
        print(
            f"chain: {chain.head} blocks, {len(chain.event_blocks)} with "
            f"{spec.txs_per_block * spec.transfers_per_tx} Transfers each, built in "
            f"{time.monotonic() - started:.0f} s",
            flush=True,
        )
        wait_until(lambda: listening(relay + "counts"), 20, "the relay to listen")

        async def run_dapp(target: Target) -> None:
            async with aiohttp.ClientSession() as session:
                await dapp.run(
                    target, chain, Miner(session, chain), clients=args.clients, seconds=args.seconds, poll=args.poll
                )

        workloads: list[tuple[str, Workload]] = [
            ("indexer", lambda t: indexer.run(t, chain, window=args.window)),
            ("wallet", lambda t: wallet.run(t, chain, addresses=args.addresses, views=args.views)),
            ("dapp", run_dapp),  # last: it mines
        ]
        rows: list[Row] = []
        for name, workload in workloads:
            if name in only:
                rows += asyncio.run(measure(name, workload, relay, chain, env))
    finally:
        relay_proc.terminate()
        relay_proc.wait(10)
        anvil.stop()
    price = pricer(env)
    print()
    print(table(rows, price))
    print()
    print(by_method(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
