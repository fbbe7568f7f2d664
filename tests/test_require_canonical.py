"""EIP-1898 requireCanonical: part of the cache key and forwarded; with true, an entry is served
only while the tracker holds that hash as canonical."""

from __future__ import annotations

from typing import Any

from proxy.http.app_keys import SERVICE
from tests.support import Anvil, Proxy, eventually, word


def storage_at(address: str, block: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [address, "0x0", block]}


def node_reply(anvil: Anvil, request: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"result": anvil.rpc(request["method"], *request["params"])}
    except RuntimeError as error:
        return {"error": str(error)}


async def block_below_the_head(anvil: Anvil, proxy: Proxy) -> tuple[str, dict[str, Any]]:
    """A Store contract and an unfinalized block one below the head, both seen by the proxy's tracker."""
    address = anvil.deploy_store()
    anvil.mine(1)
    block: dict[str, Any] = anvil.rpc("eth_getBlockByNumber", "latest", False)
    anvil.mine(1)
    await proxy.head_at(int(block["number"], 16) + 1)
    return address, block


async def reorged_out(anvil: Anvil, proxy: Proxy, block_hash: str) -> None:
    """Replace the last 3 blocks and wait until the tracker has seen `block_hash` go."""
    anvil.rpc("anvil_reorg", 3, [])
    tracker = proxy.app[SERVICE].networks["evm"].tracker

    async def gone() -> bool:
        return block_hash.lower() in tracker.orphans and block_hash not in (
            tracker.head.numbers if tracker.head else {}
        )

    await eventually(gone, 10, "the tracker to see the reorg")


async def test_require_canonical_is_forwarded_and_keyed_apart_from_false(anvil: Anvil, evm_proxy: Proxy) -> None:
    address = anvil.deploy_store()
    block = anvil.rpc("eth_getBlockByNumber", "latest", False)
    anvil.mine(2)
    await evm_proxy.head_at(int(block["number"], 16) + 2)
    canonical = storage_at(address, {"blockHash": block["hash"], "requireCanonical": True})
    _, body, headers = await evm_proxy.post(canonical)
    assert body["result"] == "0x" + word(7) and headers["X-Cache"] == "MISS"
    assert (
        "eth_getStorageAt",
        [address, "0x" + word(0), {"blockHash": block["hash"], "requireCanonical": True}],
    ) in evm_proxy.upstreams["evm"].params
    _, _, headers = await evm_proxy.post(canonical)
    assert headers["X-Cache"] == "HIT"
    _, _, headers = await evm_proxy.post(storage_at(address, {"blockHash": block["hash"], "requireCanonical": False}))
    assert headers["X-Cache"] == "MISS"


async def test_require_canonical_entries_are_not_served_once_a_reorg_removes_the_hash(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    address, block = await block_below_the_head(anvil, evm_proxy)
    canonical = storage_at(address, {"blockHash": block["hash"], "requireCanonical": True})
    await evm_proxy.post(canonical)
    _, _, headers = await evm_proxy.post(canonical)
    assert headers["X-Cache"] == "HIT"

    await reorged_out(anvil, evm_proxy, block["hash"])
    _, body, headers = await evm_proxy.post(canonical)
    assert headers["X-Cache"] != "HIT"
    node = node_reply(anvil, canonical)
    assert ("error" in body) == ("error" in node) and body.get("result") == node.get("result"), (body, node)


async def test_answers_addressed_by_a_reorged_out_hash_are_never_served_from_the_cache(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    # Content-addressed answers (receipts by hash, logs by blockHash) of a block the tracker saw
    # replaced go upstream, uncached: the node may no longer know the block at all.
    address, block = await block_below_the_head(anvil, evm_proxy)
    calls = [
        {"jsonrpc": "2.0", "id": 1, "method": "eth_getBlockReceipts", "params": [block["hash"]]},
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "eth_getLogs",
            "params": [{"address": address, "blockHash": block["hash"]}],
        },
        storage_at(address, block["hash"]),  # a plain hash as a state read's block (geth, web3.py, ethers)
        storage_at(address, {"blockHash": block["hash"]}),
    ]
    for call in calls:
        await evm_proxy.post(call)
        assert (await evm_proxy.post(call))[2]["X-Cache"] == "HIT"

    await reorged_out(anvil, evm_proxy, block["hash"])
    for call in calls:
        _, body, headers = await evm_proxy.post(call)
        assert headers["X-Cache"] == "BYPASS", (call["method"], body)
        node = node_reply(anvil, call)
        assert ("error" in body) == ("error" in node) and body.get("result") == node.get("result"), (body, node)
