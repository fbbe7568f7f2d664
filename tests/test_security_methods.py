"""Methods: an allow-list matched exactly, after a name check that comes before any memo."""

from __future__ import annotations

import pytest

from proxy.http.app_keys import GATEWAY
from proxy.rpc.methods import refusal
from tests.support import Anvil, Proxy, ProxyFactory

# What the proxy asks on its own (head polls, chain identity), whatever the clients send.
OWN_CALLS = frozenset({"eth_getBlockByNumber", "eth_blockNumber", "eth_chainId"})


def forwarded(proxy: Proxy) -> set[str]:
    """Methods that reached the node other than the proxy's own head and identity calls."""
    return set(proxy.upstreams["evm"].calls) - OWN_CALLS


def call(method: str) -> dict[str, object]:
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": []}


class TestRefusal:
    def test_the_public_read_surface_is_served_by_default(self) -> None:
        for method in (
            "eth_chainId",
            "eth_getBalance",
            "eth_sendRawTransaction",
            "net_version",
            "web3_clientVersion",
            "getSlot",
            "eth_estimateGas",
        ):
            assert refusal(method, frozenset(), frozenset()) is None, method

    def test_settings_name_more_methods_and_namespaces(self) -> None:
        assert refusal("evm_snapshot", frozenset({"evm_snapshot"}), frozenset()) is None
        assert refusal("txpool_content", frozenset(), frozenset({"txpool"})) is None
        assert refusal("txpool_status", frozenset({"txpool_content"}), frozenset()) is not None


@pytest.mark.parametrize(
    "method",
    [
        "eth_sendTransaction",
        "eth_sign",
        "anvil_setBalance",
        "evm_snapshot",
        "hardhat_mine",
        "txpool_content",
        "ots_getApiLevel",
        "requestAirdrop",
        "Admin_nodeInfo",
        "ADMIN_NODEINFO",
    ],
)
async def test_methods_off_the_allow_list_are_method_not_found_and_never_forwarded(
    evm_proxy: Proxy, method: str
) -> None:
    status, reply, _ = await evm_proxy.post(call(method))
    assert status == 200 and reply["error"]["code"] == -32601, reply
    assert not forwarded(evm_proxy)


@pytest.mark.parametrize(
    "method",
    [
        " admin_nodeInfo",
        "admin_nodeInfo ",
        "аdmin_nodeInfo",
        "eth_call\n",
        "eth-call",
        "1eth_call",
        "eth_chainId\u200b",
    ],
)
async def test_look_alike_method_names_are_invalid_requests(evm_proxy: Proxy, method: str) -> None:
    status, reply, _ = await evm_proxy.post(call(method))
    assert status == 400 and reply["error"]["code"] == -32600, reply
    assert not forwarded(evm_proxy)


async def test_allow_methods_and_allow_namespaces_open_more_of_the_node(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, ALLOW_METHODS="evm_snapshot", ALLOW_NAMESPACES="txpool")
    assert "result" in await proxy.call("evm_snapshot", [])
    assert "result" in await proxy.call("txpool_status", [])
    assert (await proxy.call("evm_revert", ["0x1"]))["error"]["code"] == -32601


async def test_subscriptions_are_refused_by_their_own_rule_not_the_allow_list(evm_proxy: Proxy) -> None:
    reply = await evm_proxy.call("eth_subscribe", ["newHeads"])
    assert reply["error"]["code"] == -32601 and "needs a WebSocket" in reply["error"]["message"]


async def test_a_method_name_over_128_bytes_is_refused_before_routing_and_never_remembered(evm_proxy: Proxy) -> None:
    routes = evm_proxy.app[GATEWAY].router.default_routes
    before = dict(routes)
    for i in range(20):
        long_name = f"eth_{i}" + "a" * 200_000
        status, reply, _ = await evm_proxy.post(call(long_name))
        assert status == 400 and reply["error"]["code"] == -32600
        assert "at most 128" in reply["error"]["message"]
        # A 128-byte name of the right form is judged by the allow-list, before the route memo.
        _, reply, _ = await evm_proxy.post(call(f"eth_{i}" + "a" * 120))
        assert reply["error"]["code"] == -32601
    assert dict(routes) == before
    assert not forwarded(evm_proxy)
