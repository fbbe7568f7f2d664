"""`rpc-proxy check`: the settings and files read as `serve` reads them, each upstream tried, the
effective configuration printed with its secrets redacted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from proxy.check import redact_url
from tests.support import Anvil, free_port
from tests.test_cli_and_logs import clean_env

SECRET = "k3yABCDEFGHIJKLMNOPQRSTUVWXYZ0123"


def check(tmp_path: Path, *args: str, **settings: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "check", *args],
        env=clean_env(**settings),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


class TestRedaction:
    def test_keys_in_a_urls_path_query_and_credentials_are_redacted(self) -> None:
        assert redact_url(f"https://eth.example.io/v2/{SECRET}") == "https://eth.example.io/v2/<redacted>"
        assert (
            redact_url(f"https://rpc.example/?apikey={SECRET}&x=1")
            == "https://rpc.example/?apikey=<redacted>&x=<redacted>"
        )
        assert redact_url(f"https://user:{SECRET}@host:8443/rpc") == "https://<credentials>@host:8443/rpc"
        assert redact_url("http://127.0.0.1:8545") == "http://127.0.0.1:8545"


def test_a_reachable_anvil_checks_ok_and_secrets_are_never_printed(anvil: Anvil, tmp_path: Path) -> None:
    networks = tmp_path / "networks.toml"
    networks.write_text(
        '[networks.main]\nfamily = "evm"\nchain_id = 31337\n'
        f'upstreams = [{{url = "{anvil.url}/?key=${{KEY}}", headers = {{X-Token = "${{KEY}}"}}}},'
        f' "{anvil.url}"]\n'
    )
    result = check(
        tmp_path,
        NETWORKS_FILE=str(networks),
        KEY=SECRET,
        ADMIN_PORT="9100",
        ADMIN_TOKEN=SECRET,
        API_KEYS=f"{SECRET}-api",
        REDIS_URL=f"redis://:{SECRET}@127.0.0.1:1/0",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok   network main upstream #0" in result.stdout and "ok   network main upstream #1" in result.stdout
    assert "chain id 31337" in result.stdout and "all upstreams ok" in result.stdout
    assert "X-Token" in result.stdout and SECRET not in result.stdout + result.stderr


def test_a_dead_upstream_exits_1_naming_it_by_its_redacted_url(anvil: Anvil, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v3/{SECRET}"
    result = check(tmp_path, EVM_UPSTREAM=f"{anvil.url},{dead}")
    assert result.returncode == 1
    assert f"FAIL network evm upstream #1 {redact_url(dead)}: unreachable" in result.stdout
    assert SECRET not in result.stdout + result.stderr


def test_another_chain_among_a_networks_upstreams_is_a_problem(anvil: Anvil, tmp_path: Path) -> None:
    other = Anvil("--chain-id", "5")
    try:
        result = check(tmp_path, EVM_UPSTREAM=f"{anvil.url},{other.url}")
    finally:
        other.stop()
    assert result.returncode == 1 and "differs from the network's other upstreams'" in result.stdout


def test_a_misspelt_field_exits_2_naming_it_as_serve_does(tmp_path: Path) -> None:
    networks = tmp_path / "networks.toml"
    networks.write_text('[networks.main]\nfamily = "evm"\nupstream = ["http://127.0.0.1:1"]\n')
    result = check(tmp_path, NETWORKS_FILE=str(networks))
    assert result.returncode == 2 and "unknown field 'upstream'" in result.stderr


def test_offline_checks_the_files_alone(tmp_path: Path) -> None:
    result = check(tmp_path, "--offline", EVM_UPSTREAM=f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 0 and "upstreams not tried" in result.stdout and "FAIL" not in result.stdout
