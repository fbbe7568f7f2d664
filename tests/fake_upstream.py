"""A misbehaving upstream for failure tests: answers with a fixed status/body, or slowly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from tests.support import fake_server


@asynccontextmanager
async def bad_upstream(
    *,
    status: int = 200,
    body: bytes = b"<html>oops</html>",
    delay: float = 0.0,
    path: str = "/",
    result: Any = None,
) -> AsyncIterator[str]:
    """`result`: answer every single call with it (under the request's own id) instead of `body`."""
    hits = {"count": 0}

    async def handle(request: web.Request) -> web.Response:
        hits["count"] += 1
        if delay:
            await asyncio.sleep(delay)
        if result is not None:
            call = json.loads(await request.read())
            return web.json_response({"jsonrpc": "2.0", "id": call.get("id"), "result": result})
        return web.Response(status=status, body=body, content_type="text/html")

    app = web.Application()
    app.router.add_post(path, handle)
    server = await fake_server(app)
    try:
        yield f"http://127.0.0.1:{server.port}{path}"
    finally:
        await server.close()
