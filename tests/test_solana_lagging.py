"""A Solana upstream that goes back (a node restarted from an old snapshot): each upstream's own slot is
polled, a lagging one is neither followed nor asked first, the network's slots never go back, and an
answer whose context.slot is below a slot already shown at its commitment is never kept."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from proxy.chain import slots
from proxy.chain.slots import SolanaSlotTracker
from proxy.http.app_keys import SERVICE
from tests.fake_solana import LARGEST, TOKEN_ACCOUNT, FakeSolana, b58
from tests.support import Proxy, ProxyFactory, eventually, free_port

ADMIN_TOKEN = "Adm1n-T0ken-For-Tests"
PROCESSED = {"commitment": "processed"}


async def call(proxy: Proxy, method: str, params: list[Any]) -> tuple[dict[str, Any], str]:
    _, body, headers = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    return body, headers["X-Cache"]


async def slots_at(proxy: Proxy, slot: int) -> SolanaSlotTracker:
    tracker = proxy.app[SERVICE].networks["solana"].tracker
    assert isinstance(tracker, SolanaSlotTracker)

    async def reached() -> bool:
        return tracker.slots.get("processed", -1) >= slot

    await eventually(reached, 10, f"the processed slot at {slot}")
    return tracker


async def test_a_lagging_solana_upstream_is_not_followed_and_its_answers_are_never_kept(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule: a Solana upstream whose own slot falls behind is not asked first, its answers below a slot
    already shown are asked elsewhere and never kept, and its head and lag show in metrics and the admin listing."""
    backup = await FakeSolana().start()
    try:
        solana.slot = backup.slot = 5000
        admin = free_port()
        proxy = await make_proxy(
            SOLANA_UPSTREAM=f"{solana.url},{backup.url}", ADMIN_PORT=str(admin), ADMIN_TOKEN=ADMIN_TOKEN
        )
        await slots_at(proxy, 5000)
        # The primary is restarted from an old snapshot; the backup keeps going (the fake's slot moves
        # per request, and the primary took the tracker's polls).
        backup.slot, solana.slot = solana.slot + 10, 500
        first, cache = await call(proxy, "getTokenAccountBalance", [TOKEN_ACCOUNT, PROCESSED])
        assert cache == "MISS" and first["result"]["context"]["slot"] >= 5000, first
        again, cache = await call(proxy, "getTokenAccountBalance", [TOKEN_ACCOUNT, PROCESSED])
        assert cache == "HIT" and again["result"] == first["result"]

        async def lag_seen() -> bool:
            return proxy.metric("rpc_proxy_upstream_head_lag_blocks", network="solana", upstream="0") > 4000

        await eventually(lag_seen, 10, "the primary's lag")
        largest, cache = await call(proxy, "getLargestAccounts", [PROCESSED])
        assert cache == "MISS" and largest["result"]["context"]["slot"] >= 5000, largest
        assert proxy.metric("rpc_proxy_upstream_head_lag_blocks", network="solana", upstream="1") == 0
        assert proxy.metric("rpc_proxy_head_block", network="solana", tag="processed") >= 5000
        async with aiohttp.ClientSession() as session:
            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            async with session.get(f"http://127.0.0.1:{admin}/upstreams", headers=headers) as resp:
                listing = (await resp.json())["solana"]
            async with session.get(f"{proxy.base}/readyz") as resp:
                ready = await resp.json()
        assert 500 <= listing[0]["head"] < 1000 and listing[0]["head_lag"] > 4000, listing
        assert listing[1]["head"] >= 5000 and listing[1]["head_lag"] == 0, listing
        assert list(ready["catching_up"]["solana"]) == ["0"], ready
    finally:
        await backup.close()


async def test_a_solana_answer_below_a_slot_already_shown_is_refused_never_kept(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule: with no upstream at the slot already shown, an answer from below it fails (-32002), is
    never kept, and the network's slot and getSlot never go back."""
    solana.slot = 5000
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url)
    await slots_at(proxy, 5000)
    solana.slot = 500  # the only upstream goes back
    for _ in range(2):
        body, cache = await call(proxy, "getTokenAccountBalance", [TOKEN_ACCOUNT, PROCESSED])
        assert body["error"]["code"] == -32002 and cache == "BYPASS", body
    assert proxy.metric("rpc_proxy_uncached_answers_total", network="solana", reason="lagging") == 2
    slot, _ = await call(proxy, "getSlot", [PROCESSED])
    assert slot["result"] >= 5000
    assert proxy.metric("rpc_proxy_head_block", network="solana", tag="processed") >= 5000
    solana.slot = 6000  # caught up
    body, cache = await call(proxy, "getTokenAccountBalance", [TOKEN_ACCOUNT, PROCESSED])
    assert cache == "MISS" and body["result"]["context"]["slot"] > 6000, body


async def test_a_solana_answer_a_few_slots_below_the_one_shown_is_in_step_and_kept(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule: nodes in step differ by a slot or two at processed (a balancer's members): an answer within
    32 slots of the slot shown is the answer, kept; one further below is refused."""
    solana.slot = 5000
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url)
    await slots_at(proxy, 5000)
    solana.slot = 5000 - 20  # a member of the balancer a few slots behind
    body, cache = await call(proxy, "getTokenAccountBalance", [TOKEN_ACCOUNT, PROCESSED])
    assert cache == "MISS" and 4980 <= body["result"]["context"]["slot"] < 5000, body
    again, cache = await call(proxy, "getTokenAccountBalance", [TOKEN_ACCOUNT, PROCESSED])
    assert cache == "HIT" and again == body
    solana.slot = 5000 - 40
    body, cache = await call(proxy, "getTokenAccountBalance", [TOKEN_ACCOUNT, {"commitment": "confirmed"}])
    assert body["error"]["code"] == -32002 and cache == "BYPASS", body


async def test_a_solana_node_that_says_it_is_unhealthy_has_given_no_answer_and_the_next_is_asked(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule (docs/networks.md): Agave's -32005 "Node is unhealthy" / "Node is behind by N slots" is the
    node's state, not an answer: the next upstream is asked; with none left, -32002 naming it."""
    backup = await FakeSolana().start()
    try:
        backup.slot = solana.slot
        proxy = await make_proxy(SOLANA_UPSTREAM=f"{solana.url},{backup.url}")
        await slots_at(proxy, 1000)
        solana.unhealthy = "Node is behind by 42 slots"
        body, cache = await call(proxy, "getTokenAccountBalance", [TOKEN_ACCOUNT, PROCESSED])
        assert cache == "MISS" and body["result"]["value"]["amount"] == "9864", body
        assert proxy.metric("rpc_proxy_upstream_errors_total", network="solana", upstream="0", kind="unhealthy") >= 1
        backup.unhealthy = "Node is unhealthy"
        body, cache = await call(proxy, "getLargestAccounts", [PROCESSED])
        assert body["error"]["code"] == -32002 and "unhealthy" in body["error"]["message"], body
    finally:
        await backup.close()


async def test_a_reset_cluster_is_taken_at_the_poll_that_finds_its_slots_below(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule (docs/caching.md, Solana slots): a poll whose every slot is below the held ones asks the
    genesis hash at once; a new cluster starts its slots anew then, not at the next identity check."""
    solana.slot = 500_000
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, IDENTITY_CHECK_INTERVAL="3600")
    await slots_at(proxy, 500_000)
    solana.genesis, solana.slot = b58(bytes(range(32))), 10  # a restarted test validator
    answers: list[dict[str, Any]] = []

    async def served() -> bool:
        answers.append((await call(proxy, "getTokenAccountBalance", [TOKEN_ACCOUNT, PROCESSED]))[0])
        return "result" in answers[-1]

    await eventually(served, 10, "an answer of the new cluster")
    assert answers[-1]["result"]["context"]["slot"] < 1000, answers[-1]


async def test_one_absurd_slot_from_a_node_is_let_go_when_no_poll_reaches_it_within_the_hold(
    solana: FakeSolana, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule (docs/caching.md, Solana slots): the slots never go back, but a slot no poll reaches again
    SLOT_HOLD seconds on is let go (one node's error); before, one bad getSlot answer held the slots
    for ever, failed every later poll and refused every read (-32002) until a restart."""
    monkeypatch.setattr(slots, "SLOT_HOLD", 1.0)
    solana.slot = 5000
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url, IDENTITY_CHECK_INTERVAL="3600", HEAD_POLL_INTERVAL="0.2")
    tracker = await slots_at(proxy, 5000)
    solana.slot = 4_000_000_000  # one answer in error (the fake's slot moves on per request)
    await slots_at(proxy, 4_000_000_000)
    solana.slot = 5100

    async def let_go() -> bool:
        return tracker.slots.get("finalized", -1) < 1_000_000

    await eventually(let_go, 10, "the absurd slots let go")
    slot, _ = await call(proxy, "getSlot", [])
    assert 5000 < slot["result"] < 1_000_000, slot
    body, _ = await call(proxy, "getTokenAccountBalance", [TOKEN_ACCOUNT])  # finalized: asked below 4e9
    assert "result" in body and body["result"]["context"]["slot"] < 1_000_000, body
    assert proxy.metric("rpc_proxy_head_block", network="solana", tag="finalized") < 1_000_000


async def test_largest_accounts_a_node_keeps_in_its_own_cache_are_in_step_whatever_their_slot(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule: Agave answers getLargestAccounts from a cache of its own (2 hours) with that cache's slot:
    an answer far below the slot shown is the in-step node's answer, served and kept."""
    solana.slot = 5000
    proxy = await make_proxy(SOLANA_UPSTREAM=solana.url)
    await slots_at(proxy, 5000)
    solana.results["getLargestAccounts"] = {"context": {"slot": 1000}, "value": LARGEST}
    body, cache = await call(proxy, "getLargestAccounts", [PROCESSED])
    assert cache == "MISS" and body["result"]["context"]["slot"] == 1000, body


async def test_a_node_unhealthy_asked_again_for_a_lagging_answer_has_given_no_answer(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule (docs/networks.md, caching.md): with the primary unhealthy and the backup behind the slot
    shown, the call fails -32002 (lagging): the primary's -32005, asked again for the backup's
    lagging answer, was handed to the client as the answer."""
    backup = await FakeSolana().start()
    try:
        solana.slot = backup.slot = 5000
        proxy = await make_proxy(SOLANA_UPSTREAM=f"{solana.url},{backup.url}")
        await slots_at(proxy, 5000)
        backup.slot, solana.unhealthy = 500, "Node is unhealthy"
        body, cache = await call(proxy, "getTokenAccountBalance", [TOKEN_ACCOUNT, PROCESSED])
        assert body["error"]["code"] == -32002 and cache == "BYPASS", body
        assert body["error"]["message"].startswith("upstream unavailable: network 'solana'"), body
    finally:
        await backup.close()


async def test_a_block_a_backup_behind_does_not_have_yet_is_no_answer_of_the_networks(
    solana: FakeSolana, make_proxy: ProxyFactory
) -> None:
    """Rule (docs/errors.md): a final block more than 32 slots below the finalized slot shown that a
    backup behind has not reached (Agave's -32004, "not available") fails -32002; the backup's -32004
    was passed through, telling the client the block was not produced yet. At `confirmed` Agave
    answers -32004 for a skipped slot above the root too: there it is passed through."""
    backup = await FakeSolana().start()
    try:
        solana.slot = backup.slot = 5000
        proxy = await make_proxy(SOLANA_UPSTREAM=f"{solana.url},{backup.url}")
        tracker = await slots_at(proxy, 5000)
        backup.slot, solana.unhealthy = 3000, "Node is unhealthy"
        final = tracker.shown("finalized")
        slot = final - 40 if (final - 40) % 7 else final - 41  # the fake skips every seventh slot
        assert slot > 3000
        body, cache = await call(proxy, "getBlock", [slot])
        assert body["error"]["code"] == -32002 and cache != "HIT", body
        assert body["error"]["message"].startswith("upstream unavailable: network 'solana'"), body
        body, _ = await call(proxy, "getBlock", [10 * final])  # a block not produced yet: the node's word
        assert body["error"]["code"] == -32004, body
        body, _ = await call(proxy, "getBlock", [slot, {"commitment": "confirmed"}])  # never read as a lag
        assert body["error"]["code"] == -32004, body
    finally:
        await backup.close()
