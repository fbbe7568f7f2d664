"""The two Solana methods against the in-repo fake Solana node."""

from __future__ import annotations

import pytest

from tests.fake_solana import MISSING_ACCOUNT, SYSTEM_ACCOUNT, TOKEN_ACCOUNT, FakeSolana
from tests.support import Proxy, ProxyFactory


@pytest.fixture
async def sol_proxy(solana: FakeSolana, make_proxy: ProxyFactory) -> Proxy:
    return await make_proxy(SOLANA_UPSTREAM=solana.url)


async def test_token_account_balance_has_the_documented_shape(sol_proxy: Proxy) -> None:
    result = await sol_proxy.result("getTokenAccountBalance", [TOKEN_ACCOUNT])
    assert isinstance(result["context"]["slot"], int) and isinstance(result["context"]["apiVersion"], str)
    assert result["value"] == {"amount": "9864", "decimals": 2, "uiAmount": 98.64, "uiAmountString": "98.64"}


async def test_token_account_balance_passes_node_errors_through(sol_proxy: Proxy) -> None:
    reply = await sol_proxy.call("getTokenAccountBalance", [SYSTEM_ACCOUNT, {"commitment": "confirmed"}])
    assert reply["error"] == {"code": -32602, "message": "Invalid param: not a Token account"}
    reply = await sol_proxy.call("getTokenAccountBalance", [MISSING_ACCOUNT])
    assert reply["error"]["message"] == "Invalid param: could not find account"


async def test_largest_accounts_returns_20_entries_and_defaults_apply_to_empty_params(sol_proxy: Proxy) -> None:
    result = await sol_proxy.result("getLargestAccounts", [])
    assert len(result["value"]) == 20
    assert set(result["value"][0]) == {"address", "lamports"}


async def test_largest_accounts_filter_is_forwarded(sol_proxy: Proxy, solana: FakeSolana) -> None:
    result = await sol_proxy.result("getLargestAccounts", [{"filter": "nonCirculating"}])
    assert len(result["value"]) == 5


@pytest.mark.parametrize(
    ("method", "params", "name"),
    [
        ("getTokenAccountBalance", ["not-base58-0OIl"], "address"),
        ("getTokenAccountBalance", [TOKEN_ACCOUNT[:-3]], "address"),
        ("getTokenAccountBalance", [TOKEN_ACCOUNT, {"commitment": "recent"}], "commitment"),
        ("getLargestAccounts", [{"filter": "everything"}], "filter"),
        ("getLargestAccounts", ["finalized"], "config"),
    ],
)
async def test_solana_params_are_validated_before_upstream(
    sol_proxy: Proxy, solana: FakeSolana, method: str, params: list[object], name: str
) -> None:
    reply = await sol_proxy.call(method, params)
    assert reply["error"]["code"] == -32602 and name in reply["error"]["message"]
    assert solana.calls[method] == 0


async def test_other_solana_methods_are_forwarded_to_the_solana_network(sol_proxy: Proxy) -> None:
    assert await sol_proxy.result("getHealth", []) == "ok"
    assert (await sol_proxy.result("getVersion", []))["solana-core"]
