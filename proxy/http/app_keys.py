"""Typed application-state keys shared by the HTTP and WebSocket handlers."""

from __future__ import annotations

from aiohttp import web

from proxy.config import Settings
from proxy.credits.ledger import Ledger
from proxy.gateway.gateway import Gateway
from proxy.http.front_routes import FrontRoutes
from proxy.http.ws_connections import Connection
from proxy.metrics import Metrics
from proxy.redis_link import RedisLink
from proxy.service import Service
from proxy.streams.subscription import Streams
from proxy.workers.replica_counts import ReplicaCounts

SETTINGS = web.AppKey("settings", Settings)
GATEWAY = web.AppKey("gateway", Gateway)
METRICS = web.AppKey("metrics", Metrics)
SERVICE = web.AppKey("service", Service)
REDIS = web.AppKey("redis", RedisLink)
WEBSOCKETS = web.AppKey("websockets", set[Connection])
WS_HELD = web.AppKey("ws_held", ReplicaCounts)  # open WebSockets per key (WS_MAX_CONNECTIONS_PER_KEY)
LEDGER = web.AppKey("ledger", Ledger)
STREAMS = web.AppKey("streams", Streams)
FRONT = web.AppKey("front", FrontRoutes)  # what the fast server (front.py) answers with
