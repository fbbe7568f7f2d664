"""Which asyncio event loop runs a serving process: uvloop (the default, a dependency wherever it
builds), or the standard one with EVENT_LOOP=asyncio. uvloop's accept loop does not pass through the
proxy's quiet accept-error handler, so listeners.watch_descriptors logs the same warning for it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

Choice = Literal["asyncio", "uvloop"]
T = TypeVar("T")


def loop_factory(choice: Choice) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """None: the standard loop. EVENT_LOOP=uvloop without uvloop installed is refused by config."""
    if choice == "asyncio":
        return None
    import uvloop

    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], choice: Choice) -> T:
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
