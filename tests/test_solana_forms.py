"""getLargestAccounts in the forms real clients send, keyed identically when they mean the same."""

from __future__ import annotations

import pytest

from proxy.rpc.jsonrpc import JsonRpcError
from proxy.rpc.params import Rules
from proxy.rpc.params.solana import get_largest_accounts
from tests.fake_solana import FakeSolana
from tests.support import ProxyFactory

RULES = Rules(False, 5000)
NON_CIRCULATING = [{"commitment": "finalized", "filter": "nonCirculating"}]


class TestLargestAccountsForms:
    @pytest.mark.parametrize(
        "params",
        [
            [{"commitment": "finalized"}, "nonCirculating"],  # solana-py
            [{"filter": "nonCirculating"}],  # @solana/web3.js, @solana/kit
            [None, "nonCirculating"],
            [{"commitment": "finalized", "filter": "nonCirculating"}, "nonCirculating"],
        ],
    )
    def test_the_same_meaning_is_the_same_canonical_params(self, params: list[object]) -> None:
        assert get_largest_accounts(params, RULES) == NON_CIRCULATING

    def test_defaults_and_contradictions(self) -> None:
        assert get_largest_accounts([], RULES) == get_largest_accounts([None], RULES) == [{"commitment": "finalized"}]
        with pytest.raises(JsonRpcError):
            get_largest_accounts([{"filter": "circulating"}, "nonCirculating"], RULES)
        with pytest.raises(JsonRpcError):
            get_largest_accounts(["finalized"], RULES)  # Agave refuses a bare commitment too


async def test_solana_py_form_is_served_and_shares_the_cache_entry_of_the_object_form(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url)
    first = await proxy.post(
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "getLargestAccounts",
            "params": [{"commitment": "finalized"}, "nonCirculating"],
        }
    )
    second = await proxy.post(
        {"jsonrpc": "2.0", "id": 2, "method": "getLargestAccounts", "params": [{"filter": "nonCirculating"}]}
    )
    assert len(first[1]["result"]["value"]) == 5 and second[1]["result"] == first[1]["result"]
    assert second[2]["X-Cache"] == "HIT" and solana.calls["getLargestAccounts"] == 1
