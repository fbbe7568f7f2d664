"""Settings refused at start (exit 2, one line naming the setting and what is allowed), as
`rpc-proxy check` refuses them: values that would run open, flap, overflow or collide."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.config import ConfigError, build_settings
from proxy.options import _SCALARS, _positive_int, _zero_or_positive_int
from tests.test_cli_and_logs import clean_env

UPSTREAM = {"EVM_UPSTREAM": "http://127.0.0.1:1"}


def refused(**raw: str) -> str:
    """The one-line ConfigError the settings raise."""
    with pytest.raises(ConfigError) as caught:
        build_settings({**UPSTREAM, **raw})
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("value", [",", " , ", ",,", " "])
def test_api_keys_that_name_no_key_are_refused_never_open(value: str) -> None:
    """Rule: a non-empty API_KEYS that names no key is a configuration error, not open mode."""
    assert "API_KEYS names no key" in refused(API_KEYS=value)


def test_an_empty_api_keys_counts_as_unset() -> None:
    """Rule: `API_KEYS=` is unset, as every empty value is: the proxy runs open and says so."""
    assert build_settings({**UPSTREAM, "API_KEYS": ""}).open_mode


def test_check_refuses_api_keys_naming_no_key_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """Rule: `rpc-proxy check` refuses what serve refuses (the same build_settings): exit 2, one line."""
    assert main(["check", "--offline"], environ={**UPSTREAM, "API_KEYS": " , "}) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "configuration error: API_KEYS names no key" in line


@pytest.mark.parametrize(
    "raw",
    [
        {"HEAD_STALE_AFTER": "1", "HEAD_POLL_INTERVAL": "2"},
        {"HEAD_STALE_AFTER": "2", "HEAD_POLL_INTERVAL": "2"},
        {"HEAD_STALE_AFTER": "0.001"},
    ],
)
def test_a_head_stale_bound_within_one_poll_interval_is_refused(raw: dict[str, str]) -> None:
    """Rule: HEAD_STALE_AFTER must exceed HEAD_POLL_INTERVAL: a head is stale only after a missed poll."""
    assert "HEAD_STALE_AFTER must be greater than HEAD_POLL_INTERVAL" in refused(**raw)


def test_a_head_stale_bound_past_one_poll_interval_is_kept() -> None:
    settings = build_settings({**UPSTREAM, "HEAD_STALE_AFTER": "2.5", "HEAD_POLL_INTERVAL": "2"})
    assert settings.head_stale_bound == 2.5


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"PROXY_PORT": "9000", "METRICS_PORT": "9000"}, "METRICS_PORT 9000 is also PROXY_PORT"),
        ({"ADMIN_PORT": "8545", "ADMIN_TOKEN": "Adm1n-T0ken-For-Tests"}, "ADMIN_PORT 8545 is also PROXY_PORT"),
        (
            {"METRICS_PORT": "9100", "ADMIN_PORT": "9100", "ADMIN_TOKEN": "Adm1n-T0ken-For-Tests"},
            "ADMIN_PORT 9100 is also METRICS_PORT",
        ),
        ({"PROXY_HOST": "0.0.0.0", "METRICS_PORT": "8545"}, "METRICS_PORT 8545 is also PROXY_PORT"),
        ({"PROXY_HOST": "localhost", "METRICS_PORT": "8545"}, "METRICS_PORT 8545 is also PROXY_PORT"),
        # One address spelled two ways (check passed them; serve then failed "Address already in use").
        ({"METRICS_HOST": "127.1", "METRICS_PORT": "8545"}, "METRICS_PORT 8545 is also PROXY_PORT"),
        ({"PROXY_HOST": "::1", "METRICS_HOST": "0:0:0:0:0:0:0:1", "METRICS_PORT": "8545"}, "is also PROXY_PORT"),
        ({"METRICS_HOST": "0", "METRICS_PORT": "8545"}, "METRICS_PORT 8545 is also PROXY_PORT"),
    ],
)
def test_two_listeners_on_one_port_of_one_host_are_refused(raw: dict[str, str], fragment: str) -> None:
    """Rule: METRICS_PORT and ADMIN_PORT each need a port of their own on their host (a wildcard host: any;
    a numeric host in any of its spellings)."""
    assert fragment in refused(**raw)


def test_one_port_on_two_distinct_hosts_is_kept() -> None:
    settings = build_settings({**UPSTREAM, "METRICS_HOST": "127.0.0.2", "METRICS_PORT": "8545"})
    assert [str(listener) for listener in settings.listeners] == [
        "127.0.0.1:8545 (PROXY_PORT)",
        "127.0.0.2:8545 (METRICS_PORT)",
    ]


def test_a_key_that_is_a_dot_segment_is_refused() -> None:
    """Rule: `/v3/.` and `/v3/..` are dot segments a URL parser removes (WHATWG, RFC 3986 5.2.4)."""
    for key in (".", ".."):
        assert "API_KEYS: key 2 holds" in refused(API_KEYS=f"sk-first-key,{key}")


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("GETLOGS_CHUNK_BLOCKS", "1_0"),
        ("UPSTREAM_TIMEOUT", "1_0"),
        ("CACHE_KEY_BYTES_PER_MINUTE", "0_0"),
        ("MAX_BATCH_SIZE", "\uff11\uff10"),
        ("HEAD_POLL_INTERVAL", "\uff12"),
    ],
)
def test_a_number_with_underscores_is_refused(setting: str, value: str) -> None:
    """Rule: Python's int() and float() read 1_0 as 10 and fullwidth digits as ASCII ones; no setting
    is written so (a typo, not ten)."""
    assert f"{setting} must be" in refused(**{setting: value})


@pytest.mark.parametrize("value", ["0", "0.0", "0.00", "-0", "0e0"])
def test_a_zero_written_any_way_disables_where_zero_is_allowed(value: str) -> None:
    """Rule: settings documented as "0 disables" take any number equal to 0."""
    assert build_settings({**UPSTREAM, "COALESCE_WAIT": value, "HEAD_CATCH_UP_WAIT": value}).coalesce_wait == 0
    whole = {"GETLOGS_CHUNK_BLOCKS": value, "MAX_CONNECTIONS_PER_IP": value, "DEFAULT_CREDITS": value}
    settings = build_settings({**UPSTREAM, **whole})  # whole-number settings too
    assert (settings.getlogs_chunk_blocks, settings.max_connections_per_ip, settings.default_credits) == (0, 0, 0)


@pytest.mark.parametrize(
    "setting",
    [
        "MAX_CONNECTIONS_PER_IP",
        "WS_MAX_CONNECTIONS_PER_KEY",
        "UPSTREAM_KEY_CONCURRENCY",
        "MAX_CALLS_IN_FLIGHT_PER_KEY",
        "COMPRESS_MIN_BYTES",
        "DEFAULT_CREDITS",
        "COALESCE_WAIT",
    ],
)
def test_a_negative_where_zero_is_allowed_says_0_or_greater(setting: str) -> None:
    """Rule: the refusal of a setting that takes 0 says "0 or greater", not "greater than 0"."""
    assert f"{setting} must be 0 or greater, got '-1'" in refused(**{setting: "-1"})


@pytest.mark.parametrize(
    "setting", ["UPSTREAM_TIMEOUT", "HEAD_POLL_INTERVAL", "REDIS_TIMEOUT", "COALESCE_WAIT", "WS_IDLE_TIMEOUT"]
)
@pytest.mark.parametrize("value", ["1e300", "86401", "inf"])
def test_durations_are_at_most_one_day(setting: str, value: str) -> None:
    """Rule: a duration setting is at most 86400 seconds (a huge timeout overflows, a huge interval never fires)."""
    assert f"{setting} must be at most 86400 seconds (one day)" in refused(**{setting: value})


def test_a_duration_of_one_day_is_kept() -> None:
    assert build_settings({**UPSTREAM, "UPSTREAM_TIMEOUT": "86400"}).upstream_timeout == 86400


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("DAILY_CREDITS", "99999999999999999999999999"),
        ("CREDITS_PER_SECOND", str(2**53 + 1)),
        ("CREDITS_LEASE_MAX", str(2**53 + 1)),
        ("DEFAULT_CREDITS", str(2**53 + 1)),
        ("SUBSCRIPTION_CREDITS", f"logs={2**53 + 1}"),
    ],
)
def test_credits_are_at_most_2_to_the_53(setting: str, value: str) -> None:
    """Rule: credits are counted as doubles in Redis: every credit setting is at most 2**53."""
    assert "must be at most 2**53" in refused(**{setting: value})


WHOLE_NUMBER_SETTINGS = sorted(
    name for name, (_, parse) in _SCALARS.items() if parse in (_positive_int, _zero_or_positive_int)
)


@pytest.mark.parametrize("setting", WHOLE_NUMBER_SETTINGS)
def test_every_whole_number_setting_is_at_most_2_to_the_53(setting: str) -> None:
    """Rule: a count or size setting is at most 2**53: each is handed on as a C integer somewhere."""
    assert len(WHOLE_NUMBER_SETTINGS) > 20
    assert f"{setting} must be at most 2**53, got '{2**64}'" in refused(**{setting: str(2**64)})


def test_workers_are_at_most_1024() -> None:
    """Rule: WORKERS is at most 1024 (auto too): WORKERS=2**53 passed `check`, and `serve` hung
    building a slot per worker (an outside attack)."""
    assert "WORKERS must be at most 1024 (or auto), got '1025'" in refused(WORKERS="1025")
    assert "WORKERS must be at most 1024" in refused(WORKERS=str(2**53))
    assert build_settings({**UPSTREAM, "WORKERS": "1024"}).workers == 1024
    assert 1 <= build_settings({**UPSTREAM, "WORKERS": "auto"}).workers <= 1024


@pytest.mark.parametrize("setting", ["WS_MAX_MESSAGE_BYTES", "MAX_RESPONSE_BYTES"])
def test_a_websocket_messages_bound_is_at_most_2_to_the_31(setting: str) -> None:
    """Rule: the bounds aiohttp's WebSocket reader takes (ours, and an upstream WebSocket's) are at
    most 2**31: WS_MAX_MESSAGE_BYTES=2**64 passed `check`, then every WebSocket closed at once with an
    OverflowError and a traceback (an outside attack)."""
    assert f"{setting} must be at most 2**31" in refused(**{setting: str(2**31 + 1)})
    assert getattr(build_settings({**UPSTREAM, setting: str(2**31)}), setting.lower()) == 2**31


def test_check_refuses_a_ws_max_message_bytes_past_its_bound_with_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check", "--offline"],
        env=clean_env(**UPSTREAM, WS_MAX_MESSAGE_BYTES=str(2**64)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "WS_MAX_MESSAGE_BYTES must be at most 2**31" in result.stderr


@pytest.mark.parametrize(
    "value",
    [
        "app.example",
        "garbage",
        "None",
        "5,6",
        "https://ok.example,app.example",
        "https://a.example:443",  # the default port, which browsers leave out
        "http://a.example:80",
        "https://*.a.example",
        "http://a.example:99999",
        "https://a.example:0",
        "https://user@a.example",
        "https://a.example?x",
        "https://a.example#",
        "https://a..example",
        "https://-a.example",
        "https://a.example/path",
        ",",  # names no origin: no page allowed, where an empty value (unset) is "*"
        " , ",
    ],
)
def test_cors_origins_that_no_browser_sends_are_refused(value: str) -> None:
    """Rule: CORS_ALLOW_ORIGINS takes `*` or origins as browsers send them (scheme://host[:port]), as
    a keys file's allowed_origins does: `app.example` never matched, and no page could call the proxy."""
    assert "CORS_ALLOW_ORIGINS must be * or origins such as https://app.example" in refused(CORS_ALLOW_ORIGINS=value)


def test_cors_origins_as_browsers_send_them_are_kept() -> None:
    kept = "https://app.example, http://localhost:3000/, *, http://[::1]:8080, chrome-extension://abcdef"
    settings = build_settings({**UPSTREAM, "CORS_ALLOW_ORIGINS": kept})
    assert settings.cors_allow_origins == (
        "https://app.example",
        "http://localhost:3000/",
        "*",
        "http://[::1]:8080",
        "chrome-extension://abcdef",
    )


def test_a_keys_file_daily_credits_past_2_to_the_53_are_refused(tmp_path: Path) -> None:
    """Rule: a keys file's daily_credits and credits_per_second are at most 2**53, as `keys new` says."""
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[keys.alice]\nkey = "s3cret-alice"\ndaily_credits = {2**53 + 1}\n')
    assert "daily_credits must be a whole number from 1 to 2**53" in refused(API_KEYS_FILE=str(keys))
    keys.write_text(f'[keys.alice]\nkey = "s3cret-alice"\ndaily_credits = {2**53}\n')
    assert build_settings({**UPSTREAM, "API_KEYS_FILE": str(keys)}).daily_credits_for("alice") == 2**53


@pytest.mark.parametrize("value", ["newheads=0", "log=10", "blocks=5"])
def test_an_unknown_subscription_credits_kind_is_refused_naming_the_known_ones(value: str) -> None:
    """Rule: SUBSCRIPTION_CREDITS prices known kinds only: a misspelt one would silently price nothing."""
    message = refused(SUBSCRIPTION_CREDITS=value)
    assert "SUBSCRIPTION_CREDITS: unknown kind" in message and "newHeads" in message and "slotSubscribe" in message


def test_solana_and_syncing_kinds_are_priced() -> None:
    settings = build_settings({**UPSTREAM, "SUBSCRIPTION_CREDITS": "slotSubscribe=10,syncing=1,other=0"})
    assert settings.subscription_credits["slotSubscribe"] == 10 and settings.subscription_credits["other"] == 0


@pytest.mark.parametrize("upstreams", ["[]", '["wss://node.example/ws"]'])
def test_a_network_with_no_http_upstream_says_so(upstreams: str, tmp_path: Path) -> None:
    """Rule: a NETWORKS_FILE network with no http(s) upstream is named as such, not as a confirm_immutable excess."""
    networks = tmp_path / "networks.toml"
    networks.write_text(f'[networks.main]\nfamily = "evm"\nupstreams = {upstreams}\n')
    message = refused(NETWORKS_FILE=str(networks))
    assert "network 'main': no http(s) upstream" in message and "confirm_immutable" not in message


def test_a_host_claimed_by_two_networks_is_refused_naming_both(tmp_path: Path) -> None:
    """Rule: a Host header routes to one network: two networks declaring it is no silent last-wins."""
    networks = tmp_path / "networks.toml"
    table = '[networks.{}]\nfamily = "evm"\nupstreams = ["http://127.0.0.1:1"]\nhosts = ["{}"]\n'
    networks.write_text(table.format("one", "rpc.example") + table.format("two", "RPC.example"))
    assert "NETWORKS_FILE: host 'rpc.example' is claimed by networks 'one' and 'two'" in refused(
        NETWORKS_FILE=str(networks)
    )  # the file named: a NETWORKS_FILE error said only "host ... is claimed" (an outside attack)


def test_a_file_network_named_as_an_environment_one_names_the_setting_it_clashes_with(tmp_path: Path) -> None:
    # "network 'evm' is declared twice" of a file that declares it once: the other is EVM_UPSTREAM's.
    networks = tmp_path / "networks.toml"
    networks.write_text('[networks.evm]\nfamily = "evm"\nupstreams = ["http://127.0.0.1:1"]\n')
    assert "network 'evm' is declared twice: by EVM_UPSTREAM and in NETWORKS_FILE" in refused(
        NETWORKS_FILE=str(networks), EVM_UPSTREAM="http://127.0.0.1:2"
    )


@pytest.mark.parametrize(
    ("written", "normal"),
    [
        ("::1", "[::1]"),
        ("[0:0:0:0:0:0:0:1]", "[::1]"),
        ("[::FFFF:7F00:1]", "[::ffff:7f00:1]"),
        ("W.Example.", "w.example"),
        ("v.example", "v.example"),
        ("bücher.example", "xn--bcher-kva.example"),
        ("BÜCHER.Example.", "xn--bcher-kva.example"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
    ],
)
def test_a_host_is_kept_in_the_one_form_routing_compares(written: str, normal: str, tmp_path: Path) -> None:
    """Rule: `hosts` entries are normalised as Host headers are (host_names.py): lower-case, one trailing
    dot dropped, an IPv6 address bracketed and canonical, a Unicode name as its IDNA A-label (what clients
    send); a bare IPv6 address is no "port"."""
    networks = tmp_path / "networks.toml"
    networks.write_text(f'[networks.main]\nfamily = "evm"\nupstreams = ["http://127.0.0.1:1"]\nhosts = ["{written}"]\n')
    assert build_settings({"NETWORKS_FILE": str(networks)}).networks[0].hosts == (normal,)


@pytest.mark.parametrize(("one", "two"), [("x.example.", "x.example"), ("[::1]", "::1"), ("[0::1]", "[::1]")])
def test_one_host_written_two_ways_is_claimed_once(one: str, two: str, tmp_path: Path) -> None:
    """Rule: two networks cannot claim one host by writing it differently: compared once normalised."""
    networks = tmp_path / "networks.toml"
    table = '[networks.{}]\nfamily = "evm"\nupstreams = ["http://127.0.0.1:1"]\nhosts = ["{}"]\n'
    networks.write_text(table.format("one", one) + table.format("two", two))
    assert "is claimed by networks 'one' and 'two'" in refused(NETWORKS_FILE=str(networks))


@pytest.mark.parametrize(
    ("host", "why"),
    [
        ("https://rpc.example", "is a URL"),
        ("rpc.example/v1", "is a URL"),
        ("rpc.example:8545", "has a port"),
        ("[::1]:8545", "has a port"),
        ("[::1", "is not a host name"),
        ("[nope]", "is not a host name"),
        (".", "is not a host name"),
        ("fe80::1%eth0", "is not a host name a Host header can carry"),
        ("[fe80::1%25eth0]", "is not a host name a Host header can carry"),
        ("user@u.example", "is not a host name a Host header can carry"),
        ("a b.example", "is not a host name a Host header can carry"),
        ("a,b.example", "is not a host name a Host header can carry"),
        ("bü..example", "is not a host name a Host header can carry"),
        ("*.v.example", "is a wildcard"),
    ],
)
def test_a_host_that_no_host_header_can_match_is_refused(host: str, why: str, tmp_path: Path) -> None:
    """Rule: `hosts` holds Host header names, matched without the port: a URL or a port never matches,
    nor a name the front refuses in a Host field (userinfo, an IPv6 zone id, spaces) or a wildcard."""
    networks = tmp_path / "networks.toml"
    networks.write_text(f'[networks.main]\nfamily = "evm"\nupstreams = ["http://127.0.0.1:1"]\nhosts = ["{host}"]\n')
    message = refused(NETWORKS_FILE=str(networks))
    assert f"hosts entry {host!r} {why}" in message, message


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ('upstreams = [{url = "http://127.0.0.1:1", max_rps = inf}]', "networks.main.upstreams[0].max_rps"),
        ('upstreams = [{url = "http://127.0.0.1:1", max_units_per_second = 1e400}]', "max_units_per_second"),
        ('upstreams = [{url = "http://127.0.0.1:1", weight = inf}]', "networks.main.upstreams[0].weight"),
        ('upstreams = ["http://127.0.0.1:1"]\nhedge_after_ms = nan', "networks.main.hedge_after_ms"),
    ],
)
def test_a_number_in_a_networks_file_must_be_finite(entry: str, field: str, tmp_path: Path) -> None:
    """Rule: inf, nan and 1e400 (read as inf) are no limit, weight or delay: refused naming the field."""
    networks = tmp_path / "networks.toml"
    networks.write_text(f'[networks.main]\nfamily = "evm"\n{entry}\n')
    message = refused(NETWORKS_FILE=str(networks))
    assert field in message and "must be a finite number" in message, message
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check", "--offline"],
        env=clean_env(NETWORKS_FILE=str(networks)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "must be a finite number" in result.stderr, result.stderr


HUGE = "1" + "0" * 400  # a TOML integer no float holds


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ('upstreams = [{url = "http://127.0.0.1:1", max_rps = 1e-320}]', "max_rps"),
        (f'upstreams = [{{url = "http://127.0.0.1:1", max_rps = {HUGE}}}]', "max_rps"),
        ('upstreams = [{url = "http://127.0.0.1:1", max_units_per_second = 5e-324}]', "max_units_per_second"),
        (f'upstreams = [{{url = "http://127.0.0.1:1", weight = {HUGE}}}]', "weight"),
        (f'upstreams = ["http://127.0.0.1:1"]\nhedge_after_ms = {HUGE}', "hedge_after_ms"),
        (f'upstreams = ["http://127.0.0.1:1"]\nfinality_depth = {HUGE}', "finality_depth"),
        (f'upstreams = [{{url = "http://127.0.0.1:1", recent_blocks = {HUGE}}}]', "recent_blocks"),
    ],
)
def test_a_number_in_a_networks_file_must_lie_in_its_range(entry: str, field: str, tmp_path: Path) -> None:
    """Rule: every number in NETWORKS_FILE has a range (config_numbers.RANGES): one past it, which would
    overflow where it is applied, is refused by serve and check alike naming the field, no traceback."""
    networks = tmp_path / "networks.toml"
    networks.write_text(f'[networks.main]\nfamily = "evm"\n{entry}\n')
    message = refused(NETWORKS_FILE=str(networks))
    assert f"{field} must be a positive" in message and HUGE not in message, message
    for command in (["check", "--offline"], ["serve"]):
        result = subprocess.run(
            [sys.executable, "-m", "proxy", *command],
            env=clean_env(NETWORKS_FILE=str(networks), PROXY_PORT="63977"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2 and f"{field} must be a positive" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("setting", "value", "floor"),
    [
        ("HEAD_POLL_INTERVAL", "1e-9", "0.05"),
        ("HEAD_POLL_INTERVAL", "0.049", "0.05"),
        ("IDENTITY_CHECK_INTERVAL", "1e-9", "1"),
        ("IDENTITY_CHECK_INTERVAL", "0.5", "1"),
    ],
)
def test_a_poll_interval_under_its_floor_is_refused(setting: str, value: str, floor: str) -> None:
    """Rule: a poll interval has a floor: a tiny one would ask the nodes back to back, a hot loop."""
    assert f"{setting} must be at least {floor} seconds" in refused(**{setting: value})


def test_a_poll_interval_at_its_floor_is_kept() -> None:
    settings = build_settings({**UPSTREAM, "HEAD_POLL_INTERVAL": "0.05", "IDENTITY_CHECK_INTERVAL": "1"})
    assert (settings.head_poll_interval, settings.identity_check_interval) == (0.05, 1.0)


@pytest.mark.parametrize("value", ["newHeads=5,newHeads=9", "logs=1, subscribe=2 ,logs=1"])
def test_a_subscription_credits_kind_given_twice_is_refused_naming_it(value: str) -> None:
    """Rule: each SUBSCRIPTION_CREDITS kind is priced once: with two, the last won silently."""
    kind = value.partition("=")[0]
    assert f"SUBSCRIPTION_CREDITS: {kind} is given twice" in refused(SUBSCRIPTION_CREDITS=value)


# Zero-width space, BOM, tab, space, no-break space, bell, line separator; the Hangul filler, a
# combining grapheme joiner, a variation selector and the braille blank (letters and marks, yet
# invisible); any other character outside ASCII.
HIDDEN = ["\u200b", "\ufeff", "\t", " ", "\u00a0", "\x07", "\u2028", "\u3164", "\u034f", "\ufe0f", "\u2800", "\u00e9"]


@pytest.mark.parametrize("hidden", HIDDEN)
def test_an_api_key_with_whitespace_control_or_invisible_characters_is_refused_by_position(hidden: str) -> None:
    """Rule: a key no client can type or paste reliably is refused; the message names its position, never it."""
    message = refused(API_KEYS=f"sk-first-key,sk-SECRET{hidden}123")
    assert "API_KEYS: key 2 contains whitespace, a control or an invisible character" in message
    assert "SECRET" not in message and "first" not in message


@pytest.mark.parametrize("breaking", ["/", "%41", "?", "#", "\\"])
def test_an_api_key_a_url_path_does_not_carry_as_written_is_refused_by_position(breaking: str, tmp_path: Path) -> None:
    """Rule: the key travels in the path (/v3/<key>): one holding '/', '%', '?' or '#' could never be
    sent there as written, so it is refused (API_KEYS by position, the file by name), never shown."""
    message = refused(API_KEYS=f"sk-first-key,sk-SECRET{breaking}123")
    assert "API_KEYS: key 2 holds '/', '%', '?', '#' or '\\', or is '.' or '..', which a URL path" in message
    assert "SECRET" not in message
    keys = tmp_path / "keys.toml"
    keys.write_text(f"[keys.alice]\nkey = 'sk-SECRET{breaking}123'\n")  # a literal string: a backslash as written
    message = refused(API_KEYS_FILE=str(keys))
    assert "API_KEYS_FILE: key 'alice'" in message and "which a URL path does not carry" in message
    assert "SECRET" not in message


@pytest.mark.parametrize(
    "table",
    [
        '[keys.alice]\nkey = "sk-SECRET\u200b123"\n',
        '[keys."sk-SECRET\ufeff123"]\n',
        '[keys.alice]\nkey = "sk SECRET"\n',
    ],
)
def test_a_keys_file_key_with_invisible_characters_is_refused_by_name(table: str, tmp_path: Path) -> None:
    """Rule: API_KEYS_FILE refuses such a key as API_KEYS does, naming the key's name (derived for the older form)."""
    keys = tmp_path / "keys.toml"
    keys.write_text(table)
    message = refused(API_KEYS_FILE=str(keys))
    assert "API_KEYS_FILE: key '" in message and "contains whitespace, a control or an invisible character" in message
    assert "SECRET" not in message


@pytest.mark.parametrize("command", [["check", "--offline"], ["keys", "list"]])
def test_check_and_keys_list_refuse_an_invisible_key_never_printing_it(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule: `rpc-proxy check` and `rpc-proxy keys list` refuse the key as serve does (exit 2), showing no secret."""
    assert main(command, environ={**UPSTREAM, "API_KEYS": "sk-SECRET\u200b123"}) == 2
    out, err = capsys.readouterr()
    assert "configuration error: API_KEYS: key 1 contains" in err and "SECRET" not in out + err


@pytest.mark.parametrize("value", ["${K1},${K2}", "sk-live,${API_KEY:-sk-default}", "$K1,$K2", "sk-live,$_KEY"])
def test_api_keys_holding_an_unexpanded_variable_is_refused(value: str) -> None:
    """Rule: API_KEYS is taken as written: a `${` or `$NAME` in it is a reference nobody expanded, not a key."""
    message = refused(API_KEYS=value)
    assert "holds '${' or '$NAME': variables are not expanded in API_KEYS" in message and "sk-" not in message


def test_an_api_key_with_a_dollar_sign_not_before_a_name_is_kept() -> None:
    """Rule: only a reference is refused: a `$` before a digit, a sign or the end is part of a key."""
    keys = build_settings({**UPSTREAM, "API_KEYS": "sk-$9x,sk-live-2$"}).api_keys
    digests = {hashlib.sha256(key.encode()).hexdigest() for key in ("sk-$9x", "sk-live-2$")}
    assert {key.sha256 for key in keys.values()} == digests


def test_api_keys_in_dotenv_are_not_expanded_from_the_environment(tmp_path: Path) -> None:
    """Rule: ./.env values are read as written, so `API_KEYS=${K1},${K2}` there is refused even with K1 and K2 set."""
    (tmp_path / ".env").write_text("EVM_UPSTREAM=http://127.0.0.1:1\nAPI_KEYS=${K1},${K2}\n")
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check", "--offline"],
        env=clean_env(K1="sk-SECRET-one", K2="sk-SECRET-two"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "API_KEYS: key 1 holds '${' or '$NAME': variables are not expanded in API_KEYS" in result.stderr
    assert "SECRET" not in result.stdout + result.stderr


def test_a_keys_file_table_name_holding_a_variable_is_refused(tmp_path: Path) -> None:
    """Rule: table names are not expanded: an older-form `[keys."${K1}"]` would be a key literally named so."""
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys."${K1}"]\n')
    assert "its table name holds '${': table names are not expanded" in refused(API_KEYS_FILE=str(keys))


@pytest.mark.parametrize("value", ["debug;txpool", "debug txpool", "debug|txpool"])
def test_allow_namespaces_with_another_separator_than_a_comma_is_refused(value: str) -> None:
    """Rule: ALLOW_NAMESPACES is comma-separated; `debug;txpool` is no namespace, never silently none."""
    assert "ALLOW_NAMESPACES" in refused(ALLOW_NAMESPACES=value)


def test_allow_namespaces_is_read_in_any_case() -> None:
    """Rule: ALLOW_NAMESPACES=Debug opens debug_* (it was accepted and matched nothing), as LOG_FORMAT=JSON is json."""
    settings = build_settings({**UPSTREAM, "ALLOW_NAMESPACES": "Debug, TXPOOL_"})
    assert settings.allowed_namespaces == frozenset({"debug", "txpool"})


def test_log_format_is_read_in_any_case() -> None:
    """Rule: LOG_FORMAT=JSON is json, as LOG_LEVEL=info is INFO (it was refused, the refusal in JSON)."""
    assert build_settings({**UPSTREAM, "LOG_FORMAT": "JSON"}).log_format == "json"
    assert build_settings({**UPSTREAM, "LOG_FORMAT": " Text "}).log_format == "text"


@pytest.mark.parametrize("value", ["Bad Header", "X-Real-IP:", "X-Forwarded-For,"])
def test_a_trusted_proxy_header_that_is_no_header_name_is_refused(value: str) -> None:
    """Rule: TRUSTED_PROXY_HEADER names a header a request can carry: `Bad Header` was taken, and
    never came, so every client was its proxy's address (an outside attack)."""
    assert "TRUSTED_PROXY_HEADER must be a header name" in refused(TRUSTED_PROXY_HEADER=value)
    assert build_settings({**UPSTREAM, "TRUSTED_PROXY_HEADER": "X-Real-IP"}).trusted_proxy_header == "X-Real-IP"


@pytest.mark.parametrize("value", ["Authorization", "host", "Cookie"])
def test_a_trusted_proxy_header_that_carries_no_client_address_is_a_doubt(value: str) -> None:
    """Rule: TRUSTED_PROXY_HEADER naming a field every request carries and that names no client
    (Authorization, Host) is warned of, as check and serve warn of a typo: taken as the client's
    address, it put every client of a key or a host under one address's limits (an outside attack)."""
    from proxy.config import doubts

    settings = build_settings({**UPSTREAM, "TRUSTED_PROXY_HEADER": value})
    assert any("carries no client address" in line for line in doubts(settings))
    assert doubts(build_settings({**UPSTREAM, "TRUSTED_PROXY_HEADER": "X-Real-IP"})) == []


def test_allow_lists_near_a_known_method_or_namespace_are_doubts_and_real_ones_are_not() -> None:
    """Rule: ALLOW_METHODS and ALLOW_NAMESPACES entries that look like typos of known ones are warned of
    (by check and serve), as a key's allowed_methods are: `debugg` allowed nothing, silently."""
    from proxy.config import doubts

    typos = {**UPSTREAM, "ALLOW_NAMESPACES": "debugg,ots", "ALLOW_METHODS": "eth_sendRawTransactionn,acme_quote"}
    assert doubts(build_settings(typos)) == [
        "ALLOW_METHODS 'eth_sendRawTransactionn' is no known method (eth_sendRawTransaction?)",
        "ALLOW_NAMESPACES 'debugg' is no namespace of a known method (debug?)",
    ]
    real = {
        **UPSTREAM,
        "ALLOW_NAMESPACES": "debug,trace,anvil",
        "ALLOW_METHODS": "eth_sendRawTransaction,eth_getTransactionReceiptsByBlock",  # Polygon's own too
    }
    assert doubts(build_settings(real)) == []


@pytest.mark.parametrize(
    ("host", "metrics_port", "doubted"),
    [
        ("0.0.0.0", None, True),
        ("127.0.0.1", None, False),
        ("127.0.0.2", None, False),
        ("::1", None, False),
        ("0.0.0.0", "9100", False),
    ],
)
def test_keys_usage_on_a_public_metrics_path_is_a_doubt(host: str, metrics_port: str | None, doubted: bool) -> None:
    """Rule: with keys, a /metrics served on a public PROXY_HOST (no METRICS_PORT) shows every key's
    name and use to anyone: warned of at start and by check."""
    from proxy.config import doubts

    raw = {
        **UPSTREAM,
        "API_KEYS": "k1-secret",
        "PROXY_HOST": host,
        **({"METRICS_PORT": metrics_port} if metrics_port else {}),
    }
    assert any(line.startswith("METRICS_PORT is not set") for line in doubts(build_settings(raw))) is doubted
