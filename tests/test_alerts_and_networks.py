"""The operator's files: alert rules with their runbooks and promtool tests, the dashboard's network
and instance variables, and the example networks file with its upstreams from the environment."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from proxy.config import ConfigError, build_settings
from proxy.memory_limit import cgroup_memory_limit
from tests.support import Anvil, free_port, settings_for, start_proxy

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
RUNBOOKS = ROOT / "docs/operations.md"
NETWORK_LABELLED = (
    "rpc_proxy_requests_total",
    "rpc_proxy_request_duration_seconds",
    "rpc_proxy_upstream_",
    "rpc_proxy_head_",
    "rpc_proxy_reorgs_total",
    "rpc_proxy_coalesced_requests_total",
)
EXAMPLE_URLS = {
    "ETH_MAINNET_URL": "https://eth-a.example/v2/k1",
    "ETH_MAINNET_BACKUP_URL": "https://eth-b.example/k2",
    "BASE_MAINNET_URL": "https://base.example/v2/k3",
    "SOLANA_MAINNET_URL": "https://sol.example/k4",
}


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool missing: bash scripts/test.sh installs Debian's prometheus package"
    return found


def rules() -> list[dict[str, object]]:
    return [r for g in yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"] for r in g["rules"]]


def test_the_alert_rules_pass_their_promtool_unit_tests() -> None:
    result = subprocess.run(
        [promtool(), "test", "rules", str(DEPLOY / "alerts.test.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_runbook_section_and_a_unit_test() -> None:
    tested = (DEPLOY / "alerts.test.yml").read_text()
    headings = set(re.findall(r"^#+ Alert (\w+)$", RUNBOOKS.read_text(), re.MULTILINE))
    for rule in rules():
        name = str(rule["alert"])
        url = rule["annotations"]["runbook_url"]  # type: ignore[index]
        assert url.endswith(f"/operations/#alert-{name.lower()}"), url
        assert name in headings, f"no '### Alert {name}' section in {RUNBOOKS.name}"
    for name in (
        "RpcProxyDown",
        "RpcProxyNetworkDown",
        "RpcProxyHighErrorRatio",
        "RpcProxyRedisDown",
        "RpcProxyHeadStale",
        "RpcProxyCreditRefusals",
        "RpcProxyMemoryNearLimit",
    ):
        assert f"alertname: {name}" in tested, name


def test_dashboard_panels_follow_the_network_and_instance_variables() -> None:
    dashboard = json.loads((ROOT / "grafana/dashboards/rpc-cache-proxy.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"network", "instance"}
    assert all(v["includeAll"] and v["multi"] for v in variables.values())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for selector in re.findall(r"\brpc_proxy_[a-z_]+(?:\{[^}]*\})?", expr):
                assert 'instance=~"$instance"' in selector, (panel["title"], selector)
                if selector.startswith(NETWORK_LABELLED):
                    assert 'network=~"$network"' in selector, (panel["title"], selector)


def test_the_example_networks_file_serves_three_chains_from_the_environment(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, url in EXAMPLE_URLS.items():
        monkeypatch.setenv(name, url)
    settings = build_settings({"NETWORKS_FILE": str(DEPLOY / "networks.example.toml")})
    assert [(n.name, n.family) for n in settings.networks] == [
        ("eth-mainnet", "evm"),
        ("base-mainnet", "evm"),
        ("solana-mainnet", "solana"),
    ]
    assert settings.networks[0].upstreams == (EXAMPLE_URLS["ETH_MAINNET_URL"], EXAMPLE_URLS["ETH_MAINNET_BACKUP_URL"])
    monkeypatch.delenv("SOLANA_MAINNET_URL")
    with pytest.raises(ConfigError, match="SOLANA_MAINNET_URL is not set"):
        build_settings({"NETWORKS_FILE": str(DEPLOY / "networks.example.toml")})


def test_compose_and_kubernetes_mount_the_example_networks_file() -> None:
    assert (DEPLOY / "kubernetes/base/networks.toml").read_bytes() == (DEPLOY / "networks.example.toml").read_bytes()
    proxy = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["proxy"]
    assert "${NETWORKS_TOML:-./networks.example.toml}:/etc/rpc-proxy/networks.toml:ro" in proxy["volumes"]
    example = set(re.findall(r"^([A-Z_]+)=", (DEPLOY / "upstreams.example.env").read_text(), re.MULTILINE))
    assert example == set(EXAMPLE_URLS)  # every ${VAR} the networks file needs, and no other


async def test_upstream_up_falls_to_zero_for_an_upstream_that_fails(anvil: Anvil) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=f"{dead},{anvil.url}"))
    try:
        assert await proxy.result("eth_getBalance", ["0x" + "22" * 20, "latest"]) == "0x0"  # #0 failed, #1 answered
        assert proxy.metric("rpc_proxy_upstream_up", network="evm", upstream="0") == 0
        assert proxy.metric("rpc_proxy_upstream_up", network="evm", upstream="1") == 1
    finally:
        await proxy.close()


class TestMemoryLimit:
    def test_cgroup_v2_and_v1_limits_are_read_and_no_limit_is_none(self, tmp_path: Path) -> None:
        (tmp_path / "memory.max").write_text("1073741824\n")
        assert cgroup_memory_limit(tmp_path) == 1 << 30
        (tmp_path / "memory.max").write_text("max\n")
        assert cgroup_memory_limit(tmp_path) is None
        (tmp_path / "memory.max").unlink()
        (tmp_path / "memory").mkdir()
        (tmp_path / "memory/memory.limit_in_bytes").write_text(str(2**63 - 4096))  # v1: no limit set
        assert cgroup_memory_limit(tmp_path) is None
        (tmp_path / "memory/memory.limit_in_bytes").write_text("536870912")
        assert cgroup_memory_limit(tmp_path) == 512 << 20
        assert cgroup_memory_limit(tmp_path / "absent") is None
