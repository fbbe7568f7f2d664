"""`rpc-proxy keys new|list|usage`: keys made and listed from the command line, never showing a secret
but once."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import sys
from pathlib import Path

from proxy.config import build_settings
from proxy.credits.accounts import digest
from tests.support import Anvil, free_port, settings_for, start_proxy
from tests.test_cli_and_logs import clean_env


def keys(tmp_path: Path, *args: str, **settings: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "keys", *args],
        env=clean_env(**settings),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_keys_new_prints_the_secret_once_and_writes_only_its_digest(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    made = keys(
        tmp_path, "new", "alice", "--daily-credits", "5000", "--credits-per-second", "50", API_KEYS_FILE=str(path)
    )
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert len(secret) >= 40 and secret not in path.read_text() and secret not in made.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # created for the proxy's user alone
    settings = build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", "API_KEYS_FILE": str(path)})
    assert settings.api_keys is not None
    alice = settings.api_keys["alice"]
    assert (alice.sha256, alice.daily_credits, alice.credits_per_second) == (digest(secret), 5000, 50)


def test_keys_new_appends_keeps_the_files_mode_and_refuses_a_duplicate(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text('[keys.bob]\nkey_sha256 = "' + "0" * 64 + '"')  # no final newline
    path.chmod(0o640)
    assert keys(tmp_path, "new", "carol.ops", API_KEYS_FILE=str(path)).returncode == 0
    duplicate = keys(tmp_path, "new", "bob", API_KEYS_FILE=str(path))
    assert duplicate.returncode == 1 and "already" in duplicate.stderr and duplicate.stdout == ""
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    settings = build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", "API_KEYS_FILE": str(path)})
    assert settings.api_keys is not None and set(settings.api_keys) == {"bob", "carol.ops"}


def test_keys_new_without_a_keys_file_or_with_a_bad_name_is_a_configuration_error(tmp_path: Path) -> None:
    assert keys(tmp_path, "new", "alice").returncode == 2
    bad = keys(tmp_path, "new", "no spaces", API_KEYS_FILE=str(tmp_path / "k.toml"))
    assert bad.returncode == 2 and "key name" in bad.stderr and not (tmp_path / "k.toml").exists()


def test_keys_list_prints_names_and_terms_never_secrets(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(
        '[keys.alice]\nkey = "alice-secret-1"\ndaily_credits = 7\n'
        '[keys.bob]\nkey = "bob-secret-2"\ncredits_per_second = 3\nallowed_origins = ["https://a.example"]\n'
    )
    listed = keys(tmp_path, "list", API_KEYS_FILE=str(path), DAILY_CREDITS="100")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [
        "alice  daily_credits=7  credits_per_second=unlimited",
        "bob  daily_credits=100  credits_per_second=3  allowed: origins=1",
    ]
    assert "secret" not in listed.stdout and digest("alice-secret-1") not in listed.stdout


def test_keys_usage_without_redis_says_it_cannot_unless_given_a_proxys_metrics(tmp_path: Path) -> None:
    cannot = keys(tmp_path, "usage", API_KEYS="k1")
    assert cannot.returncode == 1 and "no shared credit ledger" in cannot.stderr and "--metrics-url" in cannot.stderr
    dead = keys(tmp_path, "usage", "--metrics-url", f"http://127.0.0.1:{free_port()}/metrics", API_KEYS="k1")
    assert dead.returncode == 1 and "cannot read" in dead.stderr


async def test_keys_usage_reads_a_running_proxys_metrics_without_redis(anvil: Anvil, tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text('[keys.alice]\nkey = "alice-secret-1"\n')
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=str(path)))
    try:
        status, _, headers = await proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": ["0x" + "11" * 20, "latest"]},
            key="alice-secret-1",
        )
        assert status == 200
        charged = int(headers["X-Credits-Charged"])
        usage = await asyncio.to_thread(
            keys, tmp_path, "usage", "--metrics-url", proxy.base + "/metrics", API_KEYS_FILE=str(path)
        )
        assert usage.returncode == 0, usage.stderr
        assert f"key alice: {charged} credits charged by this proxy process since it started" in usage.stdout
        assert "alice-secret-1" not in usage.stdout + usage.stderr
    finally:
        await proxy.close()


def test_keys_new_output_is_a_bare_secret_for_scripts(tmp_path: Path) -> None:
    made = keys(tmp_path, "new", "ci", API_KEYS_FILE=str(tmp_path / "k.toml"))
    assert len(made.stdout.splitlines()) == 1 and json.dumps(made.stdout.strip()).isascii()


def test_keys_new_refuses_a_keys_file_it_cannot_append_to_in_one_line_writing_nothing(tmp_path: Path) -> None:
    # spec: bad input is a clear one-line configuration error (exit 2), never a traceback.
    inline = tmp_path / "inline.toml"
    inline.write_text('keys = { carol = { key_sha256 = "' + "ab" * 32 + '" } }\n')
    inline.chmod(0o600)
    before = inline.read_text()
    for path, problem in (
        (tmp_path, "is a directory"),
        (tmp_path / "missing" / "keys.toml", "does not exist"),
        (inline, "inline table"),
    ):
        result = keys(tmp_path, "new", "dave", API_KEYS_FILE=str(path))
        assert result.returncode == 2 and problem in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert result.stdout == ""  # no secret printed for a key that was not written
    assert inline.read_text() == before and not (tmp_path / "missing").exists()


def test_keys_new_refuses_credits_past_2_to_the_53(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    for flag in ("--daily-credits", "--credits-per-second"):
        result = keys(tmp_path, "new", "erin", flag, str(2**53 + 1), API_KEYS_FILE=str(path))
        assert result.returncode == 2 and f"{flag} must be" in result.stderr and not path.exists()
    assert keys(tmp_path, "new", "erin", "--daily-credits", str(2**53), API_KEYS_FILE=str(path)).returncode == 0
