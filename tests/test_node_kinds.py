"""Nodes as they are: a pruned node beside an archive one (old state is asked of one that keeps it,
learned from the pruned node's errors or stated in NETWORKS_FILE), and its error is never the
answer while another upstream can give one. Every answer is counted against the archive node."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.config_files import ConfigError, _networks_from_file
from proxy.http.app_keys import SERVICE
from proxy.upstream.replies import block_unknown, state_gone
from proxy.upstream.standing import UpstreamStates
from tests.fault_relay import FaultRelay
from tests.support import (
    DEV_ACCOUNT,
    Anvil,
    Proxy,
    ProxyFactory,
    balancer,
    eventually,
    free_port,
    selector,
    serving,
    settings_for,
    start_proxy,
    word,
)

HEAD = 250
KEPT = 64  # the pruned node keeps the state of its last 64 blocks, as anvil --prune-history 64
# Where each state read names its block.
STATE_BLOCK_AT = {
    "eth_getBalance": 1,
    "eth_getCode": 1,
    "eth_getTransactionCount": 1,
    "eth_getStorageAt": 2,
    "eth_call": 1,
    "eth_getProof": 2,
}
GETH = {
    "code": -32000,
    "message": "missing trie node 3b70737ce08bd905749df6103fbc21548427951dcf373c32aaaa9cffa1aa034a (path )",
}

# What a node without an old block's history answers a state read at it (geth's words), beside null.
HEADER_NOT_FOUND = {"code": -32000, "message": "header not found"}


def anvil_error(head: int, number: int) -> dict[str, Any]:
    """What anvil --prune-history answers for state it no longer keeps (anvil 1.7.1's words)."""
    return {"code": -32602, "message": f"BlockOutOfRangeError: block height is {head} but requested was {number}"}


class TestStateGoneRule:
    def test_the_clients_errors_for_pruned_state_are_known(self) -> None:
        assert state_gone(GETH)
        assert state_gone(anvil_error(200, 10))
        assert not state_gone(anvil_error(101, 102))  # a node behind, not a pruned one
        assert state_gone({"code": -32000, "message": "required historical state unavailable (reexec=128)"})
        assert state_gone(
            {
                "code": -32603,
                "message": "Internal error",
                "data": "Nethermind.Trie.MissingTrieNodeException: Node A: P:2 H:0x99 is missing",
            }
        )
        # Nethermind's, Reth's and Besu's words (a balancer's member may be any of them).
        assert state_gone({"code": -32002, "message": "No state available for block 0x5f2e (12,345)"})
        assert state_gone({"code": -32000, "message": "state at block #12345 is pruned"})
        assert state_gone({"code": -32000, "message": "World state unavailable"})
        assert not state_gone({"code": 3, "message": "execution reverted"})
        assert not state_gone(None)

    def test_a_nodes_error_for_a_block_it_lacks_is_known_and_is_not_a_revert(self) -> None:
        assert block_unknown(HEADER_NOT_FOUND) and not state_gone(HEADER_NOT_FOUND)
        assert block_unknown({"code": -32001, "message": "Block 0x10 could not be found"})
        assert not block_unknown({"code": 3, "message": "execution reverted"})
        # A revert's reason is the contract's words, whatever they say.
        for code, words in ((3, "execution reverted"), (-32000, "execution reverted"), (-32000, "Execution reverted")):
            revert = {"code": code, "message": f"{words}: block not found; missing trie node"}  # Besu's capital
            assert not block_unknown(revert) and not state_gone(revert)
        assert not block_unknown({"code": -32000, "message": "out of gas"}) and not block_unknown(None)

    def test_a_pruned_nodes_window_is_learned_from_its_error(self) -> None:
        states = UpstreamStates(2)
        for index in (0, 1):
            states.verified[index] = True
            states.observe_head(index, 200)
        assert states.holds_state(0, 10)  # an archive node until it says otherwise
        states.state_gone(0, 120)  # it keeps fewer than 80 blocks
        assert not states.holds_state(0, 120) and states.holds_state(0, 121)
        assert states.other_with_state({0}, 120) == 1
        states.state_gone(0, 300)  # past its head: a node behind, which says nothing of its window
        assert states.holds_state(0, 121)

    def test_a_declared_window_holds_until_a_reload(self) -> None:
        states = UpstreamStates(2)
        states.declare_recent((128, None))
        states.observe_head(0, 1000)
        assert not states.holds_state(0, 872) and states.holds_state(0, 873)


def test_networks_file_states_an_upstreams_state_window(tmp_path: Path) -> None:
    path = tmp_path / "networks.toml"
    path.write_text(
        '[networks.evm]\nfamily = "evm"\nupstreams = [{url = "http://a/", archive = false}, '
        '{url = "http://b/", recent_blocks = 64}, "http://c/"]\n'
    )
    [network] = _networks_from_file(str(path))
    assert [network.options_of(i).recent_blocks for i in range(3)] == [128, 64, None]
    path.write_text(
        '[networks.evm]\nfamily = "evm"\nupstreams = [{url = "http://a/", archive = true, recent_blocks = 64}]\n'
    )
    with pytest.raises(ConfigError, match="archive upstream has no recent_blocks"):
        _networks_from_file(str(path))


@pytest.fixture(scope="module")
def archive() -> Iterator[tuple[Anvil, str, list[int]]]:
    """An archive node: a contract whose slot 0 changes every 15 blocks, head at HEAD."""
    node = Anvil()
    address = node.deploy_store()
    marks = []
    for value in range(1, 13):
        marks.append(int(node.send(address, selector("setX(uint256)") + word(value))["blockNumber"], 16))
        node.mine(14)
    node.mine(HEAD - node.block_number())
    yield node, address, marks
    node.stop()


@dataclass
class PrunedRelay:
    """A pruned node in front of the archive one: state older than its last KEPT blocks is answered
    with a client's pruned-state error (geth's or anvil's words), or as a node that lacks the block
    ("header": geth's header not found, "null"); everything else is the node's."""

    target: str
    words: str = "geth"
    # The blocks it refused state for, once a request (a read and its proof in one batch are one refusal).
    refused: list[int] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        payload = json.loads(await request.read())
        calls = payload if isinstance(payload, list) else [payload]
        async with aiohttp.ClientSession() as session:
            async with session.post(self.target, json=payload) as resp:
                reply = await resp.json()
            head = int((await self._ask(session, "eth_blockNumber", []))["result"], 16)
            numbers = [await self._block_of(session, call) for call in calls]
        items = reply if isinstance(reply, list) else [reply]
        by_id = {item.get("id"): item for item in items}
        refused: list[int] = []
        for call, number in zip(calls, numbers, strict=True):
            if number is not None and head - number >= KEPT:
                if number not in refused:
                    refused.append(number)
                item = by_id[call.get("id")]
                item.pop("result", None)
                item.pop("error", None)
                if self.words == "null":
                    item["result"] = None
                else:
                    words = {"geth": GETH, "header": HEADER_NOT_FOUND}
                    item["error"] = words.get(self.words) or anvil_error(head, number)
        self.refused.extend(refused)
        return web.json_response(reply)

    async def _ask(self, session: aiohttp.ClientSession, method: str, params: list[Any]) -> dict[str, Any]:
        call = {"jsonrpc": "2.0", "id": 0, "method": method, "params": params}
        async with session.post(self.target, json=call) as resp:
            answer: dict[str, Any] = await resp.json()
            return answer

    async def _block_of(self, session: aiohttp.ClientSession, call: dict[str, Any]) -> int | None:
        """The number of the block a state read names: a number, or an EIP-1898 object (by hash too)."""
        at = STATE_BLOCK_AT.get(call.get("method", ""))
        params = call.get("params") or []
        block = params[at] if at is not None and len(params) > at else None
        if isinstance(block, dict) and "blockHash" in block:
            block = (await self._ask(session, "eth_getBlockByHash", [block["blockHash"], False]))["result"]["number"]
        elif isinstance(block, dict):
            block = block.get("blockNumber")
        return int(block, 16) if isinstance(block, str) and block.startswith("0x") else None


@pytest.fixture(params=["geth", "anvil"])
async def pruned(request: pytest.FixtureRequest, archive: tuple[Anvil, str, list[int]]) -> AsyncIterator[PrunedRelay]:
    relay = PrunedRelay(archive[0].url, request.param)
    async with serving(relay.handle) as url:
        relay.url = url
        yield relay


@contextlib.asynccontextmanager
async def alone_behind(relay: PrunedRelay) -> AsyncIterator[Proxy]:
    """A proxy whose one upstream is `relay`, its head at HEAD."""
    async with serving(relay.handle) as url:
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=url))
        try:
            await proxy.head_at(HEAD)
            yield proxy
        finally:
            await proxy.close()


async def both_heads_known(proxy: Proxy) -> None:
    per = proxy.app[SERVICE].networks["evm"].per_upstream
    assert per is not None

    async def known() -> bool:
        return all(per.states.latest[i] >= HEAD and per.states.verified[i] for i in (0, 1))

    await eventually(known, 15, "both upstreams' heads to be known")


def old_state_reads(address: str, marks: list[int]) -> list[tuple[str, list[Any]]]:
    """Twelve reads of state below the finalized block, newest first (each just past a change)."""
    reads: list[tuple[str, list[Any]]] = []
    for i, mark in enumerate(sorted(marks, reverse=True)):
        block = hex(mark)
        reads.append(
            [
                ("eth_getStorageAt", [address, "0x0", block]),
                ("eth_call", [{"to": address, "data": selector("x()")}, block]),
                ("eth_getBalance", [DEV_ACCOUNT, block]),
                ("eth_getTransactionCount", [DEV_ACCOUNT, block]),
            ][i % 4]
        )
    return reads


async def wrong_answers(proxy: Proxy, node: Anvil, reads: list[tuple[str, list[Any]]]) -> tuple[int, list[str]]:
    """How many of the proxy's answers differ from the archive node's, and each answer's X-Cache."""
    wrong, caches = 0, []
    for method, params in reads:
        status, body, headers = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
        caches.append(headers.get("X-Cache", ""))
        if status != 200 or body.get("result") != node.rpc(method, *params):
            wrong += 1
    return wrong, caches


async def test_old_state_is_asked_of_the_archive_node_when_the_pruned_primary_says_it_has_none(
    archive: tuple[Anvil, str, list[int]],
    pruned: PrunedRelay,
) -> None:
    node, address, marks = archive
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=f"{pruned.url},{node.url}"))
    try:
        await both_heads_known(proxy)
        head = proxy.app[SERVICE].networks["evm"].tracker.head
        assert head is not None and max(marks) < head.finalized  # every read is of final, old state
        reads = old_state_reads(address, marks)
        wrong, caches = await wrong_answers(proxy, node, reads)
        assert wrong == 0 and set(caches) == {"MISS"}
        # Learned from its first error: the pruned node is not asked for older state again.
        assert len(pruned.refused) == 1, pruned.refused
        wrong, caches = await wrong_answers(proxy, node, reads)
        assert wrong == 0 and set(caches) == {"HIT"}
        # Recent state is still the primary's to answer.
        recent = ("eth_getStorageAt", [address, "0x0", hex(HEAD - 10)])
        assert (await wrong_answers(proxy, node, [recent]))[0] == 0
        assert len(pruned.refused) == 1
    finally:
        await proxy.close()


async def test_a_declared_state_window_sends_old_state_to_the_archive_node_first(
    archive: tuple[Anvil, str, list[int]],
    tmp_path: Path,
) -> None:
    node, address, marks = archive
    relay = PrunedRelay(node.url)
    async with serving(relay.handle) as url:
        networks = tmp_path / "networks.toml"
        networks.write_text(
            f'[networks.evm]\nfamily = "evm"\nupstreams = [{{url = "{url}", archive = false, '
            f'recent_blocks = {KEPT}}}, "{node.url}"]\n'
        )
        proxy = await start_proxy(settings_for(NETWORKS_FILE=str(networks)))
        try:
            await both_heads_known(proxy)
            wrong, _ = await wrong_answers(proxy, node, old_state_reads(address, marks))
            assert wrong == 0 and relay.refused == []  # never asked: NETWORKS_FILE said it keeps 64 blocks
        finally:
            await proxy.close()


@pytest.mark.parametrize("lacking", ["header", "null"])
async def test_old_state_no_upstream_has_is_served_as_bypass_and_counted_as_state_gone(
    archive: tuple[Anvil, str, list[int]],
    lacking: str,
) -> None:
    """The pruned primary's error, then the other upstream's "header not found" or null for the same
    old block (it lacks that block's history too): no upstream can answer, so the answer is never
    kept (BYPASS, every call asked again) and each is counted as state_gone."""
    node, address, marks = archive
    pruned, without = PrunedRelay(node.url), PrunedRelay(node.url, lacking)
    async with serving(pruned.handle) as pruned.url, serving(without.handle) as without.url:
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=f"{pruned.url},{without.url}"))
        try:
            await both_heads_known(proxy)
            read = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [address, "0x0", hex(marks[0])]}
            for _ in range(3):
                status, body, headers = await proxy.post(read)
                assert status == 200 and body.get("result") is None and headers["X-Cache"] == "BYPASS", body
            assert proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason="state_gone") == 3
            assert len(without.refused) == 3  # asked every time: nothing was kept
        finally:
            await proxy.close()


@pytest.mark.parametrize("lacking", ["header", "null"])
@pytest.mark.parametrize("beside", ["archive", "pruned", "lacking"])
async def test_old_state_named_by_hash_is_asked_of_every_upstream_until_one_holds_it(
    archive: tuple[Anvil, str, list[int]],
    lacking: str,
    beside: str,
) -> None:
    """An EIP-1898 read by block hash names no number the proxy knows (the block is older than its
    window): a node's null or "header not found" is asked again of every other upstream, a pruned
    one's error passed over, until one answers with the state, kept as the by-number read is. When
    none can, the first node's answer is served, never kept, and counted as state_gone when a node
    said its state is pruned, else as unknown_hash (a hash no node knows: two nodes saying so end
    the walk, so a made-up hash is not asked of every upstream)."""
    node, address, marks = archive
    block_hash = node.rpc("eth_getBlockByNumber", hex(marks[0]), False)["hash"]
    first, second = PrunedRelay(node.url, lacking), PrunedRelay(node.url, lacking if beside == "lacking" else "geth")
    third = PrunedRelay(node.url, lacking)
    async with (
        serving(first.handle) as first.url,
        serving(second.handle) as second.url,
        serving(third.handle) as third.url,
    ):
        upstreams = [first.url, second.url, node.url if beside == "archive" else third.url]
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=",".join(upstreams)))
        try:
            await both_heads_known(proxy)
            at = {"blockHash": block_hash}
            read = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [address, "0x0", at]}
            seen = [await proxy.post(read) for _ in range(2)]
            counted = {
                reason: proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason=reason)
                for reason in ("state_gone", "unknown_hash")
            }
            if beside == "archive":
                assert [body.get("result") for _, body, _ in seen] == ["0x" + word(1)] * 2, seen
                assert [headers["X-Cache"] for _, _, headers in seen] == ["MISS", "HIT"]
                assert counted == {"state_gone": 0, "unknown_hash": 0}
            else:
                assert all(body.get("result") is None and headers["X-Cache"] == "BYPASS" for _, body, headers in seen)
                assert counted == {
                    "state_gone": 2 if beside == "pruned" else 0,
                    "unknown_hash": 2 if beside == "lacking" else 0,
                }
            assert len(second.refused) == (1 if beside == "archive" else 2)  # asked on each miss: nothing kept
            assert len(third.refused) == (2 if beside == "pruned" else 0)
        finally:
            await proxy.close()


async def test_old_state_named_by_hash_with_require_canonical_is_asked_until_an_upstream_holds_it(
    archive: tuple[Anvil, str, list[int]],
) -> None:
    """`requireCanonical: true` makes the read uncached (BYPASS), not a read that gives up on the
    archive: a pruned node's error and another's "header not found" are passed over as without it."""
    node, address, marks = archive
    block_hash = node.rpc("eth_getBlockByNumber", hex(marks[0]), False)["hash"]
    pruned, without = PrunedRelay(node.url), PrunedRelay(node.url, "header")
    async with serving(pruned.handle) as pruned.url, serving(without.handle) as without.url:
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=f"{pruned.url},{without.url},{node.url}"))
        try:
            await both_heads_known(proxy)
            at = {"blockHash": block_hash, "requireCanonical": True}
            read = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [address, "0x0", at]}
            for _ in range(2):
                status, body, headers = await proxy.post(read)
                assert status == 200 and body.get("result") == "0x" + word(1), body
                assert headers["X-Cache"] == "BYPASS"
        finally:
            await proxy.close()


@pytest.mark.parametrize("cacheable", [True, False])
async def test_a_pruned_nodes_error_is_served_uncached_and_counted_when_no_upstream_keeps_the_state(
    archive: tuple[Anvil, str, list[int]],
    cacheable: bool,
) -> None:
    """Never kept: an archive node added later answers. A read never cached at all (an eth_call with
    a state override) is counted as state_gone all the same."""
    node, address, marks = archive
    if cacheable:
        read = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [address, "0x0", hex(marks[0])]}
    else:
        call, override = {"to": address, "data": selector("x()")}, {DEV_ACCOUNT: {"balance": "0x1"}}
        read = {"jsonrpc": "2.0", "id": 1, "method": "eth_call", "params": [call, hex(marks[0]), override]}
    async with alone_behind(PrunedRelay(node.url)) as proxy:
        for _ in range(2):
            status, body, headers = await proxy.post(read)
            assert status == 200 and "missing trie node" in body["error"]["message"]
            assert headers["X-Cache"] == "BYPASS"
        assert proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason="state_gone") == 2


async def test_a_null_for_old_state_is_never_kept_as_the_final_blocks_answer(
    archive: tuple[Anvil, str, list[int]],
) -> None:
    """A state read never answers null: a lone node's null for a final block is a node without its
    history, served uncached (BYPASS) and counted as state_gone, never a HIT."""
    node, _, marks = archive
    relay = PrunedRelay(node.url, "null")
    async with alone_behind(relay) as proxy:
        read = {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": [DEV_ACCOUNT, hex(marks[0])]}
        for _ in range(2):
            status, body, headers = await proxy.post(read)
            assert status == 200 and body["result"] is None and headers["X-Cache"] == "BYPASS"
        assert proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason="state_gone") == 2
        assert len(relay.refused) == 2


@dataclass
class StalledRelay:
    """A node that takes a state read and never answers it (a stalled node, a hung load balancer);
    everything else (head polls, identity probes) is the node's. Answered once `release` is set, or
    (`delay`) after that many seconds: a slow node."""

    target: str
    release: asyncio.Event = field(default_factory=asyncio.Event)
    stalled: int = 0  # state reads taken and held
    url: str = ""
    delay: float | None = None

    async def handle(self, request: web.Request) -> web.Response:
        payload = json.loads(await request.read())
        calls = payload if isinstance(payload, list) else [payload]
        if any(call.get("method") in STATE_BLOCK_AT for call in calls):
            self.stalled += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.release.wait(), self.delay)
        async with aiohttp.ClientSession() as session, session.post(self.target, json=payload) as resp:
            return web.json_response(await resp.json())


@contextlib.asynccontextmanager
async def stalled_beside(
    node: Anvil, first: PrunedRelay, count: int, archive_last: bool, slow_archive: float | None = None
) -> AsyncIterator[tuple[Proxy, list[StalledRelay]]]:
    """A proxy whose upstreams are `first`, (`slow_archive`) the archive answering state reads that
    many seconds late, `count` stalled nodes and (if `archive_last`) the archive node, every head
    known, UPSTREAM_TIMEOUT=2."""
    stalled = [StalledRelay(node.url) for _ in range(count)]
    slow = [StalledRelay(node.url, delay=slow_archive)] if slow_archive is not None else []
    async with contextlib.AsyncExitStack() as stack:
        first.url = await stack.enter_async_context(serving(first.handle))
        for relay in [*slow, *stalled]:
            relay.url = await stack.enter_async_context(serving(relay.handle))
            stack.callback(relay.release.set)  # before its server closes: nothing is left held
        urls = [first.url, *(r.url for r in [*slow, *stalled]), *([node.url] if archive_last else [])]
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=",".join(urls), UPSTREAM_TIMEOUT=str(DEADLINE)))
        stack.push_async_callback(proxy.close)
        per = proxy.app[SERVICE].networks["evm"].per_upstream
        assert per is not None

        async def known() -> bool:
            return all(per.states.latest[i] >= HEAD and per.states.verified[i] for i in range(len(urls)))

        await eventually(known, 15, "every upstream's head to be known")
        yield proxy, stalled


DEADLINE = 2.0  # UPSTREAM_TIMEOUT in the tests below
# Within one UPSTREAM_TIMEOUT, with room for a busy machine; a walk at a whole UPSTREAM_TIMEOUT per
# stalled node (three of them) takes three.
WITHIN_BUDGET = 1.5 * DEADLINE + 1


@contextlib.asynccontextmanager
async def _old_state_within_budget(
    archive: tuple[Anvil, str, list[int]], words: str, *, archive_last: bool
) -> AsyncIterator[tuple[Proxy, int, Any, Any]]:
    """The archive's final-block storage read through a pruned (or null) node, three stalled ones and
    (`archive_last`) the archive, timed from outside: it ends within WITHIN_BUDGET, a stalled node
    asked. Yields the proxy and the answer (status, body, headers)."""
    node, address, marks = archive
    read = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [address, "0x0", hex(marks[0])]}
    async with stalled_beside(node, PrunedRelay(node.url, words), 3, archive_last=archive_last) as (proxy, stalled):
        started = time.monotonic()
        status, body, headers = await proxy.post(read)
        elapsed = time.monotonic() - started
        assert elapsed < WITHIN_BUDGET, elapsed
        assert sum(r.stalled for r in stalled) >= 1
        yield proxy, status, body, headers


@pytest.mark.parametrize("words", ["geth", "null"])
async def test_the_walk_for_old_state_past_stalled_upstreams_ends_within_one_upstream_timeout(
    archive: tuple[Anvil, str, list[int]],
    words: str,
) -> None:
    """Failover within budget: a pruned node's error (or a null) for a final block's state sends the
    call on to each upstream that may hold it, each attempt its share of what is left of one
    UPSTREAM_TIMEOUT, so three stalled nodes still leave time for the archive node: the call ends
    within the budget, with the archive's answer (or, had its share run out, the first node's,
    served as state_gone)."""
    node, address, marks = archive
    async with _old_state_within_budget(archive, words, archive_last=True) as (proxy, status, body, headers):
        assert status == 200, body
        if body.get("result") != node.rpc("eth_getStorageAt", address, "0x0", hex(marks[0])):
            assert headers["X-Cache"] == "BYPASS", body  # no share left for the archive: the first node's
            assert proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason="state_gone") == 1


async def test_a_slow_archive_asked_after_a_pruned_node_answers_though_a_stalled_node_is_next(
    archive: tuple[Anvil, str, list[int]],
) -> None:
    """Failover within budget: a node of the walk for old state may run until the call's deadline,
    and the next one is asked beside it once it has had its share of what is left. An archive that
    answers in 0.6 UPSTREAM_TIMEOUT, asked after the pruned node's error with a stalled node still
    to try, gives the answer (an even split cut it off at half the time left, and served the pruned
    node's error)."""
    node, address, marks = archive
    read = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [address, "0x0", hex(marks[0])]}
    truth = node.rpc("eth_getStorageAt", address, "0x0", hex(marks[0]))
    lineup = stalled_beside(node, PrunedRelay(node.url, "geth"), 1, archive_last=False, slow_archive=0.6 * DEADLINE)
    async with lineup as (proxy, stalled):
        started = time.monotonic()
        status, body, _headers = await proxy.post(read)
        elapsed = time.monotonic() - started
        assert elapsed < WITHIN_BUDGET, elapsed
        assert status == 200 and body.get("result") == truth, body
        assert stalled[0].stalled == 1  # asked beside the slow archive once its share was spent


@pytest.mark.parametrize("words", ["geth", "null"])
async def test_old_state_no_upstream_answers_in_time_is_served_as_state_gone_within_one_upstream_timeout(
    archive: tuple[Anvil, str, list[int]],
    words: str,
) -> None:
    """When the call's UPSTREAM_TIMEOUT passes with no upstream's answer (every other one stalled),
    the rule for none answering holds: the first node's answer, served uncached (BYPASS) and counted
    as state_gone, within the budget: never a hang nor a 500."""
    async with _old_state_within_budget(archive, words, archive_last=False) as (proxy, status, body, headers):
        assert status == 200 and headers["X-Cache"] == "BYPASS", body
        if words == "null":
            assert body.get("result") is None and "error" not in body, body
        else:
            assert "missing trie node" in body["error"]["message"], body
        assert proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason="state_gone") == 1


# --- a node still syncing beside a synced one --------------------------------------------------

LIVE_HEAD = 751
SYNCING_AT = 251


@dataclass
class SyncingRelay:
    """A node still syncing: eth_syncing says so, and every other call is a node at SYNCING_AT's.
    `synced` makes it the live node, synced (eth_syncing false)."""

    behind: str
    live: str
    synced: bool = False
    asked_syncing: int = 0
    requests: int = 0
    stuck: bool = False  # eth_syncing false all the same (a node stalled far behind)

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        payload = json.loads(await request.read())
        calls = payload if isinstance(payload, list) else [payload]
        async with (
            aiohttp.ClientSession() as session,
            session.post(self.live if self.synced else self.behind, json=payload) as resp,
        ):
            reply = await resp.json()
        items = reply if isinstance(reply, list) else [reply]
        by_id = {item.get("id"): item for item in items}
        for call in calls:
            if call.get("method") == "eth_syncing":
                self.asked_syncing += 1
                by_id[call.get("id")]["result"] = (
                    False
                    if self.synced or self.stuck
                    else {"startingBlock": "0x0", "currentBlock": hex(SYNCING_AT), "highestBlock": hex(LIVE_HEAD)}
                )
        return web.json_response(reply)


@pytest.fixture(scope="module")
def live_and_behind() -> Iterator[tuple[Anvil, Anvil, str]]:
    """The live node at LIVE_HEAD (slot 0 of a contract changed after SYNCING_AT) and a node of the
    same chain stopped at SYNCING_AT."""
    live = Anvil()
    address = live.deploy_store()
    live.send(address, selector("setX(uint256)") + word(1))
    live.mine(SYNCING_AT - live.block_number())
    behind = Anvil("--fork-url", live.url, "--fork-block-number", str(SYNCING_AT))
    live.send(address, selector("setX(uint256)") + word(2))
    live.mine(LIVE_HEAD - live.block_number())
    yield live, behind, address
    behind.stop()
    live.stop()


def head_reads(address: str) -> list[tuple[str, list[Any]]]:
    return [
        ("eth_blockNumber", []),
        ("eth_getBlockByNumber", ["latest", False]),
        ("eth_getBlockByNumber", ["safe", False]),
        ("eth_getBlockByNumber", ["finalized", False]),
        ("eth_getStorageAt", [address, "0x0", "latest"]),
        ("eth_call", [{"to": address, "data": selector("x()")}, "latest"]),
    ]


async def readyz(proxy: Proxy) -> tuple[int, dict[str, Any]]:
    async with proxy.session.get(proxy.base + "/readyz") as resp:
        return resp.status, await resp.json()


async def test_a_syncing_primary_is_out_of_head_tracking_and_latest_reads_until_it_catches_up(
    live_and_behind: tuple[Anvil, Anvil, str],
) -> None:
    live, behind, address = live_and_behind
    relay = SyncingRelay(behind.url, live.url)
    async with serving(relay.handle) as url:
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=f"{url},{live.url}"))
        try:
            reads = head_reads(address)
            wrong = 0
            for _ in range(10):  # from the first answer the proxy gives
                wrong += (await wrong_answers(proxy, live, reads))[0]
            assert wrong == 0
            assert relay.asked_syncing > 0
            assert proxy.metric("rpc_proxy_upstream_catching_up", network="evm", upstream="0") == 1
            assert proxy.metric("rpc_proxy_upstream_catching_up", network="evm", upstream="1") == 0
            status, body = await readyz(proxy)
            assert status == 200 and body["catching_up"] == {
                "evm": {"0": f"syncing, {LIVE_HEAD - SYNCING_AT} blocks behind"}
            }

            relay.synced = True  # it has caught up: back in head tracking and in rotation

            async def caught_up() -> bool:
                return proxy.metric("rpc_proxy_upstream_catching_up", network="evm", upstream="0") == 0

            await eventually(caught_up, 10, "the primary to be seen caught up")
            status, body = await readyz(proxy)
            assert status == 200 and "catching_up" not in body
            assert (await wrong_answers(proxy, live, reads))[0] == 0
        finally:
            await proxy.close()


async def test_readyz_says_degraded_when_every_upstream_is_still_syncing(
    live_and_behind: tuple[Anvil, Anvil, str],
) -> None:
    live, behind, _address = live_and_behind
    relay = SyncingRelay(behind.url, live.url)
    async with serving(relay.handle) as url:
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=url))
        try:

            async def degraded() -> bool:
                status, body = await readyz(proxy)
                return status == 503 and "every upstream is still syncing" in body["networks"]["evm"]

            await eventually(degraded, 10, "/readyz to say every upstream is syncing")
        finally:
            await proxy.close()


@pytest.mark.parametrize("says", ["syncing", "synced"])
async def test_a_node_far_behind_left_alone_below_finality_never_takes_the_head_nor_drops_the_cache(says: str) -> None:
    """Rule: a node below the network's finalized block that never reached it (syncing, or stalled
    and saying it is synced) is no evidence of a restarted chain, and one that says it is syncing is
    never followed, even as the only upstream answering: the synced node going away made the proxy
    take the other's head (eth_blockNumber back from 300 to 100, as hits) and drop the cache as "a
    restarted chain" within seconds (an outside attack)."""
    live = Anvil()
    live.mine(300)
    behind = Anvil("--fork-url", live.url, "--fork-block-number", "100")
    synced = await FaultRelay(live.url).start()
    relay = SyncingRelay(behind.url, live.url, stuck=says == "synced")
    try:
        async with serving(relay.handle) as url:
            proxy = await start_proxy(settings_for(EVM_UPSTREAM=f"{url},{synced.url}", HEAD_STALE_AFTER="0.5"))
            try:
                await proxy.head_at(300)
                number = {"jsonrpc": "2.0", "id": 1, "method": "eth_blockNumber", "params": []}
                assert (await proxy.post(number))[1]["result"] == hex(300)  # shown: never below it again
                final = {"jsonrpc": "2.0", "id": 1, "method": "eth_getBlockByNumber", "params": [hex(200), False]}
                await proxy.post(final)
                assert (await proxy.post(final))[2]["X-Cache"] == "HIT"
                await synced.close()  # the synced node goes away: only the syncing one answers
                asked = relay.requests

                async def polled_on() -> bool:
                    return relay.requests >= asked + 60  # 12 heads in a row below finality were a "restart"

                await eventually(polled_on, 20, "sixty more requests to the syncing node")
                head = proxy.app[SERVICE].networks["evm"].tracker.head
                assert head is not None and head.latest >= 300
                _, body, headers = await proxy.post(final)
                assert headers["X-Cache"] == "HIT" and body["result"]["number"] == hex(200)
                _, body, _ = await proxy.post(number)
                assert "error" in body or int(body["result"], 16) >= 300, body
            finally:
                await proxy.close()
    finally:
        await synced.close()
        behind.stop()
        live.stop()


@pytest.mark.parametrize("method", ["eth_getLogs", "eth_getTransactionReceipt"])
async def test_a_pruned_history_error_of_any_method_is_asked_of_another_upstream(
    anvil: Anvil, make_proxy: ProxyFactory, method: str
) -> None:
    """Rule: a node's error saying it no longer keeps the history asked (EIP-4444's code 4444,
    "pruned history unavailable") sends the call to another upstream, whatever its method: eth_getLogs
    and a receipt by its transaction's hash got the pruned node's error, the archive never asked (an
    outside attack)."""
    address = anvil.deploy_store()
    receipt = anvil.send(address, selector("emitMany(uint256)") + word(2))
    anvil.mine(1100)  # a range of more than one 1,000-block piece, all final: asked in pieces
    pruned = await FaultRelay(anvil.url).start()
    try:
        pruned.inject("pruned", method=method, times=None)
        proxy = await make_proxy(EVM_UPSTREAM=f"{pruned.url},{anvil.url}")
        await proxy.head_at(anvil.block_number())
        params: list[Any] = (
            [{"address": address, "fromBlock": "0x0", "toBlock": hex(anvil.block_number() - 70)}]
            if method == "eth_getLogs"
            else [receipt["transactionHash"]]
        )
        _, body, _ = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
        assert body.get("result") == anvil.rpc(method, *params), body
        assert "pruned" in pruned.applied
    finally:
        await pruned.close()


# --- a node a few blocks behind on the head's own chain ----------------------------------------

LIVE_HEAD = 300
LAGGING_AT = 290  # a few blocks behind: not "catching up" (CATCH_UP_BLOCKS), the same chain


@pytest.fixture(scope="module")
def live_and_lagging() -> Iterator[tuple[Anvil, Anvil]]:
    live = Anvil()
    live.mine(LAGGING_AT - live.block_number())
    lagging = Anvil("--fork-url", live.url, "--fork-block-number", str(LAGGING_AT))  # its blocks are live's
    live.mine(LIVE_HEAD - live.block_number())
    yield live, lagging
    lagging.stop()
    live.stop()


def _a_poll(calls: list[dict[str, Any]]) -> bool:
    """A head tracker's poll: its batch asks for the latest block first."""
    return len(calls) > 1 and calls[0].get("method") == "eth_getBlockByNumber" and calls[0]["params"][0] == "latest"


def _the_trackers(calls: list[dict[str, Any]]) -> bool:
    """A head tracker's request, made one at a time: a poll, or its window walk (blocks by number
    beside the poll's latest block). Identity and syncing checks, made beside them, are not."""
    return len(calls) > 1 and all(call.get("method") == "eth_getBlockByNumber" for call in calls)


@pytest.mark.parametrize(("stale_after", "from_start"), [(None, False), ("0.25", False), (None, True)])
async def test_a_balancer_member_a_few_blocks_behind_never_takes_the_head_back(
    live_and_lagging: tuple[Anvil, Anvil],
    stale_after: str | None,
    from_start: bool,
) -> None:
    """Rule: a poll a balancer's lagging member answers below the head is asked once more (the
    balancer sends it to another member), so the head neither goes stale nor, once stale, back to the
    member's block as a shorter chain. Here the balancer sends every other request of the tracker to
    that member (its identity and syncing checks, made beside the polls, go to the live one: counted
    in, they could make the retry land on the lagging member again on a busy machine);
    with HEAD_STALE_AFTER just over the poll interval the head is stale at almost every poll (as on
    a machine too busy to poll on time), when a lower block alone would be taken as a rollback.
    `from_start`: the balancer alternates from the proxy's first request, so the window walk after a
    poll answered at the head reaches the member without those blocks: the walk is asked beside the
    poll's latest block, again until a node shows it (the tracker never reached the head before)."""
    live, lagging = live_and_lagging
    top = live.block_number()
    turn = itertools.count()
    polls = {"lagging": 0, "on": from_start}

    def route(calls: list[dict[str, Any]]) -> str:
        if not polls["on"] or not _the_trackers(calls) or next(turn) % 2 == 0:
            return live.url
        polls["lagging"] += _a_poll(calls)
        return lagging.url

    async with balancer(route) as url:
        stale = {"HEAD_STALE_AFTER": stale_after} if stale_after is not None else {}
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=url, HEAD_POLL_INTERVAL="0.2", **stale))
        try:
            await proxy.head_at(top)
            tracker = proxy.app[SERVICE].networks["evm"].tracker
            polls["on"] = True

            async def polled_on() -> bool:
                head = tracker.head
                assert head is not None and head.latest == top, head  # never back to the member's block
                return polls["lagging"] >= 15

            await eventually(polled_on, 60, "polls to reach the lagging member")
            assert proxy.metric("rpc_proxy_reorgs_total", network="evm") == 0
            since = tracker.last_poll

            async def fresh() -> bool:
                head = tracker.head
                return head is not None and not head.stale and tracker.last_poll > since

            await eventually(fresh, 30, "a fresh head beside the lagging member")
        finally:
            await proxy.close()


async def test_a_primary_a_few_blocks_behind_leaves_the_head_to_the_upstream_ahead_of_it(
    live_and_lagging: tuple[Anvil, Anvil], tmp_path: Path
) -> None:
    """Rule: a poll answered by a node behind the head is asked once more, of the upstream furthest
    ahead, so a primary that fell a few blocks behind (not far enough to count as catching up) leaves
    the head fresh and following the chain, instead of stale for as long as it lags."""
    live, lagging = live_and_lagging
    behind = {"now": False}

    def route(calls: list[dict[str, Any]]) -> str:
        return lagging.url if behind["now"] else live.url  # the primary: in step, then a few blocks behind

    async with balancer(route) as primary:
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=f"{primary},{live.url}", HEAD_POLL_INTERVAL="0.1"))
        try:
            await proxy.head_at(live.block_number())
            tracker = proxy.app[SERVICE].networks["evm"].tracker
            behind["now"] = True
            top = live.mine(1)  # only the upstream ahead has it
            await proxy.head_at(top, timeout=30)
            since = tracker.last_poll

            async def fresh() -> bool:
                head = tracker.head
                return head is not None and not head.stale and tracker.last_poll > since

            await eventually(fresh, 30, "a fresh head while the primary lags")
            assert proxy.metric("rpc_proxy_reorgs_total", network="evm") == 0
        finally:
            behind["now"] = False
            await proxy.close()


@pytest.mark.parametrize("upstreams", ["a balancer", "the lagging node first, then the live one"])
async def test_a_recent_blocks_logs_a_lagging_node_lacks_are_asked_again_not_refused(
    live_and_lagging: tuple[Anvil, Anvil], upstreams: str
) -> None:
    """Rule: an eth_getLogs range above finality that a node answers without the range's last block
    beside it (it lacks the block: a balancer's lagging member, a backup behind) is asked again and
    served from a node that shows the block; it was refused as another fork (-32002)."""
    live, lagging = live_and_lagging
    turn = itertools.count()

    def route(calls: list[dict[str, Any]]) -> str:  # logs alternate, the lagging member first
        if any(c.get("method") == "eth_getLogs" for c in calls):
            return lagging.url if next(turn) % 2 == 0 else live.url
        return live.url

    async with balancer(route) as url:
        both = url if upstreams == "a balancer" else f"{lagging.url},{live.url}"
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=both))
        try:
            top = live.block_number()
            await proxy.head_at(top)
            for n in range(LAGGING_AT + 1, min(top, LAGGING_AT + 5) + 1):
                log_filter = {"fromBlock": hex(n), "toBlock": hex(n)}
                reply = await proxy.call("eth_getLogs", [log_filter])
                assert reply.get("result") == live.rpc("eth_getLogs", log_filter), (n, reply)
        finally:
            await proxy.close()


@pytest.fixture(scope="module")
def logs_above_a_lagging_member() -> Iterator[tuple[Anvil, Anvil, str]]:
    """A live node with logs in blocks 141-144 (two a block), and a member of its chain stopped at 140."""
    live = Anvil()
    store = live.deploy_store()
    live.mine(140 - live.block_number())
    lagging = Anvil("--fork-url", live.url, "--fork-block-number", "140")
    for _ in range(4):
        live.send(store, selector("emitMany(uint256)") + word(2))
    yield live, lagging, store
    lagging.stop()
    live.stop()


@pytest.mark.parametrize(("first", "last"), [("0x8b", "past"), ("0x8d", "past"), ("0x8b", "pending")])
async def test_a_log_range_past_the_head_is_served_only_from_a_node_that_shows_the_head(
    logs_above_a_lagging_member: tuple[Anvil, Anvil, str], first: str, last: str
) -> None:
    """Rule: an eth_getLogs range that ends past the head (or at `pending`) is asked beside the
    head's own block, and served (never kept) only from a node that shows it: a balancer's member
    behind answered short of blocks the chain has (no logs of 141-144, or its range error), and that
    answer was served. A balancer whose logs all reach the member behind gets -32002, never a short
    answer."""
    live, lagging, store = logs_above_a_lagging_member
    turn = itertools.count()
    only_lagging = {"on": False}

    def route(calls: list[dict[str, Any]]) -> str:  # logs alternate, the lagging member first
        if any(c.get("method") == "eth_getLogs" for c in calls):
            return lagging.url if only_lagging["on"] or next(turn) % 2 == 0 else live.url
        return live.url

    async with balancer(route) as url:
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=url))
        try:
            top = live.block_number()
            await proxy.head_at(top)
            log_filter = {"address": store, "fromBlock": first, "toBlock": hex(top + 3) if last == "past" else last}
            truth = live.rpc("eth_getLogs", log_filter)
            assert len(truth) == 8
            call = {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [log_filter]}
            for _ in range(4):
                status, reply, headers = await proxy.post(call)
                assert (status, reply.get("result"), headers["X-Cache"]) == (200, truth, "BYPASS"), reply
            only_lagging["on"] = True
            status, reply, _headers = await proxy.post(call)
            assert status == 502 and reply["error"]["code"] == -32002, reply
        finally:
            await proxy.close()


async def _fee_read_asked_again(
    live: Anvil,
    lagging: Anvil,
    member: Callable[[web.Request], Awaitable[web.Response]],
    release: asyncio.Event | None = None,
) -> tuple[int, Any, float, int]:
    """eth_gasPrice through a balancer that sends it first to its lagging member, then to `member` on
    every try after (`release` set before the proxy closes): status, body, seconds, fee reads asked."""
    asked = {"armed": False, "fees": 0}
    async with serving(member) as other:

        def route(calls: list[dict[str, Any]]) -> str:
            if asked["armed"] and any(c.get("method") == "eth_gasPrice" for c in calls):
                asked["fees"] += 1
                return lagging.url if asked["fees"] == 1 else other
            return live.url

        async with balancer(route) as url:
            proxy = await start_proxy(settings_for(EVM_UPSTREAM=url, UPSTREAM_TIMEOUT=str(DEADLINE)))
            try:
                await proxy.head_at(live.block_number())
                asked["armed"] = True
                started = time.monotonic()
                status, body, _ = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": "eth_gasPrice", "params": []})
                return status, body, time.monotonic() - started, asked["fees"]
            finally:
                if release is not None:
                    release.set()
                await proxy.close()


async def test_a_fee_read_asked_again_reaches_a_slow_member_at_the_head(live_and_lagging: tuple[Anvil, Anvil]) -> None:
    """Failover within budget: a try asked again for a node at the head may take all that is left of
    the call's time. A balancer whose lagging member answers a fee read first, and whose member at
    the head answers in 0.3 UPSTREAM_TIMEOUT, gives the head's price (a fifth of the time left per
    try cut that member off every time, and the call failed with -32002)."""
    live, lagging = live_and_lagging

    async def slow_live(request: web.Request) -> web.Response:
        body = await request.read()
        await asyncio.sleep(0.3 * DEADLINE)  # the member's own slowness, not a wait for state
        headers = {"Content-Type": "application/json"}
        async with aiohttp.ClientSession() as session, session.post(live.url, data=body, headers=headers) as resp:
            return web.Response(body=await resp.read(), content_type="application/json")

    status, body, _elapsed, fees = await _fee_read_asked_again(live, lagging, slow_live)
    assert status == 200 and body.get("result") == live.rpc("eth_gasPrice"), body
    assert fees >= 2  # asked again, of the member at the head


async def test_a_fee_read_asked_again_past_a_stalled_balancer_member_is_refused_within_one_upstream_timeout(
    live_and_lagging: tuple[Anvil, Anvil],
) -> None:
    """Failover within budget: a balancer's lagging member answers a fee read beside a head below the
    tracker's, and every try asked again for a node at the head (5 at most) reaches a stalled member:
    each try has its share of one UPSTREAM_TIMEOUT, not one each, and the call fails with -32002 (the
    rule when no node at the head answers) within it."""
    live, lagging = live_and_lagging
    release = asyncio.Event()

    async def stall(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({})

    status, body, elapsed, fees = await _fee_read_asked_again(live, lagging, stall, release)
    assert elapsed < WITHIN_BUDGET, (elapsed, fees)
    assert status == 502 and body["error"]["code"] == -32002, body
    assert fees >= 2  # asked again, of the stalled member


async def test_a_backup_ahead_on_another_fork_is_not_followed_while_the_primary_lags() -> None:
    """Rule: a poll answered by a lagging primary is asked of an upstream ahead only when that
    upstream's chain holds both the primary's latest block and the head's own: a backup that parted
    above the primary's block (another fork, further ahead) is passed over for the one on the head's
    chain, and the head never moves to its fork."""
    live = Anvil()
    live.mine(140 - live.block_number())
    lagging = Anvil("--fork-url", live.url, "--fork-block-number", "140")  # the primary, stopped at 140
    live.mine(12)
    forked_port = free_port()
    forked: Anvil | None = None
    proxy = await start_proxy(
        settings_for(
            EVM_UPSTREAM=f"{lagging.url},{live.url},http://127.0.0.1:{forked_port}",
            HEAD_POLL_INTERVAL="0.2",
            IDENTITY_CHECK_INTERVAL="1",  # the forked backup, down at start, is checked within a second of starting
        )
    )
    try:
        await proxy.head_at(live.block_number())
        forked = Anvil("--fork-url", live.url, "--fork-block-number", "140", port=forked_port)
        forked.send("0x" + "22" * 20, "0x")  # its own blocks from 141 on
        forked.mine(30)
        states = proxy.app[SERVICE].networks["evm"].per_upstream
        assert states is not None
        await eventually(
            lambda: _known(states.states, 2, forked.block_number()), 30, "the forked backup's head to be known"
        )
        top = live.mine(1)
        await proxy.head_at(top, timeout=30)
        tracker = proxy.app[SERVICE].networks["evm"].tracker
        assert (
            tracker.head is not None
            and tracker.head.latest_hash == live.rpc("eth_getBlockByNumber", hex(top), False)["hash"]
        )
        assert proxy.metric("rpc_proxy_reorgs_total", network="evm") == 0
    finally:
        await proxy.close()
        for node in (forked, lagging, live):
            if node is not None:
                node.stop()


async def _known(states: UpstreamStates, index: int, number: int) -> bool:
    return states.latest[index] == number and states.verified[index]


async def test_a_rollback_made_on_the_node_directly_is_taken_once_the_head_is_stale() -> None:
    """Rule: a node whose every answer is below the head, on the head's own chain (a rollback made on
    it directly, not through the proxy), is taken once the head is stale: the poll asked once more
    finds no upstream ahead, and `latest` follows the node rather than a block it no longer has."""
    node = Anvil()
    try:
        node.mine(20)
        snapshot = node.rpc("evm_snapshot")
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=node.url, HEAD_POLL_INTERVAL="0.2"))
        try:
            top = node.mine(3)
            await proxy.head_at(top)
            assert node.rpc("evm_revert", snapshot) is True
            back = node.block_number()
            assert back == top - 3
            tracker = proxy.app[SERVICE].networks["evm"].tracker

            async def taken() -> bool:
                return tracker.head is not None and tracker.head.latest == back and not tracker.head.stale

            await eventually(taken, 30, "the rolled-back chain to be taken")
            assert int(await proxy.result("eth_blockNumber", []), 16) == back
        finally:
            await proxy.close()
    finally:
        node.stop()


async def test_a_reorg_to_a_shorter_chain_is_never_served_from_the_replaced_blocks_once_a_poll_shows_it() -> None:
    """Rule (README: an answer for a replaced block is never served once the head tracker has seen the
    reorg, within one poll interval): a poll whose answers show a block of the head's window with
    another hash (the chain above it replaced by a shorter one, made on the node directly) makes the
    head stale at once, so a read by number above finalized is no longer served from the replaced
    block's entry, rather than for HEAD_STALE_AFTER (60 s here); the next poll takes the shorter chain."""
    node = Anvil()
    try:
        store = node.deploy_store()
        node.mine(20)
        snapshot = node.rpc("evm_snapshot")
        start = node.block_number()
        node.send(store, selector("setX(uint256)") + word(1))
        top = node.mine(4)
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=node.url, HEAD_POLL_INTERVAL="0.2", HEAD_STALE_AFTER="60"))
        try:
            await proxy.head_at(top)
            read = [store, "0x0", hex(start + 2)]
            assert await proxy.result("eth_getStorageAt", read) == "0x" + word(1)
            status, _, headers = await proxy.post(
                {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": read}
            )
            assert (status, headers["X-Cache"]) == (200, "HIT")
            assert node.rpc("evm_revert", snapshot) is True
            node.send(store, selector("setX(uint256)") + word(2))
            shorter = node.mine(2)
            assert shorter == start + 3 < top

            async def served_as_the_node() -> bool:
                reply = await proxy.call("eth_getStorageAt", read)  # -32002 while the tracker sorts it out
                return reply.get("result") == node.rpc("eth_getStorageAt", *read)

            await eventually(served_as_the_node, 20, "the replaced block's entry to be left (not 60 s later)")
            tracker = proxy.app[SERVICE].networks["evm"].tracker

            async def taken() -> bool:
                head = tracker.head
                return head is not None and head.latest == shorter and not head.stale

            await eventually(taken, 20, "the shorter chain to be taken")
            assert await proxy.result("eth_getStorageAt", read) == "0x" + word(2)
            assert await proxy.result("eth_getStorageAt", [store, "0x0", "latest"]) == "0x" + word(2)
        finally:
            await proxy.close()
    finally:
        node.stop()


async def test_latest_asked_as_the_tag_is_never_answered_below_a_block_shown_by_a_balancers_member_behind() -> None:
    """Rule (docs/caching.md, read-your-writes: once shown block N, `latest` is at least N): when the
    head trails a block a client was shown, `latest` goes upstream as the tag, beside the node's latest
    block, and is taken only from a node at or past the shown block; a balancer's member behind (whose
    own head the pool cannot tell from the balancer's) answered it with an older block, served."""
    live = Anvil()
    try:
        live.mine(LAGGING_AT - live.block_number())
        lagging = Anvil("--fork-url", live.url, "--fork-block-number", str(LAGGING_AT))
        try:
            live.mine(10)
            turn = itertools.count()
            alternate = {"on": False}

            def route(calls: list[dict[str, Any]]) -> str:
                return lagging.url if alternate["on"] and next(turn) % 2 else live.url

            async with balancer(route) as url:
                proxy = await start_proxy(settings_for(EVM_UPSTREAM=url, HEAD_POLL_INTERVAL="30"))
                try:
                    await proxy.head_at(live.block_number())
                    alternate["on"] = True
                    top = live.mine(1)  # past the tracker's head until its next poll, 30 s away
                    shown = await proxy.result("eth_getBlockByNumber", [hex(top), False])
                    assert int(shown["number"], 16) == top
                    for _ in range(8):
                        reply = await proxy.call("eth_getBlockByNumber", ["latest", False])
                        assert int(reply["result"]["number"], 16) >= top, reply
                finally:
                    await proxy.close()
        finally:
            lagging.stop()
    finally:
        live.stop()


# --- a load balancer with a member stalled far behind -----------------------------------------

BALANCED_HEAD = 300
STALLED_AT = 150  # below the live node's finalized block (236): the member lacks it


@pytest.fixture(scope="module")
def live_and_stalled() -> Iterator[tuple[Anvil, Anvil, str]]:
    live = Anvil()
    address = live.deploy_store()
    live.send(address, selector("setX(uint256)") + word(1))
    live.mine(STALLED_AT - live.block_number())
    stalled = Anvil("--fork-url", live.url, "--fork-block-number", str(STALLED_AT))
    live.send(address, selector("setX(uint256)") + word(2))
    live.mine(BALANCED_HEAD - live.block_number())
    yield live, stalled, address
    stalled.stop()
    live.stop()


async def test_a_balancer_member_stalled_behind_finality_never_takes_the_head_back_nor_moves_the_epoch(
    live_and_stalled: tuple[Anvil, Anvil, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    live, stalled, address = live_and_stalled
    rng = random.Random(7)
    sent = {"stalled": 0, "live": 0, "checks": 0}

    def route(calls: list[dict[str, Any]]) -> str:
        member = "stalled" if rng.random() < 0.2 else "live"
        sent[member] += 1
        if member == "stalled" and len(calls) == 4 and calls[2].get("params", [None])[0] == "finalized":
            sent["checks"] += 1  # a tracker poll with its check of the known finalized block
        return stalled.url if member == "stalled" else live.url

    async with balancer(route) as url:
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=url))
        try:
            await proxy.head_at(BALANCED_HEAD)
            tracker = proxy.app[SERVICE].networks["evm"].tracker
            assert tracker.head is not None
            space = tracker.head.space
            reads = [
                *head_reads(address),
                ("eth_getStorageAt", [address, "0x0", "finalized"]),
                ("eth_getStorageAt", [address, "0x0", "safe"]),
                ("eth_getBalance", [DEV_ACCOUNT, "latest"]),
            ]
            wrong = rounds = 0
            deadline = time.monotonic() + 60
            while rounds < 50 or sent["checks"] < 5:  # at least 450 answers, 5 polls answered by the stalled member
                assert time.monotonic() < deadline, sent
                wrong += (await wrong_answers(proxy, live, reads))[0]
                rounds += 1
            assert wrong == 0, (wrong, rounds)
            assert tracker.head is not None and tracker.head.latest == BALANCED_HEAD and tracker.head.space == space
            assert proxy.metric("rpc_proxy_finality_violations_total", network="evm") == 0
            assert "a restarted chain)" not in caplog.text
        finally:
            await proxy.close()


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("eth_getStorageAt", ["STORE", "0x0", "finalized"]),
        ("eth_getBlockByNumber", ["finalized", False]),
        ("eth_getBlockByNumber", ["safe", False]),
        ("eth_getBlockByNumber", ["latest", False]),
        ("eth_getBalance", [DEV_ACCOUNT, "latest"]),
    ],
)
async def test_a_tag_read_a_stalled_member_answers_is_asked_again_as_the_tag_rather_than_refused(
    live_and_stalled: tuple[Anvil, Anvil, str], method: str, params: list[Any]
) -> None:
    """A balancer whose stalled member answers every look at the node's head (so the proxy sees that
    upstream far behind) and the first request of a read at a tag (`latest`, `safe`, `finalized`,
    which the tracker turned into a block it holds): the member lacks the block and shows none of
    the chain beside its answer. The read is asked again with the caller's tag, answered by a member
    at the tracker's head and never kept; it is not refused with -32002 for a block the chain has."""
    live, stalled, address = live_and_stalled
    params = [address if p == "STORE" else p for p in params]
    trap = {"left": 0}

    def route(calls: list[dict[str, Any]]) -> str:
        if trap["left"] > 0:
            trap["left"] -= 1
            return stalled.url
        head_look = len(calls) == 1 and calls[0].get("method") == "eth_blockNumber"
        return stalled.url if head_look else live.url

    async with balancer(route) as url:
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=url, HEAD_POLL_INTERVAL="0.2"))
        try:
            await proxy.head_at(BALANCED_HEAD)

            per = proxy.app[SERVICE].networks["evm"].per_upstream
            assert per is not None

            async def seen_behind() -> bool:
                return per.states.latest[0] == STALLED_AT

            await eventually(seen_behind, 15, "the upstream's own head seen at the stalled member's")
            trap["left"] = 1  # the read's first request
            status, body, headers = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
            assert trap["left"] == 0  # it reached the stalled member
            assert status == 200 and body.get("result") == live.rpc(method, *params), body
            assert headers["X-Cache"] != "HIT"
        finally:
            await proxy.close()


# --- a lagging backup and reads at the head -------------------------------------------------------

LOGS_HEAD = 200
BACKUP_AT = 120


@pytest.fixture(scope="module")
def node_with_logs() -> Iterator[tuple[Anvil, str]]:
    """A node with one log in each of blocks 110-130 and falling base fees (latest 200)."""
    node = Anvil()
    address = node.deploy_store()
    node.mine(109 - node.block_number())
    for _ in range(110, 131):
        node.send(address, selector("emitMany(uint256)") + word(1))
    node.mine(LOGS_HEAD - node.block_number())
    yield node, address
    node.stop()


async def test_reads_at_the_head_are_never_answered_by_a_backup_that_lacks_the_block(
    node_with_logs: tuple[Anvil, str],
) -> None:
    """README "A node behind the head": a log range up to head+1 and the fee reads go to a node at
    the head; the lagging backup's answer is neither served nor kept."""
    node, address = node_with_logs
    backup = Anvil("--fork-url", node.url, "--fork-block-number", str(BACKUP_AT))
    relay = await FaultRelay(node.url).start()
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=f"{relay.url},{backup.url}"))
    try:
        await proxy.head_at(LOGS_HEAD)
        reads = [
            ("eth_getLogs", [{"address": address, "fromBlock": hex(110), "toBlock": hex(LOGS_HEAD + 1)}]),
            ("eth_gasPrice", []),
            ("eth_maxPriorityFeePerGas", []),
            ("eth_blobBaseFee", []),
            ("eth_feeHistory", ["0x4", "latest", [50]]),
        ]
        wrong = 0
        for method, params in reads:
            relay.inject("http500", method=method)  # once: the backup (at block 120) is asked next
            status, body, _ = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
            truth = node.rpc(method, *params)
            if status != 200 or body.get("result") != truth:
                wrong += 1
        assert wrong == 0
    finally:
        await proxy.close()
        await relay.close()
        backup.stop()
