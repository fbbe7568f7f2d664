"""Operator signals: rpc_proxy_redis_up only with Redis, process and Python collectors, INFO when a node
comes back, one access line per request (key name, client IP, status, total and upstream ms; never the
secret), and SIGHUP reloading keys and allow-lists under traffic without losing a request."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from proxy.http.access_log import client_ip
from tests.support import Anvil, ProxyFactory, eventually, free_port, wait_until

CHAIN_ID = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}


async def test_redis_up_is_exported_only_when_redis_is_configured_and_process_metrics_always(
    anvil: Anvil,
    redis_url: str,
    make_proxy: ProxyFactory,
) -> None:
    for extra, has_redis in (({}, False), ({"REDIS_URL": redis_url}, True)):
        proxy = await make_proxy(EVM_UPSTREAM=anvil.url, **extra)
        async with proxy.session.get(proxy.base + "/metrics") as resp:
            text = await resp.text()
        assert ("rpc_proxy_redis_up" in text) is has_redis
        assert "process_resident_memory_bytes" in text and "python_info" in text


async def test_a_node_that_comes_back_is_said_at_info(
    anvil: Anvil, caplog: pytest.LogCaptureFixture, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, LOG_LEVEL="INFO")
    caplog.set_level(logging.INFO, "proxy.upstream")
    await proxy.head_at(0)
    anvil.stop()

    async def failed() -> bool:
        return proxy.metric("rpc_proxy_upstream_errors_total", network="evm", upstream="0", kind="connect") > 0

    await eventually(failed, 10, "the node to be seen down")
    anvil.__init__(port=anvil.port)  # type: ignore[misc]

    async def back() -> bool:
        return any("upstream evm#0 is reachable again" in r.getMessage() for r in caplog.records)

    await eventually(back, 15, "an INFO line saying the node is back")
    assert anvil.url not in caplog.text


class TestClientIp:
    class Request:
        def __init__(self, headers: dict[str, str]) -> None:
            self.headers = headers
            self.remote = "10.0.0.9"

    def test_the_trusted_proxys_entry_is_the_last_forwarded_for(self) -> None:
        request = self.Request({"X-Forwarded-For": "6.6.6.6, 203.0.113.7"})
        assert client_ip(request, "X-Forwarded-For") == "203.0.113.7"  # type: ignore[arg-type]
        assert client_ip(request, None) == "10.0.0.9"  # type: ignore[arg-type]  # no trusted proxy: the peer


def _start(env: dict[str, str], port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy"],
        env={**os.environ, **env, "PROXY_PORT": str(port)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def listening() -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    wait_until(listening, 20, "the proxy to listen")
    return proc


def _stop(proc: subprocess.Popen[str]) -> list[dict[str, object]]:
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=20)
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


async def test_access_log_line_has_key_client_status_and_times_but_never_the_secret(anvil: Anvil) -> None:
    port = free_port()
    proc = _start(
        {
            "EVM_UPSTREAM": anvil.url,
            "API_KEYS": "sk-secret-1",
            "ACCESS_LOG": "true",
            "LOG_FORMAT": "json",
            "TRUSTED_PROXY_HEADER": "X-Forwarded-For",
        },
        port,
    )
    lines: list[dict[str, object]] = []
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/v3"
            balance = {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": ["0x" + "55" * 20, "0x0"]}
            for headers in (
                {"Authorization": "Bearer sk-secret-1", "X-Forwarded-For": "203.0.113.7"},
                {"X-Api-Key": "wrong-secret"},
            ):
                async with session.post(url, json=balance, headers=headers) as resp:
                    await resp.read()
    finally:
        lines = _stop(proc)
    # (the start-up's /readyz polls have their lines too)
    requests = [line for line in lines if line.get("msg") == "request" and line.get("path") == "/v3"]
    ok, refused = requests[0], requests[1]
    assert ok["method"] == "POST"
    assert ok["key"].startswith("key-") and ok["client"] == "203.0.113.7" and ok["status"] == 200  # type: ignore[union-attr]
    assert ok["cache"] == "MISS" and isinstance(ok["total_ms"], float) and isinstance(ok["upstream_ms"], float)
    assert refused["key"] == "invalid" and refused["status"] == 401
    everything = json.dumps(lines)
    assert "sk-secret-1" not in everything and "wrong-secret" not in everything


async def test_sighup_reloads_keys_and_lists_under_traffic_without_losing_a_request(
    anvil: Anvil,
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.alice]\nkey = "alice-secret"\n')
    port = free_port()
    proc = _start({"EVM_UPSTREAM": anvil.url, "API_KEYS_FILE": str(keys), "LOG_FORMAT": "json"}, port)
    base = f"http://127.0.0.1:{port}"
    answered: list[int] = []
    stop = asyncio.Event()
    try:
        async with aiohttp.ClientSession() as session:

            async def traffic() -> None:
                while not stop.is_set():
                    async with session.post(f"{base}/v3/alice-secret", json=CHAIN_ID) as resp:
                        answered.append(resp.status if "result" in await resp.json() else -resp.status)

            async def status(key: str) -> int:
                async with session.post(f"{base}/v3/{key}", json=CHAIN_ID) as resp:
                    return resp.status

            async with session.ws_connect(f"ws://127.0.0.1:{port}/ws/v3/alice-secret") as ws:
                clients = [asyncio.create_task(traffic()) for _ in range(4)]
                assert await status("bob-secret") == 401
                keys.write_text(
                    '[keys.alice]\nkey = "alice-secret"\nallowed_methods = ["eth_chainId"]\n'
                    '[keys.bob]\nkey = "bob-secret"\n'
                )
                proc.send_signal(signal.SIGHUP)

                async def reloaded() -> bool:
                    return await status("bob-secret") == 200

                await eventually(reloaded, 15, "bob's key to be accepted after SIGHUP")
                async with session.post(f"{base}/v3/alice-secret", json={**CHAIN_ID, "method": "eth_blockNumber"}) as r:
                    assert "allowed_methods" in (await r.json())["error"]["message"]  # alice's new list applies
                await ws.send_str(json.dumps(CHAIN_ID))  # the connection opened before the reload still serves
                assert json.loads((await ws.receive()).data)["result"] == "0x7a69"
                stop.set()
                await asyncio.gather(*clients)
    finally:
        stop.set()
        lines = _stop(proc)
    assert answered and all(s == 200 for s in answered), [s for s in answered if s != 200][:5]
    assert any("SIGHUP: 2 key(s) reloaded (1 with allow-lists)" in str(line.get("msg")) for line in lines)
