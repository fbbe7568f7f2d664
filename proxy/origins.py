"""Origins as browsers send them in `Origin` (Fetch: scheme://host[:port]): CORS_ALLOW_ORIGINS and a
keys file's allowed_origins are lists of them, compared in one form."""

from __future__ import annotations

import re
from collections.abc import Iterable

ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s]+")


def origin_form(origin: str) -> str:
    """An origin as compared: one trailing slash dropped, lower-cased."""
    return origin.rstrip("/").lower()


def not_an_origin(entries: Iterable[str]) -> str | None:
    """The first entry that is neither `*` nor an origin a browser sends (`app.example` has no
    scheme: it never matches), or None."""
    return next((e for e in entries if e != "*" and ORIGIN.fullmatch(origin_form(e)) is None), None)
