"""One key's calls in the making (MAX_CALLS_IN_FLIGHT_PER_KEY): a key that pipelines batches of a
thousand calls on many connections waits in its own queue for its turn at the process's CPU, and
another key's calls are answered meanwhile. The proxy runs as its own process (the real CLI), the
attacker as another, the victim from the test: each measured from outside."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from proxy.gateway.key_work import KeyWork
from tests.support import Anvil, eventually, free_port

ATTACKER, VICTIM = "attacker-key", "victim-key"
VICTIM_BOUND = 2.0  # seconds: the victim's worst call while the attack runs (a busy 2-core VM)

# The attacker: CONNECTIONS connections, each sending PIPELINED batches of 1,000 calls at once and
# reading what comes back, again and again; half its batches free (every call -32602), half charged.
ATTACK = """
import socket, sys, threading
port, key = int(sys.argv[1]), sys.argv[2].encode()
def batch(call):
    body = b"[" + b",".join(call % i for i in range(1000)) + b"]"
    return b"POST /v3/" + key + b" HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body) + body
free = batch(b'{"jsonrpc":"2.0","method":"eth_getStorageAt","params":[],"id":%d}')
paid = batch(b'{"jsonrpc":"2.0","method":"eth_chainId","params":[],"id":%d}')
def client(request):
    c = socket.create_connection(("127.0.0.1", port))
    while True:
        c.sendall(request * 16)
        answers = 0
        buffered = b""
        while answers < 16:
            data = c.recv(1 << 20)
            if not data:
                return
            buffered += data
            answers += buffered.count(b"HTTP/1.1 ")
            buffered = buffered[-16:]
        print("answered", flush=True)
for i in range(10):
    threading.Thread(target=client, args=(free if i % 2 else paid,), daemon=True).start()
threading.Event().wait()
"""


@pytest.fixture
def proxy_process(anvil: Anvil) -> Iterator[int]:
    port = free_port()
    keys = Path(tempfile.mkdtemp(prefix="key-work-")) / "keys.toml"
    keys.write_text(
        f'[keys.attacker]\nkey = "{ATTACKER}"\ndaily_credits = 1000000000\n[keys.victim]\nkey = "{VICTIM}"\n'
    )
    env = {**os.environ, "EVM_UPSTREAM": anvil.url, "PROXY_PORT": str(port), "API_KEYS_FILE": str(keys)}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "proxy"], env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            yield port
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            log.seek(0)
            assert b"Traceback" not in log.read()


async def _victim_call(session: aiohttp.ClientSession, port: int) -> float:
    started = time.monotonic()
    call = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}
    async with session.post(f"http://127.0.0.1:{port}/v3/{VICTIM}", json=call) as response:
        body = await response.json()
        assert response.status == 200 and body["result"] == "0x7a69", body
    return time.monotonic() - started


async def test_a_key_pipelining_thousand_call_batches_never_holds_another_keys_calls(proxy_process: int) -> None:
    """Rule (docs/security.md, tenant isolation; an outside attack): 10 connections of one key, each
    with 16 batches of 1,000 calls pipelined (free -32602 calls, or charged eth_chainId), held every
    other key's calls 10 s and more: a thousand-call batch is 50 to 90 ms of the loop, and every one
    pipelined was in the making at once. The victim's calls stay under VICTIM_BOUND."""
    port = proxy_process
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:

        async def serving() -> bool:
            try:
                await _victim_call(session, port)
            except aiohttp.ClientError:
                return False
            return True

        await eventually(serving, 30, "the proxy to answer")
        attacker = subprocess.Popen(
            [sys.executable, "-c", ATTACK, str(port), ATTACKER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        try:
            assert attacker.stdout is not None
            first = await asyncio.to_thread(attacker.stdout.readline)  # the attack is being answered
            assert first == b"answered\n"
            took = [await _victim_call(session, port) for _ in range(20)]
            assert attacker.poll() is None  # the attack ran throughout
        finally:
            attacker.kill()
            attacker.wait()
            if attacker.stdout is not None:
                attacker.stdout.close()
    assert max(took) < VICTIM_BOUND, json.dumps([round(t, 3) for t in took])


class TestKeyWork:
    """The pure queue: a key's calls in the making at most the cap (a batch counts its calls, a batch
    larger than the cap takes all of it), first come first served within the key, keys apart."""

    async def test_a_key_past_its_cap_waits_and_other_keys_do_not(self) -> None:
        work = KeyWork(100)
        held = work.held("a", 60)
        await held.__aenter__()
        second = asyncio.ensure_future(_enter(work, "a", 60))
        other = asyncio.ensure_future(_enter(work, "b", 100))
        await asyncio.sleep(0)
        assert not second.done() and other.done()
        await held.__aexit__(None, None, None)
        await asyncio.wait_for(second, 1)
        assert work.in_use("a") == 60

    async def test_a_batch_over_the_cap_takes_the_whole_cap_and_order_is_kept(self) -> None:
        work = KeyWork(100)
        first = work.held("a", 5000)
        await first.__aenter__()
        assert work.in_use("a") == 100
        small = asyncio.ensure_future(_enter(work, "a", 1))
        await asyncio.sleep(0)
        assert not small.done()  # behind the batch, never ahead of it
        await first.__aexit__(None, None, None)
        await asyncio.wait_for(small, 1)

    async def test_a_waiter_that_leaves_gives_its_turn_on(self) -> None:
        work = KeyWork(10)
        first = work.held("a", 10)
        await first.__aenter__()
        gone = asyncio.ensure_future(_enter(work, "a", 10))
        after = asyncio.ensure_future(_enter(work, "a", 5))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        await first.__aexit__(None, None, None)
        await asyncio.wait_for(after, 1)
        assert work.in_use("a") == 5

    async def test_waiters_cancelled_together_with_a_release_leave_no_room_taken(self) -> None:
        # At shutdown every task is cancelled at once: a release that came between a waiter's
        # cancellation and its task hearing of it granted a cancelled turn (InvalidStateError), and the
        # waiter then failed to find itself in the queue (ValueError): both 500s in the log.
        work = KeyWork(10)
        first = work.held("a", 10)
        await first.__aenter__()
        waiters = [asyncio.ensure_future(_enter(work, "a", 10)) for _ in range(3)]
        await asyncio.sleep(0)
        for waiter in waiters:
            waiter.cancel()
        await first.__aexit__(None, None, None)
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results), results
        assert work.in_use("a") == 0 and not work._queues

    def test_no_cap_and_open_mode_hold_nothing(self) -> None:
        assert KeyWork(0).held("a", 10) is KeyWork(5).held(None, 10)


async def _enter(work: KeyWork, key: str, calls: int) -> None:
    await work.held(key, calls).__aenter__()
