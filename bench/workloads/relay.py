"""A counting relay between the proxy and the node: every call that reaches the node, per method, those
inside batches included. `GET /counts` reads the counters (the bench runs the relay as its own process).

    python -m bench.workloads.relay TARGET_URL PORT
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import aiohttp
from aiohttp import web


class Counts:
    """The relay's counters (a holder: aiohttp's typed app keys do not take a Counter)."""

    def __init__(self, calls: Counter[str] | None = None) -> None:
        self.calls: Counter[str] = calls if calls is not None else Counter()


COUNTS = web.AppKey("counts", Counts)
TARGET = web.AppKey("target", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def _relay(request: web.Request) -> web.Response:
    body = await request.read()
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    calls = payload if isinstance(payload, list) else [payload]
    request.app[COUNTS].calls.update(c.get("method", "?") if isinstance(c, dict) else "?" for c in calls)
    async with request.app[SESSION].post(
        request.app[TARGET], data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")


async def _counts(request: web.Request) -> web.Response:
    return web.json_response(dict(request.app[COUNTS].calls))


def relay_app(target: str, counts: Counter[str] | None = None) -> web.Application:
    """The relay as an aiohttp app; `counts` is the Counter it fills (tests read it in-process)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[COUNTS] = Counts(counts)
    app[TARGET] = target

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/", _relay)
    app.router.add_get("/counts", _counts)
    return app


if __name__ == "__main__":
    web.run_app(relay_app(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), print=None, access_log=None)
