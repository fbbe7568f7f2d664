"""EIP-1898 requireCanonical: part of the cache key and forwarded; with true, an entry is served
only while the tracker holds that hash as canonical."""

from __future__ import annotations

from typing import Any

from proxy.state import SERVICE
from tests.support import Anvil, Proxy, eventually, word


def storage_at(address: str, block: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [address, "0x0", block]}


def node_reply(anvil: Anvil, request: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"result": anvil.rpc(request["method"], *request["params"])}
    except RuntimeError as error:
        return {"error": str(error)}


async def test_require_canonical_is_forwarded_and_keyed_apart_from_false(anvil: Anvil, evm_proxy: Proxy) -> None:
    address = anvil.deploy_store()
    block = anvil.rpc("eth_getBlockByNumber", "latest", False)
    anvil.mine(2)
    await evm_proxy.head_at(int(block["number"], 16) + 2)
    canonical = storage_at(address, {"blockHash": block["hash"], "requireCanonical": True})
    _, body, headers = await evm_proxy.post(canonical)
    assert body["result"] == "0x" + word(7) and headers["X-Cache"] == "MISS"
    assert ("eth_getStorageAt", [address, "0x" + word(0), {"blockHash": block["hash"], "requireCanonical": True}]
            ) in evm_proxy.upstreams["evm"].params
    _, _, headers = await evm_proxy.post(canonical)
    assert headers["X-Cache"] == "HIT"
    _, _, headers = await evm_proxy.post(storage_at(address, {"blockHash": block["hash"], "requireCanonical": False}))
    assert headers["X-Cache"] == "MISS"


async def test_require_canonical_entries_are_not_served_once_a_reorg_removes_the_hash(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    address = anvil.deploy_store()
    anvil.mine(1)
    block = anvil.rpc("eth_getBlockByNumber", "latest", False)
    anvil.mine(1)
    await evm_proxy.head_at(int(block["number"], 16) + 1)
    canonical = storage_at(address, {"blockHash": block["hash"], "requireCanonical": True})
    await evm_proxy.post(canonical)
    _, _, headers = await evm_proxy.post(canonical)
    assert headers["X-Cache"] == "HIT"

    anvil.rpc("anvil_reorg", 3, [])
    tracker = evm_proxy.app[SERVICE].networks["evm"].tracker

    async def reorged() -> bool:
        return tracker.head is not None and block["hash"] not in tracker.head.numbers

    await eventually(reorged, 10, "the tracker to see the reorg")
    _, body, headers = await evm_proxy.post(canonical)
    assert headers["X-Cache"] != "HIT"
    node = node_reply(anvil, canonical)
    assert ("error" in body) == ("error" in node) and body.get("result") == node.get("result"), (body, node)


async def test_answers_addressed_by_a_reorged_out_hash_are_never_served_from_the_cache(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    # Content-addressed answers (receipts by hash, logs by blockHash) of a block the tracker saw
    # replaced go upstream, uncached: the node may no longer know the block at all.
    address = anvil.deploy_store()
    anvil.mine(1)
    block = anvil.rpc("eth_getBlockByNumber", "latest", False)
    anvil.mine(1)
    await evm_proxy.head_at(int(block["number"], 16) + 1)
    calls = [
        {"jsonrpc": "2.0", "id": 1, "method": "eth_getBlockReceipts", "params": [block["hash"]]},
        {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [{"address": address,
                                                                         "blockHash": block["hash"]}]},
    ]
    for call in calls:
        await evm_proxy.post(call)
        assert (await evm_proxy.post(call))[2]["X-Cache"] == "HIT"

    anvil.rpc("anvil_reorg", 3, [])
    tracker = evm_proxy.app[SERVICE].networks["evm"].tracker

    async def reorged() -> bool:
        return block["hash"].lower() in tracker.orphans

    await eventually(reorged, 10, "the tracker to see the reorg")
    for call in calls:
        _, body, headers = await evm_proxy.post(call)
        assert headers["X-Cache"] == "BYPASS", (call["method"], body)
        node = node_reply(anvil, call)
        assert ("error" in body) == ("error" in node) and body.get("result") == node.get("result"), (body, node)
