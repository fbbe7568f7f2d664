"""The node's own WebSocket behind the proxy (EVM_UPSTREAM_WS, or ws:// upstreams in NETWORKS_FILE):
pushed heads reach subscribers without waiting for a poll, and kinds the proxy does not serve itself
(newPendingTransactions) are relayed to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config import ConfigError, build_settings
from proxy.state import STREAMS
from tests.support import DEV_ACCOUNT, Anvil, eventually, selector, settings_for, start_proxy, word
from tests.ws_client import connect


def ws_of(anvil: Anvil) -> str:
    return anvil.url.replace("http://", "ws://")


async def test_pushed_heads_and_their_logs_arrive_without_waiting_for_a_poll(anvil: Anvil) -> None:
    store = anvil.deploy_store()
    # One poll at startup, the next a minute later: only the node's push can deliver these blocks.
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=ws_of(anvil),
                                           HEAD_POLL_INTERVAL="60"))
    try:
        await proxy.head_at(anvil.block_number())
        client = await connect(proxy)
        heads = await client.subscribe("newHeads")
        logs = await client.subscribe("logs", {"address": store})
        feed = proxy.app[STREAMS].feeds["evm"]

        async def pushing() -> bool:
            return feed.push_live

        await eventually(pushing, 5, "the feed's push subscription on the node")
        start = anvil.block_number()
        anvil.send(store, selector("emitMany(uint256)") + word(1))
        anvil.mine(1)
        await client.notes_until(3)
        assert [int(h["number"], 16) for h in client.results(heads)] == [start + 1, start + 2]
        assert [entry["blockNumber"] for entry in client.results(logs)] == [hex(start + 1)]
    finally:
        await proxy.close()


async def test_new_pending_transactions_are_relayed_to_the_nodes_websocket(anvil: Anvil) -> None:
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=ws_of(anvil)))
    try:
        client = await connect(proxy)
        pending = await client.subscribe("newPendingTransactions")
        tx_hash = anvil.rpc("eth_sendTransaction", {"from": DEV_ACCOUNT, "to": DEV_ACCOUNT, "value": "0x1"})
        await client.notes_until(1)
        assert client.results(pending) == [tx_hash]
        assert (await client.call("eth_unsubscribe", pending))["result"] is True
    finally:
        await proxy.close()


def test_ws_upstreams_in_a_networks_file_are_the_nodes_websocket(tmp_path: Path) -> None:
    path = tmp_path / "networks.toml"
    path.write_text('[networks.main]\nfamily = "evm"\nupstreams = ["http://127.0.0.1:1", "ws://127.0.0.1:1"]\n')
    (network,) = build_settings({"NETWORKS_FILE": str(path)}).networks
    assert network.upstreams == ("http://127.0.0.1:1",) and network.ws_upstreams == ("ws://127.0.0.1:1",)


@pytest.mark.parametrize(("raw", "fragment"), [
    ({"EVM_UPSTREAM": "http://x", "EVM_UPSTREAM_WS": "http://x"}, "EVM_UPSTREAM_WS: WebSocket upstream #0 is not"),
    ({"SOLANA_UPSTREAM": "http://x", "EVM_UPSTREAM_WS": "ws://x"}, "EVM_UPSTREAM_WS needs EVM_UPSTREAM"),
    ({"EVM_UPSTREAM": "http://x", "SUBSCRIPTION_CREDITS": "logs"}, "kind=credits pairs"),
    ({"EVM_UPSTREAM": "http://x", "SUBSCRIPTION_CREDITS": "logs=-1"}, "SUBSCRIPTION_CREDITS logs"),
])
def test_websocket_settings_are_checked_at_startup(raw: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        build_settings(raw)
