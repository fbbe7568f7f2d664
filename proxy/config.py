"""Frozen settings, parsed once from a flat mapping of raw strings (env or CLI).

The options table and the parsers of one value are in options.py; the TOML files in config_files.py.
ConfigError, the options table, Network, KeyConfig and Family are re-exported: import them from here.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import ipaddress
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple
from urllib.parse import urlsplit

from proxy.config_files import HEADER_NAME, VERIFY_MODES, _credits_file, _keys, _networks_from_file
from proxy.config_files import KeyConfig as KeyConfig
from proxy.config_files import Network as Network
from proxy.credits.prices import METHOD_CREDITS, SUBSCRIPTION_CREDITS
from proxy.option_table import OPTION_NAMES as OPTION_NAMES
from proxy.option_table import OPTIONS as OPTIONS
from proxy.options import _SCALARS, _csv, _upstream_urls, _ws_urls
from proxy.options import ConfigError as ConfigError
from proxy.rpc.jsonrpc import METHOD_NAME
from proxy.rpc.known_methods import KNOWN_METHODS, near_miss
from proxy.rpc.methods import DEV_NAMESPACES, FAMILIES, POLICIES, namespace
from proxy.rpc.methods import Family as Family

NETWORK_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
# Names the paths themselves use: a network `ws` would make `/ws/v3/<key>` both a POST to it and the
# default network's WebSocket, and `v3` would make `/v3/v3` both its path and a key named v3.
RESERVED_NETWORK_NAMES = ("ws", "v3")
HEAD_POLL_INTERVAL = 2.0  # seconds between head polls (default)
HEAD_STALE_POLLS = 3  # a head older than this many poll intervals is stale...
HEAD_STALE_MIN = 1.0  # ...and never sooner than this many seconds


class Listener(NamedTuple):
    """One TCP listener: the setting of its port, its host and port."""

    setting: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port} ({self.setting})"


_ANY_ADDRESS = frozenset({"", "0.0.0.0", "::"})  # a wildcard host takes the port on every address
_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})  # `localhost` binds the loopback addresses


def _one_spelling(host: str) -> str:
    """A numeric host in one spelling (`127.1` is 127.0.0.1, `0:0::1` is ::1, `0` is 0.0.0.0); a name
    as it is (no lookup here)."""
    try:
        found = socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST) if host else []
    except (OSError, UnicodeError, ValueError):
        return host
    return str(found[0][4][0]) if found else host


def _same_host(one: str, other: str) -> bool:
    one, other = _one_spelling(one), _one_spelling(other)
    if one == other or one in _ANY_ADDRESS or other in _ANY_ADDRESS:
        return True
    return "localhost" in (one, other) and one in _LOOPBACK and other in _LOOPBACK


def listener_conflict(listeners: Sequence[Listener]) -> str | None:
    """Why two listeners cannot both bind (one port on one host, or on a wildcard host), or None."""
    for index, one in enumerate(listeners):
        for other in listeners[:index]:
            if one.port == other.port and _same_host(one.host.lower(), other.host.lower()):
                return (
                    f"{one.setting} {one.port} is also {other.setting} on {one.host} and {other.host}: "
                    "each listener needs a port of its own"
                )
    return None


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
    max_batch_size: int = 1_000
    max_body_bytes: int = 5 * 1024 * 1024
    ws_max_message_bytes: int = 5 * 1024 * 1024
    ws_max_inflight: int = 64
    upstream_timeout: float = 30.0
    upstream_batch_max: int = 50
    coalesce_wait: float = 2.0
    head_poll_interval: float = HEAD_POLL_INTERVAL
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
    max_response_bytes: int = 32 * 1024 * 1024
    upstream_key_concurrency: int = 8
    max_calls_in_flight_per_key: int = 2000
    cache_key_bytes_per_minute: int | None = None  # None: CACHE_MEMORY_BYTES / 16 (admission.py)
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
    max_pending_answer_bytes: int = 8 * 1024 * 1024
    max_pending_answer_bytes_per_key: int = 64 * 1024 * 1024
    max_pending_answer_bytes_per_process: int = 256 * 1024 * 1024
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: /metrics on the public listener
    networks_file: str | None = None  # read again by the admin listener's reload
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None  # None: no admin listener
    admin_token: str | None = field(default=None, repr=False)  # a secret: never in a repr, a log or an error
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
    cors_allow_origins: tuple[str, ...] | None = None  # None: any origin
    compress_min_bytes: int = 4096  # 0: never compressed
    compress_cache_bytes: int = 64 * 1024 * 1024
    trusted_proxy_header: str | None = None
    unmined_ttl: float = 0.25
    # API_KEYS and API_KEYS_FILE as given: SIGHUP reads the keys again from them (reload.py).
    keys_source: Mapping[str, str] = field(default_factory=dict)
    from_environment: tuple[str, ...] = ()  # the networks of EVM_UPSTREAM, SOLANA_UPSTREAM: never reloaded

    @property
    def head_stale_bound(self) -> float:
        """Seconds after the last successful head poll past which tags are no longer resolved."""
        if self.head_stale_after is not None:
            return self.head_stale_after
        return max(HEAD_STALE_POLLS * self.head_poll_interval, HEAD_STALE_MIN)

    ws_max_subscriptions: int = 100
    ws_max_subscription_bytes: int = 64 * 1024 * 1024
    ws_send_buffer_bytes: int = 4 * 1024 * 1024
    ws_max_lag: float = 10.0
    ws_max_connections_per_key: int = 512
    max_connections_per_ip: int = 1024
    ws_idle_timeout: float = 300.0
    max_filters_per_key: int = 100
    max_filter_bytes: int = 64 * 1024 * 1024
    subscription_credits: Mapping[str, int] = field(default_factory=lambda: dict(SUBSCRIPTION_CREDITS))
    # Credits per call of methods outside the spec's seven (prices.py), with CREDITS_FILE applied.
    method_credits: Mapping[str, int] = field(default_factory=lambda: dict(METHOD_CREDITS))

    @property
    def listeners(self) -> tuple[Listener, ...]:
        """The TCP addresses the proxy binds: the public port, then METRICS_PORT and ADMIN_PORT if set."""
        found = [Listener("PROXY_PORT", self.host, self.port)]
        if self.metrics_port is not None:
            found.append(Listener("METRICS_PORT", self.metrics_host, self.metrics_port))
        if self.admin_port is not None:
            found.append(Listener("ADMIN_PORT", self.admin_host, self.admin_port))
        return tuple(found)

    @property
    def ledger_redis_url(self) -> str | None:
        return self.credits_redis_url or self.redis_url

    def network(self, name: str) -> Network | None:
        return next((n for n in self.networks if n.name == name), None)

    @property
    def open_mode(self) -> bool:
        return self.api_keys is None

    def daily_credits_for(self, account: str) -> int:
        """The account's own daily_credits, else DAILY_CREDITS; with keys, an account no key names
        (one a reload removed, still named by a call in flight) has 0: revoking never raises a budget."""
        if self.api_keys is not None and account not in self.api_keys:
            return 0
        config = self.api_keys.get(account) if self.api_keys is not None else None
        return config.daily_credits if config and config.daily_credits else self.daily_credits

    def credits_per_second_for(self, account: str) -> int | None:
        """The account's own credits_per_second, else CREDITS_PER_SECOND (None: no limit)."""
        config = (self.api_keys or {}).get(account)
        return config.credits_per_second if config and config.credits_per_second else self.credits_per_second


ADMIN_TOKEN_MIN_LENGTH = 16
ADMIN_TOKEN_MIN_DISTINCT = 8


def admin_token_problem(token: str | None) -> str | None:
    """Why ADMIN_TOKEN cannot guard the admin listener, or None. Printable ASCII without whitespace
    (a header carries it as it is: a space, or a value padded to the length, would never match),
    at least 16 characters, at least 8 of them distinct (not `aaaa...` or `abab...`). Pure."""
    if not token:
        return "it is not set"
    if len(token) < ADMIN_TOKEN_MIN_LENGTH:
        return f"it has fewer than {ADMIN_TOKEN_MIN_LENGTH} characters"
    if any(not 0x21 <= ord(c) <= 0x7E for c in token):
        return "it holds whitespace or characters outside printable ASCII"
    if len(set(token)) < ADMIN_TOKEN_MIN_DISTINCT:
        return f"it has fewer than {ADMIN_TOKEN_MIN_DISTINCT} distinct characters (too easy to guess)"
    return None


def _node_of(url: str) -> tuple[Any, ...]:
    """What makes two upstream URLs one node's endpoint: all of it but the case of its scheme and host
    and one trailing `/` (URLs checked already: options._urls)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme.lower() in ("https", "wss") else 80)
    return (
        parts.scheme.lower(),
        parts.username,
        parts.password,
        parts.hostname,
        port,
        parts.path.removesuffix("/"),
        parts.query,
    )


def checked_networks(networks: Sequence[Network]) -> dict[str, str]:
    """Check the networks' names (ConfigError); each family's default network: its first declared."""
    seen: set[str] = set()
    for net in networks:
        if not NETWORK_NAME.fullmatch(net.name):
            raise ConfigError(f"network name {net.name!r} must be lower-case letters, digits and '-'")
        if net.name in RESERVED_NETWORK_NAMES:
            raise ConfigError(
                f"network name {net.name!r} is a word of the proxy's paths (/ws/v3/<key>, /v3/<key>): choose another"
            )
        if net.name in seen:
            setting = next((env for env, family in FROM_ENVIRONMENT if family == net.name), None)
            if setting is not None:  # (a TOML file holds no table twice: the other is the environment's)
                raise ConfigError(
                    f"network {net.name!r} is declared twice: by {setting} and in NETWORKS_FILE "
                    f"(unset {setting}, or give the file's network another name)"
                )
            raise ConfigError(f"network {net.name!r} is declared twice")
        seen.add(net.name)
        for kind, urls, headers_of in (
            ("upstream", net.upstreams, net.headers_of),
            ("WebSocket upstream", net.ws_upstreams, net.ws_headers_of),
        ):  # one URL with other header fields (two keys of one provider) is two accounts: allowed
            places: dict[tuple[Any, ...], int] = {}
            for index, url in enumerate(urls):
                node = (_node_of(url), headers_of(index))
                if (was := places.setdefault(node, index)) != index:
                    raise ConfigError(
                        f"network {net.name!r}: {kind} #{index} is #{was} again: one node would count as two"
                        " (confirm_immutable, checkpoint_quorum, failover)"
                    )
    claimed: dict[str, str] = {}  # host -> the network declaring it: a Host header routes to one network
    for net in networks:
        for host in net.hosts:
            if claimed.setdefault(host, net.name) != net.name:
                raise ConfigError(f"host {host!r} is claimed by networks {claimed[host]!r} and {net.name!r}")
    defaults: dict[str, str] = {}
    for family in FAMILIES:
        first = next((n for n in networks if n.family == family), None)
        if first is not None:
            defaults[family] = first.name
    return defaults


_NAMESPACE = re.compile(r"[A-Za-z][A-Za-z0-9]*_?")  # a method name's part before its `_`
_CLIENT_IP_HEADERS = ("X-Forwarded-For", "X-Real-IP")
# Fields every request carries that name no client: taken as its address, they pool clients' limits.
_NO_ADDRESS = frozenset({"authorization", "host", "cookie", "content-length", "content-type", "user-agent", "origin"})


def _loopback(host: str) -> bool:
    """Whether `host` is a loopback address (all of 127.0.0.0/8 and ::1) or `localhost`."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def doubts(settings: Settings) -> list[str]:
    """Settings that are valid but look like typos or leaks (pure): an allowed_methods or ALLOW_METHODS
    entry that is no method the proxy knows but one's near twin (`eth_cal`), an ALLOW_NAMESPACES entry
    near a known namespace (`debugg`), a TRUSTED_PROXY_HEADER near one it reads (`X-Forwarded-Fro`),
    and keys' usage on a public /metrics. Warnings, not errors: a method unknown here may be the node's own."""
    found = []
    methods = POLICIES.keys() | KNOWN_METHODS  # a node's real method is never a typo
    lists = [
        (f"API_KEYS_FILE: key {name!r}: allowed_methods", key.lists.methods)
        for name, key in (settings.api_keys or {}).items()
    ]
    for where, listed in [*lists, ("ALLOW_METHODS", settings.allowed_methods)]:
        for method in sorted(listed - methods):
            if twin := near_miss(method, methods):
                found.append(f"{where} {method!r} is no known method ({twin}?)")
    spaces = {space for name in methods if (space := namespace(name)) is not None} | DEV_NAMESPACES
    for space in sorted(settings.allowed_namespaces - spaces):
        if near := difflib.get_close_matches(space, spaces, 1, 0.8):
            found.append(f"ALLOW_NAMESPACES {space[:40]!r} is no namespace of a known method ({near[0]}?)")
    if settings.api_keys and settings.metrics_port is None and not _loopback(settings.host):
        found.append(
            f"METRICS_PORT is not set: /metrics, with the keys' names and their use, is served to anyone who "
            f"reaches PROXY_HOST {settings.host[:40]!r} (set METRICS_PORT on an internal address)"
        )
    header = settings.trusted_proxy_header
    known = {h.lower(): h for h in _CLIENT_IP_HEADERS}
    if header and header.lower() not in known and (near := difflib.get_close_matches(header.lower(), known, 1, 0.8)):
        found.append(f"TRUSTED_PROXY_HEADER {header[:40]!r} is not {known[near[0]]}, which it resembles (a typo?)")
    elif header and header.lower() in _NO_ADDRESS:  # every client of a key, or of a host, one address
        found.append(f"TRUSTED_PROXY_HEADER {header[:40]!r} carries no client address (X-Forwarded-For, X-Real-IP do)")
    return found


# The networks settings declare, each named after its family (never in NETWORKS_FILE, never reloaded).
FROM_ENVIRONMENT: tuple[tuple[str, Family], ...] = (("EVM_UPSTREAM", "evm"), ("SOLANA_UPSTREAM", "solana"))


def file_networks(settings: Settings) -> tuple[list[Network], dict[str, str]]:
    """The environment's networks and NETWORKS_FILE's as it is now, with each family's default (a
    reload, a restarted worker); ConfigError when the file does not load or check."""
    fixed = [n for n in settings.networks if n.name in settings.from_environment]
    listed = [*fixed, *(_networks_from_file(settings.networks_file) if settings.networks_file else [])]
    return listed, checked_networks(listed)


def _networks(raw: Mapping[str, str]) -> tuple[list[Network], dict[str, str]]:
    """The networks of EVM_UPSTREAM and SOLANA_UPSTREAM (named evm and solana), then NETWORKS_FILE's,
    and each family's default network."""
    networks: list[Network] = []
    verify = raw.get("VERIFY_ANSWERS", "auto").strip().lower()
    if verify not in VERIFY_MODES:
        raise ConfigError(f"VERIFY_ANSWERS must be one of {', '.join(VERIFY_MODES)}")
    for env, family in FROM_ENVIRONMENT:
        if env in raw:
            ws = _ws_urls(f"{env}_WS", raw[f"{env}_WS"]) if f"{env}_WS" in raw else ()
            networks.append(
                Network(
                    name=family,
                    family=family,
                    upstreams=_upstream_urls(env, raw[env]),
                    ws_upstreams=ws,
                    verify=verify if family == "evm" else "auto",
                )
            )
        elif f"{env}_WS" in raw:
            raise ConfigError(f"{env}_WS needs {env}: the WebSocket serves the same network")
    if "NETWORKS_FILE" in raw:
        networks.extend(_networks_from_file(raw["NETWORKS_FILE"]))
    if not networks:
        raise ConfigError("no upstream configured: set EVM_UPSTREAM, SOLANA_UPSTREAM or NETWORKS_FILE")
    try:
        return networks, checked_networks(networks)
    except ConfigError as exc:  # names, hosts, a network declared twice: the file's, when there is one
        raise ConfigError(f"NETWORKS_FILE: {exc}" if "NETWORKS_FILE" in raw else str(exc)) from None


def build_settings(raw: Mapping[str, str]) -> Settings:
    """Parse every setting from a flat mapping of raw strings; raise ConfigError on the first problem."""
    raw = {k: v for k, v in raw.items() if k in OPTION_NAMES and v is not None and v != ""}
    networks, defaults = _networks(raw)

    values: dict[str, Any] = {"networks_file": raw.get("NETWORKS_FILE")}
    for env, (attr, parse) in _SCALARS.items():
        if env in raw:
            values[attr] = parse(env, raw[env])
    if "LOG_FORMAT" in raw:  # any case, as LOG_LEVEL: `JSON` is json
        if raw["LOG_FORMAT"].strip().lower() not in ("text", "json"):
            raise ConfigError(f"LOG_FORMAT must be 'text' or 'json', got {raw['LOG_FORMAT']!r}")
        values["log_format"] = raw["LOG_FORMAT"].strip().lower()
    # uvloop, a default dependency where it builds, unless EVENT_LOOP=asyncio says otherwise.
    values["event_loop"] = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    if "EVENT_LOOP" in raw:
        if raw["EVENT_LOOP"] not in ("asyncio", "uvloop"):
            raise ConfigError(f"EVENT_LOOP must be asyncio or uvloop, got {raw['EVENT_LOOP']!r}")
        if raw["EVENT_LOOP"] == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ConfigError("EVENT_LOOP=uvloop but uvloop is not installed (it does not build on this platform)")
        values["event_loop"] = raw["EVENT_LOOP"]
    if "LOG_LEVEL" in raw:
        level = raw["LOG_LEVEL"].upper()
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"LOG_LEVEL must be DEBUG, INFO, WARNING or ERROR, got {raw['LOG_LEVEL']!r}")
        values["log_level"] = level
    if "ALLOW_NAMESPACES" in raw:
        spaces = _csv(raw["ALLOW_NAMESPACES"])
        if bad := [ns for ns in spaces if not _NAMESPACE.fullmatch(ns)]:  # `debug;txpool`: another separator
            raise ConfigError(f"ALLOW_NAMESPACES: {bad[0][:40]!r} is not a namespace (comma-separated: debug,txpool)")
        # In any case, as LOG_FORMAT: method namespaces are lower-case (`Debug` opens debug_*).
        values["allowed_namespaces"] = frozenset(ns.lower().rstrip("_") for ns in spaces)
    if "ALLOW_METHODS" in raw:
        methods = _csv(raw["ALLOW_METHODS"])
        for method in methods:
            if not METHOD_NAME.fullmatch(method):
                raise ConfigError(f"ALLOW_METHODS: {method[:40]!r} is not a method name (ASCII letters, digits, '_')")
        values["allowed_methods"] = frozenset(methods)
    if (header := values.get("trusted_proxy_header")) and not HEADER_NAME.fullmatch(header):  # it never comes
        raise ConfigError(
            f"TRUSTED_PROXY_HEADER must be a header name (no spaces, colons or commas), got {header[:40]!r}"
        )
    if "CREDITS_FILE" in raw:
        values["method_credits"] = _credits_file(raw["CREDITS_FILE"])
    # spec: getLargestAccounts results may be cached up to two hours.
    if values.get("solana_largest_accounts_ttl", 0) > 7200:
        raise ConfigError("SOLANA_LARGEST_ACCOUNTS_TTL must be at most 7200 seconds (spec: two hours)")
    stale, poll = values.get("head_stale_after"), values.get("head_poll_interval", HEAD_POLL_INTERVAL)
    if stale is not None and stale <= poll:
        # A head is stale only once a poll interval has passed without a successful poll; at or
        # under one interval every head goes stale between two polls and /readyz flaps.
        raise ConfigError(f"HEAD_STALE_AFTER must be greater than HEAD_POLL_INTERVAL ({poll:g}s), got {stale:g}")
    if values.get("admin_port") is not None:
        weak = admin_token_problem(values.get("admin_token"))
        if weak is not None:  # never the value: it is a secret, even a bad one
            raise ConfigError(f"ADMIN_PORT needs ADMIN_TOKEN, the admin listener's bearer token: {weak}")
    values["from_environment"] = tuple(family for env, family in FROM_ENVIRONMENT if env in raw)
    settings = Settings(networks=tuple(networks), default_network=defaults, **values)
    conflict = listener_conflict(settings.listeners)
    if conflict is not None:
        raise ConfigError(conflict)
    api_keys = _keys(raw)
    if (
        values.get("workers", 1) > 1
        and api_keys is not None
        and not (values.get("credits_redis_url") or values.get("redis_url"))
    ):
        # Each worker would hold its own full daily balance of every key: N times the credits.
        raise ConfigError(
            "WORKERS above 1 with API keys needs a shared credit ledger: set REDIS_URL or "
            "CREDITS_REDIS_URL (workers lease credits from it as replicas do)"
        )
    keys_source: dict[str, str] = {k: raw[k] for k in ("API_KEYS", "API_KEYS_FILE") if k in raw}
    return dataclasses.replace(settings, api_keys=api_keys, keys_source=keys_source)
