"""The indexer: passes over the chain with eth_getLogs windows overlapping by half, then the block and the
receipts of every block that had a matching log (an indexer that does not remember what the previous,
overlapping window already fetched, as most do not)."""

from __future__ import annotations

import asyncio

from .chain import TRANSFER_TOPIC, Chain
from .rpc import Client, Target


def windows(first: int, last: int, size: int) -> list[tuple[int, int]]:
    """[first, last] covered by `size`-block windows, each starting half a window after the previous."""
    out = []
    start = first
    while True:
        end = min(start + size - 1, last)
        out.append((start, end))
        if end >= last:
            return out
        start += max(size // 2, 1)


async def _window(client: Client, chain: Chain, start: int, end: int, gate: asyncio.Semaphore) -> None:
    logs = await client.result(
        "eth_getLogs",
        [{"fromBlock": hex(start), "toBlock": hex(end), "address": chain.token, "topics": [TRANSFER_TOPIC]}],
    )
    blocks = sorted({int(log["blockNumber"], 16) for log in logs})

    async def fetch(number: int) -> None:
        async with gate:
            await client.result("eth_getBlockByNumber", [hex(number), False])
            await client.result("eth_getBlockReceipts", [hex(number)])

    await asyncio.gather(*(fetch(n) for n in blocks))


async def run(target: Target, chain: Chain, *, window: int = 500, passes: int = 2, concurrency: int = 8) -> None:
    """Each pass asks the finalized block, then indexes the token's Transfers from block 0 up to it."""
    gate = asyncio.Semaphore(concurrency)
    for number in range(1, passes + 1):
        client = target.client(await target.begin(f"indexer pass {number}"))
        finalized = int((await client.result("eth_getBlockByNumber", ["finalized", False]))["number"], 16)
        for start, end in windows(0, finalized, window):
            await _window(client, chain, start, end, gate)
    await target.finish()
