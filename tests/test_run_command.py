"""The run command (README.md, docs/quickstart.md), as an operator runs it: a real process in front of a real Anvil."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import urllib.request

from proxy.app import create_app
from proxy.http.listeners import serve
from tests.support import DEV_ACCOUNT, Anvil, free_port, settings_for, wait_until


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return dict(json.loads(response.read()))


def _cache_of(url: str, body: dict[str, object]) -> str:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(response.headers["X-Cache"])


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def test_python_m_proxy_serves_a_request_from_anvil(anvil: Anvil) -> None:
    port = free_port()
    env = {
        **os.environ,
        "EVM_UPSTREAM": anvil.url,
        "PROXY_PORT": str(port),
        "LOG_FORMAT": "json",
        "ACCESS_LOG": "true",
        "HEAD_POLL_INTERVAL": "0.05",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_until(lambda: _ready(port), 15, "the proxy to listen")
        url = f"http://127.0.0.1:{port}/v3/any-key"
        reply = _post(url, {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId"})
        assert reply == {"jsonrpc": "2.0", "id": 1, "result": "0x7a69"}
        anvil.mine(70)
        storage = {"jsonrpc": "2.0", "id": 2, "method": "eth_getStorageAt", "params": [DEV_ACCOUNT, "0x0", "0x1"]}
        # Once the tracker has the new head, block 1 is final: the first ask fills, the next hit.
        wait_until(lambda: _cache_of(url, storage) == "HIT", 15, "a cache hit")
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any("running open" in line["msg"] for line in lines)  # said at startup
    assert any(line.get("method") == "eth_chainId" and "request_id" in line for line in lines)
    hits = [line for line in lines if line.get("method") == "eth_getStorageAt" and line.get("cache") == "HIT"]
    assert hits and hits[-1]["outcome"] == "ok" and "request_id" in hits[-1]
    assert anvil.url not in err


def test_console_script_reports_missing_upstream_in_one_line() -> None:
    script = os.path.join(os.path.dirname(sys.executable), "rpc-proxy")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_UPSTREAM") and k != "NETWORKS_FILE"}
    result = subprocess.run([script], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "no upstream configured" in result.stderr


async def test_what_the_process_built_before_listening_is_frozen_out_of_the_collectors_passes(anvil: Anvil) -> None:
    """The rule: modules, tables and the app live as long as the process, so a full collection never
    walks them (gc.freeze once listening: bench.miss_latency's p99 at 32 connections fell to about a third)."""
    app = create_app(settings_for(EVM_UPSTREAM=anvil.url))
    frozen: list[int] = []

    def listening() -> None:
        frozen.append(gc.get_freeze_count())
        os.kill(os.getpid(), signal.SIGINT)  # the operator's Ctrl-C: serve drains and returns

    try:
        await serve(app, "127.0.0.1", free_port(), max_connections=10, shutdown_timeout=1.0, on_listening=listening)
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 10_000  # far more than a handful: the whole startup heap
