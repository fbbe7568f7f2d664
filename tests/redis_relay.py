"""A TCP relay in front of a redis-server that can keep one replica from reading its key spaces' trails
(forks.py): while `stalled`, a connection that sends a command naming a trail key is cut before the
command reaches Redis, as a Redis that goes away would (or, while `hanging`, the command is held
unanswered, as a Redis that stops answering would); every other command passes."""

from __future__ import annotations

import asyncio
import contextlib
import re
from urllib.parse import urlsplit

TRAIL_KEY = re.compile(rb"rcp:e:[^\r\n]*:t\r\n")  # a trail key as a RESP bulk string (forks.trail_key)


class TrailStallingRelay:
    def __init__(self, redis_url: str) -> None:
        parts = urlsplit(redis_url)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._path = parts.path
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.stalled = False
        self.hanging = False
        self.cut = 0  # trail reads cut or held
        self._closing = asyncio.Event()
        self.url = ""

    async def start(self) -> TrailStallingRelay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}{self._path}"
        return self

    async def close(self) -> None:
        self._closing.set()
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        redis_reader, redis_writer = await asyncio.open_connection(*self._target)
        self._writers |= {client_writer, redis_writer}
        try:
            await asyncio.gather(
                self._pipe(client_reader, redis_writer, inspect=True), self._pipe(redis_reader, client_writer)
            )
        finally:
            for writer in (client_writer, redis_writer):
                self._writers.discard(writer)
                writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, inspect: bool = False) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await reader.read(65536):
                if inspect and (self.stalled or self.hanging) and TRAIL_KEY.search(chunk):
                    self.cut += 1
                    if self.hanging:
                        await self._closing.wait()
                    break
                writer.write(chunk)
                await writer.drain()
        writer.close()  # one side gone or cut: the other ends too
