"""Each upstream's own latest block (a Solana upstream's processed slot), polled beside the network's
head or slot tracker."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from proxy.rpc.jsonrpc import JsonRpcError
from proxy.upstream.pool import PerUpstream
from proxy.values import Answer
from proxy.workers.shared_polls import SharedPolls, aligned_delay

EVM_PROBE: tuple[tuple[str, Any], ...] = (("eth_blockNumber", []), ("eth_syncing", []))
# A Solana node's own head: its processed slot (Agave's getHealth judges a node by its slot too).
SOLANA_PROBE: tuple[tuple[str, Any], ...] = (("getSlot", [{"commitment": "processed"}]),)


async def watch_upstream_heads(
    pool: PerUpstream,
    interval: float,
    shared: SharedPolls | None = None,
    first: asyncio.Event | None = None,
    *,
    solana: bool = False,
) -> None:
    """Each upstream's own latest block and eth_syncing (`solana`: its processed slot), every poll
    interval: the tracker follows an upstream that is neither syncing nor far behind, and an answer is
    kept only if the upstream that produced it had the blocks it depends on (a Solana answer: the
    slots already shown, slots.py). `first` is set once the first round is done."""
    states = pool.states
    calls = list(SOLANA_PROBE if solana else EVM_PROBE)

    async def one(index: int) -> None:
        async def fetch(asked: list[tuple[str, Any]]) -> list[Answer]:
            return [await pool.ask(index, m, p, timeout=max(interval, 1.0)) for m, p in asked]

        try:
            if shared is None:
                answers = await fetch(calls)
            else:
                since = time.time() - interval / 2
                answers = await shared.ask(f"upstream{index}", calls, fetch, since=since)
        except JsonRpcError:
            return
        if solana:
            if type(answers[0].result) is int:
                states.observe_head(index, answers[0].result)
            return
        number, syncing = answers
        if isinstance(number.result, str):
            with contextlib.suppress(ValueError):
                states.observe_head(index, int(number.result, 16))
        if not syncing.is_error:  # a node without eth_syncing says nothing of it
            states.observe_syncing(index, syncing.result)

    while True:
        now = time.monotonic()  # one resting after a 429 is not asked before its Retry-After
        await asyncio.gather(
            *(one(i) for i in range(states.size) if states.in_rotation(i) and not states.resting(i, now))
        )
        if first is not None:
            first.set()
        await asyncio.sleep(interval if shared is None else aligned_delay(interval, time.time()))
