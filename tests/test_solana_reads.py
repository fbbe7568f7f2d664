"""Solana's common reads through the policy table, against the fake node: slots and heights from the
slot tracker, accounts at a bounded max age per commitment, finalized blocks and transactions
immutable, identity data cached."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.http.app_keys import SERVICE
from tests.fake_solana import (
    EPOCH_SCHEDULE,
    GENESIS_HASH,
    MISSING_ACCOUNT,
    SIGNATURE,
    SYSTEM_ACCOUNT,
    TOKEN_ACCOUNT,
    UNKNOWN_SIGNATURE,
    FakeSolana,
)
from tests.support import FakeClock, Proxy, ProxyFactory, eventually


@pytest.fixture
async def sol(solana: FakeSolana, make_proxy: ProxyFactory) -> Proxy:
    # One tracker poll at start (then none within a test); a max age long enough to see hits.
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, HEAD_POLL_INTERVAL="60", SOLANA_BALANCE_MAX_AGE="30")
    tracker = proxy.app[SERVICE].networks["solana"].tracker

    async def polled() -> bool:
        return bool(tracker.slots)

    await eventually(polled, 10, "the first slot poll")
    return proxy


async def call(proxy: Proxy, method: str, params: list[Any]) -> tuple[Any, str]:
    _, body, headers = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    return body, headers["X-Cache"]


async def test_get_slot_is_answered_from_the_slot_tracker_per_commitment(sol: Proxy, solana: FakeSolana) -> None:
    polls = solana.calls["getSlot"]
    finalized = [await call(sol, "getSlot", []) for _ in range(3)]
    confirmed = await call(sol, "getSlot", [{"commitment": "confirmed"}])
    assert solana.calls["getSlot"] == polls  # no upstream call per request
    assert {cache for _, cache in finalized} == {"HIT"} and confirmed[1] == "HIT"
    assert finalized[0][0]["result"] < confirmed[0]["result"]  # finalized trails confirmed


async def test_get_slot_past_its_max_age_is_forwarded_and_never_goes_back(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, HEAD_POLL_INTERVAL="60", SOLANA_BALANCE_MAX_AGE="0.001")
    seen = [(await call(proxy, "getSlot", [{"commitment": "processed"}]))[0]["result"] for _ in range(3)]
    assert solana.calls["getSlot"] >= 3 and seen == sorted(seen)
    tracker = proxy.app[SERVICE].networks["solana"].tracker
    assert tracker.observe("getSlot", "processed", seen[-1] - 10, 0.0) == seen[-1]  # a lagging answer


async def test_get_block_height_is_forwarded_once_then_held_for_its_max_age(sol: Proxy, solana: FakeSolana) -> None:
    first, cache = await call(sol, "getBlockHeight", [{"commitment": "confirmed"}])
    assert cache == "BYPASS"
    again, cache = await call(sol, "getBlockHeight", [{"commitment": "confirmed"}])
    assert cache == "HIT" and again["result"] == first["result"] and solana.calls["getBlockHeight"] == 1
    assert (await call(sol, "getBlockHeight", [{"commitment": "confirmed", "minContextSlot": 1}]))[1] == "BYPASS"


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("getBalance", [SYSTEM_ACCOUNT]),
        ("getAccountInfo", [SYSTEM_ACCOUNT, {"encoding": "base64"}]),
        ("getMultipleAccounts", [[SYSTEM_ACCOUNT, MISSING_ACCOUNT]]),
    ],
)
async def test_account_reads_are_cached_per_commitment_for_the_max_age(
    sol: Proxy, solana: FakeSolana, method: str, params: list[Any]
) -> None:
    first, cache = await call(sol, method, params)
    assert cache == "MISS" and "context" in first["result"]
    again, cache = await call(sol, method, params)
    assert cache == "HIT" and again == first and solana.calls[method] == 1
    # Another commitment is another key; minContextSlot is for the node alone.
    _, cache = await call(sol, method, [params[0], {"commitment": "processed"}])
    assert cache == "MISS"
    _, cache = await call(sol, method, [params[0], {"minContextSlot": 1}])
    assert cache == "BYPASS"


async def test_finalized_blocks_and_transactions_are_immutable_other_commitments_uncached(
    sol: Proxy, solana: FakeSolana
) -> None:
    slot = solana.slot - 200
    slot -= 1 if slot % 7 == 0 else 0
    for method, params in (("getBlock", [slot]), ("getTransaction", [SIGNATURE])):
        results = [await call(sol, method, params) for _ in range(2)]
        assert [cache for _, cache in results] == ["MISS", "HIT"] and solana.calls[method] == 1
        assert results[0][0]["result"] == results[1][0]["result"] is not None
        confirmed = [params[0], {"commitment": "confirmed"}]
        assert [(await call(sol, method, confirmed))[1] for _ in range(2)] == ["BYPASS", "BYPASS"]


@pytest.mark.parametrize(
    ("method", "result"),
    [
        ("getBlock", "garbage"),
        ("getBlock", {"blockhash": "x", "parentSlot": -1, "previousBlockhash": "y"}),
        ("getTransaction", {"slot": 5}),
        ("getTransaction", [1, 2]),
        ("getTransaction", {"slot": 900, "transaction": None, "meta": None}),  # outside attack: kept for good
        ("getTransaction", {"slot": 900, "transaction": 7, "meta": {}}),
        ("getBlock", {"blockhash": "", "previousBlockhash": "", "parentSlot": 1}),
    ],
)
async def test_a_final_block_or_transaction_not_of_its_shape_is_a_bad_reply_never_kept(
    sol: Proxy, solana: FakeSolana, method: str, result: Any
) -> None:
    # Outside attack: a final getBlock answered "garbage" once was served as a HIT for good.
    slot = solana.slot - 200
    slot -= 1 if slot % 7 == 0 else 0
    params = [slot] if method == "getBlock" else [SIGNATURE]
    solana.results[method] = result
    for _ in range(2):
        body, cache = await call(sol, method, params)
        assert body["error"]["code"] == -32002 and "malformed" in body["error"]["message"] and cache != "HIT", body
    solana.results.clear()
    assert [(await call(sol, method, params))[1] for _ in range(2)] == ["MISS", "HIT"]


@pytest.mark.parametrize("entries", [1, 3, 0])
async def test_multiple_accounts_of_another_length_than_the_keys_asked_are_no_answer(
    sol: Proxy, solana: FakeSolana, entries: int
) -> None:
    # Outside attack: one entry for two keys was served, then a HIT: entry i no longer matched key i.
    keys = [TOKEN_ACCOUNT, MISSING_ACCOUNT]
    account = {"data": ["", "base64"], "executable": False, "lamports": 1, "owner": "1" * 32, "rentEpoch": 0}
    solana.results["getMultipleAccounts"] = {"context": {"slot": solana.slot}, "value": [account] * entries}
    for _ in range(2):
        body, cache = await call(sol, "getMultipleAccounts", [keys])
        assert body["error"]["code"] == -32002 and f"{entries} accounts for 2 keys" in body["error"]["message"], body
        assert cache != "HIT"
    solana.results.clear()
    body, cache = await call(sol, "getMultipleAccounts", [keys])
    assert len(body["result"]["value"]) == 2 and cache == "MISS", body


async def test_a_transaction_in_the_legacy_binary_encoding_is_a_base58_string_served_and_kept(
    sol: Proxy, solana: FakeSolana
) -> None:
    # Agave's EncodedTransaction::LegacyBinary: the shape judge refused it once it asked for an object.
    answer = {**solana._transaction(), "transaction": "3yZe7d"}
    solana.results["getTransaction"] = answer
    params = [SIGNATURE, {"encoding": "binary", "maxSupportedTransactionVersion": 0}]
    results = [await call(sol, "getTransaction", params) for _ in range(2)]
    assert [cache for _, cache in results] == ["MISS", "HIT"], results
    assert results[1][0]["result"]["transaction"] == "3yZe7d"


async def test_agave_block_errors_are_passed_through_and_never_cached(sol: Proxy, solana: FakeSolana) -> None:
    skipped = (solana.slot - 200) // 7 * 7
    for _ in range(2):
        body, cache = await call(sol, "getBlock", [skipped])
        assert body["error"]["code"] == -32007 and cache == "MISS"
    body, _ = await call(sol, "getBlock", [solana.slot + 1000])
    assert body["error"]["code"] == -32004
    assert solana.calls["getBlock"] == 3


async def test_an_unknown_transaction_is_null_and_kept_only_for_the_negative_ttl(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    clock = FakeClock()
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, CACHE_NEGATIVE_TTL="30", clock=clock)
    for expected in ("MISS", "HIT"):
        body, cache = await call(proxy, "getTransaction", [UNKNOWN_SIGNATURE])
        assert body["result"] is None and cache == expected
    clock.advance(31)  # not yet mined is not forever
    assert (await call(proxy, "getTransaction", [UNKNOWN_SIGNATURE]))[1] == "MISS"
    assert solana.calls["getTransaction"] == 2


async def test_identity_data_is_asked_once(sol: Proxy, solana: FakeSolana) -> None:
    for method, expected in (("getGenesisHash", GENESIS_HASH), ("getEpochSchedule", EPOCH_SCHEDULE)):
        asked = solana.calls[method]  # getGenesisHash: the slot tracker's identity check at its first poll
        for cache in ("MISS", "HIT", "HIT"):
            body, seen = await call(sol, method, [])
            assert body["result"] == expected and seen == cache
        assert solana.calls[method] == asked + 1
    assert (await call(sol, "getVersion", []))[1] == "MISS" and (await call(sol, "getVersion", []))[1] == "HIT"


@pytest.mark.parametrize(
    ("method", "params", "name"),
    [
        ("getBalance", ["0OIl"], "address"),
        ("getBalance", [SYSTEM_ACCOUNT, {"encoding": "base64"}], "encoding"),
        ("getAccountInfo", [SYSTEM_ACCOUNT, {"encoding": "hex"}], "encoding"),
        ("getAccountInfo", [SYSTEM_ACCOUNT, {"dataSlice": {"offset": 0}}], "dataSlice"),
        ("getMultipleAccounts", [[]], "addresses"),
        ("getMultipleAccounts", [[SYSTEM_ACCOUNT] * 101], "addresses"),
        ("getBlock", ["100"], "slot"),
        ("getBlock", [100, {"commitment": "processed"}], "commitment"),
        ("getBlock", [100, {"transactionDetails": "most"}], "transactionDetails"),
        ("getTransaction", [TOKEN_ACCOUNT], "signature"),
        ("getTransaction", [SIGNATURE, {"maxSupportedTransactionVersion": -1}], "maxSupportedTransactionVersion"),
        ("getSlot", [{"commitment": "recent"}], "commitment"),
        ("getGenesisHash", [1], "params"),
    ],
)
async def test_solana_read_params_are_validated_before_upstream(
    sol: Proxy, solana: FakeSolana, method: str, params: list[Any], name: str
) -> None:
    body, _ = await call(sol, method, params)
    assert body["error"]["code"] == -32602 and name in body["error"]["message"], body
    # The first polls: the upstream's own slot, the tracker's three getSlot and one getGenesisHash
    # (the cluster's identity).
    assert solana.calls[method] == {"getSlot": 4, "getGenesisHash": 1}.get(method, 0)
