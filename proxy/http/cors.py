"""CORS (Fetch standard, "CORS protocol"): browser pages on other origins may call every HTTP route.

Preflight `OPTIONS` is answered here (204, nothing charged); every other answer, errors included,
gets `Access-Control-Allow-Origin` through one response-prepare hook that does nothing for a request
without an `Origin` header (servers and scripts), so the cache-hit path of such clients pays one
header lookup. Default: any origin, as hosted providers answer; `CORS_ALLOW_ORIGINS` narrows it.
"""

from __future__ import annotations

from aiohttp import web

# Headers a page may read from an answer (Fetch: only CORS-safelisted ones otherwise).
EXPOSED = "X-Cache, X-Credits-Charged, X-Credits-Remaining, Retry-After, X-Request-Id"
ALLOWED_HEADERS = "Content-Type, Authorization, X-Api-Key"
ALLOWED_METHODS = "POST, GET, OPTIONS"
PREFLIGHT_MAX_AGE = "86400"  # seconds a browser may keep a preflight's answer (Chromium caps it at 2 h)


class Cors:
    def __init__(self, allow_origins: tuple[str, ...] | None) -> None:
        """`allow_origins`: exact origins (`https://app.example`) or `*`; None: any origin."""
        self._any = allow_origins is None or "*" in allow_origins
        self._origins = frozenset(o.rstrip("/").lower() for o in allow_origins or ())

    def allow(self, origin: str) -> str | None:
        """The Access-Control-Allow-Origin value for a request from `origin`; None: not allowed."""
        if self._any:
            return "*"
        return origin if origin.rstrip("/").lower() in self._origins else None

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None:
            return
        headers = response.headers
        if not self._any:  # the answer depends on the Origin: caches in between must know
            vary = headers.get("Vary")
            headers["Vary"] = "Origin" if vary is None else f"{vary}, Origin"
        allowed = self.allow(origin)
        if allowed is not None:
            headers["Access-Control-Allow-Origin"] = allowed
            headers["Access-Control-Expose-Headers"] = EXPOSED

    async def preflight(self, request: web.Request) -> web.Response:
        """A preflight: 204, no body, never charged, whatever path it names (Fetch, "CORS-preflight")."""
        headers = {
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", ALLOWED_HEADERS),
            "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
            "X-Credits-Charged": "0",
        }
        return web.Response(status=204, headers=headers)
