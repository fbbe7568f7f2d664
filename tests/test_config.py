"""Settings: env and CLI, one-line errors, and the documentation kept in step with the table."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.config import OPTIONS, ConfigError, build_settings
from proxy.credits.accounts import derived_name
from tests.support import ROOT


def test_every_setting_is_documented_in_env_example_and_the_settings_reference() -> None:
    env_example = (ROOT / ".env.example").read_text()
    reference = (ROOT / "docs/configuration/settings.md").read_text()
    for option in OPTIONS:
        assert re.search(rf"^#? ?{option.env}=", env_example, re.M), f"{option.env} missing from .env.example"
        assert f"`{option.env}`" in reference, f"{option.env} missing from docs/configuration/settings.md"
        assert f"`{option.flag}`" in reference, f"{option.flag} missing from docs/configuration/settings.md"


def test_defaults_apply_when_only_an_upstream_is_set() -> None:
    settings = build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1"})
    assert (settings.host, settings.port, settings.open_mode) == ("127.0.0.1", 8545, True)
    assert settings.default_network == {"evm": "evm"}
    assert settings.getlogs_max_results == 10_000 and settings.getlogs_timeout == 10.0


def test_upstream_lists_keep_their_order() -> None:
    settings = build_settings({"EVM_UPSTREAM": "http://a:1, http://b:2", "SOLANA_UPSTREAM": "https://s"})
    assert settings.networks[0].upstreams == ("http://a:1", "http://b:2")
    assert settings.default_network == {"evm": "evm", "solana": "solana"}


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({}, "no upstream configured"),
        ({"EVM_UPSTREAM": "ftp://x"}, "EVM_UPSTREAM: upstream #0 is not an http(s) URL"),
        ({"EVM_UPSTREAM": "http://x", "PROXY_PORT": "99999"}, "PROXY_PORT must be a port number"),
        ({"EVM_UPSTREAM": "http://x", "HEAD_POLL_INTERVAL": "soon"}, "HEAD_POLL_INTERVAL must be a number"),
        ({"EVM_UPSTREAM": "http://x", "MAX_BATCH_SIZE": "0"}, "MAX_BATCH_SIZE must be greater than 0"),
        ({"EVM_UPSTREAM": "http://x", "SOLANA_LARGEST_ACCOUNTS_TTL": "9000"}, "at most 7200"),
        ({"EVM_UPSTREAM": "http://x", "LOG_FORMAT": "xml"}, "LOG_FORMAT"),
        ({"EVM_UPSTREAM": "http://x", "ETH_CALL_REQUIRE_FROM": "maybe"}, "true or false"),
        ({"EVM_UPSTREAM": "http://x", "API_KEYS_FILE": "/nonexistent.toml"}, "cannot read"),
    ],
)
def test_invalid_settings_raise_one_clear_line(raw: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_settings(raw)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_the_url_of_a_bad_upstream_is_not_echoed() -> None:
    with pytest.raises(ConfigError) as caught:
        build_settings({"EVM_UPSTREAM": "ftp://user:secret@host"})
    assert "secret" not in str(caught.value)


def test_networks_file_declares_networks_with_hosts(tmp_path: Path) -> None:
    path = tmp_path / "networks.toml"
    path.write_text(
        '[networks.mainnet]\nfamily = "evm"\nupstreams = ["http://a", "http://b"]\nhosts = ["Eth.Example"]\n'
        '[networks.sol]\nfamily = "solana"\nupstreams = ["http://s"]\nfinality_depth = 10\n'
    )
    settings = build_settings({"NETWORKS_FILE": str(path)})
    assert [n.name for n in settings.networks] == ["mainnet", "sol"]
    assert settings.networks[0].hosts == ("eth.example",)
    assert settings.default_network == {"evm": "mainnet", "solana": "sol"}
    # Verified answers by default: auto, every upstream that reached the checkpoint, complete logs.
    assert (settings.networks[0].verify, settings.networks[0].checkpoint_quorum) == ("auto", 0)
    assert settings.networks[0].verify_logs == "complete" and settings.networks[0].trusted_checkpoint is None


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("not toml [", "not valid TOML"),
        ('[networks.x]\nfamily = "btc"\nupstreams = ["http://a"]\n', "family must be"),
        ('[networks.x]\nfamily = "evm"\n', "must be a list of URLs"),
        ('[networks.Bad_Name]\nfamily = "evm"\nupstreams = ["http://a"]\n', "lower-case"),
        # A word of the paths: /ws/v3/<key> would be both its POSTs and the default network's WebSocket.
        ('[networks.ws]\nfamily = "evm"\nupstreams = ["http://a"]\n', "'ws' is a word of the proxy's paths"),
        ('[networks.v3]\nfamily = "evm"\nupstreams = ["http://a"]\n', "'v3' is a word of the proxy's paths"),
        # A misspelt or misplaced field would do nothing: refused, naming it.
        (
            '[networks.x]\nfamily = "evm"\nupstreams = ["http://a"]\nselectoin = "weighted"\n',
            "unknown field 'selectoin'",
        ),
        ('[networks.x]\nfamily = "evm"\nupstreams = ["http://a"]\nmax_rps = 5\n', "unknown field 'max_rps'"),
        # Verified answers' fields.
        ('[networks.x]\nfamily = "evm"\nupstreams = ["http://a"]\nverify = "yes"\n', "verify must be one of"),
        ('[networks.x]\nfamily = "evm"\nupstreams = ["http://a"]\ncheckpoint_quorum = 2\n', "cannot exceed"),
        ('[networks.x]\nfamily = "evm"\nupstreams = ["http://a"]\ntrusted_checkpoint = "0x12"\n', "block hash"),
        ('[networks.x]\nfamily = "evm"\nupstreams = ["http://a"]\nverify_logs = "some"\n', "verify_logs must be"),
        # One node twice would count as two: two of confirm_immutable = 2 "agreeing" were one node.
        (
            '[networks.x]\nfamily = "evm"\nupstreams = ["http://a:1/k", "HTTP://a:1/k/"]\nconfirm_immutable = 2\n',
            "network 'x': upstream #1 is #0 again: one node would count as two",
        ),
        (
            '[networks.x]\nfamily = "evm"\nupstreams = ["http://a", "ws://a/w", "ws://a/w"]\n',
            "WebSocket upstream #1 is #0",
        ),
    ],
)
def test_a_bad_networks_file_is_one_clear_line(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "networks.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        build_settings({"NETWORKS_FILE": str(path)})
    assert fragment in str(caught.value)


def test_one_url_with_other_header_fields_is_two_upstreams_and_paths_differ_by_one_slash(tmp_path: Path) -> None:
    """Rule (docs/networks.md): one URL is one node unless its header fields differ (two keys of one
    provider are two accounts); only one trailing `/` is the same path (`/a//` is not `/a/`)."""
    path = tmp_path / "networks.toml"
    path.write_text(
        '[networks.x]\nfamily = "evm"\nupstreams = [\n'
        '  { url = "https://h.example/a", headers = { Authorization = "Bearer k1" } },\n'
        '  { url = "https://h.example/a", headers = { Authorization = "Bearer k2" } },\n'
        '  "https://h.example/a/", "https://h.example/a//",\n]\n'
    )
    assert len(build_settings({"NETWORKS_FILE": str(path)}).networks[0].upstreams) == 4


def test_a_settings_file_saved_with_a_byte_order_mark_is_read_as_dotenv_is(tmp_path: Path) -> None:
    """Rule (docs/configuration/index.md): a leading UTF-8 byte-order mark is dropped, in the TOML
    files as in .env (a Windows editor's BOM was "Invalid statement (at line 1, column 1)")."""
    path = tmp_path / "networks.toml"
    path.write_text('\ufeff[networks.x]\nfamily = "evm"\nupstreams = ["http://a"]\n', encoding="utf-8")
    assert [n.name for n in build_settings({"NETWORKS_FILE": str(path)}).networks] == ["x"]


def test_keys_file_sets_per_key_credits(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text("[keys.alice]\ndaily_credits = 500\n[keys.bob]\ncredits_per_second = 10\n")
    settings = build_settings({"EVM_UPSTREAM": "http://x", "API_KEYS_FILE": str(path), "API_KEYS": "carol"})
    assert settings.api_keys is not None
    # Older-form tables name the secret itself: their accounts get a derived, non-secret name.
    assert settings.api_keys[derived_name("alice")].daily_credits == 500
    assert settings.api_keys[derived_name("bob")].credits_per_second == 10
    assert derived_name("carol") in settings.api_keys and not settings.open_mode


def test_cli_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_serve(settings: object) -> int:
        seen["settings"] = settings
        return 0

    monkeypatch.setattr("proxy.cli.serve", fake_serve)
    env = {"EVM_UPSTREAM": "http://env:1", "PROXY_PORT": "1000"}
    assert main(["--proxy-port", "2000"], env) == 0
    assert seen["settings"].port == 2000  # type: ignore[attr-defined]
    assert main(["serve", "--evm-upstream", "http://flag:1"], env) == 0
    assert seen["settings"].networks[0].upstreams == ("http://flag:1",)  # type: ignore[attr-defined]


def test_cli_reports_a_config_error_in_one_line_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([], {}) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "no upstream configured" in err


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "has no [credits] table"),
        ("[credit]\neth_getBalance = 1\n", "unknown table or key 'credit'"),
        ('[credits]\n"eth getBalance" = 1\n', "is not a method name"),
        ("[credits]\neth_getBalance = -1\n", "whole number of credits from 0 to 1000000"),
        ("[credits]\neth_getBalance = true\n", "whole number of credits"),
        ('[credits]\neth_getBalance = "80"\n', "whole number of credits"),
        ("[credits]\neth_getLogs = 1\n", "'eth_getLogs' costs 255 credits as the spec fixes; it cannot be changed"),
        ("[credits\n", "is not valid TOML"),
    ],
)
def test_credits_file_errors_are_one_clear_line(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "credits.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        build_settings({"EVM_UPSTREAM": "http://x", "CREDITS_FILE": str(path)})
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("setting", "text", "fragment"),
    [
        (
            "NETWORKS_FILE",
            '[networks.main]\nfamily = "evm"\nupstreams = ["http://x"]\n[network.base]\nfamily = "evm"\n',
            "unknown table or key 'network'",
        ),
        (
            "NETWORKS_FILE",
            'family = "evm"\n[networks.main]\nfamily = "evm"\nupstreams = ["http://x"]\n',
            "unknown table or key 'family'",
        ),
        ("API_KEYS_FILE", '[keys.alice]\nkey = "k1"\n[key.bob]\nkey = "k2"\n', "unknown table or key outside [keys]"),
        ("API_KEYS_FILE", 'daily_credits = 5\n[keys.alice]\nkey = "k1"\n', "unknown table or key outside [keys]"),
    ],
)
def test_a_table_or_key_outside_a_files_own_table_is_refused(
    tmp_path: Path, setting: str, text: str, fragment: str
) -> None:
    """Rule: each file is read from its own table only, and anything beside it is a configuration
    error, as CREDITS_FILE's was: a misspelt [network.base] or [key.bob] was silently never served
    (an outside attack). A keys file's names may be secrets: they are not echoed."""
    path = tmp_path / "file.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        build_settings({"EVM_UPSTREAM": "http://x", setting: str(path)})
    assert fragment in str(caught.value) and "k1" not in str(caught.value) and "bob" not in str(caught.value)


def test_a_file_setting_naming_a_fifo_is_refused_not_read(tmp_path: Path) -> None:
    """Rule: a file setting names a regular file: API_KEYS_FILE naming a FIFO held `check` forever."""
    fifo = tmp_path / "keys.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is not a regular file"):
        build_settings({"EVM_UPSTREAM": "http://x", "API_KEYS_FILE": str(fifo)})


def test_credits_file_overrides_and_adds_to_the_built_in_table(tmp_path: Path) -> None:
    path = tmp_path / "credits.toml"
    path.write_text("[credits]\neth_getBalance = 0\ntrace_block = 500\n")
    table = build_settings({"EVM_UPSTREAM": "http://x", "CREDITS_FILE": str(path)}).method_credits
    assert (table["eth_getBalance"], table["trace_block"], table["eth_getCode"]) == (0, 500, 80)
    with pytest.raises(ConfigError, match="CREDITS_FILE: cannot read"):
        build_settings({"EVM_UPSTREAM": "http://x", "CREDITS_FILE": str(tmp_path / "missing.toml")})
