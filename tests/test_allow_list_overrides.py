"""allowed_addresses cannot be sidestepped: a key with the list may not bring its own code or state
(state and block overrides) to any method that executes calls, over HTTP, in a batch or over a
WebSocket; real Anvil, two Store contracts, and a `code` override that reads the other one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from proxy.credits.allow_lists import AllowLists, call_refusal
from tests.support import Anvil, Proxy, selector, settings_for, start_proxy, word

SET_X = 1234  # the other Store's x: what a sidestep would read


def reader_code(target: str) -> str:
    """Runtime code that STATICCALLs target.x() and returns its word: placed on the allowed address
    by a `code` override, it reads a contract the key may not."""
    return (
        "0x63"
        + selector("x()")[2:]
        + "60e01b600052"  # mem[0:4] = x()'s selector
        + "6020600060046000"
        + "73"
        + target[2:].lower()
        + "5afa50"  # staticcall(gas, target, 0, 4, 0, 32)
        + "60206000f3"
    )  # return mem[0:32]


@pytest.fixture
async def stores(anvil: Anvil) -> tuple[str, str]:
    allowed, other = anvil.deploy_store(), anvil.deploy_store()
    anvil.send(other, selector("setX(uint256)") + word(SET_X))
    return allowed, other


@pytest.fixture
async def proxy(anvil: Anvil, stores: tuple[str, str], tmp_path: Path) -> AsyncIterator[Proxy]:
    path = tmp_path / "keys.toml"
    path.write_text(
        f'[keys.plain]\nkey = "plain-secret"\n[keys.reader]\nkey = "reader-secret"\n'
        f'allowed_addresses = ["{stores[0]}"]\n'
    )
    started = await start_proxy(
        settings_for(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=str(path), ALLOW_METHODS="eth_simulateV1,debug_traceCall")
    )
    yield started
    await started.close()


def _call(method: str, params: list[Any], rid: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}


def sidesteps(allowed: str, other: str) -> list[dict[str, Any]]:
    """Calls to the allowed address that run code of the caller's choosing, one per method and kind."""
    tx = {"to": allowed, "data": selector("x()")}
    code = {allowed: {"code": reader_code(other)}}
    return [
        _call("eth_call", [tx, "latest", code]),
        _call("eth_call", [tx, "latest", None, {"number": "0x1"}]),  # block overrides alone
        _call("eth_estimateGas", [tx, "latest", code]),
        _call("eth_createAccessList", [tx, "latest", code]),
        _call("debug_traceCall", [tx, "latest", {"stateOverrides": code}]),
        _call("eth_simulateV1", [{"blockStateCalls": [{"stateOverrides": code, "calls": [tx]}]}, "latest"]),
        _call(
            "eth_simulateV1", [{"blockStateCalls": [{"blockOverrides": {"number": "0x1"}, "calls": [tx]}]}, "latest"]
        ),
    ]


def refused_for_overrides(answer: dict[str, Any]) -> bool:
    error = answer.get("error") or {}
    return error.get("code") == -32001 and "overrides" in error.get("message", "")


class TestTheRule:
    def test_overrides_of_every_executing_method_are_refused_to_a_key_with_allowed_addresses(self) -> None:
        lists = AllowLists(addresses=frozenset({"0x" + "11" * 20}))
        for call in sidesteps("0x" + "11" * 20, "0x" + "22" * 20):
            error = call_refusal(lists, call["method"], call["params"])
            assert error is not None and "overrides" in error.message, call

    def test_empty_overrides_and_keys_without_addresses_are_not_refused(self) -> None:
        lists = AllowLists(addresses=frozenset({"0x" + "11" * 20}))
        assert call_refusal(lists, "eth_call", [{"to": "0x" + "11" * 20}, "latest", {}]) is None
        assert (
            call_refusal(
                AllowLists(methods=frozenset({"eth_call"})),
                "eth_call",
                [{"to": "0x" + "22" * 20}, "latest", {"0x" + "11" * 20: {"code": "0x00"}}],
            )
            is None
        )

    def test_simulate_calls_to_an_address_off_the_list_or_to_none_are_refused(self) -> None:
        lists = AllowLists(addresses=frozenset({"0x" + "11" * 20}))
        off = [{"blockStateCalls": [{"calls": [{"to": "0x" + "11" * 20}, {"to": "0x" + "22" * 20}]}]}]
        assert "0x2222" in str(call_refusal(lists, "eth_simulateV1", off))
        creation = [{"blockStateCalls": [{"calls": [{"data": "0x00"}]}]}]
        assert call_refusal(lists, "eth_simulateV1", creation) is not None
        assert call_refusal(lists, "eth_simulateV1", []) is not None

    def test_bundle_methods_are_refused_to_a_key_with_allowed_addresses(self) -> None:
        lists = AllowLists(addresses=frozenset({"0x" + "11" * 20}))
        for method in ("eth_callMany", "trace_callMany", "eth_callBundle"):
            assert call_refusal(lists, method, [[]]) is not None


async def test_a_code_override_reads_the_other_contract_for_a_key_without_lists(
    proxy: Proxy,
    stores: tuple[str, str],
) -> None:
    """The control: the sidestep is real (on Anvil the override's code reads the other Store's x)."""
    _s, answer, _h = await proxy.post(sidesteps(*stores)[0], "plain-secret")
    assert answer["result"] == "0x" + word(SET_X), answer


async def test_overrides_are_refused_over_http_uncharged(proxy: Proxy, stores: tuple[str, str]) -> None:
    for call in sidesteps(*stores):
        status, answer, headers = await proxy.post(call, "reader-secret")
        assert status == 403 and refused_for_overrides(answer), (call, answer)
        assert headers["X-Credits-Charged"] == "0"
    # The allowed address itself, without overrides, is still served.
    _s, plain, _h = await proxy.post(
        _call("eth_call", [{"to": stores[0], "data": selector("x()")}, "latest"]), "reader-secret"
    )
    assert plain["result"] == "0x" + word(7)


async def test_overrides_are_refused_in_a_batch_beside_a_call_that_is_served(
    proxy: Proxy,
    stores: tuple[str, str],
) -> None:
    calls = [{**c, "id": i} for i, c in enumerate(sidesteps(*stores), start=2)]
    batch = [_call("eth_call", [{"to": stores[0], "data": selector("x()")}, "latest"]), *calls]
    status, answers, _h = await proxy.post(batch, "reader-secret")
    assert status == 200 and answers[0]["result"] == "0x" + word(7)
    assert all(refused_for_overrides(a) for a in answers[1:]), answers


async def test_overrides_are_refused_over_a_websocket(proxy: Proxy, stores: tuple[str, str]) -> None:
    async with proxy.session.ws_connect(proxy.ws_url("reader-secret")) as ws:
        for call in sidesteps(*stores):
            await ws.send_str(json.dumps(call))
            answer = json.loads((await ws.receive(timeout=10)).data)
            assert refused_for_overrides(answer), (call, answer)
