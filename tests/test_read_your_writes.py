"""Monotonic reads for clients: once the proxy has shown a block (a receipt, a transaction, a block,
eth_blockNumber, a list of logs or receipts), `latest` resolves to at least that block for every
later request; eth_blockNumber through the proxy never goes backwards. Checked with raw calls,
web3.py and ethers v6 at the default HEAD_POLL_INTERVAL."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from typing import Any

import pytest
from web3 import AsyncHTTPProvider, AsyncWeb3

from tests.lying_relay import LyingRelay
from tests.support import (
    CONTRACTS,
    DEV_ACCOUNT,
    ROOT,
    Anvil,
    Proxy,
    ProxyFactory,
    eventually,
    selector,
    word,
)

# Writes signed by the node's unlocked dev account: off the default allow-list, opened for these tests.
DEV_WRITES = "eth_sendTransaction,eth_accounts"

ABI = json.loads((CONTRACTS / "Store.abi").read_text())
ROUNDS = 100


async def deployed(anvil: Anvil, proxy: Proxy) -> str:
    address = anvil.deploy_store()
    # Shows the client the deploy block (a block beyond the tracker's head is forwarded): the head follows.
    await proxy.result("eth_getBlockByNumber", [hex(anvil.block_number()), False])
    await proxy.head_at(anvil.block_number())
    return address


async def mined(proxy: Proxy, tx: str) -> dict[str, Any]:
    """The receipt, polled through the proxy as clients do (a node may answer null for a moment)."""
    receipts: list[Any] = []

    async def found() -> bool:
        receipts.append(await proxy.result("eth_getTransactionReceipt", [tx]))
        return receipts[-1] is not None

    await eventually(found, 10, "the receipt")
    return dict(receipts[-1])


async def test_latest_reaches_a_block_the_proxy_has_shown_a_client(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    # The tracker would not poll on its own within this test: only the hint moves the head.
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, ALLOW_METHODS=DEV_WRITES, HEAD_POLL_INTERVAL="60")
    address = await deployed(anvil, proxy)
    storage = ["eth_getStorageAt", [address, "0x0", "latest"]]
    assert await proxy.result(*storage) == "0x" + word(7)
    for value in (11, 12, 13):
        tx = await proxy.result(
            "eth_sendTransaction",
            [{"from": DEV_ACCOUNT, "to": address, "data": selector("setX(uint256)") + word(value)}],
        )
        receipt = await mined(proxy, tx)
        assert await proxy.result(*storage) == "0x" + word(value)
        call = {"from": DEV_ACCOUNT, "to": address, "data": selector("x()")}
        assert await proxy.result("eth_call", [call, "latest"]) == "0x" + word(value)
        assert int(await proxy.result("eth_blockNumber", []), 16) >= int(receipt["blockNumber"], 16)


@pytest.mark.parametrize("shown_by", ["eth_getLogs", "eth_getFilterChanges", "eth_getBlockReceipts"])
async def test_latest_reaches_the_block_of_logs_or_receipts_the_proxy_has_shown_a_client(
    anvil: Anvil, make_proxy: ProxyFactory, shown_by: str
) -> None:
    """Rule (docs/caching.md, read-your-writes): a list of logs or receipts shows its blocks, as a receipt
    does: an app that reads state in its event handler (viem's watchContractEvent) sees that block's."""
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, HEAD_POLL_INTERVAL="60")
    address = await deployed(anvil, proxy)
    call = ["eth_call", [{"from": DEV_ACCOUNT, "to": address, "data": selector("x()")}, "latest"]]
    assert await proxy.result(*call) == "0x" + word(7)  # kept at the head the tracker holds
    criteria = {"address": address, "fromBlock": "latest"}
    watch = await proxy.result("eth_newFilter", [criteria]) if shown_by == "eth_getFilterChanges" else None
    anvil.send(address, selector("setX(uint256)") + word(99))  # another app's writes, not through the proxy
    block = int(anvil.send(address, selector("emitMany(uint256)") + word(1))["blockNumber"], 16)
    if shown_by == "eth_getLogs":
        numbered = {"address": address, "fromBlock": hex(block), "toBlock": hex(block)}
        shown = await proxy.result("eth_getLogs", [numbered])
    elif shown_by == "eth_getFilterChanges":
        shown = await proxy.result("eth_getFilterChanges", [watch])
    else:
        shown = [r for r in await proxy.result("eth_getBlockReceipts", [hex(block)]) if r["logs"]]
    assert [int(entry["blockNumber"], 16) for entry in shown] == [block], shown
    assert await proxy.result(*call) == "0x" + word(99)


async def test_a_real_block_far_past_the_trackers_head_is_polled_at_once_and_latest_reaches_it(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """Rule: a block shown more than 64 past the head is no floor, but it is polled at once and the
    next `latest` call waits for that poll: a burst of blocks mined on the node (anvil_mine 100)
    before a write is no stale read."""
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, HEAD_POLL_INTERVAL="60")
    address = await deployed(anvil, proxy)
    call = ["eth_call", [{"from": DEV_ACCOUNT, "to": address, "data": selector("x()")}, "latest"]]
    assert await proxy.result(*call) == "0x" + word(7)
    anvil.mine(100)
    tx = anvil.send(address, selector("setX(uint256)") + word(42))["transactionHash"]  # not through the proxy
    receipt = await proxy.result("eth_getTransactionReceipt", [tx])
    assert await proxy.result(*call) == "0x" + word(42)
    assert int(await proxy.result("eth_blockNumber", []), 16) >= int(receipt["blockNumber"], 16)


async def test_a_lying_nodes_log_of_a_block_far_past_the_head_holds_latest_back_never(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """Rule (docs/caching.md, read-your-writes): a block shown more than 64 past the head is no floor:
    one forged log must not make every later `latest` call wait, nor eth_blockNumber show it."""
    liar = await LyingRelay(anvil.url, "result").start()
    try:
        proxy = await make_proxy(EVM_UPSTREAM=liar.url, HEAD_POLL_INTERVAL="60")
        head = anvil.block_number()
        await proxy.head_at(head)
        forged = {"address": DEV_ACCOUNT, "topics": [], "data": "0x", "blockNumber": hex(head + 10_000)}
        liar.results["eth_getLogs"] = [forged]
        assert await proxy.result("eth_getLogs", [{"fromBlock": "latest", "toBlock": "latest"}]) == [forged]
        liar.results.clear()
        balance = {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": [DEV_ACCOUNT, "latest"]}
        caches = [(await proxy.post(balance))[2]["X-Cache"] for _ in range(3)]
        assert caches[1:] == ["HIT", "HIT"], caches
        assert int(await proxy.result("eth_blockNumber", []), 16) == head
    finally:
        await liar.close()


async def test_web3py_write_then_read_sequences_see_no_stale_reads(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, ALLOW_METHODS=DEV_WRITES, HEAD_POLL_INTERVAL="2")
    address = AsyncWeb3.to_checksum_address(await deployed(anvil, proxy))
    w3 = AsyncWeb3(AsyncHTTPProvider(proxy.url()))
    sender = AsyncWeb3.to_checksum_address(DEV_ACCOUNT)
    store = w3.eth.contract(address=address, abi=ABI)
    stale: list[str] = []
    for i in range(ROUNDS):
        if i % 2 == 0:
            tx = await store.functions.setX(1000 + i).transact({"from": sender})
            receipt: Any = await w3.eth.wait_for_transaction_receipt(tx, poll_latency=0.05)
            if (x := await store.functions.x().call({"from": sender})) != 1000 + i:
                stale.append(f"round {i}: x() = {x} after block {receipt['blockNumber']}")
            if int.from_bytes(await w3.eth.get_storage_at(address, 0), "big") != 1000 + i:
                stale.append(f"round {i}: storage")
        else:
            tx = await store.functions.emitMany(1).transact({"from": sender})
            receipt = await w3.eth.wait_for_transaction_receipt(tx, poll_latency=0.05)
            logs = await w3.eth.get_logs({"address": address, "fromBlock": receipt["blockNumber"], "toBlock": "latest"})
            if not logs:
                stale.append(f"round {i}: no log at block {receipt['blockNumber']}..latest")
    assert stale == []


def node_binary() -> str:
    found = shutil.which("node")
    assert found, "node missing: scripts/test.sh needs Node.js for Anvil and ethers"
    return found


async def test_ethers_v6_write_then_read_sequences_see_no_stale_reads(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    assert (ROOT / ".tools/node_modules/ethers").exists(), "ethers missing: bash scripts/test.sh installs it"
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, ALLOW_METHODS=DEV_WRITES, HEAD_POLL_INTERVAL="2")
    address = await deployed(anvil, proxy)
    script = ROOT / "tests/js/write_then_read.mjs"
    process = await asyncio.create_subprocess_exec(
        node_binary(),
        str(script),
        proxy.url(),
        address,
        str(CONTRACTS / "Store.abi"),
        str(ROUNDS),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"TOOLS": str(ROOT / ".tools")},
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 240)
    finally:
        if process.returncode is None:
            process.kill()
    assert process.returncode == 0, err.decode()[-2000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report == {"rounds": ROUNDS, "stale": []}
