"""Bytes held for what clients leave standing: the criteria of their logs subscriptions and node-side
filters, kept until they end. Counts bounded them (WS_MAX_SUBSCRIPTIONS a connection,
MAX_FILTERS_PER_KEY a key, none in open mode), not the bytes a 5,000-address filter holds: 100 such
subscriptions on one connection held 145 MB, 8 connections 1.2 GB. Each is now measured as it is
held (`deep_size`) and taken from a bound, a key's at most a quarter of it (open mode: every client
is one account, which may take the whole)."""

from __future__ import annotations

import sys
from typing import Any


def deep_size(*values: Any) -> int:
    """What `values` hold in memory: each object once (sys.getsizeof), the items of its dicts, lists,
    tuples and sets with it, however often one is named."""
    seen: set[int] = set()
    total = 0
    stack = list(values)
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        total += sys.getsizeof(value)
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
    return total


class HeldBytes:
    """A bound on bytes held, all accounts together, a key's at most a quarter of it."""

    __slots__ = ("by_account", "held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.by_account: dict[str, int] = {}

    def take(self, account: str, size: int, *, whole: bool = False) -> bool:
        """`size` bytes for `account`, if the bound and its share have room (`whole`: the open
        account, every client of an open proxy, may take the whole bound)."""
        mine = self.by_account.get(account, 0)
        if self.held + size > self.limit or (not whole and mine + size > self.limit // 4):
            return False
        self.held += size
        self.by_account[account] = mine + size
        return True

    def give(self, account: str, size: int) -> None:
        self.held -= size
        left = self.by_account.get(account, 0) - size
        if left:
            self.by_account[account] = left
        else:
            del self.by_account[account]
