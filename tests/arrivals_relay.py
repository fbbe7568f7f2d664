"""A relay in a process of its own that writes each request's arrival time (CLOCK_MONOTONIC, the
same clock in every process) to a file: what a provider's meter sees, undisturbed by the test's own
event loop. `python -m tests.arrivals_relay TARGET PORT FILE`."""

from __future__ import annotations

import sys
import time

import aiohttp
from aiohttp import web


def main(target: str, port: int, path: str) -> None:
    log = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    session: aiohttp.ClientSession | None = None

    async def relay(request: web.Request) -> web.Response:
        nonlocal session
        log.write(f"{time.monotonic()}\n")
        body = await request.read()
        if session is None:
            session = aiohttp.ClientSession()
        async with session.post(target, data=body, headers={"Content-Type": "application/json"}) as response:
            return web.Response(body=await response.read(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/", relay)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
