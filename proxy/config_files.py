"""NETWORKS_FILE, API_KEYS_FILE and CREDITS_FILE: TOML read once, checked entry by entry.

`Network` and `KeyConfig`, what those files declare, live here too (config.py re-exports them).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.config_expand import expand
from proxy.config_numbers import Place, dotted, in_range, non_finite
from proxy.credits.accounts import ACCOUNT_NAME, SHA256_HEX, derived_name, digest
from proxy.credits.allow_lists import NO_LISTS, AllowLists
from proxy.credits.prices import METHOD_CREDITS, SPEC_CREDITS
from proxy.file_trust import check_trusted
from proxy.host_names import host_name, is_host_field
from proxy.options import MAX_CREDITS, ConfigError, _csv, _upstream_urls
from proxy.origins import is_origin, origin_form
from proxy.rpc.jsonrpc import METHOD_NAME
from proxy.rpc.methods import FAMILIES, Family

SELECTION_POLICIES = ("priority", "weighted", "fastest")  # upstream/selection.py implements each
# Header fields sent to one upstream (NETWORKS_FILE `headers`): (name, value) pairs. The values are
# secrets (a provider's token): no repr, no log line, no metric, no admin listing shows them.
UpstreamHeaders = tuple[tuple[str, str], ...]


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
    selection: str = "priority"  # which upstream is asked first (upstream/selection.py)
    hedge_after: float | None = None  # seconds before a slow read is also sent to the next upstream
    # Per http(s) upstream, in order: its weight and provider budget (empty: defaults for all).
    upstream_options: tuple[UpstreamOptions, ...] = ()
    confirm_immutable: int = 1  # upstreams that must agree before an answer is kept forever
    confirm_logs_bloom: bool = False  # eth_getLogs answers checked against logsBloom before kept forever
    # Verified answers (verifying.py): "auto", "required" or "off"; the checkpoint the trusted header
    # chain starts from (upstreams that must agree on it, 0: all; or a block hash set here); eth_getLogs
    # checked "complete" (no log missing) or for "inclusion" only.
    verify: str = "auto"
    checkpoint_quorum: int = 0
    trusted_checkpoint: str | None = None
    verify_logs: str = "complete"
    # Per upstream, in the order of `upstreams` and of `ws_upstreams`: header fields sent to it.
    upstream_headers: tuple[UpstreamHeaders, ...] = field(default=(), repr=False)
    ws_headers: tuple[UpstreamHeaders, ...] = field(default=(), repr=False)

    def headers_of(self, index: int) -> UpstreamHeaders:
        return self.upstream_headers[index] if index < len(self.upstream_headers) else ()

    def ws_headers_of(self, index: int) -> UpstreamHeaders:
        return self.ws_headers[index] if index < len(self.ws_headers) else ()

    def options_of(self, index: int) -> UpstreamOptions:
        return self.upstream_options[index] if index < len(self.upstream_options) else UpstreamOptions()


@dataclass(frozen=True, slots=True)
class UpstreamOptions:
    """One upstream's entry in NETWORKS_FILE beyond its URL."""

    weight: float = 1.0
    max_rps: float | None = None
    max_concurrency: int | None = None
    # A provider's rate in compute units: each call weighs its method's cost (default_cost if unlisted).
    max_units_per_second: float | None = None
    method_costs: tuple[tuple[str, int], ...] = ()  # pairs, not a dict: the options stay hashable
    default_cost: int = 1
    # None: an archive node as far as is known (its errors may still show it keeps recent state only);
    # a number: it keeps the state of its last `recent_blocks` blocks only, older reads go elsewhere.
    recent_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class KeyConfig:
    daily_credits: int | None = None
    credits_per_second: int | None = None
    sha256: str = ""  # hex digest of the key's secret; the secret itself is not kept
    lists: AllowLists = NO_LISTS  # allowed origins, methods, addresses (allow_lists.py)


_UPSTREAM_FIELDS = (
    "url",
    "weight",
    "max_rps",
    "max_concurrency",
    "max_units_per_second",
    "method_costs",
    "default_cost",
    "archive",
    "recent_blocks",
    "headers",
)
RECENT_BLOCKS_DEFAULT = 128  # `archive = false` without recent_blocks: geth's default state window
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 5.1: a token
# Fields the proxy writes itself (framing, the connection, a WebSocket's handshake).
_OWN_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "content-type",
        "transfer-encoding",
        "connection",
        "upgrade",
        "te",
        "trailer",
        "keep-alive",
        "proxy-connection",
        "accept-encoding",  # answers are read as identity bodies only (http_client.py)
        "content-encoding",
        "expect",
    }
)


def _headers(at: str, table: Any, url: Any = "") -> UpstreamHeaders:
    """An upstream's `headers = {Name = "value"}`: checked by name, never echoing a value."""
    if not isinstance(table, dict):
        raise ConfigError(f"{at}: headers must be a table of header names to string values")
    pairs = []
    for name, value in table.items():
        if not HEADER_NAME.fullmatch(name):
            raise ConfigError(f"{at}: header name {name[:40]!r} is not an HTTP field name")
        if name.lower() in _OWN_HEADERS or name.lower().startswith("sec-websocket-"):
            raise ConfigError(f"{at}: header {name} is the proxy's own to send")
        if not isinstance(value, str) or any(c in value for c in "\r\n\0") or not value.isascii():
            raise ConfigError(f"{at}: header {name}'s value must be one line of ASCII text")
        pairs.append((name, value.strip()))
    authority = re.split(r"[/?#]", str(url).split("//", 1)[-1], maxsplit=1)[0]  # not an "@" of the path
    if "@" in authority and any(n.lower() == "authorization" for n, _ in pairs):
        raise ConfigError(f"{at}: both user:password@ in its URL (sent as Basic) and an Authorization header")
    return tuple(pairs)


def _upstream_entries(where: str, entries: Any) -> tuple[Any, tuple[UpstreamOptions, ...], list[UpstreamHeaders]]:
    """NETWORKS_FILE upstreams, each a URL or a table: the URLs, each one's options and header fields."""
    if not isinstance(entries, list):
        return entries, (), []
    urls: list[Any] = []
    options: list[UpstreamOptions] = []
    headers: list[UpstreamHeaders] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            urls.append(entry)
            options.append(UpstreamOptions())
            headers.append(())
            continue
        at = f"{where}: upstream #{index}"  # never the URL: it may carry a provider's secret
        unknown = sorted(set(entry) - set(_UPSTREAM_FIELDS))
        if unknown:
            raise ConfigError(f"{at}: unknown field {unknown[0]!r} (expected {', '.join(_UPSTREAM_FIELDS)})")
        weight = in_range(at, "weight", entry.get("weight", 1.0))
        options.append(
            UpstreamOptions(
                float(weight),
                in_range(at, "max_rps", entry.get("max_rps")),
                in_range(at, "max_concurrency", entry.get("max_concurrency")),
                *_unit_rate(at, entry),
                _recent_blocks(at, entry),
            )
        )
        headers.append(_headers(at, entry["headers"], entry.get("url")) if "headers" in entry else ())
        urls.append(entry.get("url"))
    return urls, tuple(options), headers


def _unit_rate(at: str, entry: dict[str, Any]) -> tuple[float | None, tuple[tuple[str, int], ...], int]:
    """An upstream's compute-unit rate: max_units_per_second, method_costs {method = units} and
    default_cost (units of a method not listed, 1 if not given)."""
    rate = in_range(at, "max_units_per_second", entry.get("max_units_per_second"))
    costs = entry.get("method_costs", {})
    if not isinstance(costs, dict):
        raise ConfigError(f"{at}: method_costs must be a table of method = compute units")
    checked = {str(m): in_range(at, f"method_costs.{str(m)[:40]}", c) for m, c in costs.items()}
    default = in_range(at, "default_cost", entry.get("default_cost", 1))
    if rate is None and (checked or "default_cost" in entry):
        raise ConfigError(f"{at}: method_costs and default_cost need max_units_per_second (the budget in those units)")
    return rate, tuple(sorted(checked.items())), default


def _recent_blocks(at: str, entry: dict[str, Any]) -> int | None:
    """An upstream's state window: `archive = false` and/or `recent_blocks = N` (None: an archive node)."""
    archive = entry.get("archive")
    if archive is not None and not isinstance(archive, bool):
        raise ConfigError(f"{at}: archive must be true or false")
    recent = in_range(at, "recent_blocks", entry.get("recent_blocks"))
    if archive and recent is not None:
        raise ConfigError(f"{at}: an archive upstream has no recent_blocks (set archive = false, or drop it)")
    if archive is False and recent is None:
        return RECENT_BLOCKS_DEFAULT
    return int(recent) if recent is not None else None


def _hosts(where: str, hosts: Any) -> tuple[str, ...]:
    """A network's `hosts`: Host header names in the form routing compares (host_names.py: lower-case,
    no trailing dot, an IPv6 address bracketed and canonical, a Unicode name as its IDNA A-label). A
    Host header is matched by its name alone (gateway/network_routing.py drops its port), so a URL or a
    name with a port would never match, nor one the front refuses as a Host field."""
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        raise ConfigError(f"{where}: hosts must be a list of host names")
    names = []
    for host in hosts:
        shown = host[:60]
        if "/" in host:
            raise ConfigError(f"{where}: hosts entry {shown!r} is a URL: write the host name alone (rpc.example)")
        if "*" in host:  # a Host header is matched by its exact name: `*` would only match itself
            raise ConfigError(f"{where}: hosts entry {shown!r} is a wildcard: list each host name")
        parts = host_name(host)
        # The front refuses a Host field with userinfo, a zone id or spaces (http/head_limit.py): an
        # entry only such a field could match is never matched.
        if parts is None or any(c.isspace() for c in host) or not is_host_field(parts.name):
            raise ConfigError(f"{where}: hosts entry {shown!r} is not a host name a Host header can carry")
        if parts.port or host.rstrip().endswith(":"):
            raise ConfigError(
                f"{where}: hosts entry {shown!r} has a port: a Host header is matched by its name on any port, "
                "write the name alone"
            )
        names.append(parts.name)
    return tuple(names)


def _integrity(where: str, entry: dict[str, Any]) -> tuple[int, bool]:
    """A network's confirm_immutable (upstreams that must agree) and confirm_logs_bloom."""
    count = in_range(where, "confirm_immutable", entry.get("confirm_immutable", 1))
    bloom = entry.get("confirm_logs_bloom", False)
    if not isinstance(bloom, bool):
        raise ConfigError(f"{where}: confirm_logs_bloom must be true or false")
    return count, bloom


VERIFY_MODES = ("auto", "required", "off")
VERIFY_LOGS = ("complete", "inclusion")
_BLOCK_HASH = re.compile(r"0x[0-9a-f]{64}")


def _verification(where: str, entry: dict[str, Any], upstreams: int) -> tuple[str, int, str | None, str]:
    """A network's verify mode, checkpoint_quorum, trusted_checkpoint and verify_logs."""
    mode = entry.get("verify", "auto")
    if mode not in VERIFY_MODES:
        raise ConfigError(f"{where}: verify must be one of {', '.join(VERIFY_MODES)}")
    quorum = in_range(where, "checkpoint_quorum", entry.get("checkpoint_quorum")) or 0
    if upstreams and quorum > upstreams:
        raise ConfigError(f"{where}: checkpoint_quorum cannot exceed the number of http(s) upstreams")
    trusted = entry.get("trusted_checkpoint")
    if trusted is not None and not (isinstance(trusted, str) and _BLOCK_HASH.fullmatch(trusted.lower())):
        raise ConfigError(f"{where}: trusted_checkpoint must be a block hash (0x and 64 hex digits)")
    logs = entry.get("verify_logs", "complete")
    if logs not in VERIFY_LOGS:
        raise ConfigError(f"{where}: verify_logs must be one of {', '.join(VERIFY_LOGS)}")
    return mode, quorum, trusted.lower() if trusted is not None else None, logs


def _selection(where: str, entry: dict[str, Any]) -> tuple[str, float | None]:
    """A network's selection policy and hedging delay (seconds)."""
    selection = entry.get("selection", "priority")
    if selection not in SELECTION_POLICIES:
        raise ConfigError(f"{where}: selection must be one of {', '.join(SELECTION_POLICIES)}")
    hedge_ms = in_range(where, "hedge_after_ms", entry.get("hedge_after_ms"))
    return selection, hedge_ms / 1000 if hedge_ms is not None else None


def _split_ws(urls: Any) -> tuple[Any, tuple[str, ...]]:
    """NETWORKS_FILE upstreams may mix http(s) and ws(s) URLs: the ws ones are the node's WebSocket."""
    if not isinstance(urls, list):
        return urls, ()
    ws = [u for u in urls if isinstance(u, str) and u.startswith(("ws://", "wss://"))]
    return [u for u in urls if u not in ws], tuple(ws)


_TABLES = {"CREDITS_FILE": "credits", "NETWORKS_FILE": "networks", "API_KEYS_FILE": "keys"}  # each file's only one


def _load_toml(name: str, path: str) -> dict[str, Any]:
    check_trusted(name, Path(path))
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8-sig"))  # a leading BOM dropped, as in .env
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{name}: {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: {path} is not UTF-8 text") from None
    if (where := non_finite(data)) is not None:
        # TOML writes inf, nan and 1e400 (read as inf): no limit, weight or delay is infinite.
        shown = dotted(where) if name != "API_KEYS_FILE" else _key_place(data, where)
        raise ConfigError(f"{name}: {shown} must be a finite number (not inf or nan)")
    if (other := next((k for k in data if k != _TABLES[name]), None)) is not None:  # [network.x]: never read
        shown = repr(other) if name != "API_KEYS_FILE" else "outside [keys]"  # its names may be secrets
        raise ConfigError(f"{name}: unknown table or key {shown} (expected only [{_TABLES[name]}...])")
    # ${VAR} from the environment (config_expand.py), not in CREDITS_FILE; API_KEYS_FILE's table names may be secrets.
    return data if name == "CREDITS_FILE" else dict(expand(data, name, trace=name != "API_KEYS_FILE"))


def _credits_file(path: str) -> dict[str, int]:
    """The built-in per-method credits with CREDITS_FILE's [credits] table applied."""
    data = _load_toml("CREDITS_FILE", path)
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


_NETWORK_FIELDS = (
    "family",
    "upstreams",
    "hosts",
    "finality_depth",
    "chain_id",
    "selection",
    "hedge_after_ms",
    "confirm_immutable",
    "confirm_logs_bloom",
    "verify",
    "checkpoint_quorum",
    "trusted_checkpoint",
    "verify_logs",
)


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
        unknown = sorted(set(entry) - set(_NETWORK_FIELDS))
        if unknown:  # a misspelt or misplaced field would do nothing, silently
            raise ConfigError(f"{where}: unknown field {unknown[0]!r} (expected {', '.join(_NETWORK_FIELDS)})")
        family = entry.get("family")
        if family not in FAMILIES:
            raise ConfigError(f"{where}: family must be 'evm' or 'solana'")
        hosts = _hosts(where, entry.get("hosts", []))
        depth = in_range(where, "finality_depth", entry.get("finality_depth"))
        chain_id = in_range(where, "chain_id", entry.get("chain_id"))
        entries, options, headers = _upstream_entries(where + " upstreams", entry.get("upstreams"))
        is_ws = [isinstance(u, str) and u.startswith(("ws://", "wss://")) for u in entries] if options else []
        if any(ws and o != UpstreamOptions() for ws, o in zip(is_ws, options, strict=True)):
            raise ConfigError(f"{where}: weight and budgets apply to http(s) upstreams only")
        http_urls, ws_urls = _split_ws(entries)
        options = tuple(o for ws, o in zip(is_ws, options, strict=True) if not ws)
        http_headers = tuple(h for ws, h in zip(is_ws, headers, strict=True) if not ws)
        ws_headers = tuple(h for ws, h in zip(is_ws, headers, strict=True) if ws)
        selection, hedge_after = _selection(where, entry)
        if isinstance(http_urls, list) and not http_urls:  # before the checks that count them
            raise ConfigError(f"{where}: no http(s) upstream (upstreams lists none)")
        confirm_immutable, confirm_logs_bloom = _integrity(where, entry)
        if isinstance(http_urls, list) and confirm_immutable > len(http_urls):
            raise ConfigError(f"{where}: confirm_immutable cannot exceed the number of http(s) upstreams")
        verify, quorum, trusted, verify_logs = _verification(
            where, entry, len(http_urls) if isinstance(http_urls, list) else 0
        )
        networks.append(
            Network(
                name=str(name),
                family=family,
                upstreams=_upstream_urls(where + " upstreams", http_urls),
                hosts=hosts,
                finality_depth=depth,
                chain_id=chain_id,
                ws_upstreams=ws_urls,
                selection=selection,
                hedge_after=hedge_after,
                upstream_options=options,
                confirm_immutable=confirm_immutable,
                confirm_logs_bloom=confirm_logs_bloom,
                verify=verify,
                checkpoint_quorum=quorum,
                trusted_checkpoint=trusted,
                verify_logs=verify_logs,
                upstream_headers=http_headers if any(http_headers) else (),
                ws_headers=ws_headers if any(ws_headers) else (),
            )
        )
    return networks


_KEY_FIELDS = (
    "key",
    "key_sha256",
    "daily_credits",
    "credits_per_second",
    "allowed_origins",
    "allowed_methods",
    "allowed_addresses",
)
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{40}")


# field -> (how one entry is written, whether one is once normalised, the normaliser)
_LISTS: dict[str, tuple[str, Callable[[str], object], Callable[[str], str]]] = {
    "allowed_origins": ("origins such as https://app.example", is_origin, origin_form),
    "allowed_methods": ("method names", METHOD_NAME.fullmatch, lambda i: i),
    "allowed_addresses": ("20-byte 0x addresses", _ADDRESS.fullmatch, str.lower),
}


def _allow_lists(where: str, entry: Mapping[str, Any]) -> AllowLists:
    """A key's allowed_origins (scheme://host[:port]), allowed_methods and allowed_addresses."""
    values: dict[str, frozenset[str]] = {}
    for field_name, (kind, valid, normal) in _LISTS.items():
        items = entry.get(field_name, [])
        if not isinstance(items, list) or not all(isinstance(i, str) and valid(normal(i)) for i in items):
            raise ConfigError(f"{where}: {field_name} must be a list of {kind}")
        values[field_name.removeprefix("allowed_")] = frozenset(normal(i) for i in items)
    return AllowLists(**values)


def unsendable(secret: str) -> str | None:
    """Why a key cannot be sent as written, or None. Anything but visible ASCII: whitespace, a control
    character, an invisible one (a zero-width space, a BOM, U+3164's blank letter, a variation
    selector) or any other outside ASCII; no client types or pastes it reliably, a URL path carries it
    only percent-encoded, and it hides a copy-paste mistake. Or `/`, `%`, `?`, `#`, which a URL path
    does not carry as written (a segment's end, an escape, the query, the fragment: `/v3/<key>`
    never reaches the key). Pure; the messages never show the key."""
    if not all("!" <= c <= "~" for c in secret):
        return _UNSENDABLE
    if any(c in secret for c in "/%?#\\") or secret in (".", ".."):
        return (
            "holds '/', '%', '?', '#' or '\\', or is '.' or '..', which a URL path does not carry as written "
            "(/v3/<key>)"
        )
    return None


_UNSENDABLE = (
    "contains whitespace, a control or an invisible character, or one outside ASCII "
    "(a client cannot send it as written)"
)
# A variable reference nobody expanded: `${K1}`, `$K1` (Compose and shells expand both).
UNEXPANDED = re.compile(r"\$(?:\{|[A-Za-z_])")


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
        if not declared and "${" in secret:
            raise ConfigError(
                f"{where}: its table name holds '${{': table names are not expanded (set key = \"${{VAR}}\")"
            )
        if (why := unsendable(secret)) is not None:
            raise ConfigError(f"{where}: the key {why}")
        sha = digest(secret)
    values: dict[str, int | None] = {}
    for field_name in ("daily_credits", "credits_per_second"):
        value = entry.get(field_name)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_CREDITS
        ):
            # Credits are counted as doubles in Redis: past 2**53 a count is rounded.
            raise ConfigError(f"{where}: {field_name} must be a whole number from 1 to 2**53")
        values[field_name] = value
    return name, KeyConfig(**values, sha256=sha, lists=_allow_lists(where, entry))


def _key_place(data: dict[str, Any], where: Place) -> str:
    """A place in API_KEYS_FILE shown without any part that may be a key: an older form's table name
    (`[keys.SECRET]`, or `SECRET = ...` in `[keys]`) is the secret, so the key is named as elsewhere
    (derived_name) and a field only when it is one of a key's fields."""
    if len(where) < 2 or where[0] != "keys" or not isinstance(data.get("keys"), dict):
        return "a value outside [keys.NAME]"
    table = str(where[1])
    entry = data["keys"][where[1]]
    declared = isinstance(entry, dict) and ("key" in entry or "key_sha256" in entry) and ACCOUNT_NAME.fullmatch(table)
    shown = f"key {table if declared else derived_name(table)!r}"
    return f"{shown}: {where[2]}" if len(where) > 2 and where[2] in _KEY_FIELDS else shown


def _keys(raw: Mapping[str, str]) -> dict[str, KeyConfig] | None:
    """Accounts by name; a name is never the secret (plain API_KEYS entries get a derived name)."""
    keys: dict[str, KeyConfig] = {}
    secrets = _csv(raw.get("API_KEYS", ""))
    if raw.get("API_KEYS") and not secrets:
        # `API_KEYS=${K1},${K2}` with both unset: running open would accept any key and charge nothing.
        raise ConfigError("API_KEYS names no key (only commas and spaces): set comma-separated keys, or unset it")
    for position, secret in enumerate(secrets, 1):  # by position: a message never shows a key
        if UNEXPANDED.search(secret):
            # ./.env is read as written, as `docker run --env-file` reads it, and the environment is
            # what the shell or Compose made of it: a `${K1}` or `$K1` left here is a key literally named so.
            raise ConfigError(
                f"API_KEYS: key {position} holds '${{' or '$NAME': variables are not expanded in API_KEYS "
                '(set the keys themselves, or use API_KEYS_FILE, whose key = "${VAR}" is expanded)'
            )
        if (why := unsendable(secret)) is not None:
            raise ConfigError(f"API_KEYS: key {position} {why}")
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
