"""The HTTP side of the in-repo fake nodes: an aiohttp server on a free port answering POST /."""

from __future__ import annotations

from typing import Self

from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support import fake_server


class FakeNode:
    """Subclasses answer each JSON-RPC body in `_handle`."""

    client_max_size = 1024**2  # aiohttp's default request body limit

    def __init__(self) -> None:
        self.server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    async def start(self) -> Self:
        app = web.Application(client_max_size=self.client_max_size)
        app.router.add_post("/", self._handle)
        self._routes(app)
        self.server = await fake_server(app)
        return self

    def _routes(self, app: web.Application) -> None:
        """More routes a subclass serves (the fake Solana node's pubsub WebSocket)."""

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def _handle(self, request: web.Request) -> web.Response:
        raise NotImplementedError
