"""Fill a proxy process's in-process cache tier from outside and read what it costs the process.

Shared by tests/test_memory_bound.py and bench/memory_bound.py: the proxy runs as `python -m proxy`
in a subprocess in front of a FakeEvm, requests go over HTTP as JSON-RPC batches, and memory is read
from /proc (VmRSS) and from the proxy's own /metrics.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.fake_evm import FakeEvm
from tests.support import ROOT, free_port, wait_until

ADDRESS = "0x" + "ab" * 20
FINAL_BLOCK = "0x1"  # final from the start on a FakeEvm


def storage_call(i: int) -> dict[str, Any]:
    """A distinct small finalized answer (a 32-byte word) for every i."""
    return {"jsonrpc": "2.0", "id": i, "method": "eth_getStorageAt", "params": [ADDRESS, hex(i), FINAL_BLOCK]}


def big_call(i: int) -> dict[str, Any]:
    """A distinct large finalized answer (FakeEvm.call_result_bytes of hex) for every i."""
    call = {"from": ADDRESS, "to": ADDRESS, "data": "0x" + format(i, "08x")}
    return {"jsonrpc": "2.0", "id": i, "method": "eth_call", "params": [call, FINAL_BLOCK]}


def rss_bytes(pid: int | str = "self") -> int:
    """The process's resident set (VmRSS in /proc/PID/status)."""
    match = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


@dataclass
class Reading:
    rss: int  # bytes
    metric_bytes: float  # rpc_proxy_cache_memory_bytes
    entries: float  # rpc_proxy_cache_entries


class ProxyProcess:
    """`python -m proxy` in front of `upstream`, open mode (unless `settings` name keys), memory tier
    only, bounded at `cache_bytes`; `settings`: more of its environment."""

    def __init__(self, upstream: str, cache_bytes: int, **settings: str) -> None:
        self.port = free_port()
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.endswith("_UPSTREAM") and k not in ("NETWORKS_FILE", "REDIS_URL", "API_KEYS", "API_KEYS_FILE")
        }
        env.update(
            EVM_UPSTREAM=upstream,
            PROXY_PORT=str(self.port),
            CACHE_MEMORY_BYTES=str(cache_bytes),
            HEAD_POLL_INTERVAL="0.2",
            LOG_LEVEL="WARNING",
            # The fake nodes behind it make their blocks up: nothing they say can be proven.
            VERIFY_ANSWERS="off",
            PYTHONPATH=str(ROOT),
        )
        env.update(settings)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.url = f"http://127.0.0.1:{self.port}/v3/fill"
        wait_until(self._up, 20, "the proxy process to listen")

    def _up(self) -> bool:
        assert self.proc.poll() is None, "the proxy process exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as response:
            text = response.read().decode()
        found: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.partition(" ")
                found[name] = float(value)
        return found

    def reading(self) -> Reading:
        metrics = self.metrics()
        return Reading(
            rss_bytes(self.proc.pid),
            metrics.get("rpc_proxy_cache_memory_bytes", -1.0),
            metrics.get("rpc_proxy_cache_entries", -1.0),
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _batches(calls: Iterator[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for call in calls:
        batch.append(call)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


async def wait_for_head(proxy: ProxyProcess, session: aiohttp.ClientSession, timeout: float = 60.0) -> None:
    """Until the proxy's head tracker has polled (a finalized call is then a MISS or HIT, not BYPASS)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        async with session.post(proxy.url, json=storage_call(0)) as response:
            if response.status == 200 and response.headers.get("X-Cache") in ("MISS", "HIT"):
                return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("the proxy's head tracker never polled")
        await asyncio.sleep(0.05)


async def send(proxy: ProxyProcess, calls: Iterator[dict[str, Any]], *, batch: int, concurrency: int) -> int:
    """Send every call in JSON-RPC batches, `concurrency` batches in flight; the number answered."""
    answered = 0
    queue = _batches(calls, batch)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal answered
            for body in queue:  # the generator is shared: each batch goes to one worker
                async with session.post(proxy.url, json=body) as response:
                    replies = await response.json(content_type=None)
                    assert response.status == 200, replies
                    assert all("result" in r for r in replies), [r for r in replies if "result" not in r][:1]
                    answered += len(replies)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return answered


async def fill_side_by_side(
    bound: int,
    phases: list[tuple[Callable[[], Iterator[dict[str, Any]]], int, int]],
) -> list[tuple[Reading, Reading]]:
    """Two proxy processes in front of one FakeEvm, one bounded at `bound` and one holding nothing
    (CACHE_MEMORY_BYTES=1), sent the same calls at once: for each phase (calls, batch size,
    concurrency), both processes' readings once it is answered."""
    node = await FakeEvm(call_result_bytes=100_000).start()
    bounded, baseline = ProxyProcess(node.url, bound), ProxyProcess(node.url, 1)
    readings = []
    try:
        # Both heads first: once one process is filling, the node (in this test's own loop) answers
        # the other's polls late on a busy machine.
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(wait_for_head(bounded, session), wait_for_head(baseline, session))
        for calls, batch, concurrency in phases:
            answered = await asyncio.gather(
                send(bounded, calls(), batch=batch, concurrency=concurrency),
                send(baseline, calls(), batch=batch, concurrency=concurrency),
            )
            assert answered[0] == answered[1] == sum(1 for _ in calls())
            readings.append((bounded.reading(), baseline.reading()))
        return readings
    finally:
        bounded.stop()
        baseline.stop()
        await node.close()
