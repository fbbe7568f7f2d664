"""Upstream auto-batching cannot be turned against other clients: batches bounded in bytes, large
calls alone, and a batch the node refuses as a whole resent call by call."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.support import DEV_ACCOUNT, Anvil, selector, settings_for, start_proxy, word
from tests.test_upstream_batching import STORE_FINAL, relay


async def misses_with_one_large_call(
    anvil: Anvil, node_url: str, data_bytes: int, **settings: str
) -> list[dict[str, Any]]:
    store = anvil.deploy_store()
    block = hex(anvil.block_number())
    # Inline, not make_proxy: closed before the caller's relay closes.
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=node_url, **settings))
    try:
        await proxy.head_at(anvil.mine(STORE_FINAL))
        large = {"from": DEV_ACCOUNT, "to": store, "data": selector("x()") + "00" * data_bytes}
        calls = [proxy.call("eth_getStorageAt", [store, hex(slot), block], rid=slot) for slot in range(20)]
        calls.append(proxy.call("eth_call", [large, block], rid=99))
        return list(await asyncio.gather(*calls))
    finally:
        await proxy.close()


async def test_a_batch_the_node_refuses_whole_is_resent_singly_so_only_the_culprit_fails(anvil: Anvil) -> None:
    async with relay(anvil.url, max_body=6000) as node:
        replies = await misses_with_one_large_call(anvil, node.url, 8000)
    by_id = {r["id"]: r for r in replies}
    assert by_id[0]["result"] == "0x" + word(7)
    assert all("result" in by_id[slot] for slot in range(20)), replies
    assert by_id[99]["error"]["code"] == -32002  # the large call alone is refused by the node


async def test_batches_are_bounded_in_bytes_and_a_large_call_goes_alone(anvil: Anvil) -> None:
    async with relay(anvil.url) as node:
        replies = await misses_with_one_large_call(anvil, node.url, 8000, UPSTREAM_BATCH_MAX_BYTES="2000")
    assert all("result" in r for r in replies), replies
    large = [size for size in node.bodies if size > 8000]
    assert len(large) == 1 and large[0] < 16_000 + 300  # the eth_call, alone
    assert all(size <= 2000 + 300 for size in node.bodies if size < 8000)
