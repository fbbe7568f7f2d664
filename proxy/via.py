"""Loop detection as HTTP proxies do it (RFC 9110 7.6.3 Via): every request this proxy sends upstream
names it in a Via field, by a pseudonym drawn at random per deployment (no secret: it only tells this
proxy's requests from another's). A request that arrives carrying it came from this proxy itself: an
upstream is this proxy (EVM_UPSTREAM at its own port), and forwarding it would ask itself for ever.

The workers of one deployment share their supervisor's pseudonym (`adopt`): a call forwarded to the
port may reach any of them. Another proxy's Via (a chain of two proxies) is not this one's, and passes.
"""

from __future__ import annotations

import secrets

_own = [f"rpc-proxy-{secrets.token_hex(8)}"]


def pseudonym() -> str:
    """This deployment's name in a Via field."""
    return _own[0]


def adopt(name: str) -> None:
    """A worker takes its supervisor's pseudonym."""
    _own[0] = name


def field() -> str:
    """The Via field value of a request sent upstream (HTTP/1.1, received by this proxy)."""
    return f"1.1 {_own[0]}"


def looped(via: str | None) -> bool:
    """Whether a request's Via field names this proxy: it was sent by this proxy, to itself."""
    return via is not None and any(entry.split()[1:2] == [_own[0]] for entry in via.split(","))
