"""Which asyncio event loop runs a serving process: uvloop when installed (`pip install
'rpc-cache-proxy[fast]'`) unless EVENT_LOOP says otherwise, else the standard one."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

Choice = Literal["auto", "asyncio", "uvloop"]
T = TypeVar("T")


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def loop_factory(choice: Choice) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """None: the standard loop. EVENT_LOOP=uvloop without uvloop installed is refused by config."""
    if choice == "asyncio" or (choice == "auto" and not uvloop_installed()):
        return None
    import uvloop

    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], choice: Choice) -> T:
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
