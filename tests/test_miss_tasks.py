"""A miss is one task: the fast server's answer is made in one task from its body to the node and
back (the coalescer runs the first caller's fill in that caller's own task; no other layer starts one
for a single call), so a miss costs no task switch beyond the one it waits in."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from proxy.http.app_keys import SERVICE
from tests.support import Anvil, ProxyFactory, eventually


def _post(port: int, body: bytes) -> bytes:
    """One request on a connection of its own, from a thread: the test's client makes no task."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            b"POST /v3/k HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("block", ["latest", "final"])  # above finality, and a final block (its answer proven)
async def test_a_miss_at_concurrency_one_runs_in_one_task(anvil: Anvil, make_proxy: ProxyFactory, block: str) -> None:
    store = anvil.deploy_store()
    deployed = anvil.block_number()
    at = "latest" if block == "latest" else hex(deployed)
    anvil.mine(70)  # its block final (Anvil finalizes 64 blocks below its head)
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, HEAD_POLL_INTERVAL="0.5")
    await proxy.head_at(anvil.block_number())

    async def final() -> bool:  # the tracker holds the finalized block's hash: final answers can be proven
        head = proxy.app[SERVICE].networks["evm"].tracker.head
        return head is not None and head.finalized >= deployed and bool(head.final_hash)

    await eventually(final, 10.0, "the store's block final")
    loop = asyncio.get_running_loop()
    made: list[Any] = []
    factory = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        made.append(getattr(coro, "__qualname__", repr(coro)))
        return factory(loop, coro, **kwargs) if factory else asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(counting)  # type: ignore[arg-type]
    try:
        for slot in range(3):  # each a storage slot not read before: a miss that goes to the node
            call = {
                "jsonrpc": "2.0",
                "id": slot,
                "method": "eth_getStorageAt",
                "params": [store, hex(slot), at],
            }
            made.clear()
            reply = await loop.run_in_executor(None, _post, proxy.server.port, json.dumps(call).encode())
            assert b"X-Cache: MISS" in reply, reply[:300]
            assert (b"X-Verified: proven" in reply) == (block != "latest"), reply[:400]  # a final one, proven
            assert made == ["Pipeline._awaited"], made
    finally:
        loop.set_task_factory(factory)
