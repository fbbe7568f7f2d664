"""Log fan-out per connection (issue 19, item 2): a block's logs encoded once, expanded by each
connection's own writer.

The head feed hands every connection one shared `LogBatch` per block, in O(connections). Each
connection's writer then matches the batch against its own subscriptions and sends what matches,
as fast as its client reads. The writers busy with a batch share one SLICE_SECONDS per turn of the
event loop (each yields after its share), so however many there are, another key's request waits
about one slice per step, and a silent client costs one blocked writer, never the feed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from proxy.rpc import jsonrpc

SLICE_SECONDS = 0.005  # CPU the writers expanding log batches share per turn of the loop
_SLICE_CHECK = 16  # notifications matched between looks at the clock
_expanding = [0]  # writers expanding a batch right now (one event loop per process)


class LogSubscriber(Protocol):
    """What expansion reads of a logs subscription (subscriptions.Subscription)."""

    @property
    def active(self) -> bool: ...

    def wants(self, entry: Mapping[str, Any]) -> bool: ...


@dataclass(frozen=True, slots=True)
class LogBatch:
    """One block's logs (or its removed logs), each encoded once, shared by every connection."""

    entries: tuple[Mapping[str, Any], ...]
    payloads: tuple[bytes, ...]

    @classmethod
    def of(cls, entries: list[dict[str, Any]]) -> LogBatch:
        return cls(tuple(entries), tuple(jsonrpc.dumps(entry) for entry in entries))


S = TypeVar("S", bound=LogSubscriber)


async def expand(batch: LogBatch, subs: tuple[S, ...], send: Callable[[S, bytes], Awaitable[bool]]) -> None:
    """`send(sub, encoded log)` for each log and each active subscription that wants it, in order,
    until `send` says stop (False); yields to the loop after this writer's share of SLICE_SECONDS."""
    checked, started = 0, time.perf_counter()
    _expanding[0] += 1
    try:
        for entry, payload in zip(batch.entries, batch.payloads, strict=True):
            for sub in subs:
                checked += 1
                if checked % _SLICE_CHECK == 0 and time.perf_counter() - started > SLICE_SECONDS / _expanding[0]:
                    await asyncio.sleep(0)
                    started = time.perf_counter()
                if sub.active and sub.wants(entry) and not await send(sub, payload):
                    return
    finally:
        _expanding[0] -= 1
