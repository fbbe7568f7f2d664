"""The settings table (env name, CLI flag, help) and the parsers of one raw value each.

`ConfigError` lives here, below config.py and config_files.py, since every parser raises it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit

from proxy import cpus
from proxy.credits.prices import SUBSCRIPTION_CREDITS, SUBSCRIPTION_KINDS
from proxy.origins import not_an_origin
from proxy.redis_topology import BadRedisUrl, single_url, topology_of


class ConfigError(Exception):
    """A setting is missing or invalid; the message is one line for the operator."""


# --- the settings table: env name, CLI flag, help; cli.py builds flags from it, the docs document it ---


@dataclass(frozen=True, slots=True)
class Option:
    env: str
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.env.lower().replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option("PROXY_HOST", "address to listen on (default 127.0.0.1)"),
    Option("PROXY_PORT", "port to listen on (default 8545)"),
    Option("EVM_UPSTREAM", "comma-separated upstream URLs of the default EVM network; first is primary"),
    Option("SOLANA_UPSTREAM", "comma-separated upstream URLs of the default Solana network"),
    Option("NETWORKS_FILE", "optional TOML file declaring more networks"),
    Option(
        "VERIFY_ANSWERS",
        "verified answers of the EVM_UPSTREAM network: auto, required or off (default auto; "
        "NETWORKS_FILE networks set their own `verify`)",
    ),
    Option("REDIS_URL", "optional Redis URL for the shared cache tier and credit ledger"),
    Option("REDIS_TIMEOUT", "seconds before a Redis command is abandoned (default 0.25)"),
    Option("API_KEYS", "comma-separated API keys, as written (${VAR} is not expanded); none: the proxy runs open"),
    Option(
        "API_KEYS_FILE",
        "TOML file of keys: [keys.NAME] key_sha256 (or key), daily_credits, credits_per_second, "
        "allowed_origins, allowed_methods, allowed_addresses; SIGHUP reads it again",
    ),
    Option("DAILY_CREDITS", "default daily credit balance per key (default 3000000)"),
    Option("CREDITS_PER_SECOND", "default per-key credits-per-second limit (default: none)"),
    Option("DEFAULT_CREDITS", "credit cost of methods in neither the spec's table nor the credits table (default 20)"),
    Option(
        "CREDITS_FILE",
        "optional TOML file whose [credits] table sets per-method costs (method = credits) of "
        "methods outside the spec's seven; unlisted methods keep the built-in table, else DEFAULT_CREDITS",
    ),
    Option("ALLOW_NAMESPACES", "comma-separated namespaces whose every method is served (debug,txpool,...); any case"),
    Option(
        "MAX_BATCH_SIZE",
        "maximum calls in one batch, each counted and charged (default 1000, as geth and viem's batch: true)",
    ),
    Option("MAX_BODY_BYTES", "maximum HTTP request body in bytes (default 5242880)"),
    Option("WS_MAX_MESSAGE_BYTES", "maximum WebSocket message in bytes (default 5242880)"),
    Option("WS_MAX_INFLIGHT", "maximum concurrent requests per WebSocket connection (default 64)"),
    Option("UPSTREAM_TIMEOUT", "seconds before an upstream request is abandoned (default 30)"),
    Option(
        "COALESCE_WAIT",
        "seconds a replica waits for another replica's identical miss via Redis; 0 disables (default 2)",
    ),
    Option("UPSTREAM_BATCH_MAX", "most calls in one upstream JSON-RPC batch, headers too; 1 disables (default 50)"),
    Option("HEAD_POLL_INTERVAL", "seconds between head-tracker polls, fractions allowed, at least 0.05 (default 2)"),
    Option("FINALITY_DEPTH", "blocks below latest counted final when a node has no finalized tag (default 64)"),
    Option("CACHE_MEMORY_BYTES", "size bound of the in-process cache tier in bytes (default 268435456)"),
    Option("CACHE_UNFINALIZED_TTL", "seconds an answer for an unfinalized block is kept (default 12)"),
    Option("CACHE_NEGATIVE_TTL", "seconds a null not-found answer is kept (default 2)"),
    Option("SOLANA_BALANCE_MAX_AGE", "max age in seconds of a cached getTokenAccountBalance (default 0.4)"),
    Option("SOLANA_LARGEST_ACCOUNTS_TTL", "seconds getLargestAccounts is cached, at most 7200 (default 3600)"),
    Option("GETLOGS_MAX_RESULTS", "eth_getLogs result limit (default 10000)"),
    Option("GETLOGS_TIMEOUT", "eth_getLogs query time limit in seconds (default 10)"),
    Option("GETLOGS_MAX_PARAMS", "eth_getLogs limit on addresses plus topic values (default 5000)"),
    Option(
        "GETLOGS_CHUNK_BLOCKS",
        "eth_getLogs ranges are asked and cached in aligned chunks of this many blocks "
        "(a tenth of it near finality); 0 disables (default 1000)",
    ),
    Option("GETLOGS_CHUNK_CONCURRENCY", "chunks of one eth_getLogs call asked upstream at once (default 4)"),
    Option(
        "MAX_RESPONSE_BYTES",
        "largest answer to one request body (a batch counted whole); beyond it calls "
        "get -32005 response size exceeded (default 33554432)",
    ),
    Option(
        "UPSTREAM_KEY_CONCURRENCY",
        "upstream calls one API key may have in flight at once (chunks and batch "
        "members included); 0: no cap (default 8)",
    ),
    Option(
        "CACHE_KEY_BYTES_PER_MINUTE",
        "bytes of answers one API key's calls may store in the cache per minute; "
        "past it answers are served but not kept; 0: no bound (default CACHE_MEMORY_BYTES / 16)",
    ),
    Option("GAS_CAP_MULTIPLIER", "eth_call/eth_estimateGas gas cap as a multiple of the block gas limit (default 10)"),
    Option(
        "ETH_CALL_REQUIRE_FROM",
        "require `from` in eth_call as the spec's table does (default false: "
        "the node's own default sender applies, as with geth and Anvil)",
    ),
    Option("LOG_FORMAT", "text or json (JSON lines), in any case"),
    Option("LOG_LEVEL", "DEBUG, INFO, WARNING or ERROR (default INFO)"),
    Option(
        "ACCESS_LOG",
        "log every request (key name, client IP, status, total ms, cache, upstream ms) and every "
        "call: request id, method, cache result, upstream latency (default false)",
    ),
    Option("SHUTDOWN_TIMEOUT", "seconds SIGTERM waits for in-flight requests (default 30)"),
    Option(
        "WORKERS",
        "worker processes (at most 1024) sharing the port, each with its own memory tier; auto: one per CPU the "
        "process may use (its affinity, at most its container's CPU limit) (default 1: one process, no supervisor)",
    ),
    Option(
        "EVENT_LOOP",
        "uvloop or asyncio; uvloop (less CPU per request) comes with the proxy wherever it builds "
        "(default uvloop where installed, else asyncio)",
    ),
    Option("ALLOW_METHODS", "comma-separated methods to serve beyond the default allow-list (exact names)"),
    Option(
        "BODY_TIMEOUT",
        "seconds a client has to send a request body once the proxy reads it (from its headers, or once "
        "a body left unread for want of room is read on), and a WebSocket message from its first byte "
        "(default 30)",
    ),
    Option("MAX_CONNECTIONS", "open client connections per worker; more are answered 503 and closed (default 4096)"),
    Option(
        "MAX_INFLIGHT_BODY_BYTES",
        "request-body bytes being received at once (a request waiting for room: what it read of its body, a "
        "key's at most a quarter; a WebSocket message not yet whole: what has come of it), all clients "
        "of the host together (every worker's); beyond it 503, a WebSocket closed 1013 (default 134217728)",
    ),
    Option(
        "MAX_PENDING_ANSWER_BYTES",
        "bytes of answers one connection may have made and not yet taken by its client; its next "
        "request waits, unmade, until it takes some (default 8388608)",
    ),
    Option(
        "MAX_PENDING_ANSWER_BYTES_PER_KEY",
        "as MAX_PENDING_ANSWER_BYTES, all connections of one API key on the host together, split evenly: "
        "each of N workers holds a key to 1/N of it, rounded up (default 67108864)",
    ),
    Option(
        "MAX_PENDING_ANSWER_BYTES_PER_PROCESS",
        "as MAX_PENDING_ANSWER_BYTES, all connections of a serving process (one worker) together; past it a "
        "key holding nothing is still served one answer at a time, and one under its even share up to a "
        "quarter past it (default 268435456)",
    ),
    Option("METRICS_HOST", "address of the internal /metrics listener (default 127.0.0.1)"),
    Option(
        "METRICS_PORT",
        "port of an internal listener serving /metrics; when set, the public port does not "
        "(default: unset, /metrics on the public port)",
    ),
    Option("ADMIN_HOST", "address of the admin listener (default 127.0.0.1)"),
    Option(
        "ADMIN_PORT",
        "port of the admin listener: list, cordon and uncordon upstreams, reload NETWORKS_FILE (default: unset, off)",
    ),
    Option(
        "ADMIN_TOKEN",
        "bearer token every admin request must carry (required with ADMIN_PORT; at least 16 "
        "printable ASCII characters, no whitespace, at least 8 distinct; never logged)",
    ),
    Option(
        "UPSTREAM_BATCH_MAX_BYTES",
        "most bytes of params in one upstream auto-batch; a larger call goes alone (default 1048576)",
    ),
    Option(
        "UPSTREAM_ATTEMPT_TIMEOUT",
        "seconds one upstream attempt may take before the next upstream is tried "
        "(default: UPSTREAM_TIMEOUT shared evenly by the upstreams left to try)",
    ),
    Option(
        "HEAD_STALE_AFTER",
        "seconds after the last good head poll when tags stop being resolved (calls with them go upstream "
        "uncached), /readyz degraded; more than HEAD_POLL_INTERVAL (default 3 poll intervals, at least 1)",
    ),
    Option(
        "HEAD_CATCH_UP_WAIT",
        "seconds a `latest` call waits for the head to reach a block the proxy has "
        "already shown; then it goes upstream uncached (default 0.3; 0: no wait)",
    ),
    Option(
        "IDENTITY_CHECK_INTERVAL",
        "seconds between checks of each upstream's chain id and genesis hash, at least 1 (default 30)",
    ),
    Option("CREDITS_REDIS_URL", "Redis URL of the credit ledger, ideally a noeviction one (default REDIS_URL)"),
    Option("CREDITS_REDIS_TIMEOUT", "seconds before a ledger Redis command is abandoned (default 2)"),
    Option("CREDITS_REDIS_FAILURES", "consecutive ledger Redis failures before it counts as down (default 3)"),
    Option("CREDITS_REQUIRE_NOEVICTION", "refuse to start if the ledger's Redis may evict keys (default false)"),
    Option("CREDITS_FAIL_OPEN", "serve keys with no known usage while the ledger is unreachable (default true)"),
    Option("CREDITS_LEASE_MAX", "most credits of a key one replica leases at a time (default 100000)"),
    Option("CREDITS_LEASE_SECONDS", "seconds before an unused lease goes back to the ledger (default 10)"),
    Option(
        "CREDITS_JOURNAL_DIR",
        "directory of the journal of debits made while the ledger is unreachable; must exist and be writable at start",
    ),
    Option(
        "EVM_UPSTREAM_WS",
        "comma-separated WebSocket URLs of the default EVM network's node: push heads, relayed subscriptions",
    ),
    Option("SOLANA_UPSTREAM_WS", "comma-separated WebSocket URLs of the default Solana network (pubsub relay)"),
    Option("WS_MAX_SUBSCRIPTIONS", "maximum subscriptions per WebSocket connection (default 100)"),
    Option(
        "WS_MAX_SUBSCRIPTION_BYTES",
        "bytes a worker's WebSocket subscriptions hold (their criteria), a key's at most a quarter, open "
        "mode's the whole; more are -32005 (default 67108864)",
    ),
    Option(
        "WS_SEND_BUFFER_BYTES",
        "bytes a WebSocket connection may have waiting to be sent; past it the "
        "connection is closed as a slow consumer with 1008 (default 4194304)",
    ),
    Option(
        "WS_MAX_LAG",
        "seconds a WebSocket connection may fall behind (its oldest unsent message's age) or take no "
        "byte while output waits; past it the connection is closed as a slow consumer with 1008 (default "
        "10); notifications the key's per-second limit holds that long end its subscriptions instead (-32005)",
    ),
    Option(
        "WS_MAX_CONNECTIONS_PER_KEY",
        "open WebSocket connections per API key; more are refused with HTTP 429 (-32005); 0: no cap (default 512)",
    ),
    Option(
        "MAX_CONNECTIONS_PER_IP",
        "open client connections per client IP address; more are answered 503 and closed "
        "at once; 0: no cap, for a proxy behind a load balancer that hides client addresses (default 1024)",
    ),
    Option(
        "WS_IDLE_TIMEOUT",
        "seconds a WebSocket connection with no subscription and no call is kept open; then it "
        "is closed with 1000 (default 300)",
    ),
    Option(
        "MAX_FILTERS_PER_KEY",
        "live node-side filters (eth_newFilter, eth_newBlockFilter, "
        "eth_newPendingTransactionFilter) per API key (open mode: the host's together); more are -32005 until "
        "one is uninstalled or expires (default 100)",
    ),
    Option(
        "MAX_FILTER_BYTES",
        "bytes the host's node-side filters hold (their criteria), a key's at most a quarter, open mode's "
        "the whole; more are -32005 (default 67108864)",
    ),
    Option(
        "CORS_ALLOW_ORIGINS",
        "comma-separated origins (https://app.example) browser pages may call from; * for any (default *)",
    ),
    Option(
        "COMPRESS_MIN_BYTES",
        "answers of at least this many bytes are gzip-compressed for clients that accept it; 0 disables (default 4096)",
    ),
    Option(
        "COMPRESS_CACHE_BYTES",
        "bytes of compressed cached answers kept, so a hit is not compressed again (default 67108864)",
    ),
    Option(
        "TRUSTED_PROXY_HEADER",
        "header carrying the client IP set by a proxy in front (X-Forwarded-For: its "
        "last entry; X-Real-IP); the access log shows it instead of the peer's address (default: unset)",
    ),
    Option(
        "UNMINED_TTL",
        "seconds a null receipt or transaction (not yet mined) is kept, at most; a new head "
        "ends it sooner (default 0.25)",
    ),
    Option(
        "SUBSCRIPTION_CREDITS",
        "per-kind subscription credits, each kind once, e.g. subscribe=5,newHeads=50,logs=300 "
        "(defaults: subscribe 5, newHeads 50, logs 300, newPendingTransactions 200, other 50)",
    ),
)
OPTION_NAMES = frozenset(o.env for o in OPTIONS)


# --- parsing --------------------------------------------------------------------------


# Durations (timeouts, intervals, TTLs) are at most a day: past it a timeout overflows where it is
# handed on (a Redis socket timeout) or a check never comes round (HEAD_POLL_INTERVAL=1e300).
MAX_SECONDS = 86_400.0
# Credits are counted as doubles in Redis' Lua scripts: past 2**53 a count is rounded.
MAX_CREDITS = MAX_WHOLE = 2**53  # MAX_WHOLE: any other count or size (each is a C integer somewhere)
MAX_MESSAGE_BYTES = 2**31


def _whole(name: str, raw: str, low: int, high: int = MAX_WHOLE, high_text: str = "2**53") -> int:
    """A whole number from `low` (0 or 1) to `high`."""
    try:
        value = int(_ascii_digits(raw))
    except ValueError:
        with contextlib.suppress(ValueError):
            if low == 0 and float(_ascii_digits(raw)) == 0:
                return 0  # "0 disables": any number equal to 0 (0.00, 0e0) is 0
        raise ConfigError(f"{name} must be a whole number, got {raw!r}") from None
    if value < low:
        raise ConfigError(f"{name} must be {'0 or greater' if low == 0 else 'greater than 0'}, got {raw!r}")
    if value > high:
        raise ConfigError(f"{name} must be at most {high_text}, got {raw!r}")
    return value


def _ascii_digits(raw: str) -> str:  # int() and float() take 1_0 as 10, and １０: no setting is written so
    return raw if raw.isascii() and "_" not in raw else "!"


def _seconds(name: str, raw: str, *, zero: bool = False) -> float:
    """A duration: greater than 0 (or any number equal to 0 with `zero`: 0, 0.00, -0) up to a day."""
    try:
        value = float(_ascii_digits(raw))
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None
    if zero and value == 0:
        return 0.0
    if not value > 0:  # NaN too
        raise ConfigError(f"{name} must be {'0 or greater' if zero else 'greater than 0'}, got {raw!r}")
    if value > MAX_SECONDS:
        raise ConfigError(f"{name} must be at most {MAX_SECONDS:g} seconds (one day), got {raw!r}")
    return value


# Poll intervals' floors: shorter, the proxy asks its nodes back to back, a hot loop for both
# (HEAD_POLL_INTERVAL=1e-9). 0.05 s: 20 polls a second, faster than any chain makes blocks (Solana's
# slots: 0.4 s), the shortest the tests use. An identity check asks each upstream two calls, and one
# whose connection was lost is checked at once anyway: more than once a second finds nothing sooner.
MIN_INTERVALS = {"HEAD_POLL_INTERVAL": 0.05, "IDENTITY_CHECK_INTERVAL": 1.0}


def _poll_interval(name: str, raw: str) -> float:
    value = _seconds(name, raw)
    if value < MIN_INTERVALS[name]:
        why = "a shorter interval polls the nodes in a hot loop"
        raise ConfigError(f"{name} must be at least {MIN_INTERVALS[name]:g} seconds ({why}), got {raw!r}")
    return value


def _positive_int(name: str, raw: str) -> int:
    return _whole(name, raw, 1)


def _message_bytes(name: str, raw: str) -> int:
    """A WebSocket message's bound (ours, and an upstream WebSocket's: MAX_RESPONSE_BYTES)."""
    return _whole(name, raw, 1, MAX_MESSAGE_BYTES, "2**31 (aiohttp's WebSocket reader takes a 32-bit size)")


def _zero_or_positive_int(name: str, raw: str) -> int:  # 0: off, no cap, or free
    return _whole(name, raw, 0)


def _credits(name: str, raw: str) -> int:
    return _whole(name, raw, 1, MAX_CREDITS, "2**53 (credits are counted as doubles in Redis)")


def _zero_or_credits(name: str, raw: str) -> int:
    return _whole(name, raw, 0, MAX_CREDITS, "2**53 (credits are counted as doubles in Redis)")


def _zero_or_positive_float(name: str, raw: str) -> float:  # 0 (off), written any way, or seconds
    return _seconds(name, raw, zero=True)


def _bool(name: str, raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {raw!r}")


def _port(name: str, raw: str) -> int:
    value = _positive_int(name, raw)
    if value > 65535:
        raise ConfigError(f"{name} must be a port number (1-65535), got {raw!r}")
    return value


def _workers(name: str, raw: str) -> int:
    if raw.strip().lower() == "auto":
        return min(cpus.usable_cpus(), cpus.WORKERS_MAX)
    return _whole(name, raw, 1, cpus.WORKERS_MAX, f"{cpus.WORKERS_MAX} (or auto)")


def _csv(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _origins(name: str, raw: str) -> tuple[str, ...]:
    """CORS_ALLOW_ORIGINS: `*`, or origins a browser sends (`https://app.example`); an entry that is
    neither never matches (`app.example` has no scheme), so no page could call the proxy."""
    origins = _csv(raw)
    if (bad := not_an_origin(origins) if origins else raw) is not None:  # "," names none: no page allowed
        raise ConfigError(f"{name} must be * or origins such as https://app.example, got {bad[:100]!r}")
    return origins


def _url_parts(name: str, index: int, url: str) -> SplitResult:
    """An upstream URL's parts; never echoed, since it may carry a provider's secret key."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise ConfigError(f"{name}: upstream #{index} is not a valid URL") from None
    return parts


def _upstream_urls(name: str, urls: Any) -> tuple[str, ...]:
    return _urls(name, urls, ("http", "https"), "upstream #{} is not an http(s) URL")


def _urls(name: str, urls: Any, schemes: tuple[str, str], refusal: str) -> tuple[str, ...]:
    if isinstance(urls, str):
        urls = _csv(urls)
    if not isinstance(urls, (list, tuple)) or not all(isinstance(u, str) for u in urls):
        raise ConfigError(f"{name} must be a list of URLs")
    for index, url in enumerate(urls):
        parts = _url_parts(name, index, url)
        if parts.scheme not in schemes or not parts.hostname:
            # Never echo the URL: it may carry a provider's secret key.
            raise ConfigError(f"{name}: {refusal.format(index)}")
    return tuple(urls)


def _redis_url(name: str, raw: str) -> str:
    """A URL redis-py can connect to; the error never echoes it (it may hold a password)."""
    try:
        if topology_of(raw).kind == "single":
            single_url(raw)
    except BadRedisUrl as exc:
        raise ConfigError(f"{name} {exc}") from None
    return raw


def _ws_urls(name: str, urls: Any) -> tuple[str, ...]:
    return _urls(name, urls, ("ws", "wss"), "WebSocket upstream #{} is not a ws(s) URL")


def _credit_table(name: str, raw: str) -> dict[str, int]:
    table, given = dict(SUBSCRIPTION_CREDITS), set[str]()
    for part in _csv(raw):
        kind, eq, value = part.partition("=")
        if not eq or not kind.strip():
            raise ConfigError(f"{name} must be kind=credits pairs, got {part!r}")
        kind = kind.strip()
        if kind not in SUBSCRIPTION_KINDS:  # a misspelt kind (newheads) would price nothing
            raise ConfigError(f"{name}: unknown kind {kind[:40]!r} (expected one of {', '.join(SUBSCRIPTION_KINDS)})")
        if kind in given:  # the last would win, silently: which of the two was meant is unknown
            raise ConfigError(f"{name}: {kind} is given twice (give each kind once)")
        given.add(kind)
        table[kind] = _zero_or_credits(f"{name} {kind}", value.strip())
    return table


# --- each scalar option: the Settings field it sets and the parser of its value ---

_SCALARS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "PROXY_HOST": ("host", lambda _n, v: v),
    "PROXY_PORT": ("port", _port),
    "REDIS_URL": ("redis_url", _redis_url),
    "REDIS_TIMEOUT": ("redis_timeout", _seconds),
    "DAILY_CREDITS": ("daily_credits", _credits),
    "CREDITS_PER_SECOND": ("credits_per_second", _credits),
    "DEFAULT_CREDITS": ("default_credits", _zero_or_credits),
    "MAX_BATCH_SIZE": ("max_batch_size", _positive_int),
    "MAX_BODY_BYTES": ("max_body_bytes", _positive_int),
    "WS_MAX_MESSAGE_BYTES": ("ws_max_message_bytes", _message_bytes),
    "WS_MAX_INFLIGHT": ("ws_max_inflight", _positive_int),
    "UPSTREAM_TIMEOUT": ("upstream_timeout", _seconds),
    "UPSTREAM_BATCH_MAX": ("upstream_batch_max", _positive_int),
    "COALESCE_WAIT": ("coalesce_wait", _zero_or_positive_float),
    "HEAD_POLL_INTERVAL": ("head_poll_interval", _poll_interval),
    "FINALITY_DEPTH": ("finality_depth", _positive_int),
    "CACHE_MEMORY_BYTES": ("cache_memory_bytes", _positive_int),
    "CACHE_UNFINALIZED_TTL": ("cache_unfinalized_ttl", _seconds),
    "CACHE_NEGATIVE_TTL": ("cache_negative_ttl", _seconds),
    "SOLANA_BALANCE_MAX_AGE": ("solana_balance_max_age", _seconds),
    "SOLANA_LARGEST_ACCOUNTS_TTL": ("solana_largest_accounts_ttl", _seconds),
    "GETLOGS_MAX_RESULTS": ("getlogs_max_results", _positive_int),
    "GETLOGS_TIMEOUT": ("getlogs_timeout", _seconds),
    "GETLOGS_MAX_PARAMS": ("getlogs_max_params", _positive_int),
    "GETLOGS_CHUNK_BLOCKS": ("getlogs_chunk_blocks", _zero_or_positive_int),
    "GETLOGS_CHUNK_CONCURRENCY": ("getlogs_chunk_concurrency", _positive_int),
    "MAX_RESPONSE_BYTES": ("max_response_bytes", _message_bytes),
    "UPSTREAM_KEY_CONCURRENCY": ("upstream_key_concurrency", _zero_or_positive_int),
    "CACHE_KEY_BYTES_PER_MINUTE": ("cache_key_bytes_per_minute", _zero_or_positive_int),
    "GAS_CAP_MULTIPLIER": ("gas_cap_multiplier", _positive_int),
    "ETH_CALL_REQUIRE_FROM": ("eth_call_require_from", _bool),
    "ACCESS_LOG": ("access_log", _bool),
    "SHUTDOWN_TIMEOUT": ("shutdown_timeout", _seconds),
    "WORKERS": ("workers", _workers),
    "BODY_TIMEOUT": ("body_timeout", _seconds),
    "MAX_CONNECTIONS": ("max_connections", _positive_int),
    "MAX_INFLIGHT_BODY_BYTES": ("max_inflight_body_bytes", _positive_int),
    "MAX_PENDING_ANSWER_BYTES": ("max_pending_answer_bytes", _positive_int),
    "MAX_PENDING_ANSWER_BYTES_PER_KEY": ("max_pending_answer_bytes_per_key", _positive_int),
    "MAX_PENDING_ANSWER_BYTES_PER_PROCESS": ("max_pending_answer_bytes_per_process", _positive_int),
    "METRICS_HOST": ("metrics_host", lambda _n, v: v),
    "METRICS_PORT": ("metrics_port", _port),
    "ADMIN_HOST": ("admin_host", lambda _n, v: v),
    "ADMIN_PORT": ("admin_port", _port),
    "ADMIN_TOKEN": ("admin_token", lambda _n, v: v),
    "UPSTREAM_BATCH_MAX_BYTES": ("upstream_batch_max_bytes", _positive_int),
    "UPSTREAM_ATTEMPT_TIMEOUT": ("upstream_attempt_timeout", _seconds),
    "HEAD_STALE_AFTER": ("head_stale_after", _seconds),
    "HEAD_CATCH_UP_WAIT": ("head_catch_up_wait", _zero_or_positive_float),
    "IDENTITY_CHECK_INTERVAL": ("identity_check_interval", _poll_interval),
    "CREDITS_REDIS_URL": ("credits_redis_url", _redis_url),
    "CREDITS_REDIS_TIMEOUT": ("credits_redis_timeout", _seconds),
    "CREDITS_REDIS_FAILURES": ("credits_redis_failures", _positive_int),
    "CREDITS_REQUIRE_NOEVICTION": ("credits_require_noeviction", _bool),
    "CREDITS_FAIL_OPEN": ("credits_fail_open", _bool),
    "CREDITS_LEASE_MAX": ("credits_lease_max", _credits),
    "CREDITS_LEASE_SECONDS": ("credits_lease_seconds", _seconds),
    "CREDITS_JOURNAL_DIR": ("credits_journal_dir", lambda _n, v: v),
    "WS_MAX_SUBSCRIPTIONS": ("ws_max_subscriptions", _positive_int),
    "WS_SEND_BUFFER_BYTES": ("ws_send_buffer_bytes", _positive_int),
    "WS_MAX_LAG": ("ws_max_lag", _seconds),
    "WS_MAX_CONNECTIONS_PER_KEY": ("ws_max_connections_per_key", _zero_or_positive_int),
    "MAX_CONNECTIONS_PER_IP": ("max_connections_per_ip", _zero_or_positive_int),
    "WS_IDLE_TIMEOUT": ("ws_idle_timeout", _seconds),
    "MAX_FILTERS_PER_KEY": ("max_filters_per_key", _positive_int),
    "MAX_FILTER_BYTES": ("max_filter_bytes", _positive_int),
    "WS_MAX_SUBSCRIPTION_BYTES": ("ws_max_subscription_bytes", _positive_int),
    "SUBSCRIPTION_CREDITS": ("subscription_credits", _credit_table),
    "CORS_ALLOW_ORIGINS": ("cors_allow_origins", _origins),
    "COMPRESS_MIN_BYTES": ("compress_min_bytes", _zero_or_positive_int),
    "COMPRESS_CACHE_BYTES": ("compress_cache_bytes", _positive_int),
    "TRUSTED_PROXY_HEADER": ("trusted_proxy_header", lambda _n, v: v.strip()),
    "UNMINED_TTL": ("unmined_ttl", _seconds),
}
