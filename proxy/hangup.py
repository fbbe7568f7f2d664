"""SIGHUP from a process's first moment to its last: its default action (terminate) would kill a proxy
that is starting or stopping, so until the reload handler is installed (app.py, supervisor.py) a
SIGHUP is only remembered, and the reload made once the process serves."""

from __future__ import annotations

import signal
from types import FrameType

_received = [False]


def _remember(_signum: int, _frame: FrameType | None) -> None:
    _received[0] = True  # nothing else in a signal handler: the reload is made from the event loop


def hold() -> None:
    """From now until a reload handler replaces it: a SIGHUP is remembered, not acted on. A worker
    starts with SIGHUP blocked (the supervisor spawns it so): unblocked here, one sent meanwhile is
    remembered too."""
    signal.signal(signal.SIGHUP, _remember)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})


def received() -> bool:
    """Whether a SIGHUP came while held (forgotten once asked)."""
    came, _received[0] = _received[0], False
    return came


class Blocked:
    """SIGHUP blocked in this thread while a worker is spawned: the child inherits the mask, so a
    SIGHUP sent before it runs `hold` waits for it instead of terminating it."""

    def __enter__(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})

    def __exit__(self, *_exc: object) -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
