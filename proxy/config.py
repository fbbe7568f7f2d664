"""Frozen settings, parsed once from a flat mapping of raw strings (env or CLI)."""

from __future__ import annotations

import importlib.util
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import SplitResult, urlsplit

from redis.connection import parse_url

from proxy.credits.accounts import ACCOUNT_NAME, SHA256_HEX, derived_name, digest
from proxy.credits.prices import METHOD_CREDITS, SPEC_CREDITS
from proxy.redis_topology import BadRedisUrl, topology_of
from proxy.rpc.jsonrpc import METHOD_NAME

Family = Literal["evm", "solana"]
FAMILIES: tuple[Family, ...] = ("evm", "solana")
NETWORK_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
HEAD_STALE_POLLS = 3  # a head older than this many poll intervals is stale...
HEAD_STALE_MIN = 1.0  # ...and never sooner than this many seconds

# Credits of WebSocket subscriptions, by what is charged: `subscribe` for each eth_subscribe (or
# Solana *Subscribe) accepted, then each notification by its kind; `other` for kinds not listed.
# SUBSCRIPTION_CREDITS overrides entries ("logs=100,newHeads=20").
SUBSCRIPTION_CREDITS: Mapping[str, int] = {
    "subscribe": 5, "newHeads": 50, "logs": 300, "newPendingTransactions": 200, "other": 50,
}


class ConfigError(Exception):
    """A setting is missing or invalid; the message is one line for the operator."""


@dataclass(frozen=True, slots=True)
class Network:
    name: str
    family: Family
    upstreams: tuple[str, ...]
    hosts: tuple[str, ...] = ()
    # Depth below latest that counts as final when the node has no `finalized` tag.
    finality_depth: int | None = None
    chain_id: int | None = None  # declared in NETWORKS_FILE: upstreams of another chain are refused
    # WebSocket URLs of the same node(s): push heads and relayed subscriptions (subscriptions.py).
    ws_upstreams: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KeyConfig:
    daily_credits: int | None = None
    credits_per_second: int | None = None
    sha256: str = ""  # hex digest of the key's secret; the secret itself is not kept


@dataclass(frozen=True, slots=True)
class Settings:
    networks: tuple[Network, ...]
    default_network: Mapping[str, str]  # family -> network name
    host: str = "127.0.0.1"
    port: int = 8545
    redis_url: str | None = None
    redis_timeout: float = 0.25
    api_keys: Mapping[str, KeyConfig] | None = None  # account name -> key; None: open mode, any key accepted
    daily_credits: int = 3_000_000
    credits_per_second: int | None = None
    default_credits: int = 20
    allowed_namespaces: frozenset[str] = frozenset()
    max_batch_size: int = 100
    max_body_bytes: int = 5 * 1024 * 1024
    ws_max_message_bytes: int = 5 * 1024 * 1024
    ws_max_inflight: int = 64
    upstream_timeout: float = 30.0
    upstream_batch_max: int = 50
    coalesce_wait: float = 2.0
    head_poll_interval: float = 2.0
    finality_depth: int = 64
    cache_memory_bytes: int = 256 * 1024 * 1024
    cache_unfinalized_ttl: float = 12.0
    cache_negative_ttl: float = 2.0
    solana_balance_max_age: float = 0.4
    solana_largest_accounts_ttl: float = 3600.0
    getlogs_max_results: int = 10_000
    getlogs_timeout: float = 10.0
    getlogs_max_params: int = 5_000
    getlogs_chunk_blocks: int = 1_000
    getlogs_chunk_concurrency: int = 4
    gas_cap_multiplier: int = 10
    eth_call_require_from: bool = False
    log_format: Literal["text", "json"] = "text"
    log_level: str = "INFO"
    access_log: bool = False
    shutdown_timeout: float = 30.0
    workers: int = 1
    event_loop: Literal["asyncio", "uvloop"] = "asyncio"
    allowed_methods: frozenset[str] = frozenset()
    body_timeout: float = 30.0
    max_connections: int = 4096
    max_inflight_body_bytes: int = 128 * 1024 * 1024
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: /metrics on the public listener
    upstream_batch_max_bytes: int = 1024 * 1024
    upstream_attempt_timeout: float | None = None  # None: UPSTREAM_TIMEOUT shared by the upstreams left
    head_stale_after: float | None = None  # None: HEAD_STALE_POLLS poll intervals
    head_catch_up_wait: float = 0.3
    identity_check_interval: float = 30.0
    credits_redis_url: str | None = None  # None: the ledger lives on REDIS_URL
    credits_redis_timeout: float = 2.0
    credits_redis_failures: int = 3
    credits_require_noeviction: bool = False
    credits_fail_open: bool = True
    credits_lease_max: int = 100_000
    credits_lease_seconds: float = 10.0
    credits_journal_dir: str | None = None

    @property
    def head_stale_bound(self) -> float:
        """Seconds after the last successful head poll past which tags are no longer resolved."""
        if self.head_stale_after is not None:
            return self.head_stale_after
        return max(HEAD_STALE_POLLS * self.head_poll_interval, HEAD_STALE_MIN)
    ws_max_subscriptions: int = 100
    ws_send_buffer_bytes: int = 4 * 1024 * 1024
    subscription_credits: Mapping[str, int] = field(default_factory=lambda: dict(SUBSCRIPTION_CREDITS))
    # Credits per call of methods outside the spec's seven (prices.py), with CREDITS_FILE applied.
    method_credits: Mapping[str, int] = field(default_factory=lambda: dict(METHOD_CREDITS))

    @property
    def ledger_redis_url(self) -> str | None:
        return self.credits_redis_url or self.redis_url

    def network(self, name: str) -> Network | None:
        return next((n for n in self.networks if n.name == name), None)

    @property
    def open_mode(self) -> bool:
        return self.api_keys is None

    def daily_credits_for(self, account: str) -> int:
        """The account's own daily_credits, else DAILY_CREDITS."""
        config = (self.api_keys or {}).get(account)
        return config.daily_credits if config and config.daily_credits else self.daily_credits

    def credits_per_second_for(self, account: str) -> int | None:
        """The account's own credits_per_second, else CREDITS_PER_SECOND (None: no limit)."""
        config = (self.api_keys or {}).get(account)
        return config.credits_per_second if config and config.credits_per_second else self.credits_per_second


# --- the settings table: env name, CLI flag, help. cli.py builds flags from it; ---
# --- .env.example and README.md document every entry (a test keeps them in step). ---


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
    Option("REDIS_URL", "optional Redis URL for the shared cache tier and credit ledger"),
    Option("REDIS_TIMEOUT", "seconds before a Redis command is abandoned (default 0.25)"),
    Option("API_KEYS", "comma-separated API keys; with no key setting the proxy runs open"),
    Option("API_KEYS_FILE", "TOML file of keys: [keys.NAME] key_sha256 (or key), daily_credits, credits_per_second"),
    Option("DAILY_CREDITS", "default daily credit balance per key (default 3000000)"),
    Option("CREDITS_PER_SECOND", "default per-key credits-per-second limit (default: none)"),
    Option("DEFAULT_CREDITS", "credit cost of methods in neither the spec's table nor the credits table "
           "(default 20)"),
    Option("CREDITS_FILE", "optional TOML file whose [credits] table sets per-method costs (method = credits) of "
           "methods outside the spec's seven; unlisted methods keep the built-in table, else DEFAULT_CREDITS"),
    Option("ALLOW_NAMESPACES", "comma-separated namespaces whose every method is served (debug,txpool,...)"),
    Option("MAX_BATCH_SIZE", "maximum calls in one batch (default 100)"),
    Option("MAX_BODY_BYTES", "maximum HTTP request body in bytes (default 5242880)"),
    Option("WS_MAX_MESSAGE_BYTES", "maximum WebSocket message in bytes (default 5242880)"),
    Option("WS_MAX_INFLIGHT", "maximum concurrent requests per WebSocket connection (default 64)"),
    Option("UPSTREAM_TIMEOUT", "seconds before an upstream request is abandoned (default 30)"),
    Option("COALESCE_WAIT", "seconds a replica waits for another replica's identical miss via Redis; 0 disables "
           "(default 2)"),
    Option("UPSTREAM_BATCH_MAX", "most cache-miss reads sent upstream as one JSON-RPC batch; 1 disables (default 50)"),
    Option("HEAD_POLL_INTERVAL", "seconds between head-tracker polls, fractions allowed (default 2)"),
    Option("FINALITY_DEPTH", "blocks below latest counted final when a node has no finalized tag (default 64)"),
    Option("CACHE_MEMORY_BYTES", "size bound of the in-process cache tier in bytes (default 268435456)"),
    Option("CACHE_UNFINALIZED_TTL", "seconds an answer for an unfinalized block is kept (default 12)"),
    Option("CACHE_NEGATIVE_TTL", "seconds a null not-found answer is kept (default 2)"),
    Option("SOLANA_BALANCE_MAX_AGE", "max age in seconds of a cached getTokenAccountBalance (default 0.4)"),
    Option("SOLANA_LARGEST_ACCOUNTS_TTL", "seconds getLargestAccounts is cached, at most 7200 (default 3600)"),
    Option("GETLOGS_MAX_RESULTS", "eth_getLogs result limit (default 10000)"),
    Option("GETLOGS_TIMEOUT", "eth_getLogs query time limit in seconds (default 10)"),
    Option("GETLOGS_MAX_PARAMS", "eth_getLogs limit on addresses plus topic values (default 5000)"),
    Option("GETLOGS_CHUNK_BLOCKS", "eth_getLogs ranges are asked and cached in aligned chunks of this many blocks "
           "(a tenth of it near finality); 0 disables (default 1000)"),
    Option("GETLOGS_CHUNK_CONCURRENCY", "chunks of one eth_getLogs call asked upstream at once (default 4)"),
    Option("GAS_CAP_MULTIPLIER", "eth_call/eth_estimateGas gas cap as a multiple of the block gas limit (default 10)"),
    Option("ETH_CALL_REQUIRE_FROM", "require `from` in eth_call as the spec's table does (default false: "
           "the node's own default sender applies, as with geth and Anvil)"),
    Option("LOG_FORMAT", "text or json (JSON lines)"),
    Option("LOG_LEVEL", "DEBUG, INFO, WARNING or ERROR (default INFO)"),
    Option("ACCESS_LOG", "log every call: request id, method, cache result, upstream latency (default false)"),
    Option("SHUTDOWN_TIMEOUT", "seconds SIGTERM waits for in-flight requests (default 30)"),
    Option("WORKERS", "worker processes sharing the port, each with its own memory tier; auto: one per CPU "
           "(default 1: one process, no supervisor)"),
    Option("EVENT_LOOP", "asyncio or uvloop (needs the [fast] extra; a little less CPU per hit) "
           "(default asyncio)"),
    Option("ALLOW_METHODS", "comma-separated methods to serve beyond the default allow-list (exact names)"),
    Option("BODY_TIMEOUT", "seconds a client has to send a request body once its headers arrived (default 30)"),
    Option("MAX_CONNECTIONS", "open client connections; more are answered 503 and closed at once (default 4096)"),
    Option("MAX_INFLIGHT_BODY_BYTES", "request-body bytes being received at once, all clients together; "
           "beyond it 503 (default 134217728)"),
    Option("METRICS_HOST", "address of the internal /metrics listener (default 127.0.0.1)"),
    Option("METRICS_PORT", "port of an internal listener serving /metrics; when set, the public port does not "
           "(default: unset, /metrics on the public port)"),
    Option("UPSTREAM_BATCH_MAX_BYTES", "most bytes of params in one upstream auto-batch; a larger call goes alone "
           "(default 1048576)"),
    Option("UPSTREAM_ATTEMPT_TIMEOUT", "seconds one upstream attempt may take before the next upstream is tried "
           "(default: UPSTREAM_TIMEOUT shared evenly by the upstreams left to try)"),
    Option("HEAD_STALE_AFTER", "seconds after the last successful head poll when tags stop being resolved and "
           "/readyz reports the network degraded (default 3 poll intervals, at least 1)"),
    Option("HEAD_CATCH_UP_WAIT", "seconds a `latest` call waits for the head to reach a block the proxy has "
           "already shown; then it goes upstream uncached (default 0.3)"),
    Option("IDENTITY_CHECK_INTERVAL", "seconds between checks of each upstream's chain id and genesis hash "
           "(default 30)"),
    Option("CREDITS_REDIS_URL", "Redis URL of the credit ledger, ideally a noeviction one (default REDIS_URL)"),
    Option("CREDITS_REDIS_TIMEOUT", "seconds before a ledger Redis command is abandoned (default 2)"),
    Option("CREDITS_REDIS_FAILURES", "consecutive ledger Redis failures before it counts as down (default 3)"),
    Option("CREDITS_REQUIRE_NOEVICTION", "refuse to start if the ledger's Redis may evict keys (default false)"),
    Option("CREDITS_FAIL_OPEN", "serve keys with no known usage while the ledger is unreachable (default true)"),
    Option("CREDITS_LEASE_MAX", "most credits of a key one replica leases at a time (default 100000)"),
    Option("CREDITS_LEASE_SECONDS", "seconds before an unused lease goes back to the ledger (default 10)"),
    Option("CREDITS_JOURNAL_DIR", "directory of the journal of debits made while the ledger is unreachable"),
    Option("EVM_UPSTREAM_WS", "comma-separated WebSocket URLs of the default EVM network's node: push heads, "
           "relayed subscriptions"),
    Option("SOLANA_UPSTREAM_WS", "comma-separated WebSocket URLs of the default Solana network (pubsub relay)"),
    Option("WS_MAX_SUBSCRIPTIONS", "maximum subscriptions per WebSocket connection (default 100)"),
    Option("WS_SEND_BUFFER_BYTES", "bytes a WebSocket connection may have waiting to be sent; past it the "
           "connection is closed as a slow consumer with 1008 (default 4194304)"),
    Option("SUBSCRIPTION_CREDITS", "per-kind subscription credits, e.g. subscribe=5,newHeads=50,logs=300 "
           "(defaults: subscribe 5, newHeads 50, logs 300, newPendingTransactions 200, other 50)"),
)
OPTION_NAMES = frozenset(o.env for o in OPTIONS)


# --- parsing --------------------------------------------------------------------------


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, got {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"{name} must be greater than 0, got {raw!r}")
    return value


def _positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name} must be greater than 0, got {raw!r}")
    return value


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
        return os.cpu_count() or 1
    return _positive_int(name, raw)


def _csv(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _url_parts(name: str, index: int, url: str) -> SplitResult:
    """An upstream URL's parts; never echoed, since it may carry a provider's secret key."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise ConfigError(f"{name}: upstream #{index} is not a valid URL") from None
    return parts


def _upstream_urls(name: str, urls: Any) -> tuple[str, ...]:
    if isinstance(urls, str):
        urls = _csv(urls)
    if not isinstance(urls, (list, tuple)) or not all(isinstance(u, str) for u in urls):
        raise ConfigError(f"{name} must be a list of URLs")
    for index, url in enumerate(urls):
        parts = _url_parts(name, index, url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            # Never echo the URL: it may carry a provider's secret key.
            raise ConfigError(f"{name}: upstream #{index} is not an http(s) URL")
    return tuple(urls)


def _redis_url(name: str, raw: str) -> str:
    """A URL redis-py can connect to; the error never echoes it (it may hold a password)."""
    expected = f"{name} is not a valid redis://, rediss://, unix://, redis+cluster:// or redis+sentinel:// URL"
    try:
        topology = topology_of(raw)
    except BadRedisUrl as exc:
        raise ConfigError(f"{name} {exc}") from None
    if topology.kind != "single":
        return raw
    try:
        parts = urlsplit(raw)
        port = parts.port  # raises on a bad port
    except ValueError:
        raise ConfigError(expected) from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(expected)
    if parts.scheme != "unix" and not parts.hostname:
        raise ConfigError(f"{name} names no host")
    if port == 0:
        raise ConfigError(f"{name} has port 0")
    if parts.scheme == "unix" and not parts.path:
        raise ConfigError(f"{name} names no socket path")
    try:  # redis-py's own reading: query options such as db=x or socket_timeout=abc
        parse_url(raw)  # type: ignore[no-untyped-call]
    except (ValueError, TypeError):
        raise ConfigError(f"{name} has an invalid option in its query string") from None
    return raw
def _ws_urls(name: str, urls: Any) -> tuple[str, ...]:
    if isinstance(urls, str):
        urls = _csv(urls)
    for index, url in enumerate(urls):
        parts = _url_parts(name, index, url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise ConfigError(f"{name}: WebSocket upstream #{index} is not a ws(s) URL")
    return tuple(urls)


def _split_ws(urls: Any) -> tuple[Any, tuple[str, ...]]:
    """NETWORKS_FILE upstreams may mix http(s) and ws(s) URLs: the ws ones are the node's WebSocket."""
    if not isinstance(urls, list):
        return urls, ()
    ws = [u for u in urls if isinstance(u, str) and u.startswith(("ws://", "wss://"))]
    return [u for u in urls if u not in ws], tuple(ws)


def _credit_table(name: str, raw: str) -> dict[str, int]:
    table = dict(SUBSCRIPTION_CREDITS)
    for part in _csv(raw):
        kind, eq, value = part.partition("=")
        if not eq or not kind.strip():
            raise ConfigError(f"{name} must be kind=credits pairs, got {part!r}")
        cost = 0 if value.strip() == "0" else _positive_int(f"{name} {kind.strip()}", value.strip())
        table[kind.strip()] = cost
    return table


def _load_toml(name: str, path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{name}: {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: {path} is not UTF-8 text") from None


def _credits_file(path: str) -> dict[str, int]:
    """The built-in per-method credits with CREDITS_FILE's [credits] table applied."""
    data = _load_toml("CREDITS_FILE", path)
    for section in data:
        if section != "credits":
            raise ConfigError(f"CREDITS_FILE: unknown table or key {section!r} (expected only [credits])")
    table = data.get("credits")
    if not isinstance(table, dict):
        raise ConfigError(f"CREDITS_FILE: {path} has no [credits] table")
    costs = dict(METHOD_CREDITS)
    for method, cost in table.items():
        where = f"CREDITS_FILE: {method[:40]!r}"
        if not METHOD_NAME.fullmatch(method):
            raise ConfigError(f"{where} is not a method name (ASCII letters, digits, '_')")
        if method in SPEC_CREDITS:
            # spec "Limits / Credits per call": the seven methods' costs are fixed.
            raise ConfigError(f"{where} costs {SPEC_CREDITS[method]} credits as the spec fixes; it cannot be changed")
        if not isinstance(cost, int) or isinstance(cost, bool) or not 0 <= cost <= 1_000_000:
            raise ConfigError(f"{where} must cost a whole number of credits from 0 to 1000000")
        costs[method] = cost
    return costs


def _networks_from_file(path: str) -> list[Network]:
    data = _load_toml("NETWORKS_FILE", path)
    table = data.get("networks")
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"NETWORKS_FILE: {path} has no [networks.NAME] tables")
    networks = []
    for name, entry in table.items():
        where = f"NETWORKS_FILE: network {name!r}"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be a table")
        family = entry.get("family")
        if family not in FAMILIES:
            raise ConfigError(f"{where}: family must be 'evm' or 'solana'")
        hosts = entry.get("hosts", [])
        if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
            raise ConfigError(f"{where}: hosts must be a list of host names")
        depth = entry.get("finality_depth")
        if depth is not None and (not isinstance(depth, int) or depth <= 0):
            raise ConfigError(f"{where}: finality_depth must be a positive integer")
        chain_id = entry.get("chain_id")
        if chain_id is not None and (not isinstance(chain_id, int) or isinstance(chain_id, bool) or chain_id <= 0):
            raise ConfigError(f"{where}: chain_id must be a positive integer")
        http_urls, ws_urls = _split_ws(entry.get("upstreams"))
        networks.append(
            Network(
                name=str(name),
                family=family,
                upstreams=_upstream_urls(where + " upstreams", http_urls),
                hosts=tuple(h.lower() for h in hosts),
                finality_depth=depth,
                chain_id=chain_id,
                ws_upstreams=ws_urls,
            )
        )
    return networks


_KEY_FIELDS = ("key", "key_sha256", "daily_credits", "credits_per_second")


def _key_entry(table_name: str, entry: Any) -> tuple[str, KeyConfig]:
    """One [keys.X] table: X names the account when `key` or `key_sha256` holds the secret;
    otherwise X is the secret itself (the older form) and the account gets a derived name."""
    declared = isinstance(entry, dict) and ("key" in entry or "key_sha256" in entry)
    name = table_name if declared else derived_name(table_name)
    where = f"API_KEYS_FILE: key {name!r}"  # never the secret of an older-form table
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a table")
    for field_name in entry:
        if field_name not in _KEY_FIELDS:
            raise ConfigError(f"{where}: unknown field {field_name!r} (expected one of {', '.join(_KEY_FIELDS)})")
    if declared and not ACCOUNT_NAME.fullmatch(name):
        raise ConfigError(f"{where}: a key name is 1-64 letters, digits, '_', '.' or '-'")
    if "key" in entry and "key_sha256" in entry:
        raise ConfigError(f"{where}: set key or key_sha256, not both")
    if "key_sha256" in entry:
        sha = entry["key_sha256"]
        if not isinstance(sha, str) or not SHA256_HEX.fullmatch(sha.lower()):
            raise ConfigError(f"{where}: key_sha256 must be 64 hex digits (sha256sum of the key)")
        sha = sha.lower()
    else:
        secret = entry.get("key", table_name)
        if not isinstance(secret, str) or not secret:
            raise ConfigError(f"{where}: key must be a non-empty string")
        sha = digest(secret)
    values: dict[str, int | None] = {}
    for field_name in ("daily_credits", "credits_per_second"):
        value = entry.get(field_name)
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{where}: {field_name} must be a positive integer")
        values[field_name] = value
    return name, KeyConfig(**values, sha256=sha)


def _keys(raw: Mapping[str, str]) -> dict[str, KeyConfig] | None:
    """Accounts by name; a name is never the secret (plain API_KEYS entries get a derived name)."""
    keys: dict[str, KeyConfig] = {}
    for secret in _csv(raw.get("API_KEYS", "")):
        keys[derived_name(secret)] = KeyConfig(sha256=digest(secret))
    path = raw.get("API_KEYS_FILE")
    if path:
        data = _load_toml("API_KEYS_FILE", path)
        table = data.get("keys")
        if not isinstance(table, dict) or not table:
            raise ConfigError(f"API_KEYS_FILE: {path} has no [keys.NAME] tables")
        for table_name, entry in table.items():
            name, config = _key_entry(str(table_name), entry)
            if name in keys:
                raise ConfigError(f"API_KEYS_FILE: key {name!r} is declared twice")
            keys[name] = config
    digests = [k.sha256 for k in keys.values()]
    if len(set(digests)) != len(digests):
        raise ConfigError("API_KEYS/API_KEYS_FILE: two keys share the same secret")
    return keys or None


_SCALARS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "PROXY_HOST": ("host", lambda _n, v: v),
    "PROXY_PORT": ("port", _port),
    "REDIS_URL": ("redis_url", _redis_url),
    "REDIS_TIMEOUT": ("redis_timeout", _positive_float),
    "DAILY_CREDITS": ("daily_credits", _positive_int),
    "CREDITS_PER_SECOND": ("credits_per_second", _positive_int),
    "DEFAULT_CREDITS": ("default_credits", lambda n, v: 0 if v.strip() == "0" else _positive_int(n, v)),
    "MAX_BATCH_SIZE": ("max_batch_size", _positive_int),
    "MAX_BODY_BYTES": ("max_body_bytes", _positive_int),
    "WS_MAX_MESSAGE_BYTES": ("ws_max_message_bytes", _positive_int),
    "WS_MAX_INFLIGHT": ("ws_max_inflight", _positive_int),
    "UPSTREAM_TIMEOUT": ("upstream_timeout", _positive_float),
    "UPSTREAM_BATCH_MAX": ("upstream_batch_max", _positive_int),
    "COALESCE_WAIT": ("coalesce_wait", lambda n, v: 0.0 if v.strip() in ("0", "0.0") else _positive_float(n, v)),
    "HEAD_POLL_INTERVAL": ("head_poll_interval", _positive_float),
    "FINALITY_DEPTH": ("finality_depth", _positive_int),
    "CACHE_MEMORY_BYTES": ("cache_memory_bytes", _positive_int),
    "CACHE_UNFINALIZED_TTL": ("cache_unfinalized_ttl", _positive_float),
    "CACHE_NEGATIVE_TTL": ("cache_negative_ttl", _positive_float),
    "SOLANA_BALANCE_MAX_AGE": ("solana_balance_max_age", _positive_float),
    "SOLANA_LARGEST_ACCOUNTS_TTL": ("solana_largest_accounts_ttl", _positive_float),
    "GETLOGS_MAX_RESULTS": ("getlogs_max_results", _positive_int),
    "GETLOGS_TIMEOUT": ("getlogs_timeout", _positive_float),
    "GETLOGS_MAX_PARAMS": ("getlogs_max_params", _positive_int),
    "GETLOGS_CHUNK_BLOCKS": ("getlogs_chunk_blocks", lambda n, v: 0 if v.strip() == "0" else _positive_int(n, v)),
    "GETLOGS_CHUNK_CONCURRENCY": ("getlogs_chunk_concurrency", _positive_int),
    "GAS_CAP_MULTIPLIER": ("gas_cap_multiplier", _positive_int),
    "ETH_CALL_REQUIRE_FROM": ("eth_call_require_from", _bool),
    "ACCESS_LOG": ("access_log", _bool),
    "SHUTDOWN_TIMEOUT": ("shutdown_timeout", _positive_float),
    "WORKERS": ("workers", _workers),
    "BODY_TIMEOUT": ("body_timeout", _positive_float),
    "MAX_CONNECTIONS": ("max_connections", _positive_int),
    "MAX_INFLIGHT_BODY_BYTES": ("max_inflight_body_bytes", _positive_int),
    "METRICS_HOST": ("metrics_host", lambda _n, v: v),
    "METRICS_PORT": ("metrics_port", _port),
    "UPSTREAM_BATCH_MAX_BYTES": ("upstream_batch_max_bytes", _positive_int),
    "UPSTREAM_ATTEMPT_TIMEOUT": ("upstream_attempt_timeout", _positive_float),
    "HEAD_STALE_AFTER": ("head_stale_after", _positive_float),
    "HEAD_CATCH_UP_WAIT": ("head_catch_up_wait", lambda n, v: 0.0 if v.strip() in ("0", "0.0")
                           else _positive_float(n, v)),
    "IDENTITY_CHECK_INTERVAL": ("identity_check_interval", _positive_float),
    "CREDITS_REDIS_URL": ("credits_redis_url", _redis_url),
    "CREDITS_REDIS_TIMEOUT": ("credits_redis_timeout", _positive_float),
    "CREDITS_REDIS_FAILURES": ("credits_redis_failures", _positive_int),
    "CREDITS_REQUIRE_NOEVICTION": ("credits_require_noeviction", _bool),
    "CREDITS_FAIL_OPEN": ("credits_fail_open", _bool),
    "CREDITS_LEASE_MAX": ("credits_lease_max", _positive_int),
    "CREDITS_LEASE_SECONDS": ("credits_lease_seconds", _positive_float),
    "CREDITS_JOURNAL_DIR": ("credits_journal_dir", lambda _n, v: v),
    "WS_MAX_SUBSCRIPTIONS": ("ws_max_subscriptions", _positive_int),
    "WS_SEND_BUFFER_BYTES": ("ws_send_buffer_bytes", _positive_int),
    "SUBSCRIPTION_CREDITS": ("subscription_credits", _credit_table),
}


def build_settings(raw: Mapping[str, str]) -> Settings:
    """Parse every setting from a flat mapping of raw strings; raise ConfigError on the first problem."""
    raw = {k: v for k, v in raw.items() if k in OPTION_NAMES and v is not None and v != ""}
    networks: list[Network] = []
    defaults_from_env: tuple[tuple[str, Family], ...] = (("EVM_UPSTREAM", "evm"), ("SOLANA_UPSTREAM", "solana"))
    for env, family in defaults_from_env:
        if env in raw:
            ws = _ws_urls(f"{env}_WS", raw[f"{env}_WS"]) if f"{env}_WS" in raw else ()
            networks.append(Network(name=family, family=family, upstreams=_upstream_urls(env, raw[env]),
                                    ws_upstreams=ws))
        elif f"{env}_WS" in raw:
            raise ConfigError(f"{env}_WS needs {env}: the WebSocket serves the same network")
    if "NETWORKS_FILE" in raw:
        networks.extend(_networks_from_file(raw["NETWORKS_FILE"]))
    if not networks:
        raise ConfigError("no upstream configured: set EVM_UPSTREAM, SOLANA_UPSTREAM or NETWORKS_FILE")
    seen: set[str] = set()
    for net in networks:
        if not NETWORK_NAME.fullmatch(net.name):
            raise ConfigError(f"network name {net.name!r} must be lower-case letters, digits and '-'")
        if net.name in seen:
            raise ConfigError(f"network {net.name!r} is declared twice")
        seen.add(net.name)
    defaults: dict[str, str] = {}
    for family in FAMILIES:
        first = next((n for n in networks if n.family == family), None)
        if first is not None:
            defaults[family] = first.name

    values: dict[str, Any] = {}
    for env, (attr, parse) in _SCALARS.items():
        if env in raw:
            values[attr] = parse(env, raw[env])
    if "LOG_FORMAT" in raw:
        if raw["LOG_FORMAT"] not in ("text", "json"):
            raise ConfigError(f"LOG_FORMAT must be 'text' or 'json', got {raw['LOG_FORMAT']!r}")
        values["log_format"] = raw["LOG_FORMAT"]
    if "EVENT_LOOP" in raw:
        if raw["EVENT_LOOP"] not in ("asyncio", "uvloop"):
            raise ConfigError(f"EVENT_LOOP must be asyncio or uvloop, got {raw['EVENT_LOOP']!r}")
        if raw["EVENT_LOOP"] == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ConfigError("EVENT_LOOP=uvloop but uvloop is not installed: pip install 'rpc-cache-proxy[fast]'")
        values["event_loop"] = raw["EVENT_LOOP"]
    if "LOG_LEVEL" in raw:
        level = raw["LOG_LEVEL"].upper()
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"LOG_LEVEL must be DEBUG, INFO, WARNING or ERROR, got {raw['LOG_LEVEL']!r}")
        values["log_level"] = level
    if "ALLOW_NAMESPACES" in raw:
        values["allowed_namespaces"] = frozenset(ns.rstrip("_") for ns in _csv(raw["ALLOW_NAMESPACES"]))
    if "ALLOW_METHODS" in raw:
        methods = _csv(raw["ALLOW_METHODS"])
        for method in methods:
            if not METHOD_NAME.fullmatch(method):
                raise ConfigError(f"ALLOW_METHODS: {method[:40]!r} is not a method name (ASCII letters, digits, '_')")
        values["allowed_methods"] = frozenset(methods)
    if "CREDITS_FILE" in raw:
        values["method_credits"] = _credits_file(raw["CREDITS_FILE"])
    # spec: getLargestAccounts results may be cached up to two hours.
    if values.get("solana_largest_accounts_ttl", 0) > 7200:
        raise ConfigError("SOLANA_LARGEST_ACCOUNTS_TTL must be at most 7200 seconds (spec: two hours)")
    api_keys = _keys(raw)
    if values.get("workers", 1) > 1 and api_keys is not None and not (
            values.get("credits_redis_url") or values.get("redis_url")):
        # Each worker would hold its own full daily balance of every key: N times the credits.
        raise ConfigError("WORKERS above 1 with API keys needs a shared credit ledger: set REDIS_URL or "
                          "CREDITS_REDIS_URL (workers lease credits from it as replicas do)")
    return Settings(networks=tuple(networks), default_network=defaults, api_keys=api_keys, **values)
