"""An upstream's configured secrets kept out of the error text it sends back (pure). A provider may
echo what it was sent ("invalid token Bearer ... for /v2/<key>"); that text is relayed to clients,
written to logs and printed by `rpc-proxy check`, so each secret is replaced by `<redacted>` first.
Only errors are read: a result is the node's data and is passed on untouched."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import SplitResult, unquote, unquote_plus, urlsplit

REDACTED = "<redacted>"
# Parts shorter than this are words of the URL's shape (`v2`, `rpc`, `eth`), not keys: replacing them
# would maim the text (every `eth_call` in it) and hide nothing a guess would not find.
MIN_SECRET = 6
_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")


def basic_credentials(parts: SplitResult) -> str | None:
    """The Basic authorization a URL's `user:password@` is sent as (as aiohttp sends it), or None."""
    if parts.username is None:
        return None
    return base64.b64encode(f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()).decode()


def secrets_of(url: str, headers: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """What an upstream is configured with that may be a secret: each header value (and its
    credentials, the part after an `Authorization` scheme), the URL's user and password and the
    Basic credentials they are sent as, path segments, query values and each `name=value` whole;
    longest first (a key inside a longer one)."""
    found: set[str] = set()
    for _, value in headers:
        found.add(value)
        found.update(value.split()[1:])  # "Bearer <token>": the token alone may be echoed
    try:
        parts = urlsplit(url)
        found.update(p for p in (parts.username, parts.password, basic_credentials(parts)) if p)
    except ValueError:
        return _longest_first(found)
    found.update(parts.path.split("/"))
    for piece in parts.query.split("&"):  # `?KEY` with no `=`, each `name=value` whole, and its value
        found.update((piece, piece.partition("=")[2]))
    return _longest_first({form for secret in found for form in _forms(secret)})


def _forms(secret: str) -> tuple[str, ...]:
    """Each form a URL's part may be echoed in: as written (what goes on the wire), percent-decoded,
    plus-decoded (a query value as a form decoder reads it), and with its escapes in either case."""
    return (
        secret,
        unquote(secret),
        unquote_plus(secret),
        _ESCAPE.sub(lambda m: m[0].upper(), secret),
        _ESCAPE.sub(lambda m: m[0].lower(), secret),
    )


def _longest_first(found: set[str]) -> tuple[str, ...]:
    return tuple(sorted((s for s in found if len(s) >= MIN_SECRET), key=len, reverse=True))


def scrub_text(text: str, secrets: tuple[str, ...]) -> str:
    """`text` with each secret replaced, in any letter case; a text that still holds one once its
    percent-escapes are decoded, up to three times (`%4B` or `%254B` for `K`), is replaced whole."""
    folded = text.lower()
    for secret in secrets:
        if secret.lower() in folded:
            text = re.sub(re.escape(secret), REDACTED, text, flags=re.IGNORECASE)
            folded = text.lower()
    plain = text
    for _ in range(3):  # escaped once, or its escapes escaped again (`%2553` for `S`)
        if "%" not in plain:
            break
        plain = unquote_plus(plain)
        lowered = plain.lower()
        if any(secret.lower() in lowered for secret in secrets):
            return REDACTED
    return text


# Deeper than this, an error's content is replaced whole: no reply that deep can be encoded again
# (orjson writes 255 levels; such a reply is a bad node reply, judging.py), and recursing further
# would reach Python's recursion limit on a node's crafted nesting.
MAX_DEPTH = 256


def _scrubbed(value: Any, secrets: tuple[str, ...], depth: int = 0) -> Any:
    if isinstance(value, str):
        return scrub_text(value, secrets)
    if depth >= MAX_DEPTH and isinstance(value, (dict, list)):
        return REDACTED
    if isinstance(value, dict):
        return {
            scrub_text(k, secrets) if isinstance(k, str) else k: _scrubbed(v, secrets, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_scrubbed(v, secrets, depth + 1) for v in value]
    return value


def scrub_reply(reply: Any, secrets: tuple[str, ...]) -> None:
    """Replace `secrets` in the error objects of a decoded reply, a single answer or a batch, in
    place. A reply without errors costs a key lookup per answer."""
    for item in reply if isinstance(reply, list) else (reply,):
        if type(item) is dict and item.get("error") is not None:
            item["error"] = _scrubbed(item["error"], secrets)
