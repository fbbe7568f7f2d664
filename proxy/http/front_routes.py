"""What the fast server (front.py) answers, decided from a request's method, path and headers: a
JSON-RPC POST goes to the endpoint; health, readiness, /metrics, preflights and every other path are
answered here as aiohttp's routes answer them (routes.py, cors.py). No I/O but /metrics' scrape."""

from __future__ import annotations

import json
import re
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import parse_qs, unquote

from prometheus_client import CONTENT_TYPE_LATEST

from proxy.config import Settings
from proxy.http.compression import DECODED_CODINGS, UnsupportedCoding, decoded_body
from proxy.http.endpoint import (
    NO_CHARGE,
    Headers,
    Pending,
    RpcEndpoint,
    error_reply,
    failure_reply,
    fallback_reply,
    key_of,
)
from proxy.http.wire import Request
from proxy.rpc.jsonrpc import INVALID_REQUEST, JsonRpcError
from proxy.service import Service
from proxy.values import Reply

# aiohttp's routes: /v3/{api_key} (and /v3, /v3/) before /{network}/v3/{api_key}: the network is lazy.
_RPC = re.compile(r"(?:/([^/]+))??/v3(?:/([^/]*))?")
_WS = re.compile(r"(?:/([^/]+))??/ws/v3(?:/([^/]*))?")
_JSON_TEXT = "application/json; charset=utf-8"  # as aiohttp's json_response writes it
_HEALTHY = json.dumps({"status": "ok"}).encode()
Exposition = Callable[[], Awaitable[bytes]]


def readiness(service: Service, started: bool = False) -> tuple[int, dict[str, object]]:
    """Ready when every network's tracker has a fresh view; `started` (/readyz?started): once each has had
    one, its later faults listed but not refused (replicas sharing their upstreams fail alike: pulling
    one pulls all, and a replica with a stale head still serves its hits). Answered from the trackers'
    state: no upstream call per request, and no upstream's text or URL in the answer (upstreams by index only)."""
    now = time.time()
    networks = {name: runtime.health(now) or "ok" for name, runtime in service.networks.items()}
    ready = all(
        networks[name] == "ok" or (started and runtime.tracker.last_poll > 0)
        for name, runtime in service.networks.items()
    )
    answer: dict[str, object] = {"status": "ready" if ready else "unavailable", "networks": networks}
    # Upstreams out of head tracking while they sync: the network is served by the others.
    catching_up = {name: lagging for name, runtime in service.networks.items() if (lagging := runtime.catching_up())}
    if catching_up:
        answer["catching_up"] = catching_up
    # Served, but nothing of it proven, so nothing kept forever (verify = auto or required).
    unverifiable = service.unverifiable()
    if unverifiable:
        answer["unverifiable"] = unverifiable
    # Networks whose chain is another fork than the shared cache's: served, from a key space of their own.
    forks = {name: note for name, runtime in service.networks.items() if (note := runtime.fork_note())}
    if forks:
        answer["forks"] = forks
    return (200 if ready else 503), answer


def started_asked(query: str) -> bool:
    """Whether a /readyz query (as sent: percent-encoded) asks `started` (readiness): `?started` or
    `?started=1` does, `?started=0` (or `false`, `no`, `off`, spaces around them) does not."""
    values = parse_qs(query, keep_blank_values=True).get("started")
    return values is not None and values[-1].strip().lower() not in ("0", "false", "no", "off")


def decoded_or_refused(endpoint: RpcEndpoint, body: bytes, encoding: str) -> bytes | Reply:
    """A body decoded from its Content-Encoding (all its field lines, joined), or the answer that
    refuses it: 415 for a coding not decoded, 400 for one not decodable, 413 past the body limit."""
    try:
        plain = decoded_body(body, encoding, endpoint.max_body_bytes)
    except UnsupportedCoding as exc:
        # RFC 9110 section 15.5.16: 415, and Accept-Encoding says which codings would do (12.5.3).
        refused = f"request body: Content-Encoding {exc.coding} is not decoded (only {DECODED_CODINGS})"
        error = JsonRpcError(INVALID_REQUEST, refused, http_status=415, headers={"Accept-Encoding": DECODED_CODINGS})
        return error_reply(error, NO_CHARGE)
    except zlib.error as exc:
        refused = f"request body: not valid in its Content-Encoding ({exc})"  # what zlib or the decoder found
        return error_reply(JsonRpcError(INVALID_REQUEST, refused, http_status=400), NO_CHARGE)
    if plain is None:
        reply = endpoint.too_large()
        reply.close = True
        return reply
    return plain


def request_path(url: bytes) -> str:
    """The decoded path of a request target (origin form, or absolute form as a proxy sends it)."""
    if not url.startswith(b"/"):
        rest = url.partition(b"://")[2]
        url = b"/" + rest.partition(b"/")[2] if rest else b"/"
    path = url.partition(b"?")[0].partition(b"#")[0].decode("latin-1")
    return unquote(path) if "%" in path else path


class FrontRoutes:
    def __init__(
        self, endpoint: RpcEndpoint, service: Service, exposition: Exposition | None, settings: Settings
    ) -> None:
        self.endpoint = endpoint
        # Open mode: the root is a JSON-RPC endpoint too (POST, and a WebSocket upgrade), as a plain
        # node's URL is, so apps pointed at a node work unchanged. With keys it stays an error that
        # says where the key goes: a root URL has no place for one.
        self.root_rpc = endpoint.open_mode
        self._service = service
        self._exposition = exposition  # None: /metrics is the internal listener's only
        self.access_log = settings.access_log
        self.trusted_header = settings.trusted_proxy_header.lower() if settings.trusted_proxy_header else None

    @staticmethod
    def rpc_target(path: str, root: bool = False) -> tuple[str | None, str | None] | None:
        """(network, key in the path) of a JSON-RPC POST path; None for any other path. `root`: "/"
        is one too (open mode)."""
        match = _RPC.fullmatch(path)
        if match is None:
            return (None, None) if root and path == "/" else None
        return match[1], match[2]

    def decoded(self, request: Request, body: bytes) -> bytes | Reply:
        """A JSON-RPC POST's body decoded from its Content-Encoding, or the answer that refuses it."""
        return decoded_or_refused(self.endpoint, body, request.headers["content-encoding"])

    def answer(self, method: str, path: str, headers: Headers, target: bytes) -> Reply | Pending:
        """Every request but a JSON-RPC POST and a WebSocket upgrade (which aiohttp serves); `target`: as sent."""
        if method == "OPTIONS":
            cors = self.endpoint.cors
            reply = Reply(
                None,
                204,
                cors.preflight_headers(headers.get("access-control-request-headers")) if cors is not None else {},
            )
            return self.with_cors(reply, headers)
        if method in ("GET", "HEAD"):
            if path == "/healthz":
                return self.with_cors(Reply(_HEALTHY, 200, {"Content-Type": _JSON_TEXT}), headers)
            if path == "/readyz":
                status, answer = readiness(self._service, started_asked(target.partition(b"?")[2].decode("latin-1")))
                return self.with_cors(Reply(json.dumps(answer).encode(), status, {"Content-Type": _JSON_TEXT}), headers)
            if path == "/metrics" and self._exposition is not None:
                return self._metrics(headers)
            ws = _WS.fullmatch(path)
            if ws is not None:
                return self.with_cors(self._not_upgraded(ws[1], ws[2], headers, path), headers)
            if path == "/" and self.root_rpc:
                return self.with_cors(self._not_upgraded(None, None, headers, path), headers)
        return self.with_cors(fallback_reply(path, self.root_rpc, self.endpoint.gateway.router.networks), headers)

    def _not_upgraded(self, network: str | None, key: str | None, headers: Headers, path: str) -> Reply:
        """A GET of a WebSocket path without the upgrade: refused as the WebSocket handler refuses it."""
        endpoint = self.endpoint
        try:
            account = endpoint.authorize(key_of(key, headers), headers)
            if isinstance(account, Reply):
                return account
            endpoint.gateway.router.network_for(headers.get("host"), network, websocket=True)
        except Exception as exc:
            return failure_reply(exc, path)
        return error_reply(JsonRpcError(INVALID_REQUEST, "expected a WebSocket upgrade", http_status=400))

    async def _metrics(self, headers: Headers) -> Reply:
        assert self._exposition is not None
        return self.with_cors(Reply(await self._exposition(), 200, {"Content-Type": CONTENT_TYPE_LATEST}), headers)

    def with_cors(self, reply: Reply, headers: Mapping[str, str]) -> Reply:
        origin = headers.get("origin")
        cors = self.endpoint.cors
        if origin is not None and cors is not None:
            cors.add_headers(origin, reply.headers)
        return reply
