"""The common read surface through HTTP against a real Anvil: identity and head answered by the
proxy, blocks, transactions, state and fees cached by finality, a reorged-out receipt never served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.config import ConfigError
from proxy.http.app_keys import SERVICE
from tests.support import (
    DEV_ACCOUNT,
    Anvil,
    FakeClock,
    Proxy,
    ProxyFactory,
    eventually,
    selector,
    settings_for,
    start_proxy,
    word,
)

FINALITY = 64  # anvil: finalized = latest - 64


def rpc(method: str, params: list[Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}


async def ask(proxy: Proxy, method: str, params: list[Any]) -> tuple[Any, str]:
    """(the result, X-Cache), the call having succeeded."""
    _, body, headers = await proxy.post(rpc(method, params))
    assert "error" not in body, (method, body)
    return body["result"], headers["X-Cache"]


def asked(proxy: Proxy, *methods: str) -> int:
    """Upstream calls of these methods (the tracker's own polls are eth_getBlockByNumber batches of tags)."""
    return sum(proxy.upstreams["evm"].calls[m] for m in methods)


async def final_transaction(anvil: Anvil, proxy: Proxy) -> dict[str, Any]:
    """A Store contract and a setX transaction, both already final; returns the receipt."""
    store = anvil.deploy_store()
    receipt = anvil.send(store, selector("setX(uint256)") + word(5))
    receipt["store"] = store
    await proxy.head_at(anvil.mine(FINALITY + 2))
    return receipt


async def test_final_blocks_transactions_and_state_are_served_from_the_cache(anvil: Anvil, evm_proxy: Proxy) -> None:
    receipt = await final_transaction(anvil, evm_proxy)
    number, block_hash, tx = receipt["blockNumber"], receipt["blockHash"], receipt["transactionHash"]
    calls = [
        ("eth_getBlockByNumber", [number, False]),
        ("eth_getBlockByNumber", [number, True]),
        ("eth_getBlockByHash", [block_hash, True]),
        ("eth_getBlockTransactionCountByNumber", [number]),
        ("eth_getBlockTransactionCountByHash", [block_hash]),
        ("eth_getUncleCountByBlockNumber", [number]),
        ("eth_getUncleCountByBlockHash", [block_hash]),
        ("eth_getTransactionByBlockNumberAndIndex", [number, "0x0"]),
        ("eth_getTransactionByBlockHashAndIndex", [block_hash, "0x0"]),
        ("eth_getTransactionByHash", [tx]),
        ("eth_getTransactionReceipt", [tx]),
        ("eth_getBalance", [DEV_ACCOUNT, number]),
        ("eth_getCode", [receipt["store"], number]),
        ("eth_getTransactionCount", [DEV_ACCOUNT, number]),
        ("eth_getProof", [receipt["store"], ["0x" + word(0)], number]),
        ("eth_feeHistory", ["0x2", number, [25, 75]]),
    ]
    upstream = evm_proxy.upstreams["evm"]

    def sent() -> int:  # calls upstream, but the tracker's polls (by tag and by unfinalized number)
        return sum(1 for m, p in upstream.params if m != "eth_getBlockByNumber" or p[0] == number)

    for method, params in calls:
        result, cache = await ask(evm_proxy, method, params)
        assert cache == "MISS" and result == anvil.rpc(method, *params), method
    before = sent()
    for method, params in calls:
        result, cache = await ask(evm_proxy, method, params)
        assert cache == "HIT" and result == anvil.rpc(method, *params), method
    assert sent() == before  # every repeat was served without the upstream


async def test_chain_id_and_block_number_make_no_upstream_call(anvil: Anvil, evm_proxy: Proxy) -> None:
    await evm_proxy.head_at(anvil.mine(3))
    for _ in range(5):
        assert await ask(evm_proxy, "eth_chainId", []) == ("0x7a69", "HIT")
        assert await ask(evm_proxy, "eth_blockNumber", []) == (hex(anvil.block_number()), "HIT")
        assert (await ask(evm_proxy, "net_version", []))[0] == "31337"
    assert asked(evm_proxy, "eth_chainId", "eth_blockNumber") == 0 and asked(evm_proxy, "net_version") == 1
    saved = evm_proxy.metric("rpc_proxy_upstream_credits_saved_total", network="evm", method="eth_blockNumber")
    assert saved == 5 * 80  # prices.py: eth_blockNumber costs 80
    assert evm_proxy.metric("rpc_proxy_cache_lookups_total", tier="tracker", result="hit") == 10


async def test_block_number_never_goes_back_after_the_proxy_showed_a_later_block(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    # The tracker polls once a minute: a forwarded block beyond its head is shown to the client, so
    # eth_blockNumber is not answered from the (older) head but forwarded, and never below it.
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, HEAD_POLL_INTERVAL="60", HEAD_CATCH_UP_WAIT="0")
    await proxy.head_at(0)
    shown = anvil.mine(2)
    _, cache = await ask(proxy, "eth_getBlockByNumber", [hex(shown), False])
    assert cache == "BYPASS"  # beyond the tracker's head: never cached
    number, _ = await ask(proxy, "eth_blockNumber", [])
    assert int(number, 16) >= shown


async def test_the_pending_block_is_never_taken_for_a_block_shown_to_a_client(anvil: Anvil, evm_proxy: Proxy) -> None:
    # Found by an outside tester: the pending block (head + 1) made eth_blockNumber report a block the
    # node did not have, and every `latest` read went upstream, waiting for it.
    await evm_proxy.head_at(anvil.mine(3))
    pending, _ = await ask(evm_proxy, "eth_getBlockByNumber", ["pending", False])
    assert int(pending["number"], 16) == anvil.block_number() + 1
    assert await evm_proxy.result("eth_blockNumber", []) == hex(anvil.block_number())
    caches = [(await ask(evm_proxy, "eth_getBalance", [DEV_ACCOUNT, "latest"]))[1] for _ in range(2)]
    assert caches == ["MISS", "HIT"]


async def test_an_unfinalized_block_by_number_is_asked_by_its_hash(anvil: Anvil, evm_proxy: Proxy) -> None:
    latest = anvil.mine(3)
    await evm_proxy.head_at(latest)
    block = anvil.rpc("eth_getBlockByNumber", hex(latest - 1), False)
    for expected in ("MISS", "HIT"):
        assert await ask(evm_proxy, "eth_getBlockByNumber", [hex(latest - 1), False]) == (block, expected)
    assert ("eth_getBlockByHash", [block["hash"], False]) in evm_proxy.upstreams["evm"].params


async def test_unfinalized_state_is_pinned_to_the_block_hash_and_pending_is_not_cached(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    await evm_proxy.head_at(anvil.mine(2))
    head = anvil.rpc("eth_getBlockByNumber", "latest", False)
    for expected in ("MISS", "HIT"):
        assert (await ask(evm_proxy, "eth_getBalance", [DEV_ACCOUNT, "latest"]))[1] == expected
    assert ("eth_getBalance", [DEV_ACCOUNT, {"blockHash": head["hash"]}]) in evm_proxy.upstreams["evm"].params
    for _ in range(2):
        assert (await ask(evm_proxy, "eth_getTransactionCount", [DEV_ACCOUNT, "pending"]))[1] == "BYPASS"


@pytest.mark.parametrize("method", ["eth_gasPrice", "eth_maxPriorityFeePerGas", "eth_blobBaseFee"])
async def test_fees_are_cached_for_the_current_head_only(anvil: Anvil, evm_proxy: Proxy, method: str) -> None:
    await evm_proxy.head_at(anvil.mine(1))
    for expected in ("MISS", "HIT", "HIT"):
        assert (await ask(evm_proxy, method, []))[1] == expected
    await evm_proxy.head_at(anvil.mine(1))  # a new block: a new key
    assert (await ask(evm_proxy, method, []))[1] == "MISS"
    assert asked(evm_proxy, method) == 2


async def test_fee_history_to_latest_is_cached_per_head(anvil: Anvil, evm_proxy: Proxy) -> None:
    await evm_proxy.head_at(anvil.mine(3))
    params = ["0x2", "latest", [50]]
    for expected in ("MISS", "HIT"):
        result, cache = await ask(evm_proxy, "eth_feeHistory", params)
        assert cache == expected and result == anvil.rpc("eth_feeHistory", *params)
    await evm_proxy.head_at(anvil.mine(1))
    assert (await ask(evm_proxy, "eth_feeHistory", params))[1] == "MISS"


async def test_a_receipt_is_kept_only_once_the_tracker_holds_its_block(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, HEAD_POLL_INTERVAL="60", HEAD_CATCH_UP_WAIT="0")
    await proxy.head_at(0)
    receipt = anvil.send(anvil.deploy_store(), selector("setX(uint256)") + word(1))
    result, cache = await ask(proxy, "eth_getTransactionReceipt", [receipt["transactionHash"]])
    assert result == receipt and cache == "BYPASS"  # its block is beyond the tracker's head
    await proxy.head_at(int(receipt["blockNumber"], 16))  # the receipt showed the block: the head follows
    for expected in ("MISS", "HIT"):
        assert (await ask(proxy, "eth_getTransactionReceipt", [receipt["transactionHash"]]))[1] == expected


async def test_a_receipt_reorged_out_is_never_served(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    receipt = anvil.send(store, selector("setX(uint256)") + word(9))
    anvil.mine(1)
    await evm_proxy.head_at(int(receipt["blockNumber"], 16) + 1)
    tx = receipt["transactionHash"]
    methods = ("eth_getTransactionReceipt", "eth_getTransactionByHash")
    for method in methods:
        for expected in ("MISS", "HIT"):
            result, cache = await ask(evm_proxy, method, [tx])
            assert cache == expected and result["blockHash"] == receipt["blockHash"]

    anvil.rpc("anvil_reorg", 3, [])  # replaces the receipt's block and the two after it
    tracker = evm_proxy.app[SERVICE].networks["evm"].tracker

    async def seen() -> bool:
        return receipt["blockHash"] in tracker.orphans

    await eventually(seen, 10, "the tracker to see the reorg")
    for method in methods:
        for _ in range(2):
            result, cache = await ask(evm_proxy, method, [tx])
            assert cache != "HIT" or result is None or result["blockHash"] != receipt["blockHash"], (method, cache)
            assert result == anvil.rpc(method, tx)


async def test_unknown_transactions_are_null_for_the_negative_ttl_only(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    clock = FakeClock()
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, CACHE_NEGATIVE_TTL="30", clock=clock)
    await proxy.head_at(0)
    unknown = ["0x" + "ab" * 32]
    for expected in ("MISS", "HIT"):
        assert await ask(proxy, "eth_getTransactionReceipt", unknown) == (None, expected)
    clock.advance(31)  # not yet mined is never kept longer
    assert await ask(proxy, "eth_getTransactionReceipt", unknown) == (None, "MISS")


async def test_a_not_yet_mined_receipt_is_asked_again_once_a_new_block_arrives(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    # A null (or pending) answer is true of one head only: the next block may hold the transaction,
    # so it is never served past that block, however long CACHE_NEGATIVE_TTL is.
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, CACHE_NEGATIVE_TTL="600")
    await proxy.head_at(anvil.block_number())
    anvil.rpc("evm_setAutomine", False)
    try:
        tx = anvil.rpc("eth_sendTransaction", {"from": DEV_ACCOUNT, "to": DEV_ACCOUNT, "value": "0x1"})
        for expected in ("MISS", "HIT"):
            assert await ask(proxy, "eth_getTransactionReceipt", [tx]) == (None, expected)
        pending, cache = await ask(proxy, "eth_getTransactionByHash", [tx])
        assert pending["blockHash"] is None and cache == "MISS"
        await proxy.head_at(anvil.mine(1))
    finally:
        anvil.rpc("evm_setAutomine", True)
    receipt, cache = await ask(proxy, "eth_getTransactionReceipt", [tx])
    assert receipt == anvil.rpc("eth_getTransactionReceipt", tx) and cache == "MISS"
    mined, _ = await ask(proxy, "eth_getTransactionByHash", [tx])
    assert mined["blockHash"] == receipt["blockHash"]


@pytest.mark.parametrize(
    ("method", "params", "name"),
    [
        ("eth_chainId", [1], "params"),
        ("eth_getBlockByNumber", ["0x1", "yes"], "fullTransactions"),
        ("eth_getBlockByNumber", [{"blockHash": "0x" + "11" * 32}], "block"),
        ("eth_getBlockByHash", ["0x11"], "blockHash"),
        ("eth_getTransactionReceipt", ["0x" + "11" * 31], "transactionHash"),
        ("eth_getTransactionByBlockNumberAndIndex", ["latest", "1"], "index"),
        ("eth_getBalance", ["0x" + "11" * 19, "latest"], "address"),
        ("eth_getProof", ["0x" + "11" * 20, "0x0", "latest"], "storageKeys"),
        ("eth_feeHistory", ["0x0", "latest"], "blockCount"),
        ("eth_feeHistory", ["0x2", "latest", [75, 25]], "rewardPercentiles"),
    ],
)
async def test_read_params_are_validated_before_upstream(
    anvil: Anvil, evm_proxy: Proxy, method: str, params: list[Any], name: str
) -> None:
    _, body, _ = await evm_proxy.post(rpc(method, params))
    assert body["error"]["code"] == -32602 and name in body["error"]["message"], body
    assert (method, params) not in evm_proxy.upstreams["evm"].params


async def test_credits_file_prices_methods_but_not_the_spec_seven(anvil: Anvil, tmp_path: Path) -> None:
    prices = tmp_path / "credits.toml"
    prices.write_text("[credits]\neth_getBalance = 7\nnet_peerCount = 3\n")
    # Inline, not make_proxy: closed before the prices file is rewritten with a refused price.
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, API_KEYS="k", CREDITS_FILE=str(prices)))
    try:
        await proxy.head_at(0)
        for expected in ("MISS", "HIT"):  # a hit costs what a miss costs
            _, _, headers = await proxy.post(rpc("eth_getBalance", [DEV_ACCOUNT, "0x0"]), key="k")
            assert (headers["X-Cache"], headers["X-Credits-Charged"]) == (expected, "7")
        _, _, headers = await proxy.post(rpc("eth_getCode", [DEV_ACCOUNT, "0x0"]), key="k")
        assert headers["X-Credits-Charged"] == "80"  # the built-in table
        assert proxy.metric("rpc_proxy_upstream_credits_saved_total", network="evm", method="eth_getBalance") == 7
    finally:
        await proxy.close()
    prices.write_text("[credits]\neth_call = 1\n")
    with pytest.raises(ConfigError, match="eth_call' costs 80 credits as the spec fixes"):
        settings_for(EVM_UPSTREAM=anvil.url, CREDITS_FILE=str(prices))
