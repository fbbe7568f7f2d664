"""A relay in a process of its own that writes each request's arrival and departure times
(CLOCK_MONOTONIC, the same clock in every process), its JSON-RPC calls (a batch's length, else 1),
their methods and the sender's port (which of the proxy's connections) to a file, one request a
line: what a provider's meter sees, undisturbed by the test's own event loop. `DELAY` (seconds,
default 0) holds each request that long before it is answered; with `SLOW` (methods, comma
separated) only a request carrying one of them. A request whose sender has gone is finished and
noted all the same, as a node works on a call whatever became of its connection.
`python -m tests.arrivals_relay TARGET PORT FILE [DELAY [SLOW]]`."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp
from aiohttp import web


def main(target: str, port: int, path: str, delay: float, slow: set[str] | None) -> None:
    log = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    session: aiohttp.ClientSession | None = None

    async def relay(request: web.Request) -> web.Response:
        arrived = time.monotonic()
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        body = await request.read()
        # As a node does, it finishes a request whose client has gone (and notes it).
        answer = await asyncio.shield(answered(arrived, body, peer[1] if peer else 0))
        return web.Response(body=answer, content_type="application/json")

    async def answered(arrived: float, body: bytes, port: int) -> bytes:
        nonlocal session
        if session is None:
            session = aiohttp.ClientSession()
        parsed = json.loads(body)
        methods = [c.get("method", "?") for c in (parsed if isinstance(parsed, list) else [parsed])]
        if slow is None or slow.intersection(methods):
            await asyncio.sleep(delay)
        async with session.post(target, data=body, headers={"Content-Type": "application/json"}) as response:
            answer = await response.read()
        log.write(f"{arrived} {time.monotonic()} {len(methods)} {','.join(methods)} {port}\n")
        return answer

    app = web.Application()
    app.router.add_post("/", relay)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=True)


if __name__ == "__main__":
    main(
        sys.argv[1],
        int(sys.argv[2]),
        sys.argv[3],
        float(sys.argv[4]) if len(sys.argv) > 4 else 0.0,
        set(sys.argv[5].split(",")) if len(sys.argv) > 5 else None,
    )
