"""Tracker liveness: the head is polled with single calls when batches are refused; a head older than
the staleness bound resolves no tag (tags are forwarded uncached) and /readyz reports the network
degraded. /readyz answers from the trackers' state, never with an upstream's text or URL."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proxy.chain.head_polls import TrackerError, header_of, synced_window
from proxy.chain.poll_source import in_order
from proxy.http.app_keys import SERVICE
from proxy.values import Answer
from tests.fault_relay import FaultRelay
from tests.support import DEV_ACCOUNT, ROOT, Anvil, Proxy, ProxyFactory, eventually, free_port, selector, word
from tests.test_observability import promtool


@pytest.fixture
async def relay(anvil: Anvil) -> AsyncIterator[FaultRelay]:
    relay = await FaultRelay(anvil.url).start()
    yield relay
    await relay.close()


async def readyz(proxy: Proxy, query: str = "", base: str | None = None) -> tuple[int, dict[str, Any], str]:
    async with proxy.session.get((base or proxy.base) + "/readyz" + query) as resp:
        text = await resp.text()
        return resp.status, await resp.json(), text


async def readyz_becomes(proxy: Proxy, status: int) -> None:
    async def answers() -> bool:
        return (await readyz(proxy))[0] == status

    await eventually(answers, 10, f"/readyz to answer {status}")


def storage_latest(address: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [address, "0x0", "latest"]}


async def test_the_tracker_polls_with_single_calls_when_batches_are_refused(
    anvil: Anvil, relay: FaultRelay, make_proxy: ProxyFactory
) -> None:
    relay.inject("http429", batches_only=True, times=None)
    proxy = await make_proxy(EVM_UPSTREAM=relay.url)
    address = anvil.deploy_store()
    top = anvil.mine(30)
    await proxy.head_at(top)
    request = storage_latest(address)
    _, body, headers = await proxy.post(request)
    assert body["result"] == "0x" + word(7) and headers["X-Cache"] == "MISS"
    _, _, headers = await proxy.post(request)
    assert headers["X-Cache"] == "HIT"  # caching still works: the head moves
    status, _, _ = await readyz(proxy)
    assert status == 200


async def test_a_stale_head_forwards_tags_uncached_and_readyz_reports_the_network_degraded(
    anvil: Anvil, relay: FaultRelay, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=relay.url, HEAD_STALE_AFTER="0.5")
    address = anvil.deploy_store()
    await proxy.head_at(anvil.block_number())
    _, body, _ = await proxy.post(storage_latest(address))
    assert body["result"] == "0x" + word(7)
    stall = relay.inject("http500", method="eth_getBlockByNumber", times=None)
    anvil.send(address, selector("setX(uint256)") + word(99))
    await readyz_becomes(proxy, 503)
    _, body, text = await readyz(proxy)
    assert body["networks"]["evm"].startswith("degraded: head is stale")
    assert str(relay.url.split(":")[-1].strip("/")) not in text and "injected" not in text
    _, body, headers = await proxy.post(storage_latest(address))
    assert body["result"] == "0x" + word(99) and headers["X-Cache"] == "BYPASS"

    relay.faults.remove(stall)
    await readyz_becomes(proxy, 200)
    _, body, _ = await proxy.post(storage_latest(address))
    assert body["result"] == "0x" + word(99)


async def test_readyz_started_refuses_until_each_network_had_a_head_then_lists_faults_without_refusing(
    anvil: Anvil, relay: FaultRelay, make_proxy: ProxyFactory
) -> None:
    """Replicas sharing their upstreams fail alike (pulling one pulls every one, where each still serves
    its hits): /readyz?started is 503 only until each network's tracker has had a head."""
    stall = relay.inject("http500", method="eth_getBlockByNumber", times=None)
    metrics_port = free_port()
    proxy = await make_proxy(EVM_UPSTREAM=relay.url, HEAD_STALE_AFTER="0.5", METRICS_PORT=str(metrics_port))
    internal = f"http://127.0.0.1:{metrics_port}"
    for query in ("", "?started", "?started=1&x"):
        status, body, _ = await readyz(proxy, query)
        assert (status, body["status"]) == (503, "unavailable"), query  # no head yet: nothing to serve from
    relay.faults.remove(stall)
    await readyz_becomes(proxy, 200)
    assert (await readyz(proxy, "?started"))[0] == 200
    relay.inject("http500", method="eth_getBlockByNumber", times=None)
    await readyz_becomes(proxy, 503)
    status, body, _ = await readyz(proxy, "?started")
    assert status == 200 and body["status"] == "ready"
    assert body["networks"]["evm"].startswith("degraded: head is stale")  # listed, not refused
    for base in (proxy.base, internal):  # the public port and METRICS_PORT read a query alike
        for query in (
            "?other",
            "?started=0",
            "?started=false",
            "?started=+0",
            "?started=off",
            "?%2573tarted",
            "?Started",
        ):
            assert (await readyz(proxy, query, base))[0] == 503, (base, query)  # only `started` (not 0) loosens it
        assert (await readyz(proxy, "?%73tarted=1", base))[0] == 200, base  # percent-decoded once, as a query is


async def test_readyz_is_answered_from_tracker_state_without_an_upstream_call_per_request(
    anvil: Anvil, relay: FaultRelay, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=relay.url, HEAD_POLL_INTERVAL="30")
    await proxy.head_at(0)
    before = relay.requests
    for _ in range(20):
        states = await asyncio.gather(*(readyz(proxy) for _ in range(100)))
        assert {s[0] for s in states} == {200}
    assert relay.requests - before < 10  # at most the trackers' own polls, not 2,000 calls


def test_the_alert_rules_pass_promtool_and_watch_the_last_head_poll() -> None:
    rules = ROOT / "deploy/alerts.yml"
    result = subprocess.run([promtool(), "check", "rules", str(rules)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rpc_proxy_head_last_poll_timestamp_seconds" in rules.read_text()


async def test_a_network_whose_upstream_answers_only_errors_exports_a_head_poll_time_that_ages(
    relay: FaultRelay, make_proxy: ProxyFactory
) -> None:
    # spec: RpcProxyHeadStale fires on time() - rpc_proxy_head_last_poll_timestamp_seconds; without a
    # series (no poll ever succeeded, e.g. a revoked token answering every call -32000) it cannot fire.
    relay.inject("error", times=None)
    before = time.time()
    proxy = await make_proxy(EVM_UPSTREAM=relay.url)
    status, body, _ = await readyz(proxy)
    assert status == 503 and body["networks"]["evm"] == "degraded: no successful head poll yet"
    async with proxy.session.get(proxy.base + "/metrics") as resp:
        text = await resp.text()
    found = re.search(r'^rpc_proxy_head_last_poll_timestamp_seconds\{network="evm"\} (\S+)$', text, re.MULTILINE)
    assert found is not None, "no head-poll series for a network that never polled"
    assert before - 1 <= float(found.group(1)) <= time.time()  # the tracker's start: time() - it grows


async def stale_under(proxy: Proxy, relay: FaultRelay, anvil: Anvil, kind: str, target: str) -> int:
    """The head polls' batches edited by the relay's `kind` fault from now on, three blocks mined:
    once the head is stale, five more polls made; the node's head."""
    relay.inject(kind, target=target, batches_only=True, times=None)
    top = anvil.mine(3)
    await readyz_becomes(proxy, 503)
    edited = relay.applied.count(kind)

    async def polled_on() -> bool:
        return relay.applied.count(kind) >= edited + 5

    await eventually(polled_on, 10, f"five more polls with the {kind} fault")
    return top


@pytest.mark.parametrize("tag", ["safe", "finalized"])
async def test_a_poll_whose_safe_or_finalized_block_is_above_its_latest_is_refused(
    tag: str, anvil: Anvil, relay: FaultRelay, make_proxy: ProxyFactory
) -> None:
    """One poll is one chain's view, finalized <= safe <= latest. A node (or a relay) that answers the
    tags with each other's blocks is not followed: the head never goes back to the block given as
    latest, no new epoch drops what is kept, and once the head is stale its tags go to the node."""
    proxy = await make_proxy(EVM_UPSTREAM=relay.url, HEAD_STALE_AFTER="0.5")
    address = anvil.deploy_store()
    top = anvil.mine(100)
    await proxy.head_at(top)
    final = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [address, "0x0", hex(top - 80)]}
    await proxy.post(final)
    _, _, headers = await proxy.post(final)
    assert headers["X-Cache"] == "HIT"

    top = await stale_under(proxy, relay, anvil, "tags", tag)
    _, body, headers = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": "eth_blockNumber", "params": []})
    assert int(body["result"], 16) == top, headers.get("X-Cache")
    _, body, headers = await proxy.post(final)
    assert body["result"] == "0x" + word(7) and headers["X-Cache"] == "HIT"

    relay.clear()
    await readyz_becomes(proxy, 200)
    await proxy.head_at(top)


def test_a_poll_is_in_order_only_when_finalized_safe_and_latest_are_one_chains_view() -> None:
    def block(number: int, name: str = "") -> Answer:
        hashed = "0x" + name * 64 if name else f"0x{number:064x}"
        return Answer(b"", result={"number": hex(number), "hash": hashed, "parentHash": "0x" + "1" * 64}, upstream=0)

    no_tag = Answer(b"", error={"code": -32602, "message": "unknown tag"}, upstream=0)
    in_order([block(10), block(8), block(5)])
    in_order([block(10), block(10), block(10)])
    in_order([block(10), no_tag, no_tag])
    in_order([block(10), no_tag, block(5)])
    for disordered in (
        [block(10), block(12), block(5)],
        [block(10), block(8), block(9)],
        [block(10), no_tag, block(11)],
        [block(10), block(10, "b"), block(5)],  # two hashes at one height
        [block(10), block(8, "ab"), block(5)],  # a hash that is no 32 bytes
        [block(10, "c"), no_tag, block(5, "c")],  # one hash at two heights: another block's
        [
            Answer(b"", result={"number": "-0x1", "hash": "0x" + "a" * 64, "parentHash": "0x" + "1" * 64}),
            no_tag,
            no_tag,
        ],
    ):
        with pytest.raises(TrackerError, match=r"not one chain's view|malformed or made up"):
            in_order(disordered)


@pytest.mark.parametrize("edit", ["hash", "hash+field", "number"])
async def test_a_latest_block_whose_fields_do_not_hash_to_its_hash_is_never_the_head(
    edit: str, anvil: Anvil, relay: FaultRelay, make_proxy: ProxyFactory
) -> None:
    """Rule: on a network whose blocks hash from their fields, a poll's block that does not is made
    up (a node's or a relay's edit) and the poll is refused. A latest block given its parent's hash
    made `latest` answer the parent block, as hits; one given a number 1,000 ahead as every tag's
    block moved eth_blockNumber there, then back (an outside attack)."""
    proxy = await make_proxy(EVM_UPSTREAM=relay.url, HEAD_STALE_AFTER="0.5")
    top = anvil.mine(80)
    await proxy.head_at(top)
    top = await stale_under(proxy, relay, anvil, "made_up", edit)
    assert (await proxy.call("eth_blockNumber", []))["result"] == hex(top)
    block = (await proxy.call("eth_getBlockByNumber", ["latest", False]))["result"]
    assert block["hash"] == anvil.rpc("eth_getBlockByNumber", hex(top), False)["hash"]

    relay.clear()
    await readyz_becomes(proxy, 200)
    await proxy.head_at(top)


async def test_a_window_block_asked_by_number_must_be_of_that_number() -> None:
    """Rule: a block of the window is the block at the height asked. One lie in the first walk (block
    70 answered with its number made 71) kept block 70's hash at height 71 until it was final: reads
    of block 71 were answered from block 70, as hits (an outside attack)."""

    def block(number: int, shown: int | None = None) -> dict[str, Any]:
        return {
            "number": hex(number if shown is None else shown),
            "hash": f"0x{number:064x}",
            "parentHash": f"0x{number - 1:064x}",
        }

    class Node:
        def __init__(self, lie_at: int | None) -> None:
            self.lie_at = lie_at

        async def ask(self, calls: list[tuple[str, Any]]) -> list[Answer]:
            answers = []
            for _method, params in calls:
                number = int(params[0], 16)
                answers.append(
                    Answer(b"", result=block(number, number + 1 if number == self.lie_at else None), upstream=0)
                )
            return answers

        async def direct(self, calls: list[tuple[str, Any]]) -> list[Answer]:
            return await self.ask(calls)

    latest = header_of(Answer(b"", result=block(80), upstream=0))
    assert latest is not None
    window = await synced_window(Node(None), 256, latest, 60, {})
    assert window == {n: f"0x{n:064x}" for n in range(61, 81)}
    with pytest.raises(TrackerError, match="block 70"):
        await synced_window(Node(70), 256, latest, 60, {})


async def test_a_block_once_said_final_is_still_checked_after_the_node_takes_its_word_back(
    anvil: Anvil, relay: FaultRelay, make_proxy: ProxyFactory
) -> None:
    """Rule: the finalized block the tracker checks never goes back but for a new epoch. A node that
    gave its latest block for `finalized` (as one that takes an unknown tag for latest does), then its
    true finalized block, had the proxy keep state it called final; a reorg of those blocks then went
    unseen, and the old fork's balance was served as a hit for good (an outside attack)."""
    proxy = await make_proxy(EVM_UPSTREAM=relay.url)
    top = anvil.mine(100)
    await proxy.head_at(top)
    tracker = proxy.app[SERVICE].networks["evm"].tracker
    relay.inject("final_latest", batches_only=True, times=None)
    fork = anvil.rpc("evm_snapshot")
    to = "0x" + "bb" * 20
    anvil.rpc("eth_sendTransaction", {"from": DEV_ACCOUNT, "to": to, "value": "0x1"})
    moved = anvil.mine(2)

    async def said_final() -> bool:
        return tracker.head is not None and tracker.head.finalized == tracker.head.latest == moved

    await eventually(said_final, 10, "the head to take the latest block as final")
    balance = {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": [to, hex(top + 1)]}
    assert (await proxy.post(balance))[1]["result"] == "0x1"
    assert (await proxy.post(balance))[2]["X-Cache"] == "HIT"  # kept as a final block's

    relay.clear()

    async def honest() -> bool:
        return tracker.head is not None and tracker.head.finalized < top

    await eventually(honest, 10, "the node's true finalized block")
    anvil.rpc("evm_revert", fork)  # blocks top+1.. replaced: never final, though once said so
    anvil.rpc("eth_sendTransaction", {"from": DEV_ACCOUNT, "to": to, "value": "0x3e8"})
    anvil.mine(80)  # final now, on the new chain
    truth = anvil.rpc("eth_getBalance", to, hex(top + 1))
    assert truth == "0x3e8"

    async def served_truth() -> bool:
        _, body, _ = await proxy.post(balance)
        return body.get("result") == truth

    await eventually(served_truth, 10, "the new chain's balance, not the old fork's kept one")


async def test_a_made_up_latest_block_is_refused_from_the_first_poll(
    anvil: Anvil, relay: FaultRelay, make_proxy: ProxyFactory
) -> None:
    """Rule: a poll's honest tags' blocks tell the network's blocks hash before its latest block is
    judged, so a made-up latest block is refused on the proxy's first poll too (it was taken, then
    served as hits until the head went stale: an outside attack)."""
    anvil.mine(80)
    relay.inject("made_up", target="timestamp", batches_only=True, times=None)
    proxy = await make_proxy(EVM_UPSTREAM=relay.url)

    async def polled() -> bool:
        return relay.applied.count("made_up") >= 5

    await eventually(polled, 10, "five polls with the latest block edited")
    assert proxy.app[SERVICE].networks["evm"].tracker.head is None
    relay.clear()
    await proxy.head_at(anvil.block_number())
