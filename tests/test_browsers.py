"""Browser dapps: CORS on every route, keys in headers, per-key allow-lists, batches of 1,000."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from proxy.credits.allow_lists import AllowLists, call_refusal, origin_refusal, targets
from tests.support import DEV_ACCOUNT, Anvil, Proxy, ProxyFactory

PAGE = "https://dapp.example"
STORE = "0x" + "11" * 20
OTHER = "0x" + "22" * 20


def _keys_file(tmp_path: Path) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(f"""
[keys.plain]
key = "plain-secret"
[keys.site]
key = "site-secret"
allowed_origins = ["{PAGE}"]
[keys.reader]
key = "reader-secret"
allowed_methods = ["eth_getBalance", "eth_blockNumber", "eth_call"]
allowed_addresses = ["{STORE.upper().replace("X", "x")}"]
""")
    return str(path)


@pytest.fixture
async def keyed(anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory) -> Proxy:
    return await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=_keys_file(tmp_path))


def _call(method: str, params: list[object], rid: int = 1) -> dict[str, object]:
    return {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}


class TestAllowListDecisions:
    def test_methods_list_names_itself_when_it_refuses(self) -> None:
        error = call_refusal(AllowLists(methods=frozenset({"eth_call"})), "eth_getLogs", [{}])
        assert error is not None and "allowed_methods" in error.message and error.http_status == 403

    def test_addresses_list_covers_calls_storage_and_logs(self) -> None:
        lists = AllowLists(addresses=frozenset({STORE}))
        assert call_refusal(lists, "eth_call", [{"to": STORE}, "latest"]) is None
        assert call_refusal(lists, "eth_getStorageAt", [OTHER, "0x0", "latest"]) is not None
        assert call_refusal(lists, "eth_getLogs", [{"address": [STORE, OTHER]}]) is not None
        assert call_refusal(lists, "eth_getLogs", [{"fromBlock": "0x0"}]) is not None  # no address: all of them
        assert call_refusal(lists, "eth_blockNumber", []) is None  # names no address
        assert targets("eth_subscribe", ["logs", {"address": STORE}]) == [STORE]

    def test_addresses_list_refuses_solana_reads_that_name_accounts(self) -> None:
        # Rule: allowed_addresses holds EVM addresses, so a Solana read of named accounts is refused
        # (fail-closed, as an EVM call naming no address); a Solana call naming none is not restricted.
        lists = AllowLists(addresses=frozenset({STORE}))
        for method in (
            "getTokenAccountBalance",
            "getBalance",
            "getMultipleAccounts",
            "accountSubscribe",
            "simulateTransaction",
            "getVoteAccounts",
            "getRecentPrioritizationFees",
        ):
            error = call_refusal(lists, method, ["4Nd1mBQtrMJVYVfKf2PJy9NZUZdTAsp7D4xWLs4gDB4T"])
            assert error is not None and "Solana accounts" in error.message and error.http_status == 403
        assert call_refusal(lists, "getSlot", []) is None and call_refusal(AllowLists(), "getBalance", ["x"]) is None

    def test_origins_list_refuses_other_origins_and_none(self) -> None:
        lists = AllowLists(origins=frozenset({PAGE}))
        assert origin_refusal(lists, PAGE + "/") is None
        assert origin_refusal(lists, "https://evil.example") is not None
        assert origin_refusal(lists, None) is not None


async def test_preflight_is_answered_204_on_every_route_and_charges_nothing(keyed: Proxy) -> None:
    for path in ("/v3/plain-secret", "/v3", "/evm/v3/x", "/healthz", "/nowhere"):
        async with keyed.session.options(
            keyed.base + path,
            headers={
                "Origin": "https://other.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type,authorization",
            },
        ) as resp:
            assert resp.status == 204, path
            assert resp.headers["Access-Control-Allow-Origin"] == "*"
            assert "POST" in resp.headers["Access-Control-Allow-Methods"]
            assert "authorization" in resp.headers["Access-Control-Allow-Headers"]
    assert keyed.metric("rpc_proxy_key_credits_charged_total", key="plain") == 0


async def test_every_answer_carries_allow_origin_and_exposes_cache_and_credit_headers(keyed: Proxy) -> None:
    origin = {"Origin": "https://other.example"}
    ok = await keyed.post(_call("eth_chainId", []), "plain-secret", headers=origin)
    bad_key = await keyed.post(_call("eth_chainId", []), "wrong", headers=origin)
    bad_body = await keyed.post(b"{", "plain-secret", headers=origin)
    for status, _body, headers in (ok, bad_key, bad_body):
        assert headers["Access-Control-Allow-Origin"] == "*", status
        exposed = headers["Access-Control-Expose-Headers"]
        assert all(h in exposed for h in ("X-Cache", "X-Credits-Charged", "X-Credits-Remaining"))
    async with keyed.session.get(keyed.base + "/readyz", headers=origin) as resp:
        assert resp.headers["Access-Control-Allow-Origin"] == "*"
    no_origin = await keyed.post(_call("eth_chainId", []), "plain-secret")
    assert "Access-Control-Allow-Origin" not in no_origin[2]  # servers and scripts: nothing added


async def test_cors_allow_origins_narrows_the_origins_answered(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, CORS_ALLOW_ORIGINS=PAGE)
    _s, _b, allowed = await proxy.post(_call("eth_chainId", []), headers={"Origin": PAGE})
    _s, _b, other = await proxy.post(_call("eth_chainId", []), headers={"Origin": "https://evil.example"})
    assert allowed["Access-Control-Allow-Origin"] == PAGE and allowed["Vary"] == "Origin"
    assert "Access-Control-Allow-Origin" not in other


@pytest.mark.parametrize("header", [{"Authorization": "Bearer plain-secret"}, {"X-Api-Key": "plain-secret"}])
async def test_header_keys_open_post_and_websocket(keyed: Proxy, header: dict[str, str]) -> None:
    for path in ("/v3", "/v3/", "/evm/v3"):
        async with keyed.session.post(keyed.base + path, json=_call("eth_chainId", []), headers=header) as resp:
            assert resp.status == 200 and "result" in await resp.json(), path
    async with keyed.session.ws_connect(keyed.base.replace("http", "ws") + "/ws/v3", headers=header) as ws:
        await ws.send_str(json.dumps(_call("eth_chainId", [])))
        assert "result" in json.loads((await ws.receive()).data)


async def test_a_wrong_header_key_is_refused_like_a_wrong_path_key(keyed: Proxy) -> None:
    for header in ({"Authorization": "Bearer nope"}, {"X-Api-Key": "nope"}, {}):
        async with keyed.session.post(keyed.base + "/v3", json=_call("eth_chainId", []), headers=header) as resp:
            body = await resp.json()
            assert resp.status == 401 and body["error"]["code"] == -32001
            assert "nope" not in await resp.text()
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await keyed.session.ws_connect(keyed.base.replace("http", "ws") + "/ws/v3", headers=header)
        assert refused.value.status == 401


async def test_allowed_origins_refuse_other_pages_on_http_and_websocket(keyed: Proxy) -> None:
    status, body, _h = await keyed.post(_call("eth_chainId", []), "site-secret", headers={"Origin": PAGE})
    assert status == 200 and "result" in body
    for headers in ({"Origin": "https://evil.example"}, {}):
        status, body, _h = await keyed.post(_call("eth_chainId", []), "site-secret", headers=headers)
        assert status == 403 and "allowed_origins" in body["error"]["message"]
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await keyed.session.ws_connect(keyed.ws_url("site-secret"), headers=headers)
        assert refused.value.status == 403
    async with keyed.session.ws_connect(keyed.ws_url("site-secret"), headers={"Origin": PAGE}) as ws:
        await ws.send_str(json.dumps(_call("eth_chainId", [])))
        assert "result" in json.loads((await ws.receive()).data)


async def test_allowed_methods_and_addresses_refuse_per_call_even_when_cached(keyed: Proxy) -> None:
    balance = _call("eth_getBalance", [DEV_ACCOUNT, "latest"])
    assert "result" in (await keyed.post(balance, "plain-secret"))[1]  # now in the cache
    _s, refused, _h = await keyed.post(balance, "reader-secret")
    assert refused["error"]["code"] == -32001 and "allowed_addresses" in refused["error"]["message"]
    _s, refused, _h = await keyed.post(_call("eth_getLogs", [{"address": STORE}]), "reader-secret")
    assert "allowed_methods" in refused["error"]["message"]
    batch = [
        _call("eth_blockNumber", [], 1),
        _call("eth_call", [{"to": STORE, "data": "0x"}, "latest"], 2),
        _call("eth_call", [{"to": OTHER, "data": "0x"}, "latest"], 3),
    ]
    status, answers, headers = await keyed.post(batch, "reader-secret")
    assert status == 200 and ["error" in a for a in answers] == [False, False, True]
    assert headers["X-Credits-Charged"] == str(80 + 80)  # the refused call is not charged


async def test_a_batch_of_1000_calls_is_served_and_charged_per_call(keyed: Proxy) -> None:
    batch = [_call("eth_chainId", [], i) for i in range(1000)]
    status, answers, headers = await keyed.post(batch, "plain-secret")
    assert status == 200 and len(answers) == 1000 and all("result" in a for a in answers)
    per_call = int((await keyed.post(_call("eth_chainId", []), "plain-secret"))[2]["X-Credits-Charged"])
    assert int(headers["X-Credits-Charged"]) == 1000 * per_call
    status, answer, _h = await keyed.post([_call("eth_chainId", [], i) for i in range(1001)], "plain-secret")
    assert status == 400 and "exceeds the limit of 1000" in answer["error"]["message"]


async def test_allow_lists_also_refuse_websocket_calls_and_subscriptions(keyed: Proxy) -> None:
    async with keyed.session.ws_connect(keyed.ws_url("reader-secret")) as ws:
        await ws.send_str(json.dumps(_call("eth_subscribe", ["logs", {"address": OTHER}])))
        refused = json.loads((await ws.receive()).data)
        assert refused["error"]["code"] == -32001 and "allowed_methods" in refused["error"]["message"]
        await ws.send_str(json.dumps(_call("eth_getBalance", [OTHER, "latest"], 2)))
        refused = json.loads((await ws.receive()).data)
        assert "allowed_addresses" in refused["error"]["message"]
