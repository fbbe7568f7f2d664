"""Settings refused at start (exit 2, one line naming the setting and what is allowed), as
`rpc-proxy check` refuses them: values that would run open, flap, overflow or collide."""

from __future__ import annotations

import pytest

from proxy.cli import main
from proxy.config import ConfigError, build_settings

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
    ],
)
def test_two_listeners_on_one_port_of_one_host_are_refused(raw: dict[str, str], fragment: str) -> None:
    """Rule: METRICS_PORT and ADMIN_PORT each need a port of their own on their host (a wildcard host: any)."""
    assert fragment in refused(**raw)


def test_one_port_on_two_distinct_hosts_is_kept() -> None:
    settings = build_settings({**UPSTREAM, "METRICS_HOST": "127.0.0.2", "METRICS_PORT": "8545"})
    assert [str(listener) for listener in settings.listeners] == [
        "127.0.0.1:8545 (PROXY_PORT)",
        "127.0.0.2:8545 (METRICS_PORT)",
    ]
