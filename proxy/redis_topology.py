"""Which Redis a URL names (one server, a Cluster, or a primary found through Sentinel), and the hash
tags that keep a multi-key operation's keys in one Cluster slot. Pure: no connection is made here.

URL forms (README, "Redis topologies"):
- `redis://`, `rediss://`, `unix://`: one server, as redis-py reads them.
- `redis+cluster://[user:password@]host:port[,host:port...]`: a Redis Cluster; any of its nodes
  serve to discover the rest. Only database 0 exists in a cluster.
- `redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]`: the primary of
  `service_name` as the Sentinels report it, followed through failovers. The URL's credentials
  are the data nodes'; the Sentinels' own, if they have any, are `?sentinel_username=` and
  `?sentinel_password=`.
`rediss+cluster://` and `rediss+sentinel://` are the same over TLS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio.connection import ConnectionPool
from redis.exceptions import RedisError

Kind = Literal["single", "cluster", "sentinel"]
_SCHEMES: dict[str, tuple[Kind, bool]] = {
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
}
SENTINEL_PORT = 26379
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


class BadRedisUrl(ValueError):
    """What is wrong with a URL, in words that never include the URL (it may hold a password)."""


@dataclass(frozen=True, slots=True)
class RedisTopology:
    kind: Kind
    nodes: tuple[tuple[str, int], ...] = ()  # cluster seed nodes, or the Sentinels
    service: str = ""  # sentinel: the monitored primary's name
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    sentinel_username: str | None = None
    sentinel_password: str | None = None


def topology_of(url: str) -> RedisTopology:
    """The topology a URL names; a plain redis:// URL is `single` and is left to redis-py to read."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in _SCHEMES:
        # redis-py reads a path that is no number (`/db5`) as database 0, silently.
        path = url.partition("://")[2].partition("?")[0].partition("#")[0].partition("/")[2]
        if scheme in ("redis", "rediss") and path and not (path.isascii() and path.isdigit()):
            raise BadRedisUrl("has a path other than /DB, a database number (redis://host:6379/0)")
        return RedisTopology("single")
    kind, tls = _SCHEMES[scheme]
    rest = url.split("://", 1)[1]
    if "#" in rest:
        raise BadRedisUrl("has a fragment")
    rest, _, query = rest.partition("?")
    authority, _, path = rest.partition("/")
    userinfo, _, hostlist = authority.rpartition("@")
    username, password = _credentials(userinfo)
    nodes = tuple(_node(text, SENTINEL_PORT if kind == "sentinel" else None) for text in hostlist.split(","))
    options = _options(query, _SENTINEL_OPTIONS if kind == "sentinel" else ())
    segments = [unquote(s) for s in path.split("/")] if path else []
    if kind == "cluster":
        if segments not in ([], ["0"], [""]):
            raise BadRedisUrl("names a database, but a Redis Cluster has only database 0")
        return RedisTopology(kind, nodes, username=username, password=password, tls=tls)
    if not segments or not segments[0]:
        raise BadRedisUrl("names no Sentinel service (redis+sentinel://host:port/service_name[/db])")
    if len(segments) > 2 or (len(segments) == 2 and not segments[1].isdigit()):
        raise BadRedisUrl("has a path other than /service_name[/db]")
    db = int(segments[1]) if len(segments) == 2 else 0
    return RedisTopology(
        kind,
        nodes,
        segments[0],
        db,
        username,
        password,
        tls,
        options.get("sentinel_username"),
        options.get("sentinel_password"),
    )


def single_url(url: str) -> None:
    """A single server's URL (redis://, rediss://, unix://) checked as redis-py will read it."""
    expected = "is not a valid redis://, rediss://, unix://, redis+cluster:// or redis+sentinel:// URL"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a bad port
    except ValueError:
        raise BadRedisUrl(expected) from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise BadRedisUrl(expected)
    if parts.scheme != "unix" and not parts.hostname:
        raise BadRedisUrl("names no host")
    if port == 0:
        raise BadRedisUrl("has port 0")
    if parts.scheme == "unix" and not parts.path:
        raise BadRedisUrl("names no socket path")
    if _refused(url) is not None:
        raise BadRedisUrl(_refusal(url))


def _refused(url: str) -> Exception | None:
    """What redis-py raises reading `url` and building its connection object (none is opened)."""
    try:
        ConnectionPool.from_url(url).make_connection()  # type: ignore[no-untyped-call]
    except (ValueError, TypeError, RedisError) as exc:
        return exc
    return None


def _refusal(url: str) -> str:
    """Why redis-py refuses `url`, naming the query option it refuses (never its value).

    An option its connections do not take (x=y), or a value they refuse (db=x, protocol=9,
    ssl_cert_reqs=bogus), would fail every connect, for ever: each option is tried alone to name it."""
    base, _, query = url.partition("?")
    for pair in query.split("&") if query else ():
        exc = _refused(f"{base}?{pair}")
        if exc is not None:
            name = unquote(pair.partition("=")[0])[:40]
            if isinstance(exc, TypeError):  # an unexpected keyword argument
                return f"has a query option redis-py does not take: {name}"
            return f"has a query option whose value redis-py refuses: {name}"
    return "has an invalid option in its query string"


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    if not userinfo:
        return None, None
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if colon else None)


def _node(text: str, default_port: int | None) -> tuple[str, int]:
    try:
        parts = urlsplit("//" + text)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise BadRedisUrl("has a host with an invalid port") from None
    if not host or parts.username is not None or parts.path:
        raise BadRedisUrl("has an empty or malformed host in its host list")
    if port is None:
        if default_port is None:
            raise BadRedisUrl("has a host without a port (a cluster node is host:port)")
        port = default_port
    if port == 0:
        raise BadRedisUrl("has port 0")
    return host, port


def _options(query: str, allowed: tuple[str, ...]) -> dict[str, str]:
    try:
        parsed = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise BadRedisUrl("has a malformed query string") from None
    unknown = sorted(set(parsed) - set(allowed))
    if unknown:
        raise BadRedisUrl(f"has an option this topology does not take: {unknown[0]}")
    return {name: values[-1] for name, values in parsed.items()}


def slot_tag(text: str) -> str:
    """`{text}`: a Redis Cluster hash tag, so every key that holds it maps to the slot of `text`.

    Cluster hashes only what lies between the first `{` and the next `}` (the whole key if that is
    empty), so braces in `text` are escaped and an empty `text` gets a stand-in."""
    if "{" in text or "}" in text or "%" in text:
        text = text.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return "{" + (text or "%") + "}"
