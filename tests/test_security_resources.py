"""A bounded attack on a real `python -m proxy` process: slow bodies, huge method names, a connection
flood under a low descriptor limit. Its memory must stay bounded and a normal client answered.

The figures (RSS growth, the normal client's latency) are printed; the assertions are generous
bounds, far below what the attack cost before (GBs of RSS, clients timing out).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import pytest

from tests.support import Anvil, eventually, free_port, healthy, wait_until

MB = 1024 * 1024
CHAIN_ID = b'{"jsonrpc":"2.0","id":1,"method":"eth_chainId","params":[]}'


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@dataclass
class Running:
    proc: subprocess.Popen[str]
    port: int
    stderr: str = ""  # filled in when the process has exited


@contextmanager
def proxy_process(anvil: Anvil, nofile: int | None = None, **env: str) -> Iterator[Running]:
    port = free_port()
    full_env = {
        **os.environ,
        "EVM_UPSTREAM": anvil.url,
        "PROXY_PORT": str(port),
        "HEAD_POLL_INTERVAL": "1",
        "LOG_LEVEL": "INFO",
        **env,
    }

    def limit_descriptors() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy"], env=full_env, stderr=subprocess.PIPE, text=True, preexec_fn=limit_descriptors
    )
    running = Running(proc, port)
    try:
        wait_until(lambda: healthy(port), 20, "the proxy to listen")
        yield running
    finally:
        proc.terminate()
        try:
            running.stderr = proc.communicate(timeout=20)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            running.stderr = proc.communicate(timeout=5)[1]


async def normal_call(port: int) -> float:
    """Seconds a normal client waits for eth_chainId on a fresh connection."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v3/k HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(CHAIN_ID), CHAIN_ID)
        )
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 30)
        assert status.startswith(b"HTTP/1.1 200"), status
        return time.monotonic() - started
    finally:
        writer.close()


async def slow_body(port: int, declared: int, sent: int) -> bytes:
    """Declare a body, send part of it, then stall until the proxy gives up on it: its status line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v3/k HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % declared
        )
        await writer.drain()  # its head alone in the proxy's first read: its body waits there for room
        chunk = b"[" + b" " * (256 * 1024)
        for _ in range(sent // len(chunk)):
            writer.write(chunk)
            await writer.drain()
        # 503 at once, or 408 at BODY_TIMEOUT (from when there is room for it); then closed
        return (await asyncio.wait_for(reader.read(), 60)).partition(b"\r\n")[0]
    except (ConnectionError, TimeoutError) as exc:
        return type(exc).__name__.encode()
    finally:
        writer.close()


async def long_method(port: int, i: int) -> None:
    body = json.dumps({"jsonrpc": "2.0", "id": i, "method": f"m{i}" + "x" * MB, "params": []}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v3/k HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), 60)).startswith(b"HTTP/1.1 400")
    finally:
        writer.close()


def test_slow_bodies_and_long_method_names_leave_memory_bounded_and_clients_served(anvil: Anvil) -> None:
    with proxy_process(anvil, BODY_TIMEOUT="3", MAX_INFLIGHT_BODY_BYTES=str(32 * MB)) as running:
        proc, port = running.proc, running.port

        async def attack() -> tuple[int, float]:
            baseline = rss(proc.pid)
            for start in range(0, 100, 10):  # 100 requests with 1 MB method names, 10 at a time
                await asyncio.gather(*(long_method(port, i) for i in range(start, start + 10)))
            stalled = [asyncio.create_task(slow_body(port, 5 * MB, 4 * MB)) for _ in range(30)]

            async def all_sent() -> bool:  # the accepted bodies are in; the others were refused
                await asyncio.sleep(0.2)
                return sum(t.done() for t in stalled) >= 30 - 7

            await eventually(all_sent, 30, "the slow bodies to be sent or refused")
            peak = rss(proc.pid) - baseline
            latency = await normal_call(port)  # while the slow bodies still stall
            # Every one answered: a body left waiting for room was read a piece at each wake, until
            # all of it was in and nothing more came to start its BODY_TIMEOUT (never answered).
            answers = Counter(await asyncio.gather(*stalled))
            assert set(answers) <= {b"HTTP/1.1 408 Request Timeout", b"HTTP/1.1 503 Service Unavailable"}, answers
            return max(peak, rss(proc.pid) - baseline), latency

        growth, latency = asyncio.run(attack())
        after = asyncio.run(normal_call(port))
    print(
        f"\nslow bodies + long method names: RSS growth {growth / MB:.1f} MB, "
        f"normal client answered in {latency * 1000:.0f} ms during the attack, {after * 1000:.0f} ms after"
    )
    # Before: every stalled 4 MB body was buffered (120 MB) and every 1 MB method name was kept.
    assert growth < 100 * MB
    assert latency < 10 and after < 10
    assert "Traceback" not in running.stderr


async def waiting_body(
    port: int, declared: int, sent: int, chunk: int = 0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A head declaring a body, and `sent` bytes of it in the same write (the proxy's first read), of
    the name `attacker` (open mode: its own bounds; normal_call's is `k`); `chunk`: chunked, in
    chunks of that many bytes (`declared` unused)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = b"POST /v3/attacker HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    body = b"[" + b" " * (sent - 1)
    if chunk:
        pieces = (body[at : at + chunk] for at in range(0, sent, chunk))
        writer.write(
            head + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces)
        )
    else:
        writer.write(head + b"Content-Length: %d\r\n\r\n" % declared + body)
    await writer.drain()
    return reader, writer


async def waiting_for_room(port: int) -> float:
    """rpc_proxy_requests_waiting_for_room, scraped (a scrape holding nothing goes past the bounds)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        text = (await asyncio.wait_for(reader.read(), 30)).decode()
    finally:
        writer.close()
    [line] = [line for line in text.splitlines() if line.startswith("rpc_proxy_requests_waiting_for_room ")]
    return float(line.split()[1])


@pytest.mark.parametrize(
    ("count", "declared", "sent", "chunk"),
    [(400, MB, 256 * 1024, 0), (600, 60_000, 60_000, 0), (600, 0, 64 * 1024, 2)],
    ids=["body-waits-unread", "request-held-whole", "in-2-byte-chunks"],
)
def test_what_requests_waiting_for_room_read_is_held_within_the_body_budget(
    anvil: Anvil, count: int, declared: int, sent: int, chunk: int
) -> None:
    # MAX_INFLIGHT_BODY_BYTES: a request waiting for room (the process's answer bytes full) holds what
    # it read of its body in the body budget: a body that does not arrive whole in its first read, what
    # that read took (up to 256 KB), the rest left unread; a request read whole, held back unmade, its
    # body and head. One the budget has no room for is answered 503 at once. Before, those bytes were counted
    # nowhere: 1,000 waiting bodies held 89 to 118 MB of RSS against a bound of 48 MB (an outside
    # attack); here 400 such bodies held 37 to 43 MB, and 600 held requests of 60 KB bodies 39 MB. A
    # body's pieces are joined as they come: kept apart, 600 bodies in 2-byte chunks held 203 MB (8 MiB counted).
    budget = 8 * MB
    with proxy_process(
        anvil, BODY_TIMEOUT="60", MAX_INFLIGHT_BODY_BYTES=str(budget), MAX_PENDING_ANSWER_BYTES_PER_PROCESS="2000000"
    ) as running:
        proc, port = running.proc, running.port

        async def attack() -> tuple[int, Counter[bytes], float]:
            baseline = rss(proc.pid)
            # A body being read holds the process's room: every body after it waits for room.
            holder = await waiting_body(port, MB, 1024)
            clients = [holder]
            try:
                for _ in range(count):
                    clients.append(await waiting_body(port, declared, sent, chunk))

                lines = [asyncio.ensure_future(reader.readline()) for reader, _ in clients[1:]]

                async def each_waits_or_is_refused() -> bool:  # none left being read
                    return await waiting_for_room(port) + sum(line.done() for line in lines) == len(lines)

                await eventually(each_waits_or_is_refused, 30, "every body to wait for room or be refused")
                growth = rss(proc.pid) - baseline
                latency = await normal_call(port)
                statuses = Counter(line.result().strip() for line in lines if line.done())
                for line in lines:
                    line.cancel()
            finally:
                for _, writer in clients:
                    writer.close()
            return growth, statuses, latency

        growth, statuses, latency = asyncio.run(attack())
        after = asyncio.run(normal_call(port))
    print(f"\n{count} requests waiting for room: RSS growth {growth / MB:.1f} MB, answered at once {dict(statuses)}")
    # At most the budget's worth waits; the others were refused at once, none lost.
    assert set(statuses) == {b"HTTP/1.1 503 Service Unavailable"}, statuses
    assert growth < budget + 16 * MB
    assert latency < 10 and after < 10
    assert "Traceback" not in running.stderr


async def proxy_read_all(proxy_port: int, client_port: int) -> bool:
    """Whether the proxy's socket of the connection from `client_port` has nothing left unread, nor
    the client's anything unsent (/proc/net/tcp: tx_queue:rx_queue of each end)."""
    queues = {}
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            local, remote = (int(end.split(":")[1], 16) for end in fields[1:3])
            queues[local, remote] = [int(queue, 16) for queue in fields[4].split(":")]
    client = queues.get((client_port, proxy_port))
    return queues.get((proxy_port, client_port)) == [0, 0] and client is not None and client[0] == 0


def test_what_clients_that_leave_mid_body_sent_is_let_go(anvil: Anvil) -> None:
    # A closed connection is kept (MAX_CONNECTIONS_PER_IP's table sweeps it later), and it kept the
    # pieces of its unfinished body: 200 clients that each sent 5 MB less a byte and left held 1 GB.
    with proxy_process(anvil) as running:
        proc, port = running.proc, running.port

        async def leave_mid_body(count: int) -> int:
            baseline = rss(proc.pid)
            for _ in range(count):  # one at a time, as one client may
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    b"POST /v3/k HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n[" % (5 * MB) + b" " * (4 * MB)
                )
                await writer.drain()
                read = partial(proxy_read_all, port, writer.get_extra_info("sockname")[1])
                await eventually(read, 30, "the body to be read")
                writer.close()
            await normal_call(port)
            return rss(proc.pid) - baseline

        growth = asyncio.run(leave_mid_body(100))
    print(f"\n100 clients leaving 4 MB into 5 MB bodies: RSS growth {growth / MB:.1f} MB")
    assert growth < 100 * MB  # before: 400 MB, every body kept
    assert "Traceback" not in running.stderr


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_a_connection_flood_past_the_descriptor_limit_logs_a_few_lines_and_keeps_serving(
    anvil: Anvil, event_loop: str
) -> None:
    # Either loop: uvloop's accept loop drops connections silently out of descriptors, so the warning
    # comes from the proxy's own check (listeners.descriptors_left), asyncio's from its accept errors.
    with proxy_process(anvil, nofile=256, MAX_CONNECTIONS="10000", EVENT_LOOP=event_loop) as running:
        port = running.port

        async def flood() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # established before the flood
            attempts = [asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 3) for _ in range(450)]
            # Past the descriptor limit the proxy stops accepting and the listen backlog fills:
            # the last attempts time out at connect, which is the point.
            opened = [c for c in await asyncio.gather(*attempts, return_exceptions=True) if isinstance(c, tuple)]
            try:
                for _ in range(3):  # an established client is still served while descriptors are out
                    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                    await writer.drain()
                    assert (await asyncio.wait_for(reader.readline(), 30)).startswith(b"HTTP/1.1 200")
                    while (await asyncio.wait_for(reader.readline(), 30)) != b"\r\n":
                        pass
                    await asyncio.wait_for(reader.readexactly(len(b'{"status": "ok"}')), 30)
            finally:
                for _, w in opened:
                    w.close()
                writer.close()

        asyncio.run(flood())
        wait_until(lambda: healthy(port), 20, "the proxy to accept again")
    err = running.stderr
    lines = err.splitlines()
    print(f"\nconnection flood at 256 descriptors: {len(lines)} log lines")
    assert any("cannot accept connections" in line for line in lines)
    # What the lines were, when there are too many (once 264 under a full suite's load, not reproduced since).
    most = Counter(line.split(" msg=", 1)[-1][:160] for line in lines).most_common(5)
    assert len(lines) < 40 and "Traceback" not in err, most
