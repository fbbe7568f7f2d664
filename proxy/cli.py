"""Command line: `rpc-proxy [serve]` and `rpc-proxy keys usage KEY`. The only reader of os.environ."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from . import __version__, logs
from .config import OPTIONS, ConfigError, Settings, build_settings

if TYPE_CHECKING:
    from .workers import WorkerContext

log = logging.getLogger("proxy")


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    for option in OPTIONS:
        common.add_argument(
            option.flag, dest=option.env, metavar="VALUE", default=argparse.SUPPRESS,
            help=f"{option.help} [env {option.env}]",
        )
    parser = argparse.ArgumentParser(
        prog="rpc-proxy", description="Caching, read-through JSON-RPC proxy for EVM and Solana nodes.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"rpc-proxy {__version__}")
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("serve", parents=[common], help="run the proxy (the default)")
    keys = commands.add_parser("keys", help="operator commands for API keys")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    usage = key_commands.add_parser("usage", parents=[common],
                                    help="credits used and left today, per key (all keys, or one)")
    usage.add_argument("key", nargs="?", help="the key's name ([keys.NAME] in API_KEYS_FILE)")
    return parser


def raw_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """Environment first, CLI flags over it."""
    raw = {o.env: environ[o.env] for o in OPTIONS if o.env in environ}
    raw.update({o.env: getattr(args, o.env) for o in OPTIONS if getattr(args, o.env, None) is not None})
    return raw


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    args = _parser().parse_args(argv)
    raw = raw_settings(args, environ)
    try:
        if args.command == "keys":
            return asyncio.run(_keys_usage(raw, args.key))
        settings = build_settings(raw)
    except ConfigError as exc:
        print(f"rpc-proxy: configuration error: {exc}", file=sys.stderr)
        return 2
    return serve(settings)


def serve(settings: Settings) -> int:
    logs.setup(settings.log_format, settings.log_level, settings.access_log)
    if settings.open_mode:
        log.warning("running open: no API_KEYS or API_KEYS_FILE set, any API key is accepted and nothing is charged")
    for net in settings.networks:
        log.info("network %s (%s): %d upstream(s)", net.name, net.family, len(net.upstreams))
    log.info("cache tiers: memory%s", " + redis" if settings.redis_url else " only (no REDIS_URL)")
    if settings.workers > 1:
        from .workers import supervise

        return supervise(settings)
    return run_server(settings, on_listening=lambda: log.info("listening on http://%s:%d", settings.host,
                                                              settings.port))


def run_server(settings: Settings, *, on_listening: Callable[[], None], worker: WorkerContext | None = None) -> int:
    """One serving process: the whole proxy (WORKERS=1), or one of the workers."""
    from . import event_loop, listeners
    from .app import LedgerStorageError, create_app

    app = create_app(settings, worker=worker)
    try:
        event_loop.run(listeners.serve(
            app, settings.host, settings.port, max_connections=settings.max_connections,
            shutdown_timeout=settings.shutdown_timeout, on_listening=on_listening, reuse_port=worker is not None,
        ), settings.event_loop)
    except OSError as exc:
        print(f"rpc-proxy: cannot listen on {settings.host}:{settings.port}: {exc.strerror}", file=sys.stderr)
        return 1
    except LedgerStorageError as exc:
        print(f"rpc-proxy: configuration error: {exc}", file=sys.stderr)
        return 2
    return 0


async def _keys_usage(raw: dict[str, str], key: str | None) -> int:
    from prometheus_client import CollectorRegistry

    from .accounts import Accounts
    from .credits import day_of
    from .leases import ledger_key, read_journals
    from .metrics import Metrics
    from .redis_link import RedisLink, RedisUnavailable, connect

    settings = build_settings({"EVM_UPSTREAM": "http://unused.invalid", **raw})
    url = settings.ledger_redis_url
    if not url:
        raise ConfigError("keys usage reads the shared ledger: set CREDITS_REDIS_URL or REDIS_URL")
    if key is None and settings.api_keys is None:
        raise ConfigError("keys usage with no KEY lists the configured keys: set API_KEYS or API_KEYS_FILE")
    if settings.api_keys is not None and key is not None and key not in settings.api_keys:
        # A key's name is what to pass; an older-form key's secret still finds its account.
        found = Accounts({name: k.sha256 for name, k in settings.api_keys.items()}).account(key)
        if found is None:
            raise ConfigError("that key name is not configured in API_KEYS or API_KEYS_FILE")
        key = found
    keys = [key] if key is not None else list(settings.api_keys or {})
    timeout = max(settings.credits_redis_timeout, 2.0)
    link = RedisLink(connect(url, timeout), timeout=timeout, metrics=Metrics(CollectorRegistry()))
    now = time.time()
    day = int(now) // 86400
    journals = read_journals(settings.credits_journal_dir)
    try:
        for name in keys:
            hash_key = ledger_key(name, day)
            entry = await link.run("credits_read", lambda c: c.hgetall(hash_key))  # noqa: B023 (awaited here)
            print(usage_line(name, settings.daily_credits_for(name), entry, journals.get(hash_key, {})))
    except RedisUnavailable:
        print("rpc-proxy: the credit ledger's redis is unreachable (CREDITS_REDIS_URL or REDIS_URL)", file=sys.stderr)
        return 1
    finally:
        await link.close()
    stamp = day_of(now)
    print(f"(UTC day {stamp[:4]}-{stamp[4:6]}-{stamp[6:]})")
    return 0


def usage_line(
    key: str, daily: int, entry: Mapping[bytes | str, bytes | str], journaled: Mapping[str, tuple[int, int]],
) -> str:
    """One key's line: usage in Redis (leases included) plus debits journaled but not yet written back."""
    fields = {(k.decode() if isinstance(k, bytes) else k): int(float(v)) for k, v in entry.items()}
    used = fields.get("used", 0)
    unflushed = sum(max(0, (c - f) - max(fields.get(f"a:{r}", 0), fields.get(f"c:{r}", 0) - fields.get(f"f:{r}", 0)))
                    for r, (c, f) in journaled.items())
    used += unflushed
    line = f"key {key}: {used} credits used, {max(daily - used, 0)} left of {daily}"
    leased = sum(max(0, v - (fields.get(f"c:{k[2:]}", 0) - fields.get(f"f:{k[2:]}", 0)))
                 for k, v in fields.items() if k.startswith("a:"))
    if leased:
        line += f"; {leased} of them leased to replicas, not yet spent"
    if unflushed:
        line += f"; {unflushed} journaled while the ledger was unreachable, not yet written back"
    return line
