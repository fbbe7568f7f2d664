"""What a log filter's poll delivers when the node's changes pass GETLOGS_MAX_RESULTS, and what it
leaves to read: no log the filter matched is lost, and no answer carries more than the limit.

The node moves its filter past every change it answers, so what the proxy does not deliver cannot be
asked of the filter again. The poll delivers the first `limit` logs in chain order (blockNumber,
logIndex) and leaves a Backlog in the filter's table entry: the position of the last log delivered
and the last block the node's changes reached, never the logs themselves. The next polls read the
rest with eth_getLogs over the filter's criteria, from the position's block to that block, dropping
what lies at or before the position, `limit` at most a poll, before the node's newer changes (which
only move the backlog's last block on).

Removed logs (`removed: true`, a reorg) and logs without a position cannot be read again with
eth_getLogs: a poll delivers those it receives at once, first (so a reorg that removes more than
`limit` matching logs in one poll is the one answer past the limit). A log of the node's changes at
or before the position is a reorg's new log in a block the client has read (and been told removed):
the backlog goes back to that block, whose new logs are then read and paged like the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

Position = tuple[int, int]  # (blockNumber, logIndex); (block, -1): before the block's first log


class Backlog(NamedTuple):
    """The logs a filter has matched and not delivered: those after `after` up to block `upto`."""

    after: Position
    upto: int

    def stored(self) -> list[int]:
        """As the filter table holds it."""
        return [self.after[0], self.after[1], self.upto]


class Page(NamedTuple):
    logs: list[Any]  # to deliver now, in order
    backlog: Backlog | None  # what is left to read; None: nothing


def loaded(stored: Any) -> Backlog | None:
    """A backlog from the filter table: None when there is none, or it is not one (an entry written
    before backlogs existed has none)."""
    if isinstance(stored, list) and len(stored) == 3 and all(isinstance(n, int) for n in stored):
        return Backlog((stored[0], stored[1]), stored[2])
    return None


def position(log: Any) -> Position | None:
    try:
        return int(log["blockNumber"], 16), int(log["logIndex"], 16)
    except (KeyError, TypeError, ValueError):
        return None


def _at_once(log: Any) -> bool:
    """Whether `log` cannot be read again with eth_getLogs: removed by a reorg, or without a position."""
    return bool(isinstance(log, dict) and log.get("removed")) or position(log) is None


def _in_order(logs: Iterable[Any]) -> list[tuple[Position, Any]]:
    placed = [(p, log) for log in logs if (p := position(log)) is not None]
    placed.sort(key=lambda pair: pair[0])
    return placed


def first_page(changes: list[Any], limit: int) -> Page:
    """The node's changes, with no backlog before them, that pass `limit`: those that cannot be read
    again, then the first logs in chain order up to `limit` in all; the rest is the backlog."""
    now = [log for log in changes if _at_once(log)]
    rest = _in_order(log for log in changes if not _at_once(log))
    if not rest:
        return Page(now, None)
    room = max(limit - len(now), 0)
    taken = rest[:room]
    if len(taken) == len(rest):
        return Page(now + [log for _p, log in taken], None)
    after = taken[-1][0] if taken else (rest[0][0][0], -1)
    return Page(now + [log for _p, log in taken], Backlog(after, rest[-1][0][0]))


def behind(changes: list[Any], backlog: Backlog) -> tuple[list[Any], Backlog]:
    """The node's changes while a backlog is left: those to deliver at once (removed, or without a
    position), and the backlog reaching their last block. A log at or before the backlog's position
    is a reorg's new log in a replaced block (a reorg replaces every block from its fork up): the
    backlog goes back to before that block, so its new logs are read and paged, never past the limit."""
    placed = _in_order(log for log in changes if not _at_once(log))
    again = [p for p, _log in placed if p <= backlog.after]
    start = (again[0][0], -1) if again else backlog.after
    return [log for log in changes if _at_once(log)], Backlog(start, max([backlog.upto, *(p[0] for p, _ in placed)]))


def after(logs: list[Any], at: Position, room: int) -> tuple[list[Any], Position | None]:
    """The first `room` logs of an eth_getLogs answer that lie after `at`, in chain order, and the
    position of the last of them when more lie after it (None: none do)."""
    rest = [(p, log) for p, log in _in_order(logs) if p > at and not _at_once(log)]
    given = rest[:room]
    return [log for _p, log in given], (given[-1][0] if given and len(rest) > room else None)


def merged(stored: Backlog | None, ours: Backlog | None) -> Backlog | None:
    """What two polls that started from the same backlog leave together (another worker's finished
    while this one read): the further position, the further last block; nothing lost, a page may
    come twice."""
    if stored is None or ours is None:
        return stored if ours is None else ours
    return Backlog(max(stored.after, ours.after), max(stored.upto, ours.upto))
