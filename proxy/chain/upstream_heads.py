"""Each upstream's own latest block, polled beside the network's head tracker."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from proxy.rpc.jsonrpc import JsonRpcError
from proxy.upstream.pool import PerUpstream
from proxy.values import Answer
from proxy.workers.shared_polls import SharedPolls, aligned_delay


async def watch_upstream_heads(pool: PerUpstream, interval: float, shared: SharedPolls | None = None) -> None:
    """Each upstream's own latest block, every poll interval: the tracker follows one upstream,
    and an answer is kept only if the upstream that produced it had the blocks it depends on."""
    states = pool.states

    async def one(index: int) -> None:
        async def fetch(calls: list[tuple[str, Any]]) -> list[Answer]:
            return [await pool.ask(index, m, p, timeout=max(interval, 1.0)) for m, p in calls]

        try:
            if shared is None:
                answer = await pool.ask(index, "eth_blockNumber", [], timeout=max(interval, 1.0))
            else:
                since = time.time() - interval / 2
                [answer] = await shared.ask(f"upstream{index}", [("eth_blockNumber", [])], fetch, since=since)
        except JsonRpcError:
            return
        if isinstance(answer.result, str):
            with contextlib.suppress(ValueError):
                states.observe_head(index, int(answer.result, 16))

    while True:
        now = time.monotonic()  # one resting after a 429 is not asked before its Retry-After
        await asyncio.gather(
            *(one(i) for i in range(states.size) if states.in_rotation(i) and not states.resting(i, now))
        )
        await asyncio.sleep(interval if shared is None else aligned_delay(interval, time.time()))
