"""Which node a head poll's answers come from: the pool's (the tracker's PollAsker), unless an
upstream is known AHEAD_BY blocks or more ahead of the node that answered (a primary that lags
without failing), or the answer is below the head (Behind): then it is asked once more, of the
upstream furthest ahead alone when its chain holds the answering node's latest block (never a node
ahead on another fork), or of the pool again when none is known (a load balancer may send it to
another member). The window's blocks are then asked of the same node as the latest block."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

from proxy.chain.head_polls import Asks, Behind, Header, PollAsker, get_block, header_of
from proxy.rpc.jsonrpc import UPSTREAM_UNAVAILABLE, JsonRpcError
from proxy.upstream.pool import HttpUpstream, Upstream, http_pool
from proxy.upstream.standing import UpstreamStates
from proxy.values import Answer

# Blocks an upstream must be known ahead of a poll's node for the poll to be asked of it instead: one
# block between two nodes in step is a block still propagating.
AHEAD_BY = 2

Calls = list[tuple[str, Any]]
Judge = Callable[[list[Answer]], tuple[Header, bool]]  # the tracker's judgment of a poll's answers


class Pinned(NamedTuple):
    """A poll's calls asked of one upstream alone (one batch: one node answers them all)."""

    pool: HttpUpstream
    upstream: int
    timeout: float

    async def ask(self, calls: Calls) -> list[Answer]:
        return await self.pool.ask_all(self.upstream, calls, timeout=self.timeout)


def pinned(upstream: Upstream, index: int | None, timeout: float) -> Pinned | None:
    """An asker of upstream `index` alone (None: no index, or no pool of upstreams to ask it of)."""
    pool = http_pool(upstream) if index is not None else None
    return Pinned(pool, index, timeout) if pool is not None and index is not None else None


def further(states: UpstreamStates | None, latest_a: Answer) -> int | None:
    """An upstream in rotation known AHEAD_BY blocks or more ahead of the latest block a poll's node
    gave, or None."""
    latest = header_of(latest_a)
    ahead = states.ahead_of(latest_a.upstream) if states is not None and latest is not None else None
    if states is None or latest is None or ahead is None:
        return None
    return ahead if states.latest[ahead] >= latest.number + AHEAD_BY else None


async def answered(
    asker: PollAsker, upstream: Upstream, states: UpstreamStates | None, calls: Calls, judge: Judge, timeout: float
) -> tuple[list[Answer], Asks, Header, bool]:
    """A poll's answers, the asker of the node that gave them, and the tracker's judgment of them
    (its latest block, whether finality was violated); TrackerError as `judge` raises it."""
    answers = await asker.ask(calls)
    source: Asks = asker
    ahead = pinned(upstream, further(states, answers[0]), timeout)
    if ahead is not None:
        with contextlib.suppress(JsonRpcError):  # else this poll's own answers
            answers, source = await on_the_same_chain(ahead, calls, answers), ahead
    try:
        return answers, source, *judge(answers)
    except Behind as behind:
        ahead = pinned(upstream, states.ahead_of(answers[0].upstream) if states is not None else None, timeout)
        try:
            answers = await (on_the_same_chain(ahead, calls, answers) if ahead is not None else asker.direct(calls))
        except JsonRpcError:
            raise behind from None  # the poll's failure is the node behind, not the one that failed
        return answers, ahead or asker, *judge(answers)


async def on_the_same_chain(ahead: Pinned, calls: Calls, behind: list[Answer]) -> list[Answer]:
    """The poll's answers from the upstream ahead, when its chain holds the latest block the node
    behind gave, with that hash: that node is behind on it. An upstream ahead on another fork (a
    backup on a minority fork) is not followed for being ahead: JsonRpcError, and the poll keeps the
    answers it had."""
    latest = header_of(behind[0])
    if latest is None:
        raise JsonRpcError(UPSTREAM_UNAVAILABLE, "no latest block to compare")
    answers = await ahead.ask([*calls, get_block(hex(latest.number))])
    shown = header_of(answers[-1])
    if shown is None or shown.hash != latest.hash:
        raise JsonRpcError(UPSTREAM_UNAVAILABLE, f"upstream #{ahead.upstream} is on another chain at {latest.number}")
    return answers[:-1]
