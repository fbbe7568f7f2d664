"""A bounded memo of pure results, for the hot path."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Memo(dict[K, V]):
    """A bounded memo of pure results: when full it starts over, and hot entries come straight back.

    Reads are plain dict lookups; an LRU's bookkeeping on every read would cost the hot path more
    than the occasional recomputation after a reset. With `compute`, `memo[key]` fills itself.
    """

    def __init__(self, size: int, compute: Callable[[K], V] | None = None) -> None:
        super().__init__()
        self._size = size
        self._compute = compute

    def __setitem__(self, key: K, value: V) -> None:
        if len(self) >= self._size and key not in self:
            self.clear()
        super().__setitem__(key, value)

    def __missing__(self, key: K) -> V:
        if self._compute is None:
            raise KeyError(key)
        value = self[key] = self._compute(key)
        return value


class ByteBoundMemo(dict[K, V]):
    """Pure results kept while their sizes add up to at most `bound` bytes, the oldest forgotten first.

    Reads are plain dict lookups; `keep` is the only way in, so the count of bytes held stays exact.
    An entry larger than the whole bound is not kept.
    """

    def __init__(self, bound: int) -> None:
        super().__init__()
        self.bound = bound
        self.held = 0
        self._sizes: dict[K, int] = {}

    def keep(self, key: K, value: V, size: int) -> None:
        self.forget(key)
        if size > self.bound:
            return
        while self.held + size > self.bound:
            self.forget(next(iter(self)))
        dict.__setitem__(self, key, value)
        self._sizes[key] = size
        self.held += size

    def forget(self, key: K) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            dict.__delitem__(self, key)
            self.held -= size
