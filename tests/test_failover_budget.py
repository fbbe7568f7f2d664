"""Failover within the budget: each attempt gets its share of UPSTREAM_TIMEOUT, so a slow primary
leaves time for the backup; eth_getLogs' time limit holds per call, retries included."""

from __future__ import annotations

from tests.fake_upstream import bad_upstream
from tests.fault_relay import FaultRelay
from tests.support import Anvil, ProxyFactory

CHAIN_ID = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}


async def test_a_slow_primary_leaves_time_for_the_backup_within_the_upstream_timeout(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    async with bad_upstream(delay=3.0) as slow:
        proxy = await make_proxy(EVM_UPSTREAM=f"{slow},{anvil.url}", UPSTREAM_TIMEOUT="2")
        status, body, _ = await proxy.post(CHAIN_ID)
        assert status == 200 and body["result"] == "0x7a69"
        assert proxy.metric("rpc_proxy_upstream_errors_total", network="evm", upstream="0", kind="timeout") >= 1


async def test_an_explicit_attempt_timeout_bounds_each_attempt(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    async with bad_upstream(delay=3.0) as slow, bad_upstream(delay=3.0) as slower:  # two nodes: one is refused twice
        proxy = await make_proxy(
            EVM_UPSTREAM=f"{slow},{slower},{anvil.url}", UPSTREAM_TIMEOUT="2.5", UPSTREAM_ATTEMPT_TIMEOUT="0.5"
        )
        status, body, _ = await proxy.post(CHAIN_ID)
        assert status == 200 and body["result"] == "0x7a69"


async def test_the_getlogs_time_limit_holds_per_call_not_per_attempt(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    relay = await FaultRelay(anvil.url).start()
    proxy = await make_proxy(EVM_UPSTREAM=relay.url, GETLOGS_TIMEOUT="1")
    try:
        await proxy.head_at(0)
        # The first answer (an error at `latest` resolved to a number) comes late and makes the proxy
        # ask again with the tag; together the two take longer than the limit.
        relay.inject("error", method="eth_getLogs", delay=0.7)
        relay.inject("slow", method="eth_getLogs", delay=0.7)
        status, body, _ = await proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [{"fromBlock": "latest"}]}
        )
        assert body["error"] == {"code": -32005, "message": "query timeout exceeded"}, (status, body)
    finally:
        await relay.close()
