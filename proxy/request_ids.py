"""X-Request-Id: every HTTP answer names its request, with the client's own id when it sent a sane
one (as a load balancer or service mesh does), else a new one; ACCESS_LOG's lines name it too.

A new id is this process's random prefix and a counter (`3f9a1c2b7d4e-1a`): unique per process and
worker, and made with no system call, which a uuid4 per cache hit would cost.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

HEADER = "X-Request-Id"
MAX_LENGTH = 128
# A client's id is echoed only when it cannot split a header or a log line, nor fill one.
_SANE = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_LENGTH}}}")

# The id of the request being served, for the log lines of the calls inside it (accounting.py):
# set only with ACCESS_LOG on, so a cache hit pays nothing for it otherwise.
REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)


def sane(sent: str) -> bool:
    return _SANE.fullmatch(sent) is not None


class RequestIds:
    def __init__(self) -> None:
        self._renew()

    def _renew(self) -> None:
        """A fresh prefix and count: also in a forked child, which must not repeat its parent's ids."""
        self.prefix = secrets.token_hex(6) + "-"
        # The next number, for a pre-built head that holds the prefix and formats the number itself
        # (front.py's memory hits: no string made per hit).
        self.count = itertools.count(1).__next__

    def new(self) -> str:
        return f"{self.prefix}{self.count():x}"

    def of(self, sent: str | None) -> str:
        """The id for a request that sent `sent` (None: no X-Request-Id): its own if sane, else a new one."""
        return sent if sent is not None and _SANE.fullmatch(sent) is not None else self.new()


IDS = RequestIds()  # one per process: every transport's ids come from one count
os.register_at_fork(after_in_child=IDS._renew)


def identified(sent: str | None, serve: Callable[..., None], *args: Any) -> None:
    """`serve(*args)` with REQUEST_ID set to the request's id: the id of its log lines, its calls'
    too (a miss's task copies it with the context). Only with ACCESS_LOG on: a hit pays nothing else."""
    token = REQUEST_ID.set(IDS.of(sent))
    try:
        serve(*args)
    finally:
        REQUEST_ID.reset(token)
