"""Answers whose connections have had none yet, their size unknown (answer_bytes.py). Each is reckoned
at 64 KiB in its key's and the process's counts, so many new connections of one key (a pool opening)
are not held up by half their own bound each; so few bytes bound few answers, and how many such
answers are made at once is bounded here, per key and per process. Without it, 180 new connections
of 30 keys that read nothing held 1.28 GB of 4 MB answers against a process bound of 64 MiB: all
were made before the first was answered."""

from __future__ import annotations

from collections.abc import Callable

# Answers of unknown size one key has made at once: at least this, twice UPSTREAM_KEY_CONCURRENCY (a
# key's calls beyond it wait for the node anyway), or the process's where that is not capped (key_most).
PER_KEY = 16
# Past its bound, a key under its even share of it is made still, up to this part past it.
FAIR_OVER = 4


def key_most(key_concurrency: int, most: int) -> int:
    """How many answers of unknown size one key may have made at once, the process `most`."""
    return max(PER_KEY, 2 * key_concurrency if key_concurrency else most)


class FirstAnswers:
    """The answers of unknown size being made, in all and per key (None: no key's), and whether one
    more may be: `most` in the process (as many as its bound holds at half a connection's bound
    each), `per_key` of one key."""

    def __init__(self, most: int, wake: Callable[[], None]) -> None:
        self.most = most
        self.per_key = PER_KEY
        self.making = 0
        self.keys: dict[str | None, int] = {}
        self._wake = wake  # those waiting for room look again (AnswerBytes)

    def room(self, key: str | None) -> bool:
        """Whether one more may be made for `key`: fewer than `per_key` of its own while the process
        makes fewer than `most`; past that, fewer than its even share of `most` (over the keys making
        any, itself among them) up to a FAIR_OVER part past it, as AnswerBytes._fair (one tenant's
        slow calls held every other key's new connections, and a key's first made whatever the others
        made let 180 connections of open mode's made-up keys make 180 at once). No key: one at a time."""
        held = self.keys.get(key, 0)
        if key is not None and held >= self.per_key:
            return False
        most = self.most
        if self.making < most:
            return True
        if self.making >= most + most // FAIR_OVER:
            return False
        if key is None:
            return not held
        return held < most // (len(self.keys) + (not held))

    def made(self, key: str | None, count: int) -> None:
        """`count` begin to be made for `key` (negative: are no longer, and room is looked at again)."""
        self.making += count
        left = self.keys.get(key, 0) + count
        if left > 0:
            self.keys[key] = left
        else:
            self.keys.pop(key, None)
        if count < 0:
            self._wake()
