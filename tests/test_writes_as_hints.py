"""Writes are hints: a forwarded transaction makes the head tracker poll at once, and `latest` reads
that follow wait for that poll (bounded); a null receipt is kept UNMINED_TTL at most. Checked with raw
calls and with Foundry's `cast` (npm @foundry-rs/cast) right after `cast send`."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from proxy.cache import policy as cp
from proxy.chain.identity import ROUND_GAP
from tests.fault_relay import FaultRelay
from tests.support import DEV_ACCOUNT, ROOT, Anvil, ProxyFactory, eventually

DEV_WRITES = "eth_sendTransaction"
ANVIL_KEY = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80"  # anvil's first dev account's
OTHER = "0x" + "33" * 20


class TestUnminedTtl:
    def test_a_null_receipt_is_kept_no_longer_than_unmined_ttl(self) -> None:
        ttls = cp.Ttls(negative=2.0, unmined=0.25)
        assert cp.transaction_ttl(None, None, {}, ttls) == 0.25
        pending = {"hash": "0x" + "1" * 64, "blockHash": None, "blockNumber": None}
        assert cp.transaction_ttl(pending, None, {}, ttls) == 0.25


async def test_latest_reads_right_after_a_write_see_it_without_waiting_for_a_poll(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    # The tracker would not poll on its own within this test: only the write hint moves the head.
    proxy = await make_proxy(
        EVM_UPSTREAM=anvil.url, ALLOW_METHODS=DEV_WRITES, HEAD_POLL_INTERVAL="60", HEAD_CATCH_UP_WAIT="5"
    )
    await proxy.head_at(0)
    for round_ in range(10):
        nonce = int(await proxy.result("eth_getTransactionCount", [DEV_ACCOUNT, "latest"]), 16)
        number = int(await proxy.result("eth_blockNumber", []), 16)
        await proxy.result("eth_sendTransaction", [{"from": DEV_ACCOUNT, "to": OTHER, "value": "0x1"}])
        after = int(await proxy.result("eth_getTransactionCount", [DEV_ACCOUNT, "latest"]), 16)
        balance = int(await proxy.result("eth_getBalance", [OTHER, "latest"]), 16)
        assert (after, balance) == (nonce + 1, round_ + 1)
        assert int(await proxy.result("eth_blockNumber", []), 16) == number + 1


@pytest.mark.parametrize("mine", ["anvil_mine", "evm_mine"])
async def test_a_block_mined_through_the_proxy_is_a_write_hint(
    anvil: Anvil, make_proxy: ProxyFactory, mine: str
) -> None:
    """Rule: a dev node's call that mines a block makes the tracker poll at once and `latest` wait for
    that poll, as a transaction does ("mine, then read the block number" is a test harness's habit)."""
    proxy = await make_proxy(
        EVM_UPSTREAM=anvil.url, ALLOW_NAMESPACES="anvil,evm", HEAD_POLL_INTERVAL="60", HEAD_CATCH_UP_WAIT="5"
    )
    await proxy.head_at(anvil.block_number())
    for _ in range(5):
        number = int(await proxy.result("eth_blockNumber", []), 16)
        await proxy.result(mine, ["0x1"] if mine == "anvil_mine" else [])
        assert int(await proxy.result("eth_blockNumber", []), 16) == number + 1 == anvil.block_number()


async def test_a_chain_id_set_through_the_proxy_is_checked_at_once_not_an_identity_interval_later(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """Rule (docs/caching.md, Dev nodes): a dev call that changes state has the upstreams' identity
    checked at once; anvil_setChainId's new chain is adopted after 3 checks one poll interval apart."""
    proxy = await make_proxy(
        EVM_UPSTREAM=anvil.url, ALLOW_NAMESPACES="anvil,evm", HEAD_POLL_INTERVAL="0.2", IDENTITY_CHECK_INTERVAL="3600"
    )
    await proxy.head_at(anvil.block_number())
    assert await proxy.result("eth_chainId", []) == "0x7a69"
    await proxy.result("anvil_setChainId", [777])

    async def adopted() -> bool:
        _, body, _ = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []})
        return body.get("result") == hex(777)

    await eventually(adopted, 15, "the new chain id through the proxy")
    assert anvil.rpc("eth_chainId") == hex(777)


async def test_a_batch_with_a_dev_state_change_is_made_in_order_as_the_node_makes_it(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """Rule: a batch holding a write or a dev node's state change is made in order (its members are
    otherwise made together): [anvil_setStorageAt, eth_getStorageAt] reads what it set, as on Anvil."""
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, ALLOW_NAMESPACES="anvil,evm", HEAD_POLL_INTERVAL="60")
    await proxy.head_at(anvil.block_number())
    slot = "0x" + "00" * 31 + "05"
    for value in range(0x9200, 0x9205):
        word_ = "0x" + f"{value:064x}"
        batch = [
            {"jsonrpc": "2.0", "id": 1, "method": "anvil_setStorageAt", "params": [OTHER, slot, word_]},
            {"jsonrpc": "2.0", "id": 2, "method": "eth_getStorageAt", "params": [OTHER, slot, "latest"]},
        ]
        _, body, _ = await proxy.post(batch)
        answers = {a["id"]: a for a in body}
        assert answers[1]["result"] is True and answers[2]["result"] == word_, body
        assert anvil.rpc("eth_getStorageAt", OTHER, slot, "latest") == word_


async def test_a_burst_of_dev_state_changes_is_checked_for_identity_in_rounds_a_second_apart(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """Rule: each dev call that changes state asks for an identity check, but rounds of checks come a
    second apart at most (ROUND_GAP): a burst of calls made checks back to back before."""
    relay = await FaultRelay(anvil.url).start()
    try:
        proxy = await make_proxy(EVM_UPSTREAM=relay.url, ALLOW_NAMESPACES="anvil,evm", HEAD_POLL_INTERVAL="1")
        await proxy.head_at(anvil.block_number())
        before, began = sum(c.get("method") == "eth_chainId" for c in relay.calls), time.monotonic()
        for round_ in range(6):
            await asyncio.gather(
                *(proxy.result("anvil_setBalance", [OTHER, hex(round_ * 10 + i + 1)]) for i in range(10))
            )

        def checks() -> int:
            return sum(c.get("method") == "eth_chainId" for c in relay.calls) - before

        async def checked() -> bool:  # the burst's suspicion is still honoured, a round later
            return checks() >= 1

        await eventually(checked, 10, "an identity check after the burst")
        assert checks() <= 2 + (time.monotonic() - began) / ROUND_GAP, checks()  # a round a second at most
    finally:
        await relay.close()


def _cast(*args: str) -> str:
    cast = ROOT / ".tools/node_modules/.bin/cast"
    done = subprocess.run([str(cast), *args], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and not done.stderr.startswith("Error"), done.stderr[-500:]
    return done.stdout.strip()


@pytest.mark.skipif(
    not (ROOT / ".tools/node_modules/.bin/cast").exists() and not shutil.which("cast"),
    reason="cast not installed: bash scripts/test.sh installs @foundry-rs/cast",
)
async def test_cast_nonce_balance_and_call_right_after_cast_send(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    # The default poll interval: without the hint, cast's reads would trail the write by a block.
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, HEAD_POLL_INTERVAL="2")
    store = anvil.deploy_store()
    await proxy.head_at(anvil.block_number())
    url = proxy.url()
    for value in range(1, 6):
        nonce = int(await asyncio.to_thread(_cast, "nonce", DEV_ACCOUNT, "--rpc-url", url))
        await asyncio.to_thread(
            _cast, "send", store, "setX(uint256)", str(value), "--private-key", ANVIL_KEY, "--rpc-url", url
        )
        after, balance, stored = await asyncio.gather(
            asyncio.to_thread(_cast, "nonce", DEV_ACCOUNT, "--rpc-url", url),
            asyncio.to_thread(_cast, "balance", DEV_ACCOUNT, "--rpc-url", url),
            asyncio.to_thread(_cast, "call", store, "x()(uint256)", "--rpc-url", url),
        )
        assert int(after) == nonce + 1
        assert int(stored.split()[0]) == value
        assert balance == await asyncio.to_thread(_cast, "balance", DEV_ACCOUNT, "--rpc-url", anvil.url)
