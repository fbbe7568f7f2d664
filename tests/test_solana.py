"""The two Solana methods against the in-repo fake Solana node."""

from __future__ import annotations

from pathlib import Path

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


async def test_a_key_with_allowed_addresses_is_refused_solana_reads_of_named_accounts(
    solana: FakeSolana, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """Rule (docs/clients.md, allow-lists): allowed_addresses holds EVM addresses, so a key with the list
    is refused the Solana reads that name accounts (403, -32001, uncharged) rather than read any
    account; a Solana call naming none (getLargestAccounts) is served. A key without lists reads them."""
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[keys.dave]\nkey = "dave-key-1"\nallowed_addresses = ["0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266"]\n'
        '[keys.erin]\nkey = "erin-key-1"\n'
    )
    keys.chmod(0o600)
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, API_KEYS_FILE=str(keys))
    call = {"jsonrpc": "2.0", "id": 1, "method": "getTokenAccountBalance", "params": [TOKEN_ACCOUNT]}
    status, body, _ = await proxy.post(call, "dave-key-1")
    assert (status, body["error"]["code"]) == (403, -32001) and "Solana accounts" in body["error"]["message"]
    assert "result" in await proxy.call("getLargestAccounts", [], "dave-key-1")
    assert (await proxy.result("getTokenAccountBalance", [TOKEN_ACCOUNT], "erin-key-1"))["value"]["amount"] == "9864"
