"""API keys, and the choice of network: Host header, then path prefix, then method family."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from tests.fake_solana import TOKEN_ACCOUNT, FakeSolana
from tests.support import Anvil, ProxyFactory

CHAIN_ID = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}
CLIENT_VERSION = {"jsonrpc": "2.0", "id": 1, "method": "web3_clientVersion", "params": []}  # always forwarded


async def test_unknown_or_missing_key_is_401_with_a_json_rpc_error(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS="alice,bob")
    status, body, _ = await proxy.post(CHAIN_ID, key="mallory")
    assert status == 401 and body["error"]["code"] == -32001 and "invalid API key" in body["error"]["message"]
    async with proxy.session.post(proxy.base + "/v3", data=json.dumps(CHAIN_ID)) as resp:
        assert resp.status == 401
    status, body, _ = await proxy.post(CLIENT_VERSION, key="mallory")
    assert status == 401
    status, body, _ = await proxy.post(CLIENT_VERSION, key="bob")
    assert status == 200 and body["result"].startswith("anvil")
    assert proxy.upstreams["evm"].calls["web3_clientVersion"] == 1  # mallory's never went upstream


async def test_websocket_upgrade_with_a_bad_key_is_refused_with_401(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS="alice")
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await proxy.session.ws_connect(proxy.ws_url("mallory"))
    assert refused.value.status == 401
    async with proxy.session.ws_connect(proxy.ws_url("alice")) as ws:
        await ws.send_str(json.dumps(CHAIN_ID))
        assert json.loads((await ws.receive(timeout=5)).data)["result"] == "0x7a69"


async def test_keys_file_configures_keys(anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text("[keys.alice]\ndaily_credits = 3000000\n")
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=str(keys))
    assert (await proxy.post(CHAIN_ID, key="alice"))[0] == 200
    assert (await proxy.post(CHAIN_ID, key="bob"))[0] == 401


async def test_open_mode_accepts_any_key(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url)
    assert (await proxy.post(CHAIN_ID, key="anything"))[0] == 200


async def test_a_declared_host_routes_however_the_host_header_writes_it(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    """Rule: a Host header matches `hosts` in one normal form (host_names.py): its port dropped, IPv6
    addresses canonical, case and one trailing dot ignored, on either side; a Unicode entry matches the
    IDNA A-label clients send."""
    side_node = Anvil("--chain-id", "5")
    networks = tmp_path / "networks.toml"
    networks.write_text(
        f'[networks.first]\nfamily = "evm"\nupstreams = ["{anvil.url}"]\n'
        f'[networks.second]\nfamily = "evm"\nupstreams = ["{side_node.url}"]\n'
        'hosts = ["[::1]", "v.example", "w.example.", "bücher.example"]\n'
    )
    proxy = await make_proxy(NETWORKS_FILE=str(networks))
    try:
        for host in (
            "[::1]:80",
            "[0:0:0:0:0:0:0:1]",
            "[::1]",
            "v.example.",
            "V.Example:8545",
            "w.example",
            "w.example.",
            "xn--bcher-kva.example",
        ):
            status, body, _ = await proxy.post(CHAIN_ID, headers={"Host": host})
            assert status == 200 and body["result"] == "0x5", (host, body)
        _, body, _ = await proxy.post(CHAIN_ID, headers={"Host": "x.example"})
        assert body["result"] == "0x7a69"
    finally:
        side_node.stop()


async def test_network_is_chosen_by_declared_host_then_path_then_host_label_then_method_family(
    tmp_path: Path, solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    main_node, side_node = Anvil(), Anvil("--chain-id", "5")
    networks = tmp_path / "networks.toml"
    networks.write_text(
        f'[networks.mainnet]\nfamily = "evm"\nupstreams = ["{main_node.url}"]\n'
        f'[networks.goerli]\nfamily = "evm"\nupstreams = ["{side_node.url}"]\nhosts = ["rpc.goerli.example"]\n'
        f'[networks.sol]\nfamily = "solana"\nupstreams = ["{solana.url}"]\n'
    )
    proxy = await make_proxy(NETWORKS_FILE=str(networks))
    try:
        # Method family: EVM methods go to the first EVM network, Solana ones to the Solana network.
        assert (await proxy.result("eth_chainId", [])) == "0x7a69"
        assert (await proxy.result("getTokenAccountBalance", [TOKEN_ACCOUNT]))["value"]["amount"] == "9864"
        # Path prefix.
        status, body, _ = await proxy.post(CHAIN_ID, network="goerli")
        assert body["result"] == "0x5"
        # Host header: its first label names a network, or a declared host name matches.
        for host in ("goerli.rpc.example.com", "rpc.goerli.example"):
            _, body, _ = await proxy.post(CHAIN_ID, headers={"Host": host})
            assert body["result"] == "0x5", host
        # The path names the network explicitly: a first label (any client may send any Host) is only
        # a guess and never overrides it; a host the operator declared in `hosts` still does.
        _, body, _ = await proxy.post(CHAIN_ID, network="mainnet", headers={"Host": "goerli.rpc.example.com"})
        assert body["result"] == "0x7a69"
        _, body, _ = await proxy.post(CHAIN_ID, network="goerli", headers={"Host": "mainnet.cheap.example"})
        assert body["result"] == "0x5"
        _, body, _ = await proxy.post(CHAIN_ID, network="mainnet", headers={"Host": "rpc.goerli.example"})
        assert body["result"] == "0x5"
        ws_url = f"ws://127.0.0.1:{proxy.server.port}/mainnet/ws/v3/test-key"
        async with proxy.session.ws_connect(ws_url, headers={"Host": "goerli.rpc.example.com"}) as ws:
            await ws.send_json(CHAIN_ID)
            assert (await ws.receive_json(timeout=10))["result"] == "0x7a69"
        # An unknown path network is a clear 404.
        status, body, _ = await proxy.post(CHAIN_ID, network="nope")
        assert status == 404 and "unknown network" in body["error"]["message"]
    finally:
        main_node.stop()
        side_node.stop()
