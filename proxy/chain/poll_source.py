"""Which node a head poll's answers come from: the pool's (the tracker's PollAsker), unless an
upstream is known AHEAD_BY blocks or more ahead of the node that answered (a primary that lags
without failing), or the answer is below the head (Behind, or a lower block once the head is
stale): then it is asked once more, of the first upstream ahead (furthest first, alone) whose chain
holds both the answering node's latest block and the tracker's (never one ahead on another fork), or
of the pool again when none is known ahead (a load balancer may send it to another member). The
window's blocks are then asked of the same node as the latest block."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from proxy.chain.head_polls import (
    Asks,
    Behind,
    Head,
    Header,
    PollAsker,
    TrackerError,
    get_block,
    header_of,
    made_up,
    unsure,
)
from proxy.rpc.jsonrpc import JsonRpcError
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

    async def direct(self, calls: Calls) -> list[Answer]:
        return await self.ask(calls)  # one upstream: no sibling's answers to go past


def further(states: UpstreamStates | None, latest_a: Answer) -> list[int]:
    """The upstreams in rotation known AHEAD_BY blocks or more ahead of the latest block a poll's node
    gave, furthest first."""
    latest = header_of(latest_a)
    if states is None or latest is None:
        return []
    return states.ahead_of(latest_a.upstream, latest.number + AHEAD_BY - 1)  # ahead of this answer


async def answered(
    asker: PollAsker,
    upstream: Upstream,
    states: UpstreamStates | None,
    calls: Calls,
    judge: Judge,
    timeout: float,
    old_head: Head | None,
) -> tuple[list[Answer], Asks, Header, bool]:
    """A poll's answers, the asker of the node that gave them, and the tracker's judgment of them
    (its latest block, whether finality was violated); TrackerError as `judge` raises it. An
    upstream ahead is followed only when it holds the tracker's latest block (`old_head`'s)."""
    head = (old_head.latest, old_head.latest_hash) if old_head is not None else None
    # The upstream the head came from: one that no longer holds it was reorged, not parted (standing.py).
    origin = old_head.source if old_head is not None else None
    window = old_head.hashes if old_head is not None else None
    answers = await asker.ask(calls)
    source: Asks = asker
    taken = await from_ahead(
        upstream, states, further(states, answers[0]), calls, answers, head, timeout, origin, window
    )
    if taken is not None:
        answers, source = taken
    try:
        answers = checked(answers, states)
        below = _below(answers[0], old_head) if taken is None else None
        if below is not None:
            # Asked once more before it is judged, also once the head is stale (when a lower block
            # is taken as a rollback): a balancer's lagging member answers below the head too.
            raise below
        return answers, source, *judge(answers)
    except Behind as behind:
        candidates = states.ahead_of(answers[0].upstream) if states is not None else []
        if not candidates:  # none known ahead (one URL): the pool again, which may pick another member
            try:
                answers, source = await asker.direct(calls), asker
            except JsonRpcError:
                raise behind from None  # the poll's failure is the node behind, not the one that failed
        elif (
            taken := await from_ahead(upstream, states, candidates, calls, answers, head, timeout, origin, window)
        ) is not None:
            answers, source = taken
        else:
            raise
        answers = checked(answers, states)
        return answers, source, *judge(answers)


def checked(answers: list[Answer], states: UpstreamStates | None) -> list[Answer]:
    """A poll's answers as the tracker may judge them: its tags one chain's view (in_order), a made-up
    block after them as none (unmade)."""
    in_order(answers, states)
    return unmade(answers, states)


def unmade(answers: list[Answer], states: UpstreamStates | None) -> list[Answer]:
    """A poll's answers with a made-up block after its tags (the finalized block it knew, asked by
    number) as none: it cannot start a new epoch (a relay's edit of an old block's timestamp or hash
    dropped the cache), and a node that lies of old blocks does not stop the head. So is one that
    cannot be hashed on a network whose blocks have been (a field added to hide the edit)."""
    return [
        Answer(b"null", upstream=answer.upstream) if i >= 3 and unsure(header_of(answer), states) else answer
        for i, answer in enumerate(answers)
    ]


def in_order(answers: list[Answer], states: UpstreamStates | None = None) -> None:
    """TrackerError unless a poll's blocks are one chain's view: finalized <= safe <= latest, one hash
    where two tags name one height, none a made-up block (head_polls.made_up). Each may be a true
    block and still not the tag's (a node or a relay that trades them): taken, a finalized block above
    latest would move the head back and the final mark up to a block the chain has not finalized."""
    latest, safe, final = (header_of(answer) for answer in answers[:3])
    if states is not None and any(block is not None and block.hashed for block in (latest, safe, final)):
        states.headers_hash = True  # learnt first: on the first poll, an honest tag's block refuses a made-up latest
    for tag, answer, block in (
        ("latest", answers[0], latest),
        ("safe", answers[1], safe),
        ("finalized", answers[2], final),
    ):
        if (block is None and isinstance(answer.result, dict) and not answer.is_error) or made_up(block, states):
            raise TrackerError(f"upstream #{answer.upstream} gave as {tag} a block that is malformed or made up")
    ordered = [(tag, block) for tag, block in (("finalized", final), ("safe", safe), ("latest", latest)) if block]
    if len({b.hash for _, b in ordered}) != len({b.number for _, b in ordered}):  # another block's hash
        raise TrackerError(f"upstream #{answers[0].upstream} gave one hash for two heights: not one chain's view")
    for (low_tag, low), (high_tag, high) in itertools.pairwise(ordered):
        if low.number > high.number or (low.number == high.number and low.hash != high.hash):
            raise TrackerError(
                f"upstream #{answers[0].upstream} gave as {low_tag} block {low.number} ({low.hash[:10]}) and as "
                f"{high_tag} block {high.number} ({high.hash[:10]}): not one chain's view"
            )


def _below(latest_a: Answer, old_head: Head | None) -> Behind | None:
    """A poll's latest block below the tracker's head, as the failure it is if no other answer comes."""
    latest = header_of(latest_a)
    if old_head is None or latest is None or latest.number >= old_head.latest:
        return None
    return Behind.at(latest_a.upstream, latest, old_head.latest)


async def from_ahead(
    upstream: Upstream,
    states: UpstreamStates | None,
    candidates: list[int],
    calls: Calls,
    behind: list[Answer],
    head: tuple[int, str] | None,
    timeout: float,
    origin: int | None = None,
    window: Mapping[int, str] | None = None,
) -> tuple[list[Answer], Pinned] | None:
    """The poll's answers from the first upstream ahead (furthest first) whose chain holds the
    tracker's own latest block (before it has one, the latest block the node behind gave), with its
    hash: one that extends the chain the head follows. One ahead on another fork (a backup on a
    minority fork, parted below that block) is never followed for being ahead; None when none is
    taken. Whatever chain the node behind is on: a backup on a fork the network left shows a block
    the network's chain does not hold, and while its polls found no upstream ahead the head went
    stale, every read then unpinned (the backup's blocks and state were served for the network's)."""
    latest, pool = header_of(behind[0]), http_pool(upstream)
    if latest is None or pool is None:
        return None
    held = dict([head if head is not None else (latest.number, latest.hash)])
    # The node behind's latest block, when the head's window holds it too: one ahead that holds it but
    # not the head extends the head's chain below a reorg of its tip, which no upstream holds any more
    # (the head stayed stale while the primary lagged: every `latest` read refused).
    # One that holds the head is taken first, any of them (a fork parted between the two blocks is not).
    below = head is not None and latest.number < head[0] and (window or {}).get(latest.number) == latest.hash
    if below:
        held[latest.number] = latest.hash
    fallback: tuple[list[Answer], Pinned] | None = None
    for index in candidates:
        ahead = Pinned(pool, index, timeout)
        try:
            answers = await ahead.ask([*calls, *(get_block(hex(number)) for number in held)])
        except JsonRpcError:
            continue
        shown = [header_of(answer) for answer in answers[len(calls) :]]
        matches = [s is not None and s.hash == h for s, h in zip(shown, held.values(), strict=True)]
        holds = matches[0] or (below and matches[-1])
        # Against the head's chain (not the node behind's), and never the head's own node (reorged).
        if states is not None and 0 <= index < states.size and head is not None:
            parted = [n for s, n in zip(shown, held, strict=True) if s is not None and s.hash != held[n]]
            kept = None if holds or index == origin else min(parted, default=states.parted[index])
            states.parted[index] = kept
        if matches[0]:
            return answers[: len(calls)], ahead
        if (holds or index == origin) and fallback is None:
            # The head's own node without the head reorged it, as a poll it answered directly shows:
            # taken so (it was not while it cooled down, and every read at the head was refused).
            fallback = answers[: len(calls)], ahead
    return fallback
