"""Loop detection as HTTP proxies do it (RFC 9110 7.6.3 Via): every request this proxy sends upstream
names it in a Via field, by a pseudonym drawn at random per deployment (no secret: it only tells this
proxy's requests from another's: `rpc-proxy-<16 hex>`). A request that arrives carrying it came from
this proxy itself: an upstream is this proxy (EVM_UPSTREAM at its own port), and forwarding it would
ask itself for ever.

The workers of one deployment share their supervisor's pseudonym (`adopt`): a call forwarded to the
port may reach any of them. Another proxy's Via (a chain of two proxies) is not this one's, and passes.
What a request for a call sends upstream carries the received Via's rpc-proxy marks (`marks`: another
kind of proxy in front, a load balancer's `1.1 google`, a CDN's, is not carried and changes nothing)
with this proxy's mark appended (RFC 9110 7.6.3: a proxy appends): two proxies that are each other's
upstream see their own mark come back on the second hop, whoever sent the call first. The transport
sets RECEIVED for the calls of a request that arrived with rpc-proxy marks; the HTTP client reads it
as it writes (http_client.py). A call carrying it is auto-batched only with calls carrying the same
marks (batching.py): a request has one Via. Coalesced calls share the request of the call that runs it, marks and all; a
joiner sends nothing, so it adds no hop; so only calls carrying the same marks are coalesced
(`coalescing`): a forged Via whose request is refused upstream fails no other client's call. A request
whose Via already names more than MAX_PROXIES proxies is refused as a loop too (proxies that do not
mark their requests), and so is one that already carries MAX_PROXIES marks (`exhausted`): its upstream
would refuse it for its count once this proxy's mark is appended. An upstream's 508 (Loop Detected)
is the request's fault, never the node's: it fails that call and cools no upstream (posting.py).

A subscription relayed over an upstream WebSocket travels on that shared socket, whose handshake
carries this proxy's mark alone, not its subscriber's: a chain of proxies that are each other's
WebSocket upstreams would relay it around for ever. So a relayed subscription passes at most two
rpc-proxies: one that came with rpc-proxy marks is not relayed over an upstream socket that is an
rpc-proxy itself (its handshake answer's Server is SERVER: upstream/ws.py).
"""

from __future__ import annotations

import re
import secrets
from contextvars import ContextVar

_own = [f"rpc-proxy-{secrets.token_hex(8)}"]
SERVER = "rpc-cache-proxy"  # the Server field of this proxy's answers: a WebSocket upstream's tells it is one
MAX_PROXIES = 8  # a request that already passed more proxies than this is refused (508)
# A mark as `field` writes it: RFC 9110 7.6.3 received-protocol (a token, `name/` before it if
# named), then `rpc-proxy-` and 16 lowercase hex digits, nothing else (no comment).
_MARK = re.compile(r"(?:[A-Za-z0-9!#$%&'*+.^_`|~-]{1,16}/)?[A-Za-z0-9!#$%&'*+.^_`|~-]{1,16} rpc-proxy-[0-9a-f]{16}")
# The Via a call's request arrived with (None: none, the common case), for the requests made for it.
RECEIVED: ContextVar[str | None] = ContextVar("rpc_proxy_via", default=None)


def pseudonym() -> str:
    """This deployment's name in a Via field."""
    return _own[0]


def adopt(name: str) -> None:
    """A worker takes its supervisor's pseudonym."""
    _own[0] = name


def field() -> str:
    """The Via field value of a request sent upstream (HTTP/1.1, received by this proxy)."""
    return f"1.1 {_own[0]}"


def marks(received: str | None) -> str | None:
    """The entries of a received Via that are rpc-proxy marks (this proxy's kind), or None if none: the
    only ones carried on, at most MAX_PROXIES. Another kind of proxy's entry (a load balancer's `1.1
    google`, a CDN's) is no loop of ours, and a call that came through it alone is batched and sent as
    any other. A mark is carried only in the form a proxy writes (`field`): an oversized, malformed or
    non-ASCII one is a client's, and dropped (never a Via its upstream refuses for its size)."""
    if received is None or "rpc-proxy-" not in received:
        return None
    found = [entry.strip() for entry in received.split(",") if _MARK.fullmatch(entry.strip())]
    return ", ".join(found[:MAX_PROXIES]) or None


def looped(via: str | None) -> bool:
    """Whether a request's Via field names this proxy: it was sent by this proxy, to itself."""
    return via is not None and any(entry.split()[1:2] == [_own[0]] for entry in via.split(","))


def too_many(via: str) -> bool:
    """Whether a request's Via names more than MAX_PROXIES proxies (empty list elements not counted)."""
    return sum(1 for entry in via.split(",") if entry.strip()) > MAX_PROXIES


def exhausted(via: str) -> bool:
    """Whether a request's Via already holds MAX_PROXIES rpc-proxy marks: with this proxy's appended, its
    upstream would refuse it for its count (too_many), and that 508 is no fault of the upstream's."""
    found = marks(via)
    return found is not None and found.count(",") + 1 >= MAX_PROXIES


LOOP_DETECTED = "HTTP 508 (Loop Detected)"  # how an upstream's loop refusal is told in the call's error


def refused_as_loop(message: str) -> bool:
    """Whether a failed call's error says an upstream refused its request as a loop (its Via's fault:
    asked again, alone or in parts, it carries the same marks and is refused the same)."""
    return LOOP_DETECTED in message


def coalescing(key: str) -> str:
    """The key under which a call is coalesced with identical ones: a call carrying marks shares a
    request only with calls carrying the same marks (a joiner takes the runner's answer, refusal and all)."""
    received = RECEIVED.get()
    return key if received is None else f"{key}\nvia {received}"


def forwarded(received: str) -> str:
    """The Via field of a request sent upstream for a call that arrived with `received`."""
    return f"{received}, {field()}"
