"""Cache admission per API key: bytes of answers one key's calls may place in the tiers per window.

Answers are kept for everyone (a key's miss fills the cache others hit), so a key that asks for
many large distinct answers could push every other key's warm entries out of the memory LRU and
out of an evicting Redis. Past its budget for the window a key's answers are served but not kept.
One key therefore evicts at most `per_window` bytes per window: with the default (a sixteenth of
CACHE_MEMORY_BYTES a minute) an entry any key touched in the last 16 minutes is never evicted from
memory by one key's traffic; size Redis's maxmemory at least as large for the same bound there.
The proxy's own stores (no key) and open mode are not bounded. Pure but for the injected clock.
"""

from __future__ import annotations

from collections.abc import Callable

WINDOW = 60.0  # seconds: CACHE_KEY_BYTES_PER_MINUTE


class Admission:
    def __init__(self, per_window: int, clock: Callable[[], float], window: float = WINDOW) -> None:
        self.per_window = per_window
        self._clock = clock
        self._window = window
        self._spent: dict[str, tuple[float, int]] = {}  # key -> (its window's start, bytes stored in it)

    def admit(self, key: str | None, size: int) -> bool:
        """Whether `key` may store `size` more bytes now (counted when it may)."""
        if key is None or self.per_window <= 0:
            return True
        now = self._clock()
        start, spent = self._spent.get(key, (now, 0))
        if now - start >= self._window:
            start, spent = now, 0
        if spent + size > self.per_window:
            return False
        self._spent[key] = (start, spent + size)
        return True
