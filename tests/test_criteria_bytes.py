"""What clients leave standing is bounded in bytes, not only in counts (held_bytes.py): logs
subscriptions' criteria by WS_MAX_SUBSCRIPTION_BYTES a worker, node-side filters' by MAX_FILTER_BYTES
a host, a key's at most a quarter of either, open mode's filters too (uncapped, they held 590 KB
each; 100 subscriptions of 4,999 addresses held 145 MB on one connection). Real Anvil, two keys."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

from proxy.credits.accounts import OPEN_ACCOUNT
from proxy.gateway.filters import FILTER_TIMEOUT, Filters
from proxy.held_bytes import HeldBytes, deep_size
from proxy.rpc.jsonrpc import Call
from tests.support import Anvil, Proxy, ProxyFactory, settings_for
from tests.test_filter_paging import _Node, _unused
from tests.ws_client import Client, connect

ADDRESSES = ["0x" + f"{n:040x}" for n in range(1, 5000)]  # 4,999: under GETLOGS_MAX_PARAMS


class TestHeldBytes:
    def test_an_object_named_twice_is_counted_once(self) -> None:
        word, key = "0x" + "ab" * 20, "address"
        assert deep_size([word, word]) == sys.getsizeof([word, word]) + sys.getsizeof(word)
        held = {key: [word]}
        assert deep_size(held, held[key]) == sys.getsizeof(held) + sys.getsizeof(key) + deep_size([word])

    def test_a_key_takes_a_quarter_and_the_open_account_the_whole(self) -> None:
        held = HeldBytes(1000)
        assert held.take("a", 250) and not held.take("a", 1)
        assert held.take(OPEN_ACCOUNT, 700, whole=True) and not held.take("b", 51)
        held.give("a", 250)
        assert held.take("b", 250) and held.by_account == {OPEN_ACCOUNT: 700, "b": 250}


async def _until_refused(
    ask: Callable[[], Awaitable[dict[str, Any]]], limit: int = 200
) -> tuple[list[Any], dict[str, Any]]:
    """What `ask` made (a subscription's or filter's id each) until it was refused, and the refusal."""
    ids = []
    for _ in range(limit):
        reply = await ask()
        if "error" in reply:
            return ids, reply
        ids.append(reply["result"])
    raise AssertionError(f"{limit} of {len(ADDRESSES)} addresses each were all taken")


async def _subscribe_until_refused(client: Client) -> tuple[list[Any], dict[str, Any]]:
    return await _until_refused(lambda: client.call("eth_subscribe", "logs", {"address": ADDRESSES}))


async def test_a_keys_subscriptions_hold_a_quarter_of_the_workers_bytes_and_give_them_back(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS="key-a,key-b", WS_MAX_SUBSCRIPTION_BYTES="16000000")
    alice = await connect(proxy, "key-a")
    taken, refused = await _subscribe_until_refused(alice)
    assert refused["error"]["code"] == -32005 and "WS_MAX_SUBSCRIPTION_BYTES" in refused["error"]["message"]
    assert 1 <= len(taken) <= 4_000_000 // deep_size(ADDRESSES)  # a quarter, each at least its addresses
    more = await connect(proxy, "key-a")  # a key's share, whatever its connections
    assert "error" in await more.call("eth_subscribe", "logs", {"address": ADDRESSES})
    bob = await connect(proxy, "key-b")
    assert len((await _subscribe_until_refused(bob))[0]) == len(taken)  # another key's share is its own
    assert (await alice.call("eth_unsubscribe", taken[0]))["result"] is True
    assert "result" in await more.call("eth_subscribe", "logs", {"address": ADDRESSES})
    await alice.ws.close()
    await bob.ws.close()
    again = await connect(proxy, "key-b")  # a closed socket's subscriptions gave their bytes back
    assert len((await _subscribe_until_refused(again))[0]) == len(taken)


async def _filters_until_refused(proxy: Proxy, key: str) -> tuple[list[Any], dict[str, Any]]:
    return await _until_refused(lambda: proxy.call("eth_newFilter", [{"address": ADDRESSES}], key))


async def test_a_keys_filters_hold_a_quarter_of_the_hosts_bytes_and_an_uninstall_gives_them_back(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(
        EVM_UPSTREAM=anvil.url, API_KEYS="key-a,key-b", MAX_FILTER_BYTES="8000000", MAX_FILTERS_PER_KEY="1000"
    )
    taken, refused = await _filters_until_refused(proxy, "key-a")
    assert refused["error"]["code"] == -32005 and "MAX_FILTER_BYTES" in refused["error"]["message"], refused
    assert 1 <= len(taken) <= 2_000_000 // deep_size(ADDRESSES)
    assert len((await _filters_until_refused(proxy, "key-b"))[0]) == len(taken)
    assert await proxy.result("eth_uninstallFilter", [taken[0]], "key-a") is True
    assert "result" in await proxy.call("eth_newFilter", [{"address": ADDRESSES}], "key-a")


async def test_open_modes_filters_are_capped_as_one_keys_on_the_host(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    # Uncapped, 62,000 block filters were made, each install scanning the table: the loop held for seconds.
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, MAX_FILTERS_PER_KEY="3")
    made = [await proxy.result("eth_newBlockFilter", [], "anyone") for _ in range(3)]
    refused = await proxy.call("eth_newBlockFilter", [], "someone-else")
    assert "at most 3 on this host in open mode (MAX_FILTERS_PER_KEY)" in refused["error"]["message"], refused
    assert await proxy.result("eth_uninstallFilter", [made[0]], "anyone") is True
    assert await proxy.result("eth_newBlockFilter", [], "someone-else")


async def test_open_modes_filters_are_bounded_in_bytes(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, MAX_FILTER_BYTES="4000000")
    taken, refused = await _filters_until_refused(proxy, "anyone")
    assert "MAX_FILTER_BYTES" in refused["error"]["message"], refused
    # The open account is every client: it may take the whole bound, not a quarter.
    assert 2_000_000 // deep_size(ADDRESSES) < len(taken) <= 4_000_000 // deep_size(ADDRESSES)


async def test_open_modes_lapsed_filters_are_forgotten_as_a_keys_are(tmp_path: Path) -> None:
    # Open mode never counted its filters, so it never pruned them: every filter ever made stayed.
    now = [1000.0]
    settings = settings_for(EVM_UPSTREAM="http://127.0.0.1:1")
    filters = Filters(settings, _unused, _unused, clock=lambda: now[0], run_dir=str(tmp_path))
    network = SimpleNamespace(name="evm", upstream=_Node([]), tracker=None)

    async def made() -> None:
        prepared: Any = SimpleNamespace(call=Call("eth_newBlockFilter", [], 1), network=network, params=[])
        outcome = await filters.execute(prepared, OPEN_ACCOUNT)
        assert isinstance(orjson.loads(outcome.payload), str)

    for _ in range(5):
        await made()
    now[0] += FILTER_TIMEOUT + 1
    await made()
    assert len(orjson.loads((tmp_path / "filters.json").read_bytes())) == 1
