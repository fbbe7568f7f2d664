"""Upstream failures become clear JSON-RPC errors; the next URL takes over; URLs never leak."""

from __future__ import annotations

import json
import logging
import re
import urllib.request
from typing import Any

import pytest
from prometheus_client import generate_latest

from proxy.values import Answer
from tests.fake_upstream import bad_upstream
from tests.fault_relay import FaultRelay
from tests.support import Anvil, CountingUpstream, ProxyFactory, eventually, free_port

ADDRESS = "0x" + "ab" * 20
CHAIN_ID = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}


async def test_the_next_upstream_takes_over_when_the_primary_refuses_connections(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = await make_proxy(EVM_UPSTREAM=f"{dead},{anvil.url}")
    status, body, _ = await proxy.post(CHAIN_ID)
    assert status == 200 and body["result"] == "0x7a69"
    assert proxy.metric("rpc_proxy_upstream_failovers_total", network="evm") >= 1
    assert proxy.metric("rpc_proxy_upstream_errors_total", network="evm", upstream="0", kind="connect") >= 1


@pytest.mark.parametrize(("status", "body"), [(200, b"<html>oops</html>"), (503, b"busy"), (200, b'{"no":1}')])
async def test_a_broken_upstream_reply_is_a_json_rpc_error_not_a_500(
    status: int, body: bytes, make_proxy: ProxyFactory
) -> None:
    async with bad_upstream(status=status, body=body) as url:
        proxy = await make_proxy(EVM_UPSTREAM=url)
        http_status, reply, _ = await proxy.post(CHAIN_ID)
        assert http_status == 502
        assert reply["error"]["code"] == -32002 and reply["error"]["message"].startswith("upstream unavailable")
        assert reply["id"] == 1


async def test_a_broken_primary_fails_over_to_the_next(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    async with bad_upstream(status=500) as url:
        proxy = await make_proxy(EVM_UPSTREAM=f"{url},{anvil.url}")
        assert (await proxy.result("eth_chainId", [])) == "0x7a69"


async def test_a_reply_crowded_with_objects_fails_its_try_unparsed_and_the_next_upstream_answers(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    relay = await FaultRelay(anvil.url).start()
    try:
        proxy = await make_proxy(EVM_UPSTREAM=f"{relay.url},{anvil.url}")
        relay.inject("crowded", method="eth_getLogs")  # 1.2 MB of `{}`: ~110 MB once parsed
        logs = {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [{"fromBlock": "0x0", "toBlock": "0x0"}]}
        status, body, _ = await proxy.post(logs)
        assert status == 200 and body["result"] == [] and relay.applied == ["crowded"]
        assert proxy.metric("rpc_proxy_upstream_errors_total", network="evm", upstream="0", kind="invalid") == 1

        relay.inject("crowded", method="eth_getBlockByNumber", batches_only=True)  # the head poll's reply too

        async def refused() -> bool:
            return proxy.metric("rpc_proxy_upstream_errors_total", network="evm", upstream="0", kind="invalid") == 2

        await eventually(refused, 10, "the head poll's crowded reply to be refused")
        await proxy.head_at(anvil.mine(1))
    finally:
        await relay.close()


def brace_revert(length: int) -> str:
    """Initcode that writes `length` `{` bytes to memory and reverts with them as its Error(string)."""
    fill = f"5b7f{'7b' * 32}815260200180 62{0x60 + length:06x} 1160025750"  # MSTORE 32 `{` a time from 0x60
    revert = f"6308c379a0600052602060205262{length:06x}60405262{68 + length:06x}601cfd"  # Error(string)
    return "0x6060" + (fill + revert).replace(" ", "")


async def test_a_reply_dense_in_braces_inside_its_strings_is_served_as_the_node_answers(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url)
    call = {"jsonrpc": "2.0", "id": 1, "method": "eth_call", "params": [{"data": brace_revert(30_000)}, "latest"]}
    request = urllib.request.Request(anvil.url, json.dumps(call).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        direct = response.read()  # 90 KB, a `{` per 3 bytes, all inside its strings
    assert direct.count(b"{") > len(direct) // 16
    status, body, _ = await proxy.post(call)
    assert status == 200 and body == json.loads(direct)
    assert body["error"]["message"] == "execution reverted: " + "{" * 30_000
    assert proxy.metric("rpc_proxy_upstream_errors_total", network="evm", upstream="0", kind="invalid") == 0


async def test_an_answer_with_both_a_result_and_an_error_fails_its_try(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    relay = await FaultRelay(anvil.url).start()
    try:
        proxy = await make_proxy(EVM_UPSTREAM=f"{relay.url},{anvil.url}")
        relay.inject("both", method="eth_getTransactionCount")
        status, body, _ = await proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_getTransactionCount", "params": [ADDRESS, "latest"]}
        )
        assert status == 200 and body.get("result") == "0x0" and relay.applied == ["both"]
        assert proxy.metric("rpc_proxy_upstream_errors_total", network="evm", upstream="0", kind="mismatch") == 1
    finally:
        await relay.close()


async def test_a_slow_upstream_times_out_with_504(make_proxy: ProxyFactory) -> None:
    async with bad_upstream(delay=5.0) as url:
        proxy = await make_proxy(EVM_UPSTREAM=url, UPSTREAM_TIMEOUT="0.3")
        status, reply, _ = await proxy.post(CHAIN_ID)
        assert status == 504 and reply["error"]["code"] == -32002 and "timeout" in reply["error"]["message"]


async def test_upstream_urls_never_appear_in_responses_logs_or_metrics(
    caplog: pytest.LogCaptureFixture, make_proxy: ProxyFactory
) -> None:
    secret = "sk-live-0123456789abcdef"
    port = free_port()
    caplog.set_level(logging.DEBUG)
    proxy = await make_proxy(EVM_UPSTREAM=f"http://127.0.0.1:{port}/v3/{secret}", LOG_LEVEL="DEBUG")
    _, reply, _ = await proxy.post(CHAIN_ID)
    assert reply["error"]["code"] == -32002
    async with proxy.session.get(proxy.base + "/readyz") as resp:
        ready_text = await resp.text()
    # The port as a number of its own (a metric's float, a timestamp, may hold its digits by chance).
    port_alone = re.compile(rf"(?<![0-9]){port}(?![0-9])")
    for text in (str(reply), ready_text, caplog.text, generate_latest(proxy.registry).decode()):
        assert secret not in text and port_alone.search(text) is None


class FaultyUpstream(CountingUpstream):
    """An upstream whose client code fails unexpectedly for one method (a bug, not a node error)."""

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer:
        if method == "eth_gasPrice":
            raise RuntimeError("secret internals: connection pool state 0xdeadbeef")
        return await super().request(method, params, timeout=timeout)

    async def proven(
        self, method: str, params: Any, block: str, *, index: int | None = None, timeout: float | None = None
    ) -> Answer:
        if method == "eth_gasPrice":  # a read kept for the head goes with its proof header (proofs.py)
            raise RuntimeError("secret internals: connection pool state 0xdeadbeef")
        return await super().proven(method, params, block, index=index, timeout=timeout)


async def test_an_internal_fault_fails_only_its_call_and_never_leaks_internals(
    anvil: Anvil, caplog: pytest.LogCaptureFixture, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, upstream_class=FaultyUpstream)
    status, body, _ = await proxy.post(
        [{"jsonrpc": "2.0", "id": 1, "method": "eth_gasPrice", "params": []}, CHAIN_ID | {"id": 2}]
    )
    assert status == 200
    assert body[0]["error"] == {"code": -32603, "message": "internal error"}
    assert body[1]["result"] == "0x7a69"  # the rest of the batch is answered
    assert "secret internals" not in json.dumps(body)
    assert "secret internals" in caplog.text  # for the operator, in the log
    status, alone, _ = await proxy.post({"jsonrpc": "2.0", "id": 3, "method": "eth_gasPrice", "params": []})
    assert status == 500 and alone["error"] == {"code": -32603, "message": "internal error"}
    assert (await proxy.post(CHAIN_ID))[0] == 200  # and the server keeps serving
