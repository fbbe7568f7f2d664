"""Typed application-state keys shared by the HTTP and WebSocket handlers."""

from __future__ import annotations

from aiohttp import web

from .config import Settings
from .credits import Ledger
from .gateway import Gateway
from .metrics import Metrics
from .redis_link import RedisLink
from .service import Service
from .subscriptions import Streams
from .ws_state import Connection

SETTINGS = web.AppKey("settings", Settings)
GATEWAY = web.AppKey("gateway", Gateway)
METRICS = web.AppKey("metrics", Metrics)
SERVICE = web.AppKey("service", Service)
REDIS = web.AppKey("redis", RedisLink)
WEBSOCKETS = web.AppKey("websockets", set[Connection])
LEDGER = web.AppKey("ledger", Ledger)
STREAMS = web.AppKey("streams", Streams)
