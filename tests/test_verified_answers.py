"""Verified answers: nothing a node says about a final block is kept forever unless it is proven
against the block's header (verifying.py, chain/header_chain.py, chain/answer_proofs.py). A relay
in front of real Anvil lies about final blocks while its head polls stay honest (tests/lying_relay.py):
alone, its lie is never kept (once it turns honest, the next answer is the truth); beside an honest
node, its lie is never served."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from proxy.chain import bloom
from proxy.chain.fields import keccak256
from proxy.http.app_keys import SERVICE
from proxy.verifying import LOGS_MAX_CHECKED
from tests.lying_relay import LyingRelay
from tests.support import (
    DEV_ACCOUNT,
    Anvil,
    Proxy,
    ProxyFactory,
    eventually,
    free_port,
    selector,
    settings_for,
    start_proxy,
    word,
)
from tests.test_upstream_selection import TOKEN, _admin


def _networks(tmp_path: Path, urls: list[str], **fields: Any) -> str:
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())
    path = tmp_path / "networks.toml"
    path.write_text(f'[networks.evm]\nfamily = "evm"\n{extra}upstreams = {json.dumps(urls)}\n')
    return str(path)


@asynccontextmanager
async def _proxy(tmp_path: Path, urls: list[str], **fields: Any) -> AsyncIterator[Proxy]:
    proxy = await start_proxy(settings_for(NETWORKS_FILE=_networks(tmp_path, urls, **fields)))
    try:
        yield proxy
    finally:
        await proxy.close()


async def _final(anvil: Anvil, proxy: Proxy, number: int) -> None:
    """Mine until block `number` is final as the proxy's tracker sees it."""
    anvil.mine(100)
    await proxy.head_at(anvil.block_number())

    async def final() -> bool:
        head = proxy.app[SERVICE].networks["evm"].tracker.head
        return head is not None and head.finalized >= number and bool(head.final_hash)

    await eventually(final, 10.0, f"block {number} final")


async def _ask(proxy: Proxy, method: str, params: list[Any]) -> tuple[Any, str, str]:
    status, body, headers = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    assert status == 200 and "result" in body, body
    return body["result"], headers.get("X-Cache", ""), headers.get("X-Verified", "")


def _store_with_logs(anvil: Anvil) -> tuple[str, int]:
    """A store contract with x = 5 and three logs in one block: (address, that block)."""
    store = anvil.deploy_store()
    anvil.send(store, selector("setX(uint256)") + word(5))
    receipt = anvil.send(store, selector("emitMany(uint256)") + word(3))
    return store, int(receipt["blockNumber"], 16)


def _verifications(proxy: Proxy, method: str, outcome: str) -> float:
    return proxy.metric("rpc_proxy_verifications_total", network="evm", method=method, outcome=outcome)


async def _refuted_then_proven(proxy: Proxy, liar: LyingRelay, method: str, params: list[Any], truth: Any) -> Any:
    """A lie served unproven and never kept (counted refuted); then, its node honest, the truth proven
    and kept. What the lie told."""
    told, cache, verified = await _ask(proxy, method, params)
    assert told != truth and cache != "HIT" and verified == "unproven"
    assert (await _ask(proxy, method, params))[1] != "HIT"
    assert _verifications(proxy, method, "refuted") >= 1
    liar.lie = None  # honest now: the truth is proven and kept
    assert await _ask(proxy, method, params) == (truth, "MISS", "proven")
    assert (await _ask(proxy, method, params))[:2] == (truth, "HIT")
    return told


CASES = {
    # case: (the lie, the method lied about, its params at block N)
    "storage": ("storage", "eth_getStorageAt", lambda store, n: [store, "0x0", hex(n)]),
    "proof": ("storage", "eth_getProof", lambda store, n: [store, ["0x" + "00" * 32], hex(n)]),
    "droplog": ("droplog", "eth_getBlockReceipts", lambda store, n: [hex(n)]),
    "logs": ("droplog", "eth_getLogs", lambda store, n: [{"address": store, "fromBlock": hex(n), "toBlock": hex(n)}]),
    "gas": ("gas", "eth_getBlockReceipts", lambda store, n: [hex(n)]),
    "nofields": ("nofields", "eth_getBlockReceipts", lambda store, n: [hex(n)]),
    "blobprice": ("blobprice", "eth_getBlockReceipts", lambda store, n: [hex(n)]),
    "timestamp": ("timestamp", "eth_getBlockByNumber", lambda store, n: [hex(n), False]),
}


async def _lie_alone_is_never_kept(anvil: Anvil, tmp_path: Path, case: str, **fields: Any) -> None:
    store, n = _store_with_logs(anvil)
    lie, method, params = CASES[case]
    truth = anvil.rpc(method, *params(store, n))
    liar = await LyingRelay(anvil.url, lie, below=n).start()
    try:
        async with _proxy(tmp_path, [liar.url], **fields) as proxy:
            await _final(anvil, proxy, n)
            told, cache, verified = await _ask(proxy, method, params(store, n))
            # served (nothing better to serve), told unproven, not kept
            assert told != truth and cache != "HIT" and verified == "unproven"
            assert (await _ask(proxy, method, params(store, n)))[1] != "HIT"
            liar.lie = None  # honest now: the next answer is the truth, proven and kept
            assert await _ask(proxy, method, params(store, n)) == (truth, "MISS", "proven")
            assert await _ask(proxy, method, params(store, n)) == (truth, "HIT", "proven")
    finally:
        await liar.close()


async def test_a_flipped_storage_word_alone_is_never_kept(anvil: Anvil, tmp_path: Path) -> None:
    await _lie_alone_is_never_kept(anvil, tmp_path, "storage")


async def test_a_flipped_proof_value_alone_is_never_kept(anvil: Anvil, tmp_path: Path) -> None:
    await _lie_alone_is_never_kept(anvil, tmp_path, "proof")


async def test_a_log_dropped_from_get_logs_alone_is_never_kept(anvil: Anvil, tmp_path: Path) -> None:
    await _lie_alone_is_never_kept(anvil, tmp_path, "logs")


async def test_inclusion_only_still_refuses_a_log_list_its_receipts_do_not_prove(anvil: Anvil, tmp_path: Path) -> None:
    """verify_logs = "inclusion": the block with logs is checked against its receipts (the liar's
    receipts drop the same log, and no longer hash to receiptsRoot)."""
    await _lie_alone_is_never_kept(anvil, tmp_path, "logs", verify_logs="inclusion")


async def test_a_log_dropped_from_block_receipts_alone_is_never_kept(anvil: Anvil, tmp_path: Path) -> None:
    await _lie_alone_is_never_kept(anvil, tmp_path, "droplog")


async def test_a_receipts_gas_changed_by_one_alone_is_never_kept(anvil: Anvil, tmp_path: Path) -> None:
    await _lie_alone_is_never_kept(anvil, tmp_path, "gas")


async def test_receipts_and_logs_without_fields_of_the_interface_alone_are_never_kept(
    anvil: Anvil, tmp_path: Path
) -> None:
    """The root proves what it commits to; the fields it does not (a receipt's from, to, hash, price,
    a log's block and transaction) must be there and follow, or the answer is refuted."""
    await _lie_alone_is_never_kept(anvil, tmp_path, "nofields")


async def test_a_blob_gas_price_the_header_does_not_settle_is_never_kept_nor_told_proven(
    anvil: Anvil, tmp_path: Path
) -> None:
    """Anvil's blocks have no excess blob gas: EIP-4844 settles their blob gas price at 1. Another is
    unproven (a chain's own blob schedule may differ), served, never kept."""
    await _lie_alone_is_never_kept(anvil, tmp_path, "blobprice")


async def test_a_slot_written_back_to_zero_is_proven_as_the_zero_its_nodes_trie_commits_to(
    anvil: Anvil, tmp_path: Path
) -> None:
    """Anvil keeps a leaf holding zero for a slot written back to zero (geth drops it): the root commits
    to that leaf, so the honest node's zero is proven, never refuted."""
    store, _ = _store_with_logs(anvil)
    n = int(anvil.send(store, selector("setX(uint256)") + word(0))["blockNumber"], 16)
    async with _proxy(tmp_path, [anvil.url], verify="required") as proxy:
        await _final(anvil, proxy, n)
        zero = "0x" + word(0)
        assert await _ask(proxy, "eth_getStorageAt", [store, "0x0", hex(n)]) == (zero, "MISS", "proven")
        assert await _ask(proxy, "eth_getStorageAt", [store, "0x0", hex(n)]) == (zero, "HIT", "proven")
        assert _verifications(proxy, "eth_getStorageAt", "refuted") == 0


async def test_a_headers_timestamp_changed_by_one_alone_is_never_kept(anvil: Anvil, tmp_path: Path) -> None:
    await _lie_alone_is_never_kept(anvil, tmp_path, "timestamp")


def _two_transactions_in_one_block(anvil: Anvil) -> tuple[str, str, dict[str, Any]]:
    """Two value transfers mined in one block, at indexes 0 and 1: (first hash, second hash, first receipt)."""
    anvil.rpc("evm_setAutomine", False)
    try:
        sent = [
            anvil.rpc("eth_sendTransaction", {"from": DEV_ACCOUNT, "to": "0x" + f"{n}" * 40, "value": hex(n)})
            for n in (1, 2)
        ]
        anvil.mine(1)
    finally:
        anvil.rpc("evm_setAutomine", True)
    return sent[0], sent[1], anvil.rpc("eth_getTransactionReceipt", sent[0])


@pytest.mark.parametrize(
    "method",
    [
        "eth_getTransactionByHash",
        "eth_getTransactionReceipt",
        "eth_getTransactionByBlockNumberAndIndex",
        "eth_getTransactionByBlockHashAndIndex",
    ],
)
async def test_another_final_item_in_place_of_the_transaction_or_receipt_asked_for_is_never_kept(
    anvil: Anvil, tmp_path: Path, method: str
) -> None:
    """Rule: an answer is proven only as the item its call names. The liar answers with the block's
    other transaction (or its receipt), which the block's proofs prove as that one."""
    first, second, receipt = _two_transactions_in_one_block(anvil)
    n, block_hash = int(receipt["blockNumber"], 16), receipt["blockHash"]
    asked = {
        "eth_getTransactionByHash": ([first], [second]),
        "eth_getTransactionReceipt": ([first], [second]),
        "eth_getTransactionByBlockNumberAndIndex": ([hex(n), "0x0"], [hex(n), "0x1"]),
        "eth_getTransactionByBlockHashAndIndex": ([block_hash, "0x0"], [block_hash, "0x1"]),
    }
    params, others = asked[method]
    truth, other = anvil.rpc(method, *params), anvil.rpc(method, *others)
    assert truth != other
    liar = await LyingRelay(anvil.url, "swap", below=n, swap={method: other}).start()
    try:
        async with _proxy(tmp_path, [liar.url]) as proxy:
            await _final(anvil, proxy, n)
            told, cache, verified = await _ask(proxy, method, params)
            # served (nothing better to serve), told unproven, refuted, not kept
            assert told == other and cache != "HIT" and verified == "unproven"
            assert _verifications(proxy, method, "refuted") >= 1
            assert (await _ask(proxy, method, params))[1] != "HIT"
            liar.lie = None  # honest now: the next answer is the truth, proven and kept
            assert await _ask(proxy, method, params) == (truth, "MISS", "proven")
            # A hit by hash is told unproven (as on the honest path: it may have been kept a while
            # before its block was final); by number, proven.
            found = "proven" if method == "eth_getTransactionByBlockNumberAndIndex" else "unproven"
            assert await _ask(proxy, method, params) == (truth, "HIT", found)
    finally:
        await liar.close()


@pytest.mark.parametrize("case", ["verify off, final", "unfinalized"])
async def test_another_item_in_place_of_the_transaction_asked_for_is_never_kept_where_no_proof_runs(
    anvil: Anvil, tmp_path: Path, case: str
) -> None:
    """Rule: what no proof checks is still the item asked for before it is kept: with verify = "off",
    or about a block not yet final, another transaction in its place is served, never kept."""
    first, second, receipt = _two_transactions_in_one_block(anvil)
    n = int(receipt["blockNumber"], 16)
    method = "eth_getTransactionByHash"
    truth, other = anvil.rpc(method, first), anvil.rpc(method, second)
    liar = await LyingRelay(anvil.url, "swap", below=n, swap={method: other}).start()
    fields = {"verify": "off"} if case.startswith("verify off") else {}
    try:
        async with _proxy(tmp_path, [liar.url], **fields) as proxy:
            if fields:
                await _final(anvil, proxy, n)
            else:
                await proxy.head_at(anvil.block_number())
            told, cache, _ = await _ask(proxy, method, [first])
            assert told == other and cache != "HIT"
            assert (await _ask(proxy, method, [first]))[1] != "HIT"
            assert proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason="other_item") == 2
            liar.lie = None
            assert (await _ask(proxy, method, [first]))[:2] == (truth, "MISS")
            assert (await _ask(proxy, method, [first]))[:2] == (truth, "HIT")
    finally:
        await liar.close()


@pytest.mark.parametrize("verify", ["auto", "off"])
@pytest.mark.parametrize("beside", ["alone", "beside an honest node"])
async def test_a_null_for_a_final_blocks_receipts_or_logs_is_never_kept(
    anvil: Anvil, tmp_path: Path, verify: str, beside: str
) -> None:
    """Rule: a final block that exists has receipts (a list, maybe empty) and eth_getLogs answers a
    list: a node that answers null has dropped the block's history (or lies). Its null was kept for
    CACHE_NEGATIVE_TTL and served as a hit told proven, and the honest node was never asked (an
    outside attack). Now another upstream is asked; alone, the null receipts are served uncached and
    the null logs are a malformed reply (-32002)."""
    _, n = _store_with_logs(anvil)
    receipts = anvil.rpc("eth_getBlockReceipts", hex(n))
    logs_params = [{"fromBlock": hex(n), "toBlock": hex(n)}]
    logs = anvil.rpc("eth_getLogs", *logs_params)
    assert receipts and logs
    liar = await LyingRelay(anvil.url, "result", results={"eth_getBlockReceipts": None, "eth_getLogs": None}).start()
    urls = [liar.url] if beside == "alone" else [liar.url, anvil.url]
    try:
        async with _proxy(tmp_path, urls, verify=verify) as proxy:
            await _final(anvil, proxy, n)
            for _ in range(2):
                status, body, headers = await proxy.post(
                    {"jsonrpc": "2.0", "id": 1, "method": "eth_getBlockReceipts", "params": [hex(n)]}
                )
                if beside == "alone":
                    assert body["result"] is None and headers["X-Cache"] == "BYPASS"
                else:
                    assert body["result"] == receipts and headers["X-Verified"] != "refuted"
                status, body, headers = await proxy.post(
                    {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": logs_params}
                )
                if beside == "alone":
                    assert status == 502 and body["error"]["code"] == -32002
                    assert "malformed result: eth_getLogs answered with NoneType" in body["error"]["message"]
                else:
                    assert body["result"] == logs
            liar.lie = None  # honest now: the truth, and nothing of the null was kept
            assert (await _ask(proxy, "eth_getBlockReceipts", [hex(n)]))[0] == receipts
            assert (await _ask(proxy, "eth_getLogs", logs_params))[0] == logs
    finally:
        await liar.close()


BLOCK_READS_BY_NUMBER = {
    "eth_getBlockByNumber": [False],
    "eth_getBlockTransactionCountByNumber": [],
    "eth_getUncleCountByBlockNumber": [],
    "eth_getTransactionByBlockNumberAndIndex": ["0x0"],
}


@pytest.mark.parametrize("method", list(BLOCK_READS_BY_NUMBER))
@pytest.mark.parametrize("beside", ["alone", "alone, required", "beside an honest node"])
async def test_a_null_for_a_final_block_read_by_number_is_never_kept(
    anvil: Anvil, tmp_path: Path, method: str, beside: str
) -> None:
    """Rule: a final block exists, so a null for it, its counts or a transaction it has is a node
    without its history (or a liar), as for its receipts. The null was kept for CACHE_NEGATIVE_TTL and
    served as a hit told proven, and the archive node beside it never asked (an outside attack). Now
    the next upstream is asked; alone, the null is served uncached (a transaction's is refuted by the
    block's proven transactions), and under `required` a provable read's is -32002 (it was served)."""
    _, n = _store_with_logs(anvil)
    params = [hex(n), *BLOCK_READS_BY_NUMBER[method]]
    truth = anvil.rpc(method, *params)
    assert truth is not None
    # Null for this block alone: the tracker's heads and the finalized header beside each read are true.
    liar = await LyingRelay(anvil.url, "swap", swap={method: None}, swap_first=hex(n)).start()
    urls = [liar.url, anvil.url] if beside.startswith("beside") else [liar.url]
    fields = {"verify": "required"} if beside.endswith("required") else {}
    try:
        async with _proxy(tmp_path, urls, **fields) as proxy:
            await _final(anvil, proxy, n)
            for _ in range(2):
                if fields and method in ("eth_getBlockByNumber", "eth_getTransactionByBlockNumberAndIndex"):
                    status, body, _ = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
                    assert status == 502 and body["error"]["code"] == -32002, body
                    continue
                result, cache, verified = await _ask(proxy, method, params)
                if beside.startswith("alone"):
                    assert result is None and cache != "HIT" and verified != "proven"
                else:
                    assert result == truth and verified != "refuted"
            liar.lie = None  # honest now: the truth, and nothing of the null was kept
            assert (await _ask(proxy, method, params))[0] == truth
    finally:
        await liar.close()


async def test_a_transaction_index_past_a_final_blocks_last_is_a_proven_null(anvil: Anvil, tmp_path: Path) -> None:
    """Rule: no transaction at an index of a final block is proven by the block's proven transactions,
    then kept as final as the block, each hit told proven (it was kept for CACHE_NEGATIVE_TTL only)."""
    _, n = _store_with_logs(anvil)
    params = [hex(n), "0x9"]
    async with _proxy(tmp_path, [anvil.url]) as proxy:
        await _final(anvil, proxy, n)
        assert await _ask(proxy, "eth_getTransactionByBlockNumberAndIndex", params) == (None, "MISS", "proven")
        assert await _ask(proxy, "eth_getTransactionByBlockNumberAndIndex", params) == (None, "HIT", "proven")
        assert _verifications(proxy, "eth_getTransactionByBlockNumberAndIndex", "proven") == 1


@pytest.mark.parametrize("case", ["a block outside the range", "another address", "another block hash"])
async def test_logs_outside_their_filter_are_never_kept_where_no_proof_runs(
    anvil: Anvil, tmp_path: Path, case: str
) -> None:
    """Rule: an eth_getLogs answer is of its filter before it is kept, as an item is the one asked
    for: with verify = "off", a node's logs of another block, address or block hash (its own, whole
    and true) were kept forever and served as hits (an outside attack)."""
    _, n = _store_with_logs(anvil)
    anvil.mine(2)
    logs = anvil.rpc("eth_getLogs", {"fromBlock": hex(n), "toBlock": hex(n)})
    assert len(logs) == 3
    log_filter = {
        "a block outside the range": {"fromBlock": hex(n + 1), "toBlock": hex(n + 2)},
        "another address": {"fromBlock": hex(n), "toBlock": hex(n), "address": "0x" + "11" * 20},
        "another block hash": {"blockHash": anvil.rpc("eth_getBlockByNumber", hex(n + 1), False)["hash"]},
    }[case]
    truth = anvil.rpc("eth_getLogs", log_filter)
    assert truth == []
    liar = await LyingRelay(anvil.url, "result", results={"eth_getLogs": logs}).start()
    try:
        async with _proxy(tmp_path, [liar.url], verify="off") as proxy:
            await _final(anvil, proxy, n + 2)
            told, cache, _ = await _ask(proxy, "eth_getLogs", [log_filter])
            assert told == logs and cache != "HIT"
            assert (await _ask(proxy, "eth_getLogs", [log_filter]))[1] != "HIT"
            # (by a block hash not shown canonical beside it, `unverified` comes first)
            reason = "unverified" if "blockHash" in log_filter else "other_item"
            assert proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason=reason) == 2
            liar.lie = None
            assert (await _ask(proxy, "eth_getLogs", [log_filter]))[:2] == (truth, "MISS")
            assert (await _ask(proxy, "eth_getLogs", [log_filter]))[:2] == (truth, "HIT")
    finally:
        await liar.close()


@pytest.mark.parametrize(
    ("method", "case"),
    [
        ("eth_getBlockByHash", "not yet final, by hash"),
        ("eth_getBlockReceipts", "not yet final, by hash"),
        ("eth_getBlockByNumber", "final, by number, verify off"),
        ("eth_getBlockReceipts", "final, by number, verify off"),
    ],
)
async def test_another_block_in_place_of_the_block_asked_for_is_never_kept_nor_told_proven(
    anvil: Anvil, tmp_path: Path, method: str, case: str
) -> None:
    """Rule: an answer is the block its call names (each receipt's block too). The liar answers with
    another block, whole and true of its own header: a final one for a block asked by hash before it
    is final (proven by its own header), or another final one where no proof runs."""
    other = _two_transactions_in_one_block(anvil)[2]
    asked = _two_transactions_in_one_block(anvil)[2]
    by_hash = case.endswith("by hash")
    liar = await LyingRelay(anvil.url, "swap", below=10**9).start()
    try:
        async with _proxy(tmp_path, [liar.url], **({} if by_hash else {"verify": "off"})) as proxy:
            await _final(anvil, proxy, int(asked["blockNumber"], 16))
            if by_hash:
                asked = anvil.send(None, "0x00")  # a block with a receipt, not yet final
                await proxy.head_at(anvil.block_number())
            field = "blockHash" if by_hash else "blockNumber"
            params = [asked[field], True] if method != "eth_getBlockReceipts" else [asked[field]]
            truth, lie = anvil.rpc(method, *params), anvil.rpc(method, other[field], *params[1:])
            liar.swap, liar.swap_first = {method: lie}, asked[field]
            told, cache, verified = await _ask(proxy, method, params)
            assert told == lie and cache != "HIT" and verified != "proven"
            assert (await _ask(proxy, method, params))[1] != "HIT"
            liar.lie = None
            assert (await _ask(proxy, method, params))[:2] == (truth, "MISS")
            assert (await _ask(proxy, method, params))[:2] == (truth, "HIT")
    finally:
        await liar.close()


# Calls that name a block by its hash: (method, params for the block's hash H, a store's address S)
BY_HASH = {
    "eth_getBlockByHash": lambda h, s: [h, False],
    "eth_getBlockReceipts": lambda h, s: [h],
    "eth_getTransactionByBlockHashAndIndex": lambda h, s: [h, "0x0"],
    "eth_getStorageAt": lambda h, s: [s, "0x0", {"blockHash": h}],
    "eth_getLogs": lambda h, s: [{"address": s, "blockHash": h}],
}


async def _above_finality(anvil: Anvil, proxy: Proxy) -> tuple[str, str]:
    """A store and the hash of its block with three logs, mined above the finality the proxy knows."""
    await _final(anvil, proxy, anvil.block_number())
    store, n = _store_with_logs(anvil)
    await proxy.head_at(n)
    return store, anvil.rpc("eth_getBlockByNumber", hex(n), False)["hash"]


@pytest.mark.parametrize("method", sorted(BY_HASH))
async def test_an_answer_by_the_hash_of_a_block_not_yet_final_is_proven_by_the_header_that_hash_names(
    anvil: Anvil, tmp_path: Path, method: str
) -> None:
    """Rule: an answer kept forever because its key is a block's hash is proven first, against the
    header whose fields hash to that hash (no final block vouches for it, and none is needed)."""
    async with _proxy(tmp_path, [anvil.url]) as proxy:
        store, block_hash = await _above_finality(anvil, proxy)
        params = BY_HASH[method](block_hash, store)
        truth = anvil.rpc(method, *params)
        assert await _ask(proxy, method, params) == (truth, "MISS", "proven")
        assert (await _ask(proxy, method, params))[:2] == (truth, "HIT")
        assert _verifications(proxy, method, "proven") == 1


@pytest.mark.parametrize(
    ("lie", "method"),
    [("timestamp", "eth_getBlockByHash"), ("gas", "eth_getBlockReceipts"), ("droplog", "eth_getLogs")],
)
async def test_a_lie_about_a_block_not_yet_final_asked_by_its_hash_is_never_kept(
    anvil: Anvil, tmp_path: Path, lie: str, method: str
) -> None:
    """Rule: what a node says of a block named by hash above finality is refuted by the header that
    hash names, and never kept (it was kept forever, its key being the hash)."""
    liar = await LyingRelay(anvil.url, lie, below=10**9, heads_honest=True).start()  # every block's, tags left honest
    try:
        async with _proxy(tmp_path, [liar.url]) as proxy:
            store, block_hash = await _above_finality(anvil, proxy)
            params = BY_HASH[method](block_hash, store)
            await _refuted_then_proven(proxy, liar, method, params, anvil.rpc(method, *params))
    finally:
        await liar.close()


async def test_an_answer_by_hash_above_finality_that_no_header_can_prove_is_served_and_never_kept(
    anvil: Anvil, tmp_path: Path
) -> None:
    """Rule: neither proven nor refuted (here a header field the proxy does not know; a node that
    answers the header's hash with null alike), an answer by the hash of a block above finality is
    served uncached, as an unproven answer about a final block is: a liar gains nothing by it."""
    liar = await LyingRelay(anvil.url, "newfield", below=10**9).start()
    try:
        async with _proxy(tmp_path, [liar.url]) as proxy:
            _store, block_hash = await _above_finality(anvil, proxy)
            first = await _ask(proxy, "eth_getBlockByHash", [block_hash, False])
            assert first[1:] != ("HIT", "proven") and first[2] == "unproven" and "futureRoot" in first[0]
            assert (await _ask(proxy, "eth_getBlockByHash", [block_hash, False]))[1] != "HIT"
            assert _verifications(proxy, "eth_getBlockByHash", "unproven") >= 1
    finally:
        await liar.close()


async def test_beside_an_honest_node_no_lie_about_final_data_is_served(
    anvil: Anvil, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The liar first in NETWORKS_FILE, an honest node second: every answer served is the truth, and
    the liar is named in the log by its index, never its URL."""
    store, n = _store_with_logs(anvil)
    log_filter = {"address": store, "fromBlock": hex(n), "toBlock": hex(n)}
    calls = [
        ("storage", "eth_getStorageAt", [store, "0x0", hex(n)]),
        ("storage", "eth_getProof", [store, ["0x" + "00" * 32], hex(n)]),
        ("droplog", "eth_getLogs", [log_filter]),
        ("droplog", "eth_getBlockReceipts", [hex(n)]),
        ("gas", "eth_getBlockReceipts", [hex(n)]),
        ("timestamp", "eth_getBlockByNumber", [hex(n), False]),
    ]
    liar = await LyingRelay(anvil.url, below=n).start()
    try:
        async with _proxy(tmp_path, [liar.url, anvil.url]) as proxy:
            await _final(anvil, proxy, n)
            for lie, method, params in calls:
                liar.lie = lie
                truth = anvil.rpc(method, *params)
                for _ in range(3):
                    answer, _cache, _verified = await _ask(proxy, method, params)
                    assert answer == truth, (lie, method)
                assert liar.lies_told > 0
            assert sum(_verifications(proxy, m, "refuted") for _, m, _ in calls) >= 1
            lines = [r.getMessage() for r in caplog.records if r.name == "proxy.verify"]
            assert any("upstream #0 gave" in line for line in lines), lines
            assert not any(liar.url in line or anvil.url in line for line in caplog.messages)
    finally:
        await liar.close()


async def test_the_honest_path_is_proven_and_a_repeat_is_a_hit(anvil: Anvil, tmp_path: Path) -> None:
    store, n = _store_with_logs(anvil)
    block = anvil.rpc("eth_getBlockByNumber", hex(n), False)
    receipt_hash, block_hash = block["transactions"][0], block["hash"]
    calls = [
        ("eth_getStorageAt", [store, "0x0", hex(n)]),
        ("eth_getBalance", [store, hex(n)]),
        ("eth_getTransactionCount", [store, hex(n)]),
        ("eth_getCode", [store, hex(n)]),
        ("eth_getProof", [store, ["0x" + "00" * 32], hex(n)]),
        ("eth_getBlockReceipts", [hex(n)]),
        ("eth_getTransactionReceipt", [receipt_hash]),
        ("eth_getTransactionByHash", [receipt_hash]),
        ("eth_getBlockByNumber", [hex(n), False]),
        ("eth_getBlockByNumber", [hex(n), True]),
        ("eth_getLogs", [{"address": store, "fromBlock": hex(n - 2), "toBlock": hex(n)}]),
        ("eth_getLogs", [{"address": store, "blockHash": block_hash}]),
    ]
    async with _proxy(tmp_path, [anvil.url]) as proxy:
        await _final(anvil, proxy, n)
        for method, params in calls:
            truth = anvil.rpc(method, *params)
            assert await _ask(proxy, method, params) == (truth, "MISS", "proven"), method
            assert _verifications(proxy, method, "proven") >= 1, method
            # A transaction, a receipt or an answer by block hash found in the cache is told
            # unproven: it may have been kept a while before its block was final.
            by_hash = method in ("eth_getTransactionReceipt", "eth_getTransactionByHash") or "blockHash" in str(params)
            found = "unproven" if by_hash else "proven"
            assert await _ask(proxy, method, params) == (truth, "HIT", found), method
        # No proof covers eth_call: kept as without verification, and told so.
        call = [{"to": store, "data": selector("x()")}, hex(n)]
        assert (await _ask(proxy, "eth_call", call))[1:] == ("MISS", "not-applicable")
        assert (await _ask(proxy, "eth_call", call))[1:] == ("HIT", "not-applicable")


def _round_trips(relay: LyingRelay, method: str) -> list[list[str]]:
    """The methods of each request that reached the node with `method` or an eth_getProof in it."""
    posts = [[str(call.get("method")) for call in post] for post in relay.posts]
    return [post for post in posts if method in post or "eth_getProof" in post]


async def test_a_final_blocks_state_read_and_its_proof_reach_the_node_in_one_round_trip(
    anvil: Anvil, tmp_path: Path
) -> None:
    """The eth_getProof that proves a state read about a final block goes in the read's own batch, to
    the same node: a verified miss waits for one answer of the node, not two. A read about a block
    not final yet (nothing would prove it) asks no proof at all."""
    store, n = _store_with_logs(anvil)
    relay = await LyingRelay(anvil.url).start()
    try:
        async with _proxy(tmp_path, [relay.url]) as proxy:
            await _final(anvil, proxy, n)
            for method, params in [
                ("eth_getStorageAt", [store, "0x0", hex(n)]),
                ("eth_getBalance", [store, hex(n)]),
                ("eth_getTransactionCount", [store, hex(n)]),
                ("eth_getCode", [store, hex(n)]),
            ]:
                relay.posts.clear()
                assert await _ask(proxy, method, params) == (anvil.rpc(method, *params), "MISS", "proven"), method
                assert _round_trips(relay, method) == [[method, "eth_getBlockByNumber", "eth_getProof"]], relay.posts
            relay.posts.clear()
            unfinal = [store, "0x0", hex(anvil.block_number())]
            assert (await _ask(proxy, "eth_getStorageAt", unfinal))[0] == anvil.rpc("eth_getStorageAt", *unfinal)
            assert _round_trips(relay, "eth_getProof") == [], relay.posts
    finally:
        await relay.close()


async def test_a_budget_with_no_room_for_the_proof_beside_the_read_still_proves_it_with_a_second_call(
    anvil: Anvil, tmp_path: Path
) -> None:
    """max_concurrency = 2 leaves room for the read and its header only: the proof is asked after
    the read, of the same node, and the answer is proven all the same (no call waits for places its
    budget can never give)."""
    store, n = _store_with_logs(anvil)
    relay = await LyingRelay(anvil.url).start()
    path = tmp_path / "networks.toml"
    path.write_text(f'[networks.evm]\nfamily = "evm"\nupstreams = [{{url = "{relay.url}", max_concurrency = 2}}]\n')
    try:
        proxy = await start_proxy(settings_for(NETWORKS_FILE=str(path)))
        try:
            await _final(anvil, proxy, n)
            relay.posts.clear()
            params = [store, "0x0", hex(n)]
            assert await _ask(proxy, "eth_getStorageAt", params) == (
                anvil.rpc("eth_getStorageAt", *params),
                "MISS",
                "proven",
            )
            trips = _round_trips(relay, "eth_getStorageAt")
            assert trips == [["eth_getStorageAt", "eth_getBlockByNumber"], ["eth_getProof"]], relay.posts
        finally:
            await proxy.close()
    finally:
        await relay.close()


async def test_reads_of_one_account_share_one_proof_and_a_batch_keeps_within_upstream_batch_max(
    anvil: Anvil, tmp_path: Path
) -> None:
    """A client's batch of an account's balance, nonce and code at a final block reaches the node as
    one batch with one eth_getProof for the three; and a batch never grows past UPSTREAM_BATCH_MAX
    calls beside its header for the proofs (a provider's cap on a batch): the proofs that do not fit
    are asked after the answers, and every answer is proven all the same."""
    store, n = _store_with_logs(anvil)
    relay = await LyingRelay(anvil.url).start()
    path = tmp_path / "networks.toml"
    path.write_text(f'[networks.evm]\nfamily = "evm"\nupstreams = ["{relay.url}"]\n')
    try:
        proxy = await start_proxy(settings_for(NETWORKS_FILE=str(path), UPSTREAM_BATCH_MAX="4"))
        try:
            await _final(anvil, proxy, n)
            relay.posts.clear()
            alike = [("eth_getBalance", [store, hex(n)]), ("eth_getTransactionCount", [store, hex(n)])]
            batch = [{"jsonrpc": "2.0", "id": i, "method": m, "params": p} for i, (m, p) in enumerate(alike)]
            status, body, _ = await proxy.post(batch)
            assert status == 200 and [item["result"] for item in body] == [anvil.rpc(m, *p) for m, p in alike]
            assert _round_trips(relay, "eth_getBalance") == [
                ["eth_getBalance", "eth_getTransactionCount", "eth_getBlockByNumber", "eth_getProof"]
            ], relay.posts
            relay.posts.clear()
            slots = [[store, hex(slot), hex(n)] for slot in range(1, 7)]
            batch = [
                {"jsonrpc": "2.0", "id": i, "method": "eth_getStorageAt", "params": p} for i, p in enumerate(slots)
            ]
            status, body, _ = await proxy.post(batch)
            assert status == 200 and [item["result"] for item in body] == [
                anvil.rpc("eth_getStorageAt", *p) for p in slots
            ]
            assert max(len(post) for post in relay.posts) <= 4 + 1, relay.posts  # the reads' header beside them
            for params in slots:  # each kept as proven
                assert (await _ask(proxy, "eth_getStorageAt", params))[1:] == ("HIT", "proven")
        finally:
            await proxy.close()
    finally:
        await relay.close()


async def test_verify_off_keeps_the_liars_answer_as_before(anvil: Anvil, tmp_path: Path) -> None:
    store, n = _store_with_logs(anvil)
    liar = await LyingRelay(anvil.url, "storage", below=n).start()
    try:
        async with _proxy(tmp_path, [liar.url], verify="off") as proxy:
            await _final(anvil, proxy, n)
            told, _, _ = await _ask(proxy, "eth_getStorageAt", [store, "0x0", hex(n)])
            assert (await _ask(proxy, "eth_getStorageAt", [store, "0x0", hex(n)]))[:2] == (told, "HIT")
    finally:
        await liar.close()


async def test_verify_required_refuses_what_no_upstream_proves(anvil: Anvil, tmp_path: Path) -> None:
    store, n = _store_with_logs(anvil)
    liar = await LyingRelay(anvil.url, "storage", below=n).start()
    try:
        async with _proxy(tmp_path, [liar.url], verify="required") as proxy:
            await _final(anvil, proxy, n)
            status, body, _ = await proxy.post(
                {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [store, "0x0", hex(n)]}
            )
            assert body["error"]["code"] == -32002 and "refuted" in body["error"]["message"], body
            assert status == 502
    finally:
        await liar.close()


async def test_a_tampered_proof_is_refused_and_its_answer_never_kept(anvil: Anvil, tmp_path: Path) -> None:
    """The storage word is true but the account proof beside it is not: nothing proves the word,
    so it is served unproven and not kept; the upstream is counted."""
    store, n = _store_with_logs(anvil)
    params = [store, "0x0", hex(n)]
    truth = anvil.rpc("eth_getStorageAt", *params)
    liar = await LyingRelay(anvil.url, "proofnode", below=n).start()
    try:
        async with _proxy(tmp_path, [liar.url]) as proxy:
            await _final(anvil, proxy, n)
            assert await _ask(proxy, "eth_getStorageAt", params) == (truth, "BYPASS", "unproven")
            assert (await _ask(proxy, "eth_getStorageAt", params))[1] == "BYPASS"
            assert _verifications(proxy, "eth_getStorageAt", "refuted") == 2
            liar.lie = None
            assert await _ask(proxy, "eth_getStorageAt", params) == (truth, "MISS", "proven")
    finally:
        await liar.close()


async def test_a_header_field_the_proxy_does_not_know_makes_the_network_unverifiable(
    anvil: Anvil, tmp_path: Path
) -> None:
    """Fail safe: such a header is never believed, so nothing final is kept; /readyz and the metric
    say so, and answers are still served."""
    store, n = _store_with_logs(anvil)
    params = [store, "0x0", hex(n)]
    liar = await LyingRelay(anvil.url, "newfield", below=n).start()
    try:
        async with _proxy(tmp_path, [liar.url]) as proxy:
            await _final(anvil, proxy, n)
            for _ in range(2):
                assert (await _ask(proxy, "eth_getStorageAt", params))[1:] == ("BYPASS", "unproven")
            assert proxy.metric("rpc_proxy_network_unverifiable", network="evm") == 1
            async with proxy.session.get(f"{proxy.base}/readyz") as resp:
                ready = await resp.json()
            assert "futureRoot" in ready["unverifiable"]["evm"]
    finally:
        await liar.close()


def _blocks_with_logs(anvil: Anvil, count: int) -> tuple[str, list[int]]:
    """A store contract that emitted one log in each of `count` blocks: (address, those blocks)."""
    store = anvil.deploy_store()
    emit = selector("emitMany(uint256)") + word(1)
    return store, [int(anvil.send(store, emit)["blockNumber"], 16) for _ in range(count)]


@pytest.mark.parametrize(("chunk_blocks", "width"), [("0", "wide"), ("1000", "wide"), ("1000", "one")])
async def test_a_final_log_range_kept_unchecked_or_merged_is_told_unproven_on_the_miss_and_every_hit(
    anvil: Anvil, tmp_path: Path, chunk_blocks: str, width: str
) -> None:
    # spec (caching.md, Verified answers): an eth_getLogs range with more than 32 blocks to check is
    # kept as without verification and told X-Verified: unproven, on a repeat too (never "proven");
    # so is a merge of pieces (GETLOGS_CHUNK_BLOCKS), even of one block, whose pieces may be unchecked.
    store, blocks = _blocks_with_logs(anvil, LOGS_MAX_CHECKED + 4)
    last = blocks[-1] if width == "wide" else blocks[5]
    params = [{"address": store, "fromBlock": hex(blocks[5] if width == "one" else blocks[0]), "toBlock": hex(last)}]
    networks = _networks(tmp_path, [anvil.url])
    proxy = await start_proxy(settings_for(NETWORKS_FILE=networks, GETLOGS_CHUNK_BLOCKS=chunk_blocks))
    try:
        if width == "one":  # its whole chunk (blocks 0-999, every log block in it) final: a piece to cut it from
            anvil.mine(1100 - anvil.block_number())
        await _final(anvil, proxy, 999 if width == "one" else blocks[-1])
        truth = anvil.rpc("eth_getLogs", *params)
        assert len(truth) == (len(blocks) if width == "wide" else 1)
        answers = [await _ask(proxy, "eth_getLogs", params) for _ in range(3)]
        assert answers == [(truth, "MISS", "unproven"), (truth, "HIT", "unproven"), (truth, "HIT", "unproven")]
        assert _verifications(proxy, "eth_getLogs", "unchecked") >= 1
    finally:
        await proxy.close()


async def test_an_empty_log_answer_past_the_blocks_checked_is_refuted_by_a_block_its_bloom_names(
    anvil: Anvil, tmp_path: Path
) -> None:
    """Rule: an eth_getLogs answer with more than 32 blocks whose bloom may match is unchecked, but the
    blocks whose bloom may match and that show no log are checked first (32 of them, spread): a
    pruned node's `[]` over 36 blocks of logs was kept forever, and every range cut from it served
    `[]` as a hit (an outside attack). Refuted, the next upstream's answer is served and kept."""
    store, blocks = _blocks_with_logs(anvil, LOGS_MAX_CHECKED + 4)
    params = [{"address": store, "fromBlock": hex(blocks[0]), "toBlock": hex(blocks[-1])}]
    liar = await LyingRelay(anvil.url, "result", results={"eth_getLogs": []}).start()
    try:
        async with _proxy(tmp_path, [liar.url, anvil.url]) as proxy:
            await _final(anvil, proxy, blocks[-1])
            truth = anvil.rpc("eth_getLogs", *params)
            assert len(truth) == len(blocks)
            assert (await _ask(proxy, "eth_getLogs", params))[:2] == (truth, "MISS")
            assert (await _ask(proxy, "eth_getLogs", params))[:2] == (truth, "HIT")
            one = [{"address": store, "fromBlock": hex(blocks[3]), "toBlock": hex(blocks[3])}]
            assert (await _ask(proxy, "eth_getLogs", one))[0] == anvil.rpc("eth_getLogs", *one)
            assert _verifications(proxy, "eth_getLogs", "refuted") >= 1
    finally:
        await liar.close()


@pytest.mark.parametrize(("count", "verdict"), [(150, "proven"), (2000, "unchecked")])
async def test_a_filter_of_many_addresses_over_a_final_chunk_hashes_each_once_and_bounds_its_work(
    anvil: Anvil, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int, verdict: str
) -> None:
    """Rule: a filter within GETLOGS_MAX_PARAMS that its node answers at once gets its answer. Each
    of the chunk's 1,000 blooms was checked by hashing every address again: 2,000 addresses were
    -32005 "query timeout exceeded" after tens of seconds of the event loop's time, every other call
    waiting (an outside attack). Now each value is hashed once (chain/bloom.py FilterBits), and past
    MASK_CHECKS_MAX masks times blooms the check is not made (unchecked, as a range too wide)."""
    hashed: list[bytes] = []

    def counted(value: bytes) -> bytes:
        hashed.append(value)
        return keccak256(value)

    monkeypatch.setattr(bloom, "keccak256", counted)
    store, blocks = _blocks_with_logs(anvil, 1)
    addresses = [store, *("0x" + (i + 1).to_bytes(20, "big").hex() for i in range(count - 1))]
    params = [{"address": addresses, "fromBlock": hex(blocks[0]), "toBlock": hex(blocks[0])}]
    anvil.mine(1100 - anvil.block_number())
    async with _proxy(tmp_path, [anvil.url]) as proxy:
        await _final(anvil, proxy, 999)  # the block's whole chunk (0-999) final: asked and checked whole
        truth = anvil.rpc("eth_getLogs", *params)
        assert len(truth) == 1
        told, _, _ = await _ask(proxy, "eth_getLogs", params)
        assert told == truth
        assert count <= len(hashed) <= 2 * count  # count x 1,000 before: each address once per bloom
        assert _verifications(proxy, "eth_getLogs", verdict) >= 1


async def test_under_verify_required_a_merge_of_log_pieces_is_kept_no_longer_than_the_unfinalized_ttl(
    anvil: Anvil, tmp_path: Path
) -> None:
    # spec (caching.md): with verify = "required" nothing unproven is kept forever; a merge of pieces
    # is not told proven, so it is kept for the unfinalized TTL and then asked again.
    store, blocks = _blocks_with_logs(anvil, LOGS_MAX_CHECKED + 4)
    params = [{"address": store, "fromBlock": hex(blocks[5]), "toBlock": hex(blocks[5])}]
    networks = _networks(tmp_path, [anvil.url], verify="required")
    proxy = await start_proxy(settings_for(NETWORKS_FILE=networks, CACHE_UNFINALIZED_TTL="1"))
    try:
        anvil.mine(1100 - anvil.block_number())  # the whole chunk (blocks 0-999) final: its piece is unchecked
        await _final(anvil, proxy, 999)
        truth = anvil.rpc("eth_getLogs", *params)
        assert await _ask(proxy, "eth_getLogs", params) == (truth, "MISS", "unproven")
        assert (await _ask(proxy, "eth_getLogs", params))[2] == "unproven"

        async def asked_again() -> bool:
            return (await _ask(proxy, "eth_getLogs", params))[1] == "MISS"

        await eventually(asked_again, 10.0, "the merge to leave the cache")
    finally:
        await proxy.close()


async def test_every_single_answer_says_x_verified_the_trackers_and_the_proxys_own_errors_too(
    anvil: Anvil, tmp_path: Path
) -> None:
    # spec (caching.md): every single (non-batch) answer says proven, unproven or not-applicable.
    async with _proxy(tmp_path, [anvil.url]) as proxy:
        for method in ("eth_chainId", "eth_blockNumber", "eth_chainId"):  # the last from the tracker
            assert (await _ask(proxy, method, []))[2] == "not-applicable", method
        bad = {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": ["0x12", "latest"]}
        _, body, headers = await proxy.post(bad)
        assert "error" in body and headers["X-Verified"] == "not-applicable"


async def test_answers_kept_unverified_are_not_told_proven_once_a_reload_turns_verification_on(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    # spec (caching.md, X-Verified): proven is said only of what was proven. Answers kept with
    # verify = "off" have a key space of their own: once a reload sets "auto", they are not found.
    store, n = _store_with_logs(anvil)
    port = free_port()
    proxy = await make_proxy(
        NETWORKS_FILE=_networks(tmp_path, [anvil.url], verify="off"), ADMIN_PORT=str(port), ADMIN_TOKEN=TOKEN
    )
    await _final(anvil, proxy, n)
    calls = [("eth_getBalance", [store, hex(n)]), ("eth_getStorageAt", [store, "0x0", hex(n)])]
    for method, params in calls:
        truth = anvil.rpc(method, *params)
        assert [await _ask(proxy, method, params) for _ in range(2)] == [
            (truth, "MISS", "unproven"),
            (truth, "HIT", "unproven"),
        ]
    _networks(tmp_path, [anvil.url], verify="auto")
    assert (await _admin(proxy.session, port, "/reload", method="POST"))[0] == 200
    anvil.mine(1)  # a new head: every plan is made again
    await proxy.head_at(anvil.block_number())
    for method, params in calls:
        truth = anvil.rpc(method, *params)
        assert [await _ask(proxy, method, params) for _ in range(2)] == [
            (truth, "MISS", "proven"),
            (truth, "HIT", "proven"),
        ]


async def test_block_zeros_answers_are_told_unproven_on_the_miss_and_every_hit(anvil: Anvil, tmp_path: Path) -> None:
    # spec (caching.md, Verified answers): a hit says what its miss said. Block 0's answers are told
    # unproven on both: earlier releases kept them unproven (refuted ones too) under the same keys in a
    # shared cache, so a hit about block 0 cannot tell a proven entry from those; and a dev node does
    # not commit its genesis state to the genesis stateRoot.
    rich = anvil.rpc("eth_accounts")[0]
    async with _proxy(tmp_path, [anvil.url]) as proxy:
        await _final(anvil, proxy, 1)
        for method, params in (
            ("eth_getBlockByNumber", ["0x0", True]),
            ("eth_getBlockReceipts", ["0x0"]),
            ("eth_getLogs", [{"fromBlock": "0x0", "toBlock": "0x0"}]),
            ("eth_getBalance", [rich, "0x0"]),
            ("eth_getStorageAt", [rich, "0x0", "0x0"]),
        ):
            truth = anvil.rpc(method, *params)
            answers = [await _ask(proxy, method, params) for _ in range(3)]
            # (The logs of block 0 may come from its receipts, asked just before.)
            assert [(result, verified) for result, _, verified in answers] == [(truth, "unproven")] * 3, method
            assert [cache for _, cache, _ in answers][1:] == ["HIT", "HIT"], method


async def test_a_lie_about_block_zeros_header_is_never_kept(anvil: Anvil, tmp_path: Path) -> None:
    # "nothing a node says about a final block is kept forever unless it is proven": block 0 too.
    liar = await LyingRelay(anvil.url, "timestamp", below=0).start()
    try:
        async with _proxy(tmp_path, [liar.url]) as proxy:
            await _final(anvil, proxy, 1)
            for _ in range(2):
                _, cache, verified = await _ask(proxy, "eth_getBlockByNumber", ["0x0", False])
                assert (cache, verified) == ("BYPASS", "unproven")
            assert liar.lies_told >= 2
    finally:
        await liar.close()


async def test_a_hash_the_node_says_is_block_zeros_is_proven_as_any_other(anvil: Anvil, tmp_path: Path) -> None:
    # Block 0's state is kept unproven only when the call names block 0; a final block's hash that
    # the node claims is block 0's must be proven (its header there has another hash): never kept.
    rich = anvil.rpc("eth_accounts")[0]
    anvil.mine(3)
    number = anvil.block_number()
    block_hash = anvil.rpc("eth_getBlockByNumber", hex(number), False)["hash"]
    truth = anvil.rpc("eth_getBalance", rich, hex(number))
    liar = await LyingRelay(anvil.url, "genesis", below=number).start()
    try:
        async with _proxy(tmp_path, [liar.url]) as proxy:
            anvil.mine(300)  # the block far below the tracker's window: its hash is asked of the node
            await _final(anvil, proxy, anvil.block_number() - 100)
            for _ in range(3):
                told, cache, verified = await _ask(proxy, "eth_getBalance", [rich, {"blockHash": block_hash}])
                assert (cache, verified) == ("BYPASS", "unproven") and told != truth
            assert liar.hashes_asked.get(block_hash, 0) >= 2
    finally:
        await liar.close()


@pytest.mark.parametrize("kind", ["logs", "logs_merged", "call"])
async def test_under_verify_required_nothing_an_auto_replica_kept_forever_unproven_is_served_from_redis(
    anvil: Anvil, tmp_path: Path, redis_url: str, kind: str
) -> None:
    # spec (caching.md): with verify = "required" nothing unproven is kept forever. A replica with
    # `auto` beside it in one Redis keeps, forever, a wide final log range it could not check and an
    # eth_call no proof covers, here as its lying node told them: the required replica takes neither.
    store, blocks = _blocks_with_logs(anvil, LOGS_MAX_CHECKED + 4)
    if kind == "call":
        method, params = "eth_call", [{"to": store, "data": selector("x()")}, hex(blocks[-1])]
        liar = await LyingRelay(anvil.url, "result", results={"eth_call": "0x" + word(9)}).start()
    else:  # a log's data changed: in a block that shows logs, which an unchecked range leaves unread
        method, params = "eth_getLogs", [{"address": store, "fromBlock": hex(blocks[0]), "toBlock": hex(blocks[-1])}]
        logs = anvil.rpc(method, *params)
        forged = [*logs[:-1], {**logs[-1], "data": "0x" + word(9)}]
        liar = await LyingRelay(anvil.url, "result", results={"eth_getLogs": forged}).start()
    chunks = "1000" if kind == "logs_merged" else "0"
    if kind == "logs_merged":  # its whole chunk (blocks 0-999) final: the piece it is cut from is kept too
        anvil.mine(1100 - anvil.block_number())
    replicas: list[Proxy] = []
    try:
        for name, url, verify in (("auto", liar.url, "auto"), ("required", anvil.url, "required")):
            (tmp_path / name).mkdir()
            networks = _networks(tmp_path / name, [url], verify=verify)
            settings = settings_for(NETWORKS_FILE=networks, REDIS_URL=redis_url, GETLOGS_CHUNK_BLOCKS=chunks)
            replicas.append(await start_proxy(settings))
        auto, required = replicas
        for proxy in replicas:
            await _final(anvil, proxy, blocks[-1])

        async def one_space() -> bool:
            spaces = {p.app[SERVICE].networks["evm"].tracker.head.space for p in replicas}
            return len(spaces) == 1 and None not in spaces and "/~" not in str(spaces)

        await eventually(one_space, 10.0, "both replicas in one shared key space")
        truth = anvil.rpc(method, *params)
        lie, cache, _ = await _ask(auto, method, params)
        assert lie != truth and cache == "MISS"
        assert (await _ask(auto, method, params))[:2] == (lie, "HIT")  # kept by the auto replica
        assert (await _ask(required, method, params))[:2] == (truth, "MISS")
        assert (await _ask(required, method, params))[:2] == (truth, "HIT")
    finally:
        for proxy in replicas:
            await proxy.close()
        await liar.close()


async def test_after_a_reorg_below_finality_the_new_chains_final_answers_are_proven_and_kept_again(
    anvil: Anvil, tmp_path: Path
) -> None:
    """A reorg below finality moves the network to a new epoch, and the header chain begun on the old
    chain goes with it: the new chain's true answers about its final blocks are proven and kept, not
    refuted against the old chain's hashes (and their node cooled down) for ever."""
    async with _proxy(tmp_path, [anvil.url]) as proxy:
        await _final(anvil, proxy, 16)
        params = [hex(16), False]
        before, _, verified = await _ask(proxy, "eth_getBlockByNumber", params)
        assert verified == "proven" and (await _ask(proxy, "eth_getBlockByNumber", params))[1] == "HIT"
        tracker = proxy.app[SERVICE].networks["evm"].tracker
        space = tracker.head.space if tracker.head else None

        anvil.rpc("anvil_reorg", anvil.block_number() - 8, [])  # blocks 9 on replaced: 16 was final
        truth = anvil.rpc("eth_getBlockByNumber", *params)
        assert truth["hash"] != before["hash"]

        async def new_epoch() -> bool:
            return tracker.head is not None and tracker.head.space not in (None, space)

        await eventually(new_epoch, 20.0, "the reorg below finality to move the epoch")

        async def proven() -> bool:  # an answer may fail while the new epoch's first polls are made
            status, body, headers = await proxy.post(
                {"jsonrpc": "2.0", "id": 1, "method": "eth_getBlockByNumber", "params": params}
            )
            return status == 200 and (body.get("result"), headers.get("X-Cache"), headers.get("X-Verified")) == (
                truth,
                "MISS",
                "proven",
            )

        await eventually(proven, 20.0, "the new chain's block to be proven")
        assert await _ask(proxy, "eth_getBlockByNumber", params) == (truth, "HIT", "proven")
        assert _verifications(proxy, "eth_getBlockByNumber", "refuted") == 0
