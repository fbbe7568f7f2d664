"""Command line: `rpc-proxy [serve]`, `rpc-proxy check` and `rpc-proxy keys new|list|usage`. The only
reader of os.environ (and of `./.env`, the settings file under it) but for ${VAR} in the files
(config_expand.py)."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from proxy import __version__, hangup, logs
from proxy.config import OPTION_NAMES, OPTIONS, ConfigError, Settings, build_settings, doubts
from proxy.file_trust import check_trusted

log = logging.getLogger("proxy")

DOTENV = Path(".env")
# The settings `keys usage` reads: its --help lists these, not every server flag.
KEYS_USAGE_OPTIONS = (
    "REDIS_URL",
    "CREDITS_REDIS_URL",
    "CREDITS_REDIS_TIMEOUT",
    "API_KEYS",
    "API_KEYS_FILE",
    "DAILY_CREDITS",
    "CREDITS_JOURNAL_DIR",
    "LOG_FORMAT",
)
_DOTENV_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def _flags(names: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """A parent parser with the settings' flags (all, or the named ones)."""
    flags = argparse.ArgumentParser(add_help=False)
    for option in OPTIONS:
        if names is None or option.env in names:
            flags.add_argument(
                option.flag,
                dest=option.env,
                metavar="VALUE",
                default=argparse.SUPPRESS,
                help=f"{option.help} [env {option.env}]".replace("%", "%%"),  # argparse formats help with %
            )
    return flags


def _parser() -> argparse.ArgumentParser:
    common = _flags()
    parser = argparse.ArgumentParser(
        prog="rpc-proxy",
        description="Caching, read-through JSON-RPC proxy for EVM and Solana nodes.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"rpc-proxy {__version__}")
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("serve", parents=[common], help="run the proxy (the default)")
    check = commands.add_parser(
        "check",
        parents=[common],
        help="read the settings and files as serve does, try "
        "each upstream, print the effective configuration (secrets redacted)",
    )
    check.add_argument("--offline", action="store_true", help="check the settings and files only")
    keys = commands.add_parser("keys", help="operator commands for API keys")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    usage = key_commands.add_parser(
        "usage", parents=[_flags(KEYS_USAGE_OPTIONS)], help="credits used and left today, per key (all keys, or one)"
    )
    usage.add_argument("key", nargs="?", help="the key's name ([keys.NAME] in API_KEYS_FILE)")
    usage.add_argument(
        "--metrics-url",
        help="without Redis: a running proxy's /metrics URL, for the credits it charged since it started",
    )
    new = key_commands.add_parser(
        "new",
        parents=[_flags(("API_KEYS_FILE", "LOG_FORMAT"))],
        help="print a new key's secret once and append its [keys.NAME] table (its sha256) to API_KEYS_FILE",
    )
    new.add_argument("name", help="the key's name: 1-64 letters, digits, '_', '.' or '-'")
    new.add_argument("--daily-credits", type=int, help="its daily credits (default: DAILY_CREDITS)")
    new.add_argument("--credits-per-second", type=int, help="its credits-per-second limit (default: none)")
    key_commands.add_parser(
        "list", parents=[_flags(KEYS_USAGE_OPTIONS)], help="configured keys' names and terms (never their secrets)"
    )
    return parser


def raw_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """Environment first, CLI flags over it; an empty value (`NAME=`, `--flag=`) is one left unset,
    so the source below it (the environment, ./.env, the default) gives the setting."""
    raw = {o.env: environ[o.env] for o in OPTIONS if environ.get(o.env, "").strip()}
    raw.update({o.env: value for o in OPTIONS if (value := getattr(args, o.env, None)) is not None and value.strip()})
    return raw


def parse_dotenv(text: str) -> dict[str, str]:
    """A .env file: NAME=value lines (an optional `export `, optional matching quotes around the
    value), `#` comment lines and blank lines, each name once. The value is taken as written (no
    inline comments), as `docker run --env-file` takes it, so one file serves both."""
    values: dict[str, str] = {}
    first: dict[str, int] = {}
    # A leading byte-order mark (an editor's UTF-8 "with BOM"), which `docker run --env-file` drops too.
    # Lines end at \n (and \r\n) alone, as Docker's reader splits them: splitlines() also splits at
    # \x0c, \x85 or U+2028, which would make one Docker value two settings here.
    for number, raw in enumerate(text.removeprefix("\ufeff").split("\n"), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = _DOTENV_LINE.match(stripped)
        if match is None:  # the line is not echoed: it may hold a secret
            spaced = " (no spaces around =: docker run --env-file reads the name with them)" if " =" in stripped else ""
            raise ConfigError(f".env line {number} is not NAME=value{spaced}")
        name, value = match.groups()
        if name in first:  # the last would win, silently (`API_KEYS=` appended would run it open)
            raise ConfigError(f".env lines {first[name]} and {number} both set {name}: give each setting once")
        first[name] = number
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name] = value
    return values


def dotenv_settings(path: Path) -> tuple[dict[str, str], list[str]]:
    """The settings a .env file sets, and the names in it that are no setting (ignored)."""
    check_trusted(".env", path.absolute())
    try:
        values = parse_dotenv(path.read_text())
    except FileNotFoundError:
        return {}, []
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    unknown = sorted(set(values) - OPTION_NAMES)
    return {k: v for k, v in values.items() if k in OPTION_NAMES}, [next(iter(misspelt([n])), n) for n in unknown]


def misspelt(names: Iterable[str]) -> list[str]:
    """The names among `names` (the environment's) that are no setting but one's near twin
    (`API_KEY` for API_KEYS), each as `NAME (SETTING?)`: a typo there would leave the setting unset
    (a misspelt API_KEYS runs the proxy open). Names only, never values."""
    found = []
    for name in sorted(names):
        if name not in OPTION_NAMES and (near := difflib.get_close_matches(name.upper(), OPTION_NAMES, 1, 0.85)):
            found.append(f"{name} ({near[0]}?)")
    return found


def quoted(environ: Mapping[str, str]) -> list[str]:
    """The settings in `environ` (the environment's) whose value is wrapped in matching quotes:
    `docker run --env-file` keeps a `.env` line's quotes as part of the value (compose's `env_file:`
    and this proxy's own `.env` reading drop them), so `API_KEYS="k"` became the key `"k"`, quotes
    included, and every client got 401. Names only, never values."""
    found = []
    for name, value in environ.items():
        text = value.strip()
        if name in OPTION_NAMES and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            found.append(name)
    return sorted(found)


def _error(raw: Mapping[str, str], message: str) -> None:
    """One error line in LOG_FORMAT (text when LOG_FORMAT itself is what is wrong)."""
    fmt = "json" if raw.get("LOG_FORMAT", "").strip().lower() == "json" else "text"
    print(logs.line(fmt, logging.ERROR, message), file=sys.stderr)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """`environ` given (tests): exactly that environment. Otherwise the process environment over
    the settings in ./.env (a variable set in the environment wins; a CLI flag wins over both)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    from_dotenv: dict[str, str] = {}
    unknown: list[str] = []
    near: list[str] = []
    wrapped: list[str] = []
    if environ is None:
        near, wrapped = misspelt(os.environ), quoted(os.environ)
        try:
            from_dotenv, unknown = dotenv_settings(DOTENV)
        except ConfigError as exc:
            _error(os.environ, f"configuration error: {exc}")
            return 2
        environ = {**from_dotenv, **{name: value for name, value in os.environ.items() if value.strip()}}
    raw = raw_settings(args, environ)
    try:
        if args.command == "keys":
            from proxy import keys_command

            if args.keys_command == "new":
                return keys_command.keys_new(raw, args.name, args.daily_credits, args.credits_per_second)
            if args.keys_command == "list":
                return keys_command.keys_list(raw)
            return asyncio.run(_keys_usage(raw, args.key, args.metrics_url))
        settings = build_settings(raw)
        _check_journal_dir(settings)
        _rehearse(settings)
    except ConfigError as exc:
        # A quoted value (docker run --env-file keeps quotes) is refused first as the setting's own error.
        hint = f" (wrapped in quotes, taken as part of the value: {', '.join(wrapped)})" if wrapped else ""
        _error(raw, f"configuration error: {exc}{hint}")
        return 2
    if args.command == "check":
        from proxy.check import run_check

        return run_check(settings, offline=args.offline, ignored=unknown, misspelt=near, quoted=wrapped)
    if doubtful := doubts(settings):
        logs.setup(settings.log_format, settings.log_level, settings.access_log)
        for line in doubtful:
            log.warning("%s", line)
    if near:
        logs.setup(settings.log_format, settings.log_level, settings.access_log)
        log.warning("in the environment, not settings (misspelt?), ignored: %s", ", ".join(near))
    if wrapped:
        logs.setup(settings.log_format, settings.log_level, settings.access_log)
        log.warning("in the environment, values wrapped in quotes, taken with them: %s", ", ".join(wrapped))
    if from_dotenv or unknown:
        logs.setup(settings.log_format, settings.log_level, settings.access_log)
        over = {**os.environ, **vars(args)}  # what the environment and the flags set (empty: unset)
        used = sorted(k for k in from_dotenv if from_dotenv[k].strip() and not str(over.get(k) or "").strip())
        log.info("settings from %s: %s (the environment and flags override it)", DOTENV, ", ".join(used) or "none")
        if unknown:
            log.warning("ignored in %s, not settings: %s", DOTENV, ", ".join(unknown))
    return serve(settings)


def _check_journal_dir(settings: Settings) -> None:
    """A journal directory that cannot be written would first fail in an outage: refuse it at start."""
    from proxy.credits.journal import journal_dir_problem

    problem = settings.credits_journal_dir and journal_dir_problem(settings.credits_journal_dir)
    if problem:
        raise ConfigError(problem)


def _rehearse(settings: Settings) -> None:
    """The networks' routing worked out as a reload would (network_set.rehearse), before serving."""
    from proxy.network_set import rehearse

    rehearse(settings.networks)


def serve(settings: Settings) -> int:
    hangup.hold()  # held already (proxy.__main__.main); again for a caller of cli.main itself
    logs.setup(settings.log_format, settings.log_level, settings.access_log)
    if settings.open_mode:
        log.warning("running open: no API_KEYS or API_KEYS_FILE set, any API key is accepted and nothing is charged")
    for net in settings.networks:
        log.info("network %s (%s): %d upstream(s)", net.name, net.family, len(net.upstreams))
    log.info("cache tiers: memory%s", " + redis" if settings.redis_url else " only (no REDIS_URL)")
    if settings.workers > 1:
        from proxy.supervisor import supervise

        return supervise(settings)
    from proxy.server import run_server  # the app's imports are not needed by --help or keys usage

    return run_server(
        settings, on_listening=lambda: log.info("listening on http://%s:%d", settings.host, settings.port)
    )


async def _keys_usage(raw: dict[str, str], key: str | None, metrics_url: str | None = None) -> int:
    from prometheus_client import CollectorRegistry

    from proxy.credits.accounts import Accounts
    from proxy.credits.journal import read_journals
    from proxy.credits.lease_exchange import ledger_key
    from proxy.credits.ledger import day_of
    from proxy.metrics import Metrics
    from proxy.redis_link import RedisLink, RedisUnavailable, connect

    settings = build_settings({"EVM_UPSTREAM": "http://unused.invalid", **raw})
    logs.setup(settings.log_format, settings.log_level, False)
    logging.getLogger("proxy.redis").setLevel(logging.ERROR)  # an unreachable ledger is said in one line below
    if key is None and settings.api_keys is None:
        raise ConfigError("keys usage with no KEY lists the configured keys: set API_KEYS or API_KEYS_FILE")
    if settings.api_keys is not None and key is not None and key not in settings.api_keys:
        # A key's name is what to pass; an older-form key's secret still finds its account.
        found = Accounts({name: k.sha256 for name, k in settings.api_keys.items()}).account(key)
        if found is None:
            raise ConfigError("that key name is not configured in API_KEYS or API_KEYS_FILE")
        key = found
    keys = [key] if key is not None else list(settings.api_keys or {})
    url = settings.ledger_redis_url
    if not url:
        from proxy.keys_command import usage_without_ledger

        return usage_without_ledger(keys, metrics_url)
    timeout = max(settings.credits_redis_timeout, 2.0)
    link = RedisLink(connect(url, timeout), timeout=timeout, metrics=Metrics(CollectorRegistry()))
    now = time.time()
    day = int(now) // 86400
    journals = read_journals(settings.credits_journal_dir)
    entries: dict[str, Mapping[bytes | str, bytes | str]] = {}
    try:
        for name in keys:
            hash_key = ledger_key(name, day)
            entries[name] = await link.run("credits_read", lambda c: c.hgetall(hash_key))  # noqa: B023 (awaited here)
    except RedisUnavailable:
        where = (
            f"only the debits journaled in CREDITS_JOURNAL_DIR {settings.credits_journal_dir} follow"
            if settings.credits_journal_dir
            else "set CREDITS_JOURNAL_DIR to see journaled debits"
        )
        _error(raw, f"the credit ledger's redis is unreachable (CREDITS_REDIS_URL or REDIS_URL): {where}")
        if settings.credits_journal_dir:
            for name in keys:
                known = sum(max(0, c - f) for c, f in journals.get(ledger_key(name, day), {}).values())
                print(f"key {name}: at least {known} credits used (journaled while the ledger was unreachable)")
        return 1
    finally:
        await link.close()
    for name in keys:
        journaled = journals.get(ledger_key(name, day), {})
        print(usage_line(name, settings.daily_credits_for(name), entries[name], journaled))
    stamp = day_of(now)
    print(f"(UTC day {stamp[:4]}-{stamp[4:6]}-{stamp[6:]})")
    return 0


def usage_line(
    key: str,
    daily: int,
    entry: Mapping[bytes | str, bytes | str],
    journaled: Mapping[str, tuple[int, int]],
) -> str:
    """One key's line (README "Limits and credits"): spent (what to bill: debits less refunds, journaled
    ones included), left, leased to replicas and not spent, journaled and not yet in Redis."""
    fields = {(k.decode() if isinstance(k, bytes) else k): int(float(v)) for k, v in entry.items()}

    def net(replica: str) -> int:
        return fields.get(f"c:{replica}", 0) - fields.get(f"f:{replica}", 0)

    def spent_by(replica: str) -> int:  # as its journal says, if that is further than Redis
        c, f = journaled.get(replica, (0, 0))
        return max(net(replica), c - f)

    unflushed = sum(max(0, (c - f) - net(r)) for r, (c, f) in journaled.items())
    spent = sum(net(k[2:]) for k in fields if k.startswith("c:")) + unflushed
    leased = sum(max(0, v - spent_by(k[2:])) for k, v in fields.items() if k.startswith("a:"))
    return (
        f"key {key}: {spent} credits used, {max(daily - spent, 0)} left of {daily} (spent: what to bill); "
        f"{leased} leased to replicas and not spent; {unflushed} journaled and not yet in the ledger"
    )
