"""Metrics, the Grafana dashboard, Prometheus, logs, deployment files and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from proxy.logs import JsonFormatter
from proxy.metrics import Metrics
from tests.fake_solana import FakeSolana
from tests.fake_upstream import bad_upstream
from tests.support import ROOT, Anvil, Proxy, ProxyFactory, eventually, free_port

DASHBOARD = ROOT / "grafana/dashboards/rpc-cache-proxy.json"


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool missing: bash scripts/test.sh installs Debian's prometheus package"
    return found


async def exercise(anvil: Anvil, proxy: Proxy) -> None:
    """A hit, a miss, an error and a forwarded call, so every labelled family has samples."""
    store = anvil.deploy_store()
    anvil.mine(70)
    await proxy.head_at(anvil.block_number())
    request = [store, "0x0", "0x1"]
    await proxy.call("eth_getStorageAt", request)
    await proxy.call("eth_getStorageAt", request)
    await proxy.call("eth_getStorageAt", ["0x12", "0x0", "latest"])
    await proxy.call("eth_chainId", [])


def exported_sample_names(text: str) -> set[str]:
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        suffixes = {"histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum", "")}.get(kind, ("",))
        names.update(name + s for s in suffixes)
    return names


async def test_metric_values_move_on_a_hit_a_miss_and_an_error(anvil: Anvil, evm_proxy: Proxy) -> None:
    await exercise(anvil, evm_proxy)
    m = evm_proxy.metric
    assert m("rpc_proxy_requests_total", network="evm", method="eth_getStorageAt", outcome="ok") == 2
    assert m("rpc_proxy_requests_total", network="none", method="eth_getStorageAt", outcome="invalid") == 1
    assert m("rpc_proxy_request_duration_seconds_count", network="evm", method="eth_getStorageAt", cache="HIT") == 1
    assert m("rpc_proxy_request_duration_seconds_count", network="evm", method="eth_getStorageAt", cache="MISS") == 1
    assert m("rpc_proxy_cache_lookups_total", tier="memory", result="hit") == 1
    assert m("rpc_proxy_cache_lookups_total", tier="memory", result="miss") == 1
    assert (
        m("rpc_proxy_upstream_request_duration_seconds_count", network="evm", method="eth_getStorageAt", upstream="0")
        == 1
    )
    assert m("rpc_proxy_upstream_credits_saved_total", network="evm", method="eth_getStorageAt") == 80
    assert m("rpc_proxy_head_block", network="evm", tag="latest") == anvil.block_number()
    assert m("rpc_proxy_head_block", network="evm", tag="finalized") == anvil.block_number() - 64
    assert m("rpc_proxy_inflight_requests") == 0


def test_latency_buckets_count_each_observation_at_its_upper_bound() -> None:
    registry = CollectorRegistry()
    cell = Metrics(registry).request_seconds.labels("evm", "eth_call", "HIT")
    for seconds in (0.0001, 0.0005, 0.0007, 0.001, 0.02, 60.0):  # 0.0005 and 0.001 are bounds (le)
        cell.observe(seconds)

    def bucket(le: str) -> float | None:
        return registry.get_sample_value(
            "rpc_proxy_request_duration_seconds_bucket",
            {"network": "evm", "method": "eth_call", "cache": "HIT", "le": le},
        )

    assert (bucket("0.0005"), bucket("0.001"), bucket("0.025"), bucket("30.0"), bucket("+Inf")) == (2, 4, 5, 5, 6)


async def test_metrics_endpoint_passes_promtool_check_metrics(anvil: Anvil, evm_proxy: Proxy) -> None:
    await exercise(anvil, evm_proxy)
    async with evm_proxy.session.get(evm_proxy.base + "/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    result = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


async def test_every_dashboard_expression_uses_only_exported_metric_names(anvil: Anvil, evm_proxy: Proxy) -> None:
    await exercise(anvil, evm_proxy)
    exported = exported_sample_names(generate_latest(evm_proxy.registry).decode())
    exported.add("rpc_proxy_redis_up")  # exported only with REDIS_URL (test_operator_signals.py)
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(expressions) >= 11
    for expr in expressions:
        used = set(re.findall(r"\brpc_proxy_[a-z_]+\b", expr))
        assert used, expr
        assert used <= exported, f"{expr}: {used - exported} not exported"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for wanted in (
        "requests",
        "hit ratio",
        "hits",
        "misses",
        "upstream latency",
        "errors",
        "credits",
        "head lag",
        "redis",
    ):
        assert wanted in titles, wanted


async def test_open_mode_keys_never_become_metric_labels(evm_proxy: Proxy) -> None:
    for key in ("k1", "k2"):
        await evm_proxy.post({"jsonrpc": "2.0", "id": 1, "method": "eth_chainId"}, key=key)
    text = generate_latest(evm_proxy.registry).decode()
    assert 'key="k1"' not in text and 'key="k2"' not in text


def test_prometheus_config_passes_promtool_check_config() -> None:
    result = subprocess.run(
        [promtool(), "check", "config", str(ROOT / "deploy/prometheus.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@contextlib.asynccontextmanager
async def prometheus_scraping(proxy: Proxy, tmp_path: Path) -> AsyncIterator[Callable[[str], Awaitable[list[Any]]]]:
    """A real Prometheus scraping `proxy` each second with deploy/prometheus.yml; yields a query:
    an instant query's series ([] while it has none, or Prometheus is not up yet)."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus missing: bash scripts/test.sh installs it"
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{proxy.server.port}"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    async def query(expr: str) -> list[Any]:
        try:
            async with proxy.session.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr}) as resp:
                body = await resp.json()
        except aiohttp.ClientError:
            return []
        return list(body.get("data", {}).get("result", []))

    try:
        yield query
    finally:
        proc.terminate()
        proc.wait(10)


async def test_a_real_prometheus_scrapes_the_running_proxy(anvil: Anvil, evm_proxy: Proxy, tmp_path: Path) -> None:
    await exercise(anvil, evm_proxy)
    found: list[Any] = []
    async with prometheus_scraping(evm_proxy, tmp_path) as query:

        async def scraped() -> bool:
            found[:] = await query("rpc_proxy_requests_total")
            return bool(found)

        await eventually(scraped, 30, "Prometheus to scrape the proxy")
    assert any(s["metric"].get("method") == "eth_getStorageAt" for s in found)


async def test_the_head_panels_show_an_evm_and_a_solana_network_from_a_real_scrape(
    anvil: Anvil, solana: FakeSolana, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    # spec (operations.md, the dashboard): "Head lag" and "Blocks to finality" have a figure for each
    # network the $network variable offers, Solana's too. Counters (reorgs) have no series before their first event.
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, SOLANA_UPSTREAM=solana.url)
    anvil.mine(70)  # a finalized block below the latest
    dashboard = json.loads(DASHBOARD.read_text())
    gauges = [
        (p["title"], t["expr"].replace("$network", ".*").replace("$instance", ".*"))
        for p in dashboard["panels"]
        if p["title"] in ("Head lag", "Blocks to finality")
        for t in p["targets"]
        if "increase(" not in t["expr"]
    ]
    assert len(gauges) == 3, gauges
    async with prometheus_scraping(proxy, tmp_path) as query:
        for title, expr in gauges:
            shown: set[str] = set()

            async def both(expr: str = expr, shown: set[str] = shown) -> bool:
                shown.update(s["metric"].get("network") for s in await query(expr))
                return shown >= {"evm", "solana"}

            await eventually(both, 30, f"{title}: {expr} for evm and solana")


def test_json_log_lines_carry_the_call_fields() -> None:
    record = logging.LogRecord("proxy.access", logging.INFO, __file__, 1, "call", None, None)
    for name, value in {"request_id": "ab-1", "method": "eth_call", "cache": "HIT", "upstream_ms": 1.5}.items():
        setattr(record, name, value)
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "call" and line["request_id"] == "ab-1" and line["cache"] == "HIT"
    assert line["upstream_ms"] == 1.5 and line["level"] == "info"


# --- graceful shutdown -----------------------------------------------------------------------


async def test_sigterm_lets_an_in_flight_request_complete_and_closes_websockets() -> None:
    async with bad_upstream(result="0x7a69", delay=1.5) as url:
        port = free_port()
        env = {
            **os.environ,
            "EVM_UPSTREAM": url,
            "PROXY_PORT": str(port),
            "LOG_LEVEL": "WARNING",
            "HEAD_POLL_INTERVAL": "60",
        }
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen([sys.executable, "-m", "proxy"], env=env, stderr=err)
            base = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as session:

                async def up() -> bool:
                    try:
                        async with session.get(base + "/healthz") as resp:
                            return resp.status == 200
                    except aiohttp.ClientError:
                        return False

                await eventually(up, 15, "the proxy to listen")
                ws = await session.ws_connect(base.replace("http", "ws") + "/ws/v3/k")
                call = {"jsonrpc": "2.0", "id": 7, "method": "eth_chainId", "params": []}
                in_flight = asyncio.create_task(session.post(base + "/v3/k", json=call))

                async def serving() -> bool:
                    async with session.get(base + "/metrics") as resp:
                        return "rpc_proxy_inflight_requests 1.0" in await resp.text()

                await eventually(serving, 10, "the request to be in flight")
                proc.send_signal(signal.SIGTERM)
                started = time.monotonic()
                response = await in_flight
                assert response.status == 200 and (await response.json())["result"] == "0x7a69"
                closing = await ws.receive(timeout=10)  # the frame was sent at SIGTERM; read it now
                assert closing.type is aiohttp.WSMsgType.CLOSE
                assert closing.data == aiohttp.WSCloseCode.GOING_AWAY and closing.extra == "server shutting down"
                await ws.close()
            assert proc.wait(15) == 0
            assert time.monotonic() - started < 10
            err.seek(0)
            assert b"Traceback" not in err.read()


def test_the_recommended_redis_eviction_policy_is_documented() -> None:
    assert "maxmemory-policy allkeys-lru" in (ROOT / "docs/caching.md").read_text()


def test_per_call_lines_are_logged_only_with_access_log() -> None:
    from proxy import logs

    root, access = logging.getLogger(), logging.getLogger("proxy.access")
    saved = (root.handlers[:], root.level, access.level)
    try:
        logs.setup("json", "INFO", access_log=False)
        assert not access.isEnabledFor(logging.INFO) and logging.getLogger("proxy.chain").isEnabledFor(logging.INFO)
        logs.setup("json", "INFO", access_log=True)
        assert access.isEnabledFor(logging.INFO)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        access.setLevel(saved[2])
