"""An open WebSocket connection and what it has in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web


@dataclass(eq=False)
class Connection:
    ws: web.WebSocketResponse
    account: str = ""  # the key's account name: WS_MAX_CONNECTIONS_PER_KEY counts by it
    active_at: float = 0.0  # loop time of its last message: WS_IDLE_TIMEOUT counts from it
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    messages: dict[asyncio.Task[None], str | bytes] = field(default_factory=dict)  # each task's, for a cut-off
    draining: bool = False
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # set once the close frame is sent
    recheck: Callable[[], None] | None = None  # after a reload of keys: its key and lists checked again (ws.py)
    revoked: bool = False  # its key was removed or changed: nothing more is served, the socket is closing
