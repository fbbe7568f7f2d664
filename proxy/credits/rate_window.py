"""A key's per-second credit window (pure): the in-process ledger, a replica cut off from Redis and
the lease script in Redis (lease_script.py, its twin) keep it alike. A window already in use may not
go over the limit; an empty one admits one call of any size (a batch dearer than the limit), and
what that call passes the limit by fills the seconds after it, so the key's average stays within it.
"""

from __future__ import annotations

# `(start, last, used)`: the second of the key's latest spending, the last second it fills, and what
# it holds of that one; every second from `start` to before `last` is full. A call judged late (its
# second before `start`: replicas' calls reach Redis out of order) counts in the window's `start`.
Window = tuple[int, int, int]
NO_WINDOW: Window = (-1, -1, 0)


def window_held(window: Window, second: int, per_second: int) -> int:
    """What the window holds of `second`: all of it while a dearer call's excess still fills it."""
    start, last, used = window
    second = max(second, start)
    return 0 if second > last else used if second == last else per_second


def window_after(window: Window, second: int, amount: int, per_second: int) -> Window:
    """The window once `amount` is spent at `second`: what passes the limit carried into the next seconds."""
    if amount <= 0:
        return window  # a free call takes nothing, and gives back none of what a dearer one carried
    second = max(second, window[0])
    full, rest = divmod(window_held(window, second, per_second) + amount, per_second)
    if rest == 0 and full > 0:  # ends exactly at a second's end: that second is the last one filled
        full, rest = full - 1, per_second
    return (second, second + full, rest)
