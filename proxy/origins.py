"""Origins as browsers send them in `Origin` (Fetch, RFC 6454: scheme://host[:port], the port left out
when it is the scheme's default): CORS_ALLOW_ORIGINS and a keys file's allowed_origins list them,
compared in one form."""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import urlsplit

ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s]+")
_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def origin_form(origin: str) -> str:
    """An origin as compared: one trailing slash dropped, lower-cased."""
    return origin.rstrip("/").lower()


def is_origin(entry: str) -> bool:
    """Whether a browser may send `entry` (once origin_form has it) as its Origin: a scheme and a host
    (DNS labels, an IPv4 or a bracketed IPv6 address), a port only when not the scheme's default, and
    nothing else (no user, path, query, fragment or wildcard: `https://*.app.example` never matches)."""
    if ORIGIN.fullmatch(entry) is None or any(c in entry for c in "@?#*\\"):
        return False
    try:
        parts = urlsplit(entry)
        port = parts.port
    except ValueError:  # a port that is not a number, or past 65535
        return False
    host = parts.hostname or ""
    if parts.path or port == 0 or port == _DEFAULT_PORTS.get(parts.scheme, -1) or not host:
        return False
    return ":" in host or all(_LABEL.fullmatch(label) for label in host.split("."))


def not_an_origin(entries: Iterable[str]) -> str | None:
    """The first entry that is neither `*` nor an origin a browser sends (`app.example` has no
    scheme: it never matches), or None."""
    return next((e for e in entries if e != "*" and not is_origin(origin_form(e))), None)
