"""web3.py as an app uses it, with no settings for the proxy: view calls without a default account,
ContractLogicError on revert, and subscriptions over AsyncWeb3's WebSocketProvider."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from web3 import AsyncHTTPProvider, AsyncWeb3, WebSocketProvider
from web3.exceptions import ContractLogicError

from tests.support import CONTRACTS, Anvil, Proxy, ProxyFactory, selector, word

ABI = json.loads((CONTRACTS / "Store.abi").read_text())


@pytest.fixture
async def http_w3(evm_proxy: Proxy) -> AsyncIterator[AsyncWeb3[Any]]:
    provider = AsyncHTTPProvider(evm_proxy.url())
    yield AsyncWeb3(provider)
    await provider.disconnect()  # web3 keeps its HTTP sessions cached until told


async def test_view_calls_need_no_default_account_over_http(
    anvil: Anvil,
    evm_proxy: Proxy,
    http_w3: AsyncWeb3[Any],
) -> None:
    w3 = http_w3
    store = w3.eth.contract(address=AsyncWeb3.to_checksum_address(anvil.deploy_store()), abi=ABI)
    await evm_proxy.head_at(anvil.block_number())  # deployed behind the proxy's back: wait for its head
    assert w3.eth.default_account is None or not w3.eth.default_account
    assert await store.functions.x().call() == 7
    assert await store.functions.x().call(block_identifier=anvil.block_number()) == 7
    async with w3.batch_requests() as batch:
        batch.add(store.functions.x())
        batch.add(w3.eth.get_block_number())
        x, number = await batch.async_execute()
    assert (x, number) == (7, anvil.block_number())
    with pytest.raises(ContractLogicError, match="nope"):
        await store.functions.boom().call()
    # eth_call without a block parameter: latest, as on the node.
    raw = await w3.provider.make_request("eth_call", [{"to": store.address, "data": selector("x()")}])
    assert int(raw["result"], 16) == 7


async def test_view_calls_and_reverts_over_websocket(anvil: Anvil, evm_proxy: Proxy) -> None:
    address = AsyncWeb3.to_checksum_address(anvil.deploy_store())
    await evm_proxy.head_at(anvil.block_number())
    async with AsyncWeb3(WebSocketProvider(evm_proxy.ws_url())) as w3:
        store = w3.eth.contract(address=address, abi=ABI)
        assert await store.functions.x().call() == 7
        with pytest.raises(ContractLogicError, match="nope"):
            await store.functions.boom().call()


async def _collect(w3: AsyncWeb3[Any], count: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    async with asyncio.timeout(15):
        async for message in w3.socket.process_subscriptions():
            messages.append(dict(message))
            if len(messages) >= count:
                break
    return messages


async def test_web3_subscribes_to_new_heads_and_logs(anvil: Anvil, evm_proxy: Proxy) -> None:
    address = anvil.deploy_store()
    await evm_proxy.head_at(anvil.block_number())
    async with AsyncWeb3(WebSocketProvider(evm_proxy.ws_url())) as w3:
        heads = await w3.eth.subscribe("newHeads")
        logs = await w3.eth.subscribe("logs", {"address": AsyncWeb3.to_checksum_address(address)})
        receipt = anvil.send(address, selector("emitMany(uint256)") + word(2))
        messages = await _collect(w3, 3)
        by_sub: dict[str, list[Any]] = {}
        for message in messages:
            by_sub.setdefault(message["subscription"], []).append(message["result"])
        assert [h["number"] for h in by_sub[heads]] == [int(receipt["blockNumber"], 16)]
        assert [int(log["topics"][1].hex(), 16) for log in by_sub[logs]] == [0, 1]
        assert await w3.eth.unsubscribe(heads) is True
        assert await w3.eth.unsubscribe(logs) is True


async def test_a_view_call_after_a_receipt_sees_the_receipts_block(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    """ethers' `await tx.wait()` then a view call: the read must not come from the block before."""
    store = anvil.deploy_store()
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, HEAD_POLL_INTERVAL="60")  # one poll only
    await proxy.head_at(anvil.block_number())
    provider = AsyncHTTPProvider(proxy.url())
    w3 = AsyncWeb3(provider)
    contract = w3.eth.contract(address=AsyncWeb3.to_checksum_address(store), abi=ABI)
    assert await contract.functions.x().call() == 7
    receipt = anvil.send(store, selector("setX(uint256)") + word(9))
    await w3.eth.get_transaction_receipt(receipt["transactionHash"])
    assert await contract.functions.x().call() == 9
    await provider.disconnect()
