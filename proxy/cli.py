"""Command line: `rpc-proxy [serve]` and `rpc-proxy keys usage KEY`. The only reader of os.environ."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence

from . import __version__, logs
from .config import OPTIONS, ConfigError, Settings, build_settings

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
    usage = key_commands.add_parser("usage", parents=[common], help="credits used and left today (from Redis)")
    usage.add_argument("key", help="the key's name ([keys.NAME] in API_KEYS_FILE)")
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
    from . import listeners
    from .app import create_app

    logs.setup(settings.log_format, settings.log_level, settings.access_log)
    if settings.open_mode:
        log.warning("running open: no API_KEYS or API_KEYS_FILE set, any API key is accepted and nothing is charged")
    for net in settings.networks:
        log.info("network %s (%s): %d upstream(s)", net.name, net.family, len(net.upstreams))
    log.info("cache tiers: memory%s", " + redis" if settings.redis_url else " only (no REDIS_URL)")
    app = create_app(settings)
    try:
        asyncio.run(listeners.serve(
            app, settings.host, settings.port, max_connections=settings.max_connections,
            shutdown_timeout=settings.shutdown_timeout,
            on_listening=lambda: log.info("listening on http://%s:%d", settings.host, settings.port),
        ))
    except OSError as exc:
        print(f"rpc-proxy: cannot listen on {settings.host}:{settings.port}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


async def _keys_usage(raw: dict[str, str], key: str) -> int:
    from prometheus_client import CollectorRegistry

    from .accounts import Accounts
    from .credits import RedisLedger, day_of
    from .metrics import Metrics
    from .redis_link import RedisLink, RedisUnavailable, connect

    settings = build_settings({"EVM_UPSTREAM": "http://unused.invalid", **raw})
    if not settings.redis_url:
        raise ConfigError("keys usage reads the shared ledger: set REDIS_URL")
    account = key
    if settings.api_keys is not None and key not in settings.api_keys:
        # A key's name is what to pass; an older-form key's secret still finds its account.
        found = Accounts({name: k.sha256 for name, k in settings.api_keys.items()}).account(key)
        if found is None:
            raise ConfigError("that key name is not configured in API_KEYS or API_KEYS_FILE")
        account = found
    daily = settings.daily_credits_for(account)
    link = RedisLink(connect(settings.redis_url, max(settings.redis_timeout, 2.0)),
                     timeout=max(settings.redis_timeout, 2.0), metrics=Metrics(CollectorRegistry()))
    now = time.time()
    try:
        used = await RedisLedger(link).used(account, now=now)
    except RedisUnavailable:
        print("rpc-proxy: redis is unreachable at REDIS_URL", file=sys.stderr)
        return 1
    finally:
        await link.close()
    day = day_of(now)
    print(f"key {key}: {used} credits used, {max(daily - used, 0)} left of {daily} "
          f"(UTC day {day[:4]}-{day[4:6]}-{day[6:]})")
    return 0
