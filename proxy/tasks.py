"""Stopping background tasks: cancelled until they end, bounded."""

from __future__ import annotations

import asyncio
import logging

STOP_BOUND = 10.0  # seconds the lifecycle's tasks get to end once cancelled


async def stop_tasks(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the tasks and wait until they end. A task can take a cancellation for a timeout of its
    own (a Redis command's, in redis-py or a nested asyncio.timeout) and carry on: it is cancelled
    again until it ends, so no shutdown waits forever; past STOP_BOUND it is left behind, named."""
    pending = set(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STOP_BOUND
    while pending and loop.time() < deadline:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=0.25)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: a task that failed on its way out is not "never retrieved"
    if pending:
        logging.getLogger("proxy.app").warning(
            "stopping: %s did not end when cancelled; left behind", ", ".join(sorted(t.get_name() for t in pending))
        )
