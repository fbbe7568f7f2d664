"""Real JavaScript clients (ethers v6, viem 2 from npm, installed by scripts/test.sh) as apps use them:
the same script against the proxy and against Anvil directly must see the same things."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest

from tests.support import CONTRACTS, ROOT, Anvil, Proxy

NODE_PATH = str(ROOT / ".tools/node_modules")


async def run_app(script: str, http_url: str, ws_url: str, node_url: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        "node",
        str(ROOT / "tests/clients" / script),
        http_url,
        ws_url,
        str(CONTRACTS),
        node_url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NODE_PATH": NODE_PATH},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode()[-2000:]
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


@pytest.fixture(params=["proxy", "anvil"])
def endpoints(request: pytest.FixtureRequest, anvil: Anvil, evm_proxy: Proxy) -> tuple[str, str, str]:
    """The app's HTTP and WebSocket URLs, and the node's own URL, which only mines blocks on demand."""
    if request.param == "proxy":
        return evm_proxy.url(), evm_proxy.ws_url(), anvil.url
    return anvil.url, anvil.url.replace("http://", "ws://"), anvil.url


async def test_an_ethers_app_sees_through_the_proxy_what_it_sees_on_the_node(endpoints: tuple[str, str, str]) -> None:
    seen = await run_app("ethers_app.cjs", *endpoints)
    assert seen == {
        "setXStatus": 1,
        "httpX": "9",
        "wsX": "9",
        "revert": "CALL_EXCEPTION:nope",
        "events": 20,
        "uniqueEvents": 20,
        "eventsMatchReceipts": True,  # contract.on: each event exactly once
        "httpEvents": 20,
        "httpEventsSameAsWs": True,  # contract.on over HTTP (node-side filters), no settings
        "blocksConsecutive": True,
        "blocksSeen": True,
        "queryFilter": 20,
    }


async def test_a_viem_app_sees_through_the_proxy_what_it_sees_on_the_node(endpoints: tuple[str, str, str]) -> None:
    seen = await run_app("viem_app.cjs", *endpoints)
    assert seen == {
        "deployStatus": "success",
        "httpX": "7",
        "wsX": "7",
        "events": 5,
        "uniqueEvents": 5,
        "blocksConsecutive": True,
        "getLogs": 5,
        "wsGetLogs": 5,
    }


@pytest.mark.parametrize("calls", [150, 1000])
async def test_viem_batch_true_with_150_and_1000_concurrent_calls(anvil: Anvil, evm_proxy: Proxy, calls: int) -> None:
    seen = {}
    for url in (evm_proxy.url(), anvil.url):
        proc = await asyncio.create_subprocess_exec(
            "node",
            str(ROOT / "tests/clients/viem_batch.cjs"),
            url,
            str(calls),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "NODE_PATH": NODE_PATH},
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()[-2000:]
        seen[url] = json.loads(out.decode().strip().splitlines()[-1])["balances"]
    assert seen[evm_proxy.url()] == seen[anvil.url] and len(seen[anvil.url]) == calls
    assert evm_proxy.upstreams["evm"].calls["eth_getBalance"] <= calls  # each asked upstream once at most
