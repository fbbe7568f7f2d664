"""`rpc-proxy keys new NAME` and `keys list`, and `keys usage` without a shared ledger.

`keys new` prints a new secret once and appends its `[keys.NAME]` table, with the secret's sha256
only, to API_KEYS_FILE: the file never holds the secret, and a running proxy loads it on SIGHUP.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from proxy.check import redact_url
from proxy.config import ConfigError, build_settings
from proxy.config_files import _key_entry
from proxy.credits.accounts import ACCOUNT_NAME, digest
from proxy.file_trust import check_trusted
from proxy.options import MAX_CREDITS

_UNUSED_UPSTREAM = {"EVM_UPSTREAM": "http://unused.invalid"}  # the key commands need no network


def _positive(name: str, value: int | None) -> int | None:
    if value is not None and not 0 < value <= MAX_CREDITS:
        raise ConfigError(f"{name} must be a whole number from 1 to 2**53")
    return value


def _open_for_append(path: str) -> int:
    """API_KEYS_FILE opened to append (created 0600 if absent), or a ConfigError saying in one line
    why it cannot be: a directory, a directory that does not exist, no permission."""
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"API_KEYS_FILE {path} is a directory, not a file: nothing written")
    if not file.parent.is_dir():
        raise ConfigError(f"API_KEYS_FILE {path}: its directory does not exist (keys new creates no directory)")
    if file.exists():
        check_trusted("API_KEYS_FILE", file)
    try:
        # O_APPEND keeps an existing file's mode; a new one is the proxy user's alone (it names accounts).
        return os.open(file, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot open API_KEYS_FILE {path}: {exc.strerror}") from None


def key_table(name: str, secret: str, daily: int | None, per_second: int | None) -> str:
    """The TOML a new key appends (pure): its name, the secret's sha256 and its terms."""
    table = name if "." not in name else f'"{name}"'  # a dot would nest tables
    lines = [f"[keys.{table}]", f'key_sha256 = "{digest(secret)}"']
    lines += [f"daily_credits = {daily}"] if daily is not None else []
    lines += [f"credits_per_second = {per_second}"] if per_second is not None else []
    return "\n".join(lines) + "\n"


def _declared_names(text: str) -> set[str]:
    """The key names a keys file declares (older-form tables by their derived names)."""
    try:
        table = tomllib.loads(text.removeprefix("\ufeff")).get("keys", {})  # a leading BOM dropped, as serve does
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"API_KEYS_FILE is not valid TOML: {exc}") from None
    if not isinstance(table, dict):
        raise ConfigError("API_KEYS_FILE: keys must be [keys.NAME] tables")
    return {_key_entry(str(t), e)[0] for t, e in table.items()} | set(table)


def keys_new(raw: Mapping[str, str], name: str, daily: int | None, per_second: int | None) -> int:
    """Append a new key to API_KEYS_FILE (created 0600 if absent) and print its secret once."""
    path = raw.get("API_KEYS_FILE")
    if not path:
        raise ConfigError("keys new appends to API_KEYS_FILE: set it (or pass --api-keys-file)")
    if not ACCOUNT_NAME.fullmatch(name):
        raise ConfigError("a key name is 1-64 letters, digits, '_', '.' or '-'")
    _positive("--daily-credits", daily)
    _positive("--credits-per-second", per_second)
    fd = _open_for_append(path)
    secret = secrets.token_urlsafe(32)
    with os.fdopen(fd, "r+", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # two `keys new` at once: one after the other
        handle.seek(0)
        text = handle.read()
        if name in _declared_names(text):
            print(f"keys new: a key named {name} is already in {path}: nothing written", file=sys.stderr)
            return 1
        addition = ("\n" if text and not text.endswith("\n") else "") + ("\n" if text else "")
        addition += key_table(name, secret, daily, per_second)
        try:
            tomllib.loads(text.removeprefix("\ufeff") + addition)  # never leaves the file unreadable
        except tomllib.TOMLDecodeError:
            raise ConfigError(
                f"API_KEYS_FILE {path} cannot take a [keys.{name}] table after its own (keys = {{...}} as an "
                "inline table?): write its keys as [keys.NAME] tables; nothing written"
            ) from None
        handle.write(addition)
    print(secret)
    print(
        f"key {name} added to {path} (its sha256 only). The secret above is shown once: store it now. "
        "Running proxies load it on SIGHUP.",
        file=sys.stderr,
    )
    return 0


def keys_list(raw: Mapping[str, str]) -> int:
    """Every configured key's name and terms; never a secret nor its digest."""
    settings = build_settings({**_UNUSED_UPSTREAM, **raw})
    if settings.api_keys is None:
        print("no keys configured (API_KEYS, API_KEYS_FILE): the proxy runs open")
        return 0
    for name, key in sorted(settings.api_keys.items()):
        per_second = settings.credits_per_second_for(name)
        lists = [
            f"{kind}={len(getattr(key.lists, kind))}"
            for kind in ("origins", "methods", "addresses")
            if getattr(key.lists, kind)
        ]
        print(
            f"{name}  daily_credits={settings.daily_credits_for(name)}  "
            f"credits_per_second={per_second if per_second is not None else 'unlimited'}"
            + (f"  allowed: {', '.join(lists)}" if lists else "")
        )
    return 0


def charged_from_metrics(text: str) -> dict[str, float]:
    """Credits charged per key in a proxy's /metrics exposition (pure)."""
    charged: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "rpc_proxy_key_credits_charged":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    charged[sample.labels["key"]] = sample.value
    return charged


def usage_without_ledger(keys: list[str], metrics_url: str | None) -> int:
    """`keys usage` with no Redis: what a running proxy's /metrics says, or plainly that it cannot."""
    if metrics_url is None:
        print(
            "keys usage: no shared credit ledger (CREDITS_REDIS_URL or REDIS_URL is not set), so there is no "
            "day's usage to read. Pass --metrics-url http://HOST:PORT/metrics of a running proxy to see the "
            "credits it charged since it started.",
            file=sys.stderr,
        )
        return 1
    try:
        with contextlib.closing(urllib.request.urlopen(metrics_url, timeout=10)) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"keys usage: cannot read {redact_url(metrics_url)}: {type(exc).__name__}", file=sys.stderr)
        return 1
    charged = charged_from_metrics(text)
    for name in keys:
        print(f"key {name}: {int(charged.get(name, 0))} credits charged by this proxy process since it started")
    print(
        f"(from {redact_url(metrics_url)}; without Redis each process counts its own credits from zero at "
        "each start: other replicas, workers and earlier runs are not in it, nor what is left today)"
    )
    return 0
