"""The parsers of one raw setting value each, by the settings table (option_table.py).

`ConfigError` lives here, below config.py and config_files.py, since every parser raises it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any
from urllib.parse import SplitResult, urlsplit

from proxy import cpus
from proxy.credits.prices import SUBSCRIPTION_CREDITS, SUBSCRIPTION_KINDS
from proxy.origins import not_an_origin
from proxy.redis_topology import BadRedisUrl, single_url, topology_of


class ConfigError(Exception):
    """A setting is missing or invalid; the message is one line for the operator."""


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
    "MAX_CALLS_IN_FLIGHT_PER_KEY": ("max_calls_in_flight_per_key", _zero_or_positive_int),
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
