"""Replies are checked against requests: a reply that answers something else is an upstream fault
(-32002, counted, retried on another upstream, never stored). Only eth_call's code 3 is cached."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.fault_relay import FaultRelay
from tests.support import Anvil, Proxy, ProxyFactory, eventually, word


@pytest.fixture
async def relay(anvil: Anvil) -> AsyncIterator[FaultRelay]:
    relay = await FaultRelay(anvil.url).start()
    yield relay
    await relay.close()


def storage(address: str, slot: int, block: int) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": slot + 1, "method": "eth_getStorageAt", "params": [address, hex(slot), hex(block)]}


async def final_store(anvil: Anvil, proxy: Proxy) -> tuple[str, int]:
    """A Store contract at a final block (slot 0 holds 7), and that block."""
    address = anvil.deploy_store()
    block = anvil.block_number()
    anvil.mine(70)
    await proxy.head_at(block + 70)
    return address, block


def mismatches(proxy: Proxy, upstream: str = "0") -> float:
    return proxy.metric("rpc_proxy_upstream_errors_total", network="evm", upstream=upstream, kind="mismatch")


async def test_a_single_reply_with_another_id_is_an_upstream_fault_and_never_stored(
    anvil: Anvil, relay: FaultRelay, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=relay.url)
    address, block = await final_store(anvil, proxy)
    relay.inject("wrong_id", method="eth_getStorageAt")
    status, body, headers = await proxy.post(storage(address, 0, block))
    # The faulty reply is never served: -32002, or the call asked again alone (its batch with the
    # proof header failed), unproven and so never kept.
    assert (status == 502 and body["error"]["code"] == -32002) or (
        body.get("result") == "0x" + word(7) and headers["X-Cache"] != "MISS"
    ), body
    assert mismatches(proxy) == 1
    status, body, headers = await proxy.post(storage(address, 0, block))
    assert body["result"] == "0x" + word(7) and headers["X-Cache"] == "MISS"  # nothing had been stored


async def test_a_reply_with_another_id_is_retried_on_the_next_upstream(
    anvil: Anvil, relay: FaultRelay, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=f"{relay.url},{anvil.url}")
    address, block = await final_store(anvil, proxy)
    relay.inject("wrong_id", method="eth_getStorageAt")
    status, body, _ = await proxy.post(storage(address, 0, block))
    assert status == 200 and body["result"] == "0x" + word(7)
    assert mismatches(proxy) == 1 and proxy.metric("rpc_proxy_upstream_failovers_total", network="evm") >= 1


@pytest.mark.parametrize("fault", ["duplicate_id", "partial", "wrong_id"])
async def test_a_batch_reply_must_hold_each_id_exactly_once(
    anvil: Anvil, relay: FaultRelay, fault: str, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=f"{relay.url},{anvil.url}")
    address, block = await final_store(anvil, proxy)
    relay.inject(fault, method="eth_getStorageAt", batches_only=True)
    # Asked again with new slots until a batch of them reached the relay: on a busy machine one may
    # not (the relay cooling after a slow answer in the set-up, or the calls sent apart). Every
    # answer is the node's either way.
    rounds: list[tuple[range, list[Any]]] = []

    async def batch_reached_the_relay() -> bool:
        slots = range(3 * len(rounds), 3 * len(rounds) + 3)
        expected = [anvil.rpc("eth_getStorageAt", address, hex(slot), hex(block)) for slot in slots]
        rounds.append((slots, expected))
        status, body, _ = await proxy.post([storage(address, slot, block) for slot in slots])
        assert status == 200
        assert [item["result"] for item in sorted(body, key=lambda i: i["id"])] == expected
        return bool(relay.applied)

    await eventually(batch_reached_the_relay, 30, "a batch to reach the fault relay")
    slots, expected = rounds[-1]
    assert relay.applied == [fault] and mismatches(proxy) == 1
    again = await asyncio.gather(*(proxy.post(storage(address, slot, block)) for slot in slots))
    assert [r[1]["result"] for r in again] == expected and {r[2]["X-Cache"] for r in again} == {"HIT"}


async def test_code_3_is_cached_only_for_eth_call(anvil: Anvil, relay: FaultRelay, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=relay.url)
    anvil.mine(70)
    await proxy.head_at(70)
    relay.inject("error3", method="eth_getBlockReceipts")
    receipts = {"jsonrpc": "2.0", "id": 1, "method": "eth_getBlockReceipts", "params": ["0x1"]}
    _, body, _ = await proxy.post(receipts)
    assert body["error"]["code"] == 3
    _, body, headers = await proxy.post(receipts)
    assert body["result"] == [] and headers["X-Cache"] == "MISS"
