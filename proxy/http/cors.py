"""CORS (Fetch standard, "CORS protocol"): browser pages on other origins may call every HTTP route.

Preflight `OPTIONS` is answered here (204, nothing charged); every other answer, errors included,
gets `Access-Control-Allow-Origin` when the request has an `Origin` header. Each route's handler is
wrapped (`wrap`), and the JSON-RPC route checks for `Origin` itself: a response-prepare signal would
cost every cache hit two coroutines, while a request without `Origin` (servers and scripts) pays one
header lookup here. Default: any origin, as hosted providers answer; `CORS_ALLOW_ORIGINS` narrows it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping

from aiohttp import web

from proxy.origins import origin_form

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Headers a page may read from an answer (Fetch: only CORS-safelisted ones otherwise).
EXPOSED = "X-Cache, X-Verified, X-Credits-Charged, X-Credits-Remaining, Retry-After, X-Request-Id"
ALLOWED_HEADERS = "Content-Type, Authorization, X-Api-Key"
ALLOWED_METHODS = "POST, GET, OPTIONS"
PREFLIGHT_MAX_AGE = "86400"  # seconds a browser may keep a preflight's answer (Chromium caps it at 2 h)


class Cors:
    def __init__(self, allow_origins: tuple[str, ...] | None) -> None:
        """`allow_origins`: exact origins (`https://app.example`) or `*`; None: any origin."""
        self._any = allow_origins is None or "*" in allow_origins
        self._origins = frozenset(origin_form(o) for o in allow_origins or ())

    def allow(self, origin: str) -> str | None:
        """The Access-Control-Allow-Origin value for a request from `origin`; None: not allowed."""
        if self._any:
            return "*"
        return origin if origin_form(origin) in self._origins else None

    def wrap(self, handler: Handler) -> Handler:
        async def run(request: web.Request) -> web.StreamResponse:
            return self.decorate(request, await handler(request))

        return run

    def decorate(self, request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
        """The response with the CORS headers its request's Origin calls for (none without one)."""
        origin = request.headers.get("Origin")
        if origin is None or response.prepared:  # a WebSocket's upgrade was sent when it was accepted
            return response
        self.add_headers(origin, response.headers)
        return response

    def add_headers(self, origin: str, headers: MutableMapping[str, str]) -> None:
        """The CORS headers an answer to a request from `origin` gets."""
        if not self._any:  # the answer depends on the Origin: caches in between must know
            vary = headers.get("Vary")
            headers["Vary"] = "Origin" if vary is None else f"{vary}, Origin"
        allowed = self.allow(origin)
        if allowed is not None:
            headers["Access-Control-Allow-Origin"] = allowed
            headers["Access-Control-Expose-Headers"] = EXPOSED

    @staticmethod
    def preflight_headers(requested: str | None) -> dict[str, str]:
        """A preflight's answer: 204, no body, never charged, whatever path it names (Fetch, "CORS-preflight")."""
        return {
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": ALLOWED_HEADERS if requested is None else requested,
            "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
            "X-Credits-Charged": "0",
        }

    async def preflight(self, request: web.Request) -> web.StreamResponse:
        headers = self.preflight_headers(request.headers.get("Access-Control-Request-Headers"))
        return self.decorate(request, web.Response(status=204, headers=headers))
