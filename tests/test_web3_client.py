"""web3.py, as an app would use it, pointed at the proxy instead of the node."""

from __future__ import annotations

import json

import pytest
from web3 import AsyncHTTPProvider, AsyncWeb3, WebSocketProvider
from web3.exceptions import ContractLogicError

from tests.support import CONTRACTS, DEV_ACCOUNT, Anvil, Proxy, mapping_slot, selector, word

ABI = json.loads((CONTRACTS / "Store.abi").read_text())
SENDER = AsyncWeb3.to_checksum_address(DEV_ACCOUNT)


async def test_web3_reads_storage_calls_and_receipts_through_the_proxy(anvil: Anvil, evm_proxy: Proxy) -> None:
    w3 = AsyncWeb3(AsyncHTTPProvider(evm_proxy.url()))
    address = AsyncWeb3.to_checksum_address(anvil.deploy_store())
    store = w3.eth.contract(address=address, abi=ABI)
    await evm_proxy.head_at(anvil.block_number())  # a write the proxy did not see: up to one poll behind

    assert await w3.eth.chain_id == 31337
    assert await store.functions.x().call({"from": SENDER}) == 7
    assert await store.functions.bal(AsyncWeb3.to_checksum_address(DEV_ACCOUNT)).call({"from": SENDER}) == 42
    slot = await w3.eth.get_storage_at(address, int(mapping_slot(DEV_ACCOUNT, 1), 16))
    assert int.from_bytes(slot, "big") == 42

    receipt = anvil.send(address, selector("emitMany(uint256)") + word(2))
    # `latest` is the head tracker's latest: it trails the node by at most one poll interval.
    await evm_proxy.head_at(int(receipt["blockNumber"], 16))
    receipts = await w3.eth.get_block_receipts(int(receipt["blockNumber"], 16))
    assert [r["transactionHash"].to_0x_hex() for r in receipts] == [receipt["transactionHash"]]
    logs = await w3.eth.get_logs({"address": address, "fromBlock": 0, "toBlock": "latest"})
    assert len(logs) == 2
    events = store.events.Emitted().process_receipt(receipts[0])
    assert [e["args"]["i"] for e in events] == [0, 1]

    with pytest.raises(ContractLogicError) as reverted:
        await store.functions.boom().call({"from": SENDER})
    assert "nope" in str(reverted.value)

    block = await w3.eth.get_block("latest")
    uncle = await w3.provider.make_request("eth_getUncleByBlockHashAndIndex", [block["hash"].to_0x_hex(), "0x0"])
    assert uncle["result"] is None


async def test_web3_over_websocket(anvil: Anvil, evm_proxy: Proxy) -> None:
    address = AsyncWeb3.to_checksum_address(anvil.deploy_store())
    # eth_blockNumber is the head tracker's: a write the proxy did not see is up to one poll behind.
    await evm_proxy.head_at(anvil.block_number())
    async with AsyncWeb3(WebSocketProvider(evm_proxy.ws_url())) as w3:
        store = w3.eth.contract(address=address, abi=ABI)
        assert await w3.eth.block_number == anvil.block_number()
        assert await store.functions.x().call({"from": SENDER}) == 7
        slot = await w3.eth.get_storage_at(address, 0)
        assert int.from_bytes(slot, "big") == 7


async def test_web3_reads_state_at_a_block_named_by_its_hash_as_the_node_answers(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    # Rule: a block parameter may be a plain 32-byte hash, as geth reads it (a block hash, the
    # canonical chain not required): what web3.py sends for `block_identifier=<hash>` and ethers for
    # `blockTag`. It was refused as "block number exceeds 64 bits" on the state reads (found by an
    # outside attack: web3.py's get_balance, get_storage_at and call by hash failed through the proxy).
    address = AsyncWeb3.to_checksum_address(anvil.deploy_store())
    anvil.send(address, selector("setX(uint256)") + word(11))
    block = anvil.rpc("eth_getBlockByNumber", "latest", False)
    anvil.send(address, selector("setX(uint256)") + word(12))
    await evm_proxy.head_at(anvil.block_number())
    w3 = AsyncWeb3(AsyncHTTPProvider(evm_proxy.url()))
    at = block["hash"]
    store = w3.eth.contract(address=address, abi=ABI)
    assert int.from_bytes(await w3.eth.get_storage_at(address, 0, block_identifier=at), "big") == 11
    assert await store.functions.x().call({"from": SENDER}, block_identifier=at) == 11
    assert await w3.eth.get_balance(SENDER, block_identifier=at) == int(
        anvil.rpc("eth_getBalance", DEV_ACCOUNT, at), 16
    )
    assert await w3.eth.get_transaction_count(SENDER, block_identifier=at) == int(
        anvil.rpc("eth_getTransactionCount", DEV_ACCOUNT, at), 16
    )
    assert (await w3.eth.get_code(address, block_identifier=at)).to_0x_hex() == anvil.rpc("eth_getCode", address, at)
    for method, params in (
        ("eth_getStorageAt", [address, "0x0", at]),
        ("eth_getProof", [address, ["0x" + word(0)], at]),
        ("eth_estimateGas", [{"from": DEV_ACCOUNT, "to": address, "data": selector("setX(uint256)") + word(5)}, at]),
    ):
        answer = await w3.provider.make_request(method, params)
        assert answer.get("result") == anvil.rpc(method, *params), (method, answer)
