"""The wallet: the ether balance and the token balance (eth_call balanceOf) of many addresses, at `latest`
and at `finalized`, sent as ethers v6 batches; the same view asked again and again."""

from __future__ import annotations

import asyncio
from typing import Any

from .chain import Chain, balance_of
from .rpc import CallSpec, Target


def view(chain: Chain, addresses: int) -> list[CallSpec]:
    calls: list[CallSpec] = []
    for address in chain.holders[:addresses]:
        for tag in ("latest", "finalized"):
            calls.append(("eth_getBalance", [address, tag]))
            calls.append(("eth_call", [{"to": chain.token, "data": balance_of(address)}, tag]))
    return calls


async def run(
    target: Target, chain: Chain, *, addresses: int = 1000, views: int = 3, batch: int = 100, concurrency: int = 4
) -> None:
    """View 1 is cold; views 2..n are the repeated views (one phase)."""
    calls = view(chain, addresses)
    gate = asyncio.Semaphore(concurrency)
    repeated = None
    for number in range(1, views + 1):
        if number == 1:
            phase = await target.begin("wallet first view")
        elif repeated is None:
            phase = repeated = await target.begin("wallet repeated views")
        client = target.client(phase)

        async def send(chunk: list[CallSpec]) -> list[dict[str, Any]]:
            async with gate:
                return await client.batch(chunk)  # noqa: B023 (awaited inside this iteration)

        await asyncio.gather(*(send(calls[i : i + batch]) for i in range(0, len(calls), batch)))
    await target.finish()
