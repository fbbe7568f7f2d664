"""A node's answer must be one the proxy can serve: a result of the shape its method has (spec: hex
strings) and JSON the proxy can encode again (orjson writes 255 levels of nesting at most). Any other
reply is a bad node reply: asked of the next upstream, else -32002 (HTTP 502) for that call alone,
never kept and never served as an answer. A null is judged as before."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.fake_solana import TOKEN_ACCOUNT, FakeSolana
from tests.lying_relay import LyingRelay, nested
from tests.support import DEV_ACCOUNT, Anvil, Proxy, ProxyFactory, eventually, selector, word
from tests.test_cache import FINALITY, finalized_store

# What a lying (or broken) node answers eth_call with: valid JSON, of no shape eth_call has.
MISSHAPEN_CALLS = {
    "not_hex": "aaaaaaaaaa",
    "nul": "\u0000",
    "odd_digits": "0x123",
    "float": 1.5,
    "object": {"a": 2},
    "arrays": [["0x01"]],
    "deep": nested(300),
}


@pytest.fixture
async def liar(anvil: Anvil) -> AsyncIterator[LyingRelay]:
    relay = await LyingRelay(anvil.url, "result").start()
    yield relay
    await relay.close()


def call(method: str, params: list[Any], rid: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}


def reads(address: str, block: int) -> dict[str, list[Any]]:
    """A final read of each shape-checked method, by method."""
    return {
        "eth_call": [{"from": DEV_ACCOUNT, "to": address, "data": selector("x()")}, hex(block)],
        "eth_getStorageAt": [address, "0x0", hex(block)],
        "eth_getBalance": [DEV_ACCOUNT, hex(block)],
        "eth_getCode": [address, hex(block)],
    }


def asked(liar: LyingRelay, method: str) -> int:
    return sum(1 for c in liar.calls if c.get("method") == method)


async def assert_bad_node_reply_never_kept(proxy: Proxy, liar: LyingRelay, method: str, params: list[Any]) -> None:
    """-32002 (502), naming a malformed reply; asked of the node again the next time; once the node tells
    the truth, its answer is a miss (nothing was kept)."""
    for _ in range(2):
        before = asked(liar, method)
        status, body, _ = await proxy.post(call(method, params))
        assert status == 502 and body["error"]["code"] == -32002, body
        assert "malformed" in body["error"]["message"] and "aaaa" not in body["error"]["message"]
        assert asked(liar, method) > before  # never served from the cache
    liar.results.clear()
    status, body, headers = await proxy.post(call(method, params))
    assert status == 200 and "result" in body and headers["X-Cache"] == "MISS", body


@pytest.mark.parametrize("form", list(MISSHAPEN_CALLS))
async def test_an_eth_call_result_of_no_hex_shape_is_a_bad_node_reply_never_kept(
    anvil: Anvil, liar: LyingRelay, make_proxy: ProxyFactory, form: str
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=liar.url)
    address, block = await finalized_store(anvil, proxy)
    liar.results["eth_call"] = MISSHAPEN_CALLS[form]
    await assert_bad_node_reply_never_kept(proxy, liar, "eth_call", reads(address, block)["eth_call"])


@pytest.mark.parametrize(
    ("method", "result"),
    [
        ("eth_getStorageAt", [["0x" + word(7)]]),  # VERIFY_ANSWERS=auto served this, uncached
        ("eth_getStorageAt", "0x7"),  # not padded to 32 bytes
        ("eth_getBalance", "1000"),
        ("eth_getBalance", 1.5),
        ("eth_getCode", "0xabc"),
    ],
)
async def test_a_state_read_of_the_wrong_shape_is_a_bad_node_reply_never_kept(
    anvil: Anvil, liar: LyingRelay, make_proxy: ProxyFactory, method: str, result: Any
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=liar.url, VERIFY_ANSWERS="auto")
    address, block = await finalized_store(anvil, proxy)
    liar.results[method] = result
    await assert_bad_node_reply_never_kept(proxy, liar, method, reads(address, block)[method])


@pytest.mark.parametrize(
    ("method", "result"),
    [("eth_call", "aaaaaaaaaa"), ("eth_call", nested(300)), ("eth_getStorageAt", [[]]), ("eth_getBalance", 1.5)],
)
async def test_a_bad_node_reply_is_asked_of_the_next_upstream(
    anvil: Anvil, liar: LyingRelay, make_proxy: ProxyFactory, method: str, result: Any
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=f"{liar.url},{anvil.url}")
    address, block = await finalized_store(anvil, proxy)
    liar.results[method] = result
    # Until a call reaches the liar first: on a busy host a head poll it was slow to answer may have
    # it cooling down, and the call then goes to the next upstream (one more block each: no hit).
    for offset in range(FINALITY):
        params = reads(address, block + offset)[method]
        truth = anvil.rpc(method, *params)
        before = asked(liar, method)
        status, body, _ = await proxy.post(call(method, params))
        assert status == 200 and body["result"] == truth, body
        if asked(liar, method) > before:
            break
    else:
        pytest.fail("no call reached the lying upstream")
    assert proxy.metric("rpc_proxy_upstream_errors_total", network="evm", upstream="0", kind="mismatch") >= 1


async def test_a_reply_nested_past_what_orjson_writes_fails_only_its_own_call_in_a_batch(
    anvil: Anvil, liar: LyingRelay, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=liar.url)
    address, block = await finalized_store(anvil, proxy)
    params = {**reads(address, block), "eth_getTransactionByBlockNumberAndIndex": [hex(block), "0x0"]}
    # eth_call has a shape; a transaction has none the reply is judged by: only its nesting.
    liar.results.update({"eth_call": nested(300), "eth_getTransactionByBlockNumberAndIndex": nested(300)})
    methods = ["eth_call", "eth_getTransactionByBlockNumberAndIndex", "eth_getStorageAt", "eth_getBalance"]
    status, body, _ = await proxy.post([call(m, params[m], rid) for rid, m in enumerate(methods, 1)])
    assert status == 200
    by_id = {item["id"]: item for item in body}
    assert by_id[1]["error"]["code"] == -32002 and "malformed" in by_id[1]["error"]["message"]
    assert by_id[2]["error"]["code"] == -32002 and "nested too deep" in by_id[2]["error"]["message"]
    assert by_id[3]["result"] == "0x" + word(7)
    assert by_id[4]["result"] == anvil.rpc("eth_getBalance", *params["eth_getBalance"])


async def test_a_forwarded_result_254_levels_deep_is_served_and_255_is_a_bad_node_reply(
    anvil: Anvil, liar: LyingRelay, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=liar.url)
    liar.results["eth_syncing"] = nested(254)
    status, body, _ = await proxy.post(call("eth_syncing", []))
    assert status == 200 and body["result"] == nested(254)
    liar.results["eth_syncing"] = nested(255)
    status, body, _ = await proxy.post(call("eth_syncing", []))
    assert status == 502 and body["error"]["code"] == -32002 and "nested too deep" in body["error"]["message"]


SOLANA_READS = {
    "getTokenAccountBalance": [TOKEN_ACCOUNT],
    "getLargestAccounts": [],
    "getBalance": [TOKEN_ACCOUNT],
    "getAccountInfo": [TOKEN_ACCOUNT],
}
_CONTEXT = {"slot": 5, "apiVersion": "2.2.0"}
MISSHAPEN_SOLANA = [
    ("getLargestAccounts", "oops"),
    ("getLargestAccounts", 123),
    ("getLargestAccounts", {"value": []}),
    ("getLargestAccounts", {"context": {"slot": -1}, "value": []}),
    ("getLargestAccounts", {"context": {"slot": 5.0}, "value": []}),
    ("getLargestAccounts", {"context": _CONTEXT, "value": [{"address": "0OIl" * 9, "lamports": 1}]}),
    ("getLargestAccounts", {"context": _CONTEXT, "value": [{"address": TOKEN_ACCOUNT, "lamports": -1}]}),
    ("getLargestAccounts", {"context": _CONTEXT, "value": [{"address": TOKEN_ACCOUNT, "lamports": True}]}),
    ("getTokenAccountBalance", "oops"),
    ("getTokenAccountBalance", None),
    # context.apiVersion is a string (spec Versioning 3; outside attack: an integer was kept).
    (
        "getTokenAccountBalance",
        {
            "context": {"slot": 5, "apiVersion": 2},
            "value": {"amount": "5", "decimals": 0, "uiAmount": 5.0, "uiAmountString": "5"},
        },
    ),
    ("getLargestAccounts", {"context": {"slot": 5, "apiVersion": None}, "value": []}),
    ("getTokenAccountBalance", {"context": _CONTEXT, "value": None}),
    ("getTokenAccountBalance", {"context": _CONTEXT, "value": {"amount": 5, "decimals": 2}}),
    (
        "getTokenAccountBalance",
        {"context": _CONTEXT, "value": {"amount": "-5", "decimals": 2, "uiAmount": 0.05, "uiAmountString": "0.05"}},
    ),
    # A mint's decimals are a u8, and Agave writes a u64 amount with no leading zero (outside attack: both kept).
    (
        "getTokenAccountBalance",
        {"context": _CONTEXT, "value": {"amount": "5", "decimals": 256, "uiAmount": 0.0, "uiAmountString": "0"}},
    ),
    (
        "getTokenAccountBalance",
        {
            "context": _CONTEXT,
            "value": {"amount": "0986", "decimals": 2, "uiAmount": 9.86, "uiAmountString": "9.86"},
        },
    ),
    # uiAmount and uiAmountString say what amount and decimals do, as Agave writes them (outside attack:
    # -7.5 and "lots" for an amount of 5 were kept).
    (
        "getTokenAccountBalance",
        {"context": _CONTEXT, "value": {"amount": "5", "decimals": 0, "uiAmount": -7.5, "uiAmountString": "5"}},
    ),
    (
        "getTokenAccountBalance",
        {"context": _CONTEXT, "value": {"amount": "5", "decimals": 0, "uiAmount": 5.0, "uiAmountString": "lots"}},
    ),
    (
        "getTokenAccountBalance",
        {"context": _CONTEXT, "value": {"amount": "1500", "decimals": 3, "uiAmount": 1.5, "uiAmountString": "1.500"}},
    ),
    ("getBalance", 12345),
    ("getBalance", {"context": _CONTEXT, "value": -1}),
    ("getAccountInfo", "hello"),
    ("getAccountInfo", {"context": _CONTEXT, "value": {"lamports": 5}}),
    (
        "getAccountInfo",
        {"context": _CONTEXT, "value": {"lamports": 5, "owner": TOKEN_ACCOUNT, "executable": False, "data": 5}},
    ),
]


async def test_a_null_largest_accounts_answer_is_the_nodes_served_and_kept_no_longer_than_a_not_found(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Spec getLargestAccounts 3: the result may be null. It is served as the node said, 200, and kept
    no longer than CACHE_NEGATIVE_TTL, never for the method's two hours; it was refused 502 before."""
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, CACHE_NEGATIVE_TTL="0.2")
    solana.results["getLargestAccounts"] = None
    status, body, headers = await proxy.post(call("getLargestAccounts", SOLANA_READS["getLargestAccounts"]))
    assert status == 200 and body["result"] is None and headers["X-Cache"] == "MISS", body
    solana.results.clear()

    async def answered() -> bool:
        _, body, _ = await proxy.post(call("getLargestAccounts", SOLANA_READS["getLargestAccounts"]))
        return body["result"] is not None

    await eventually(answered, 5, "the node's accounts once the null is no longer kept")


@pytest.mark.parametrize(("method", "result"), MISSHAPEN_SOLANA)
async def test_a_solana_result_not_of_its_methods_rpc_response_form_is_a_bad_node_reply_never_kept(
    solana: FakeSolana, make_proxy: ProxyFactory, method: str, result: Any
) -> None:
    """Spec "Token account balance", "Largest-account entry": context.slot an integer, context.apiVersion
    a string, the value of the method's form; Agave answers a missing token account with an error,
    never null."""
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url)
    solana.results[method] = result
    for _ in range(2):
        before = solana.calls[method]
        status, body, _ = await proxy.post(call(method, SOLANA_READS[method]))
        assert status == 502 and body["error"]["code"] == -32002 and "malformed" in body["error"]["message"], body
        assert solana.calls[method] > before  # never served from the cache
    solana.results.clear()
    status, body, headers = await proxy.post(call(method, SOLANA_READS[method]))
    assert status == 200 and "context" in body["result"] and headers["X-Cache"] == "MISS", body
    status, again, headers = await proxy.post(call(method, SOLANA_READS[method]))
    assert again == body and headers["X-Cache"] == "HIT"
