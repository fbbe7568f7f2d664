"""Secrets stay secret: API keys never reach metrics, logs, errors or the ledger's keys."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from proxy.app import create_app
from proxy.credits.accounts import derived_name
from tests.support import ROOT, Anvil, ProxyFactory, fake_server, settings_for, start_proxy

SECRET = "sk-live-SECRET123"
STORAGE = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": ["0x" + "11" * 20, "0x0", "latest"]}


def keys_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return str(path)


async def test_metrics_label_keys_by_their_name_never_by_their_secret(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    hashed = hashlib.sha256(b"sk-live-OTHER456").hexdigest()
    path = keys_toml(tmp_path, f'[keys.alice]\nkey = "{SECRET}"\n[keys.bob]\nkey_sha256 = "{hashed}"\n')
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=path, API_KEYS="sk-plain-789")
    for key in (SECRET, "sk-live-OTHER456", "sk-plain-789"):
        assert (await proxy.post(STORAGE, key=key))[0] == 200
    assert (await proxy.post(STORAGE, key="alice"))[0] == 401  # a name is not a key
    async with proxy.session.get(proxy.base + "/metrics") as resp:
        text = await resp.text()
    assert "SECRET123" not in text and "OTHER456" not in text and "sk-plain" not in text
    assert proxy.metric("rpc_proxy_key_credits_charged_total", key="alice") == 80
    assert proxy.metric("rpc_proxy_key_credits_charged_total", key="bob") == 80
    assert proxy.metric("rpc_proxy_key_credits_charged_total", key=derived_name("sk-plain-789")) == 80


async def test_older_form_key_tables_work_but_are_labelled_by_a_derived_name(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    path = keys_toml(tmp_path, f'[keys."{SECRET}"]\ndaily_credits = 1000\n')
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=path)
    status, _, headers = await proxy.post(STORAGE, key=SECRET)
    assert status == 200 and headers["X-Credits-Remaining"] == "920"
    assert SECRET not in generate_latest(proxy.registry).decode()
    assert proxy.metric("rpc_proxy_key_credits_charged_total", key=derived_name(SECRET)) == 80


async def test_the_ledger_in_redis_is_keyed_by_account_name(anvil: Anvil, redis_url: str, tmp_path: Path) -> None:
    import redis.asyncio as aioredis

    path = keys_toml(tmp_path, f'[keys.alice]\nkey = "{SECRET}"\n')
    # Inline, not make_proxy: closed before `keys usage` reads what it spent.
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=path, REDIS_URL=redis_url))
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert (await proxy.post(STORAGE, key=SECRET))[0] == 200
        names = [k.decode() for k in await client.keys("rcp:credits:*")]
        assert len(names) == 1 and names[0].endswith(":{alice}")
    finally:
        await client.aclose()
        await proxy.close()
    env = {"PATH": "/usr/bin:/bin", "REDIS_URL": redis_url, "API_KEYS_FILE": path}
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "keys", "usage", "alice"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0 and "80 credits used" in result.stdout, result.stderr


@pytest.mark.parametrize(
    "text",
    [
        "[keys]\nsk-live-SECRET123 = nan\n",
        '[keys]\n"sk.live.SECRET123" = inf\n',
        '[keys."sk-live-SECRET123"]\ndaily_credits = nan\n',
        '[keys."sk.live.SECRET123"]\ncredits_per_second = -inf\n',
        '[keys."sk-live-SECRET123"]\nallowed_methods = [nan]\n',
        '[keys."sk-live-SECRET123".SECRET123]\nx = nan\n',
        '[keys.alice]\nkey = "sk-live-SECRET123"\ndaily_credits = nan\n',
        "sk-live-SECRET123 = nan\n",
    ],
)
def test_a_non_finite_number_in_a_key_file_is_refused_without_the_key(tmp_path: Path, text: str) -> None:
    """Rule: a key file's inf or nan is refused naming the key by its name (derived for the older form,
    whose table name is the secret) and never any part of the path that may be a key."""
    from proxy.config import ConfigError, build_settings

    with pytest.raises(ConfigError) as caught:
        build_settings({"EVM_UPSTREAM": "http://x", "API_KEYS_FILE": keys_toml(tmp_path, text)})
    message = str(caught.value)
    assert "must be a finite number" in message and "SECRET123" not in message and "sk-live" not in message, message


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('[keys.alice]\nkey = "a"\nkey_sha256 = "' + "0" * 64 + '"\n', "not both"),
        ('[keys.alice]\nkey_sha256 = "xyz"\n', "64 hex digits"),
        ('[keys."sk-live-SECRET123"]\ndaily_credit = 5\n', "unknown field"),
        ('[keys.alice]\nkey = "sk-dup-77"\n[keys.bob]\nkey = "sk-dup-77"\n', "share the same secret"),
        ('[keys."sk-live-SECRET123"]\ndaily_credits = -1\n', "whole number from 1 to 2**53"),
        ('[keys."sk-live-SECRET123\u200b"]\n', "an invisible character"),
        ('[keys.alice]\nkey = "sk-live-SECRET123\\t"\n', "an invisible character"),
    ],
)
def test_key_file_errors_never_echo_a_secret(tmp_path: Path, text: str, fragment: str) -> None:
    from proxy.config import ConfigError, build_settings

    with pytest.raises(ConfigError) as caught:
        build_settings({"EVM_UPSTREAM": "http://x", "API_KEYS_FILE": keys_toml(tmp_path, text)})
    assert fragment in str(caught.value) and "SECRET123" not in str(caught.value) and "sk-dup" not in str(caught.value)


class BrokenLedger:
    """A ledger whose debit fails with an unexpected error: an internal fault of the proxy."""

    async def debit(self, api_key: str, amount: int, *, daily: int, per_second: int | None, now: float) -> Any:
        raise RuntimeError("the ledger broke")

    async def refund(self, api_key: str, amount: int, *, now: float) -> None:
        return None

    async def used(self, api_key: str, *, now: float) -> int:
        return 0


async def test_an_internal_error_logs_the_request_path_with_the_key_redacted(
    anvil: Anvil, caplog: pytest.LogCaptureFixture
) -> None:
    settings = settings_for(EVM_UPSTREAM=anvil.url, API_KEYS=SECRET)
    app = create_app(settings, ledger=BrokenLedger(), registry=CollectorRegistry())
    server = await fake_server(app)
    try:
        url = f"http://127.0.0.1:{server.port}/evm/v3/{SECRET}"
        async with aiohttp.ClientSession() as session, session.post(url, json=STORAGE) as resp:
            assert resp.status == 500 and (await resp.json())["error"]["code"] == -32603
    finally:
        await server.close()
    logged = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert logged and logged[0].getMessage() == "internal error serving /evm/v3/<key>"
    assert all(SECRET not in r.getMessage() and SECRET not in str(r.exc_info) for r in caplog.records)


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunter2@[bad",
        "redis://:hunter2@host:99999",
        "redis://:hunter2@host:abc",
        "http://:hunter2@host",
        "redis://:hunter2@",
        "hunter2",
    ],
)
def test_a_bad_redis_url_is_a_one_line_configuration_error_naming_no_password(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.cli import main

    assert main([], {"EVM_UPSTREAM": "http://127.0.0.1:1", "REDIS_URL": url}) == 2
    err = capsys.readouterr().err
    assert 'msg="configuration error: REDIS_URL' in err and err.count("\n") == 1
    assert "hunter2" not in err and "Traceback" not in err
