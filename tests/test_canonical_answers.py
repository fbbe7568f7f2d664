"""Every answer kept forever belongs to the canonical chain (issue 25): forked and stalled backups,
restarted devnets, persisted epochs, orphaned hashes, load balancers, reconnects, dev-node state
changes. Real Anvil nodes, real redis-server, the proxy on a real port."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from proxy.cache.policy import Decision, Mode
from proxy.chain.head_polls import Head
from proxy.chain.heads import EvmHeadTracker
from proxy.chain.proofs import NOT_PROVABLE, answer_block_number, plan_proof, proof_doubt
from proxy.http.app_keys import SERVICE
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
    settings_for,
    start_proxy,
    word,
)
from tests.ws_client import connect

FINALITY = 64  # anvil: finalized = latest - 64
FIXED_GENESIS = ("--timestamp", "1700000000")  # the same genesis on every start


def tracker_of(proxy: Proxy) -> EvmHeadTracker:
    tracker = proxy.app[SERVICE].networks["evm"].tracker
    assert isinstance(tracker, EvmHeadTracker)
    return tracker


def request(method: str, params: list[Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}


async def answer(proxy: Proxy, method: str, params: list[Any]) -> tuple[dict[str, Any], str]:
    _, body, headers = await proxy.post(request(method, params))
    return body, headers.get("X-Cache", "")


class TestProofDecisions:
    HEAD = Head(200, 150, 136, "0xlatest", 30_000_000, 0, {199: "0xa"}, {"0xa": 199}, final_hash="0xfinal")

    def test_a_final_answer_by_number_is_proven_at_the_finalized_block(self) -> None:
        assert plan_proof(Decision(Mode.IMMUTABLE), True, self.HEAD, [], {}) == (hex(136), "0xfinal", True)
        assert plan_proof(Decision(Mode.IMMUTABLE), False, self.HEAD, ["0xh"], {}) is None  # by hash

    def test_a_head_answer_is_proven_at_the_trackers_latest_block(self) -> None:
        assert plan_proof(Decision(Mode.TTL, 1, per_head=True), False, self.HEAD, [], {}) == (
            "latest",
            "0xlatest",
            True,
        )

    def test_a_final_answer_without_a_known_finalized_hash_cannot_be_kept(self) -> None:
        head = Head(200, 150, 136, "0xlatest", 30_000_000, 0)
        assert plan_proof(Decision(Mode.IMMUTABLE), True, head, [], {}) == NOT_PROVABLE

    def test_a_reorged_out_hash_is_answered_by_a_node_that_no_longer_has_it(self) -> None:
        proof = plan_proof(Decision(Mode.IMMUTABLE), False, self.HEAD, ["0xold"], {"0xold": 99})
        assert proof == ("0x63", "0xold", False)
        assert proof_doubt(proof, "0xold") == "orphaned" and proof_doubt(proof, "0xnew") is None
        assert proof_doubt(proof, "", head=self.HEAD) == "unproven"  # no block 99 on a chain at 200: behind

    def test_a_hash_rolled_back_above_the_head_is_answered_by_a_node_without_its_height(self) -> None:
        proof = plan_proof(Decision(Mode.IMMUTABLE), False, self.HEAD, ["0xgone"], {"0xgone": 203})
        assert proof_doubt(proof, "", head=self.HEAD) is None  # the chain is at 200: no block 203 is its answer
        assert proof_doubt(proof, "0xgone", head=self.HEAD) == "orphaned"
        assert proof_doubt(proof, "", head=replace(self.HEAD, latest=203)) == "unproven"

    def test_an_answer_pinned_to_an_unfinalized_hash_is_proven_at_that_block(self) -> None:
        pinned = Decision(Mode.TTL, 1, pin_hashes=True)
        proof = plan_proof(pinned, True, self.HEAD, [], {}, (199, "0xa"))
        assert proof == (hex(199), "0xa", True)
        assert proof_doubt(proof, "0xa", final=False) is None
        assert proof_doubt(proof, "0xb", final=False) == "fork"  # another fork's block there: never off-chain
        assert proof_doubt(proof, "", final=False) == "unproven"

    def test_doubts_name_why_an_answer_is_not_kept(self) -> None:
        final = (hex(136), "0xfinal", True)
        assert proof_doubt(final, "0xfinal") is None
        assert proof_doubt(final, "0xother") == "off_chain" and proof_doubt(final, "") == "unproven"
        assert proof_doubt(("latest", "0xlatest", True), "0xolder") == "other_head"

    def test_the_block_of_a_hash_addressed_answer(self) -> None:
        assert answer_block_number({"number": "0x10"}) == 16
        assert answer_block_number([{"blockNumber": "0x2"}]) == 2 and answer_block_number("0x1") is None


# --- 1. a backup on another fork ------------------------------------------------------------


@pytest.mark.parametrize(("mined", "height", "tries"), [(4, 102, 3), (80, 105, 1)], ids=["unfinalized", "final"])
async def test_an_answer_from_a_backup_on_another_fork_is_never_served_nor_kept(
    mined: int,
    height: int,
    tries: int,
    make_proxy: ProxyFactory,
) -> None:
    # Final: the node's block at the tracker's finalized height comes in the same batch. Unfinalized:
    # a forked Anvil asked `{"blockHash": H}` for a canonical block it never had resolves H through its
    # fork source and runs the call on its own state: the pinned block's header shows the other fork.
    node = Anvil()
    node.mine(100)
    backup = Anvil("--fork-url", node.url, "--fork-block-number", "100")
    for _ in range(10):  # the backup mines blocks 101-110 of its own, with transfers
        backup.send("0x" + "22" * 20, "0x")
    node.mine(mined)  # empty blocks on the primary
    relay = await FaultRelay(node.url).start()
    proxy = await make_proxy(EVM_UPSTREAM=f"{relay.url},{backup.url}")
    try:
        await proxy.head_at(100 + mined)
        states = proxy.app[SERVICE].networks["evm"].per_upstream
        assert states is not None
        await eventually(
            lambda: _true(states.states.latest[1] == 110 and states.states.verified[1]),
            10,
            "the backup's head to be known",
        )
        truth = node.rpc("eth_getBalance", DEV_ACCOUNT, hex(height))
        assert truth != backup.rpc("eth_getBalance", DEV_ACCOUNT, hex(height))
        for _ in range(tries):
            relay.inject("http500", method="eth_getBalance")  # the primary fails: the backup answers first
            body, _ = await answer(proxy, "eth_getBalance", [DEV_ACCOUNT, hex(height)])
            assert body.get("result") in (truth, None), body  # the primary's answer, or -32002
        body, cache = await answer(proxy, "eth_getBalance", [DEV_ACCOUNT, hex(height)])
        assert body["result"] == truth, (body, cache)
    finally:
        await relay.close()
        backup.stop()
        node.stop()


async def _true(value: bool) -> bool:
    return value


# --- 2. a devnet restarted with the same genesis ------------------------------------------------


def devnet(port: int, x: int, blocks: int) -> tuple[Anvil, str]:
    """A devnet with the fixed genesis: a Store at block 1, setX(x) at block 2, mined to `blocks`."""
    node = Anvil(*FIXED_GENESIS, port=port)
    store = node.deploy_store()
    node.send(store, selector("setX(uint256)") + word(x))
    node.mine(blocks - node.block_number())
    return node, store


async def test_a_devnet_restarted_with_the_same_genesis_is_never_served_the_old_chains_entries(
    make_proxy: ProxyFactory,
) -> None:
    port = free_port()
    node, store = devnet(port, 12345, 140)  # finalized: 76
    proxy = await make_proxy(EVM_UPSTREAM=node.url)
    try:
        await proxy.head_at(140)
        old = await proxy.result("eth_getStorageAt", [store, "0x0", "0x2"])
        assert old == "0x" + word(12345)
        _, cache = await answer(proxy, "eth_getStorageAt", [store, "0x0", "0x2"])
        assert cache == "HIT"
        node.stop()
        node, store = devnet(port, 777, 70)  # shorter than the old finalized block: it has no block 76
        new = "0x" + word(777)

        async def serves_the_new_chain() -> bool:
            body, _ = await answer(proxy, "eth_getStorageAt", [store, "0x0", "0x2"])
            return body.get("result") == new

        await eventually(serves_the_new_chain, 15, "the proxy to serve the restarted chain")
        body, cache = await answer(proxy, "eth_getStorageAt", [store, "0x0", "0x2"])
        assert body["result"] == new
    finally:
        node.stop()


# --- 3. the epoch outlives the proxy ---------------------------------------------------------


async def test_a_restarted_proxy_stays_in_the_epoch_a_finality_violation_moved_to(
    redis_url: str, make_proxy: ProxyFactory
) -> None:
    node = Anvil()
    store = node.deploy_store()
    node.mine(20)
    written = int(node.send(store, selector("setX(uint256)") + word(12345))["blockNumber"], 16)
    node.mine(70)
    settings = settings_for(EVM_UPSTREAM=node.url, REDIS_URL=redis_url)
    call = [store, "0x0", hex(written)]
    # Inline, not make_proxy: closed mid-test, and a proxy restarted on the same Redis takes over.
    proxy = await start_proxy(settings)
    try:
        await proxy.head_at(node.block_number())
        assert await proxy.result("eth_getStorageAt", call) == "0x" + word(12345)
        node.rpc("anvil_reorg", 80, [])  # below finality: the write is gone
        await eventually(
            lambda: _true(proxy.metric("rpc_proxy_finality_violations_total", network="evm") >= 1),
            10,
            "the finality violation to be seen",
        )
    finally:
        await proxy.close()
    truth = node.rpc("eth_getStorageAt", *call)
    assert truth != "0x" + word(12345)
    restarted = await make_proxy(settings)
    try:
        await restarted.head_at(node.block_number())
        for _ in range(2):
            body, cache = await answer(restarted, "eth_getStorageAt", call)
            assert body["result"] == truth, (body, cache)
    finally:
        node.stop()


# --- 4. reads by a reorged-out hash ---------------------------------------------------------------


async def test_a_reorged_out_hash_is_answered_as_the_canonical_node_answers_it(make_proxy: ProxyFactory) -> None:
    node = Anvil()
    node.mine(100)
    backup = Anvil("--fork-url", node.url, "--fork-block-number", "100")
    orphan = node.rpc("eth_getBlockByNumber", hex(99), False)["hash"]
    assert backup.rpc("eth_getBlockByHash", orphan, False)["hash"] == orphan  # the backup holds it
    relay = await FaultRelay(node.url).start()
    proxy = await make_proxy(EVM_UPSTREAM=f"{relay.url},{backup.url}")
    try:
        await proxy.head_at(100)
        node.rpc("anvil_reorg", 3, [])  # 98-100 replaced
        node.mine(2)
        await eventually(lambda: _true(orphan in tracker_of(proxy).orphans), 10, "the reorg to be seen")
        assert node.rpc("eth_getBlockByHash", orphan, False) is None
        relay.inject("http500", method="eth_getBlockByHash")  # the primary fails once: the backup answers first
        body, _ = await answer(proxy, "eth_getBlockByHash", [orphan, False])
        assert "error" in body or body["result"] is None, body  # never the backup's old block
        body, cache = await answer(proxy, "eth_getBlockByHash", [orphan, False])
        assert body["result"] is None and cache != "HIT"
    finally:
        await relay.close()
        backup.stop()
        node.stop()


async def test_a_reorg_the_chain_moved_past_finality_before_the_next_poll_leaves_nothing_of_it_served(
    make_proxy: ProxyFactory,
) -> None:
    """Rule: a block a reorg replaced is never answered from cache, also when the chain had moved
    far enough by the next poll that the replaced blocks are final and out of the tracker's window.
    Before, the poll compared only the blocks still above the finalized one: a receipt, a block by
    hash and a storage read by block hash of the dropped blocks were served as hits, the receipt
    until its TTL ran out and the rest for good (an outside attack: anvil_reorg(2) then 70 blocks
    mined within one poll)."""
    node = Anvil()
    try:
        store = node.deploy_store()
        node.mine(70)
        receipt = node.send(store, selector("setX(uint256)") + word(7))
        block = receipt["blockHash"]
        proxy = await make_proxy(EVM_UPSTREAM=node.url, HEAD_POLL_INTERVAL="60", HEAD_STALE_AFTER="300")
        await proxy.head_at(node.block_number())
        reads = (
            ("eth_getTransactionReceipt", [receipt["transactionHash"]]),
            ("eth_getBlockByHash", [block, False]),
            ("eth_getStorageAt", [store, "0x0", {"blockHash": block}]),
        )
        for method, params in reads:
            await answer(proxy, method, params)
            body, cache = await answer(proxy, method, params)
            assert body.get("result") == node.rpc(method, *params) and cache == "HIT", (method, body, cache)
        node.rpc("anvil_reorg", 2, [])  # the write's block and the one before it, replaced
        node.mine(70)  # final before the tracker polls again
        await tracker_of(proxy).poll()
        for method, params in reads:
            try:
                truth: Any = node.rpc(method, *params)
            except RuntimeError as error:  # the node's error for a block it no longer has
                truth = error
            body, cache = await answer(proxy, method, params)
            assert cache != "HIT", (method, body)
            if isinstance(truth, Exception):
                assert "error" in body, (method, body)
            else:
                assert body.get("result") == truth, (method, body, truth)
    finally:
        node.stop()


async def test_a_backup_on_a_fork_the_network_left_never_answers_for_the_networks_blocks(
    make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """Rule (docs/caching.md, a backup on another fork): a node behind the network on a fork of its own
    never answers for the network's blocks. Before, each head poll that reached it made the head stale
    (its latest block had another hash than the head's window), or failed (the upstream ahead was not
    taken, as it does not hold the backup's block), and in the meantime every read went unpinned to
    whichever upstream was picked: with `selection = "weighted"`, up to a third of the reads of blocks
    101-106 got the backup's block, balances and receipts (outside attacks)."""
    async with left_fork(100, 6, relayed="backup") as (node, _, relay):  # relay: counts the backup's polls
        networks = tmp_path / "networks.toml"
        networks.write_text(
            f'[networks.evm]\nfamily = "evm"\nupstreams = ["{node.url}", "{relay.url}"]\nselection = "weighted"\n'
        )
        # Stale as soon as one poll fails (each of the backup's did, as no upstream ahead was taken).
        proxy = await make_proxy(NETWORKS_FILE=str(networks), HEAD_POLL_INTERVAL="0.1", HEAD_STALE_AFTER="0.15")
        await proxy.head_at(111)
        reads = [("eth_getBlockByNumber", [hex(n), False]) for n in (102, 106)] + [
            ("eth_getBalance", ["0x" + "bb" * 20, hex(106)]),
            ("eth_getBlockReceipts", [hex(104)]),
            ("eth_getTransactionByBlockNumberAndIndex", [hex(103), "0x0"]),
        ]
        truths = [node.rpc(method, *params) for method, params in reads]

        def polls_at_backup() -> int:  # the tracker's polls (the tags' batch) that the pool sent to it: half
            return sum(1 for call in relay.calls if call.get("params", [None])[:1] == ["finalized"])

        start = polls_at_backup()
        deadline = time.monotonic() + 30
        while polls_at_backup() < start + 10 and time.monotonic() < deadline:
            for (method, params), truth in zip(reads, truths, strict=True):
                body, cache = await answer(proxy, method, params)
                assert body.get("result") == truth, (method, params, body, cache)
        assert polls_at_backup() >= start + 10, "the head polls to reach the backup"


async def test_a_transaction_only_a_backup_on_another_fork_mined_is_answered_as_the_networks_chain_has_it(
    make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """Rule (docs/caching.md, a backup on another fork): a receipt or transaction by hash whose block
    the tracker holds with another hash is another fork's, and the network's node is asked instead;
    when it cannot answer, the call fails (-32002), never with the other fork's answer. Before, a
    backup on a fork the network left answered its own transaction's receipt (BYPASS) where the
    network's node answers null, and, once the re-ask was added, still did while the network's node
    failed or cooled down (outside attacks)."""
    async with left_fork(5, 1, relayed="node") as (node, backup, relay):
        theirs = backup.rpc("eth_getBlockByNumber", "0x6", True)["transactions"][0]  # on the backup's fork only
        networks = tmp_path / "networks.toml"
        networks.write_text(f'[networks.evm]\nfamily = "evm"\nupstreams = ["{relay.url}", "{backup.url}"]\n')
        for method in ("eth_getTransactionReceipt", "eth_getTransactionByHash"):
            proxy = await make_proxy(NETWORKS_FILE=str(networks))  # its own: the primary not cooling down
            await proxy.head_at(11)
            assert node.rpc(method, theirs["hash"]) is None
            relay.inject("http500", method=method)  # the primary fails once: the backup answers first
            body, cache = await answer(proxy, method, [theirs["hash"]])
            assert body == {"jsonrpc": "2.0", "id": 1, "result": None}, (method, body, cache)
            assert len(primary_calls(relay, method)) == 2, method  # the one that failed, then asked again
            relay.inject("http500", method=method, times=None)  # the network's node fails it from now on
            status, body, _ = await proxy.post(
                {"jsonrpc": "2.0", "id": 1, "method": method, "params": [theirs["hash"]]}
            )
            assert status == 502 and body["error"]["code"] == -32002, (method, body)
            relay.clear()


@asynccontextmanager
async def left_fork(at: int, blocks: int, relayed: str) -> AsyncIterator[tuple[Anvil, Anvil, FaultRelay]]:
    """The network's node, and a backup forked from it at block `at`; `blocks` transfers on each
    (another content on each fork: the network's to 0xaa.., the backup's to 0xbb..), then the network
    5 blocks further; a FaultRelay in front of `relayed` ("node" or "backup"). All stopped after."""
    node = Anvil()
    backup = relay = None
    try:
        node.mine(at)
        backup = Anvil("--fork-url", node.url, "--fork-block-number", str(at))
        for chain, to in ((node, "aa"), (backup, "bb")):
            for _ in range(blocks):
                chain.send("0x" + to * 20, "0x")
        node.mine(5)
        relay = await FaultRelay((node if relayed == "node" else backup).url).start()
        yield node, backup, relay
    finally:
        if relay is not None:
            await relay.close()
        if backup is not None:
            backup.stop()
        node.stop()


def primary_calls(relay: FaultRelay, method: str) -> list[dict[str, Any]]:
    return [c for c in relay.calls if c.get("method") == method]


# --- 5. a load balancer in front of a lagging node -----------------------------------------------


async def test_a_fee_read_from_a_node_behind_the_head_is_never_served_nor_kept(make_proxy: ProxyFactory) -> None:
    node = Anvil()
    node.mine(10)
    lagging = Anvil("--fork-url", node.url, "--fork-block-number", "10")
    node.mine(40)  # empty blocks: the base fee, and so the gas price, fell on the fresh node
    assert node.rpc("eth_gasPrice") != lagging.rpc("eth_gasPrice")

    def route(calls: list[dict[str, Any]]) -> str:  # the balancer sends fee reads to its lagging member
        return lagging.url if any(c.get("method") == "eth_gasPrice" for c in calls) else node.url

    async with balancer(route) as url:
        proxy = await make_proxy(EVM_UPSTREAM=url)
        await proxy.head_at(50)
        stale_price = lagging.rpc("eth_gasPrice")
        for _ in range(3):
            body, cache = await answer(proxy, "eth_gasPrice", [])
            assert cache != "HIT", (body, cache)  # the lagging node's price is never kept for this head
            # Nor served: only it is asked, so the read fails (-32002) rather than give an old block's price.
            assert body.get("result") != stale_price and body["error"]["code"] == -32002, body
        assert proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason="lagging") >= 1
    lagging.stop()
    node.stop()


@pytest.mark.parametrize(
    "method, params",
    [
        ("eth_getTransactionCount", [DEV_ACCOUNT, "pending"]),
        ("eth_getBalance", [DEV_ACCOUNT, "pending"]),
        ("eth_getBlockByNumber", ["pending", False]),
    ],
)
async def test_a_pending_read_from_a_balancers_member_behind_the_head_is_never_served(
    make_proxy: ProxyFactory, method: str, params: list[Any]
) -> None:
    """Rule: a read at `pending` stands for the block after the tracker's head, so it is answered by a
    node that shows that head beside it. A load balancer's member behind answered it from its own
    older head (a `pending` nonce that went back, so a wallet's next transaction reused a mined one:
    an outside attack, 11 to 18 of 120 calls); now it is asked again, and -32002 when only that
    member answers."""
    node = Anvil()
    node.mine(10)
    lagging = Anvil("--fork-url", node.url, "--fork-block-number", "10")
    store = node.deploy_store()
    for i in range(3):
        node.send(store, selector("setX(uint256)") + word(i))
    node.mine(5)
    stale = lagging.rpc(method, *params)
    behind = [True]

    def route(calls: list[dict[str, Any]]) -> str:  # reads at `pending` go to the member behind, or not
        return lagging.url if behind[0] and "pending" in json.dumps([c.get("params") for c in calls]) else node.url

    try:
        async with balancer(route) as url:
            proxy = await make_proxy(EVM_UPSTREAM=url)
            await proxy.head_at(node.block_number())
            for _ in range(2):
                body, cache = await answer(proxy, method, params)
                assert body.get("result") != stale and body["error"]["code"] == -32002, body
            behind[0] = False
            body, cache = await answer(proxy, method, params)
            assert body["result"] == node.rpc(method, *params) and cache == "BYPASS", body
    finally:
        lagging.stop()
        node.stop()


async def test_a_pending_read_goes_to_an_upstream_at_the_head_when_the_first_is_behind(
    make_proxy: ProxyFactory,
) -> None:
    """Rule: a read at `pending` shown behind the head is asked again of an upstream that has reached
    it. The first upstream by priority a few blocks behind (still asked first) was asked five times,
    then -32002: a wallet's send-then-`pending`-nonce got HTTP 502 (an outside re-attack)."""
    node = Anvil()
    node.mine(10)
    lagging = Anvil("--fork-url", node.url, "--fork-block-number", "10")
    try:
        store = node.deploy_store()
        for i in range(3):
            node.send(store, selector("setX(uint256)") + word(i))
        node.mine(5)
        proxy = await make_proxy(EVM_UPSTREAM=f"{lagging.url},{node.url}")
        await proxy.head_at(node.block_number())
        for method, params in (
            ("eth_getTransactionCount", [DEV_ACCOUNT, "pending"]),
            ("eth_getBalance", [DEV_ACCOUNT, "pending"]),
            ("eth_call", [{"to": store, "data": selector("x()")}, "pending"]),
        ):
            body, cache = await answer(proxy, method, params)
            assert body.get("result") == node.rpc(method, *params) and cache == "BYPASS", (method, body)
    finally:
        lagging.stop()
        node.stop()


async def test_a_load_balancers_member_on_a_left_fork_never_answers_nor_moves_the_head_back(
    make_proxy: ProxyFactory,
) -> None:
    node = Anvil()
    store = node.deploy_store()
    node.mine(100)
    lagging = Anvil("--fork-url", node.url, "--fork-block-number", str(node.block_number()))
    node.rpc("anvil_reorg", 4, [])  # the member holds the 4 blocks the network replaced, and no more
    node.send(store, selector("setX(uint256)") + word(42))
    turn = iter(range(10**6))

    def route(_calls: list[dict[str, Any]]) -> str:  # every other HTTP request reaches the member
        return lagging.url if next(turn) % 2 else node.url

    async with balancer(route) as url:
        # A head that stays fresh however busy the machine: a stale one may take a shorter chain.
        proxy = await make_proxy(EVM_UPSTREAM=url, HEAD_POLL_INTERVAL="0.1", HEAD_STALE_AFTER="60")
        top = node.block_number()
        await proxy.head_at(top)
        latest = node.rpc("eth_getBlockByNumber", "latest", False)["hash"]
        seen = []
        for _ in range(40):
            body, _ = await answer(proxy, "eth_blockNumber", [])
            seen.append(int(body["result"], 16))
            body, _ = await answer(proxy, "eth_call", [{"to": store, "data": selector("x()")}, "latest"])
            assert body.get("result") in ("0x" + word(42), None), body  # the network's value, or -32002
            body, _ = await answer(proxy, "eth_getUncleByBlockHashAndIndex", [latest, "0x0"])
            assert "result" in body or body["error"]["code"] == -32002, body  # never the member's range error
        assert seen == sorted(seen) and seen[0] >= top, seen  # the head never went back
    lagging.stop()
    node.stop()


async def test_a_tag_read_after_a_reorg_the_tracker_has_not_polled_is_asked_as_the_tag_of_its_only_node(
    make_proxy: ProxyFactory,
) -> None:
    """Rule: with one upstream, the head tracker's chain is that node's: a read pinned to a block the
    node has since replaced (a reorg the tracker has not polled yet), by a tag, a range to `pending`
    or a number, is asked again as the caller sent it and served as the node answers it, never kept.
    It was a 502 (-32002 "no upstream could answer for block N") for every such read until the next
    poll (found by outside attacks reading while reorging)."""
    node = Anvil()
    try:
        node.mine(70)
        node.send("0x" + "22" * 20, "0x")
        proxy = await make_proxy(EVM_UPSTREAM=node.url, HEAD_POLL_INTERVAL="30", HEAD_STALE_AFTER="120")
        await proxy.head_at(node.block_number())
        node.rpc("anvil_reorg", 1, [[{"from": DEV_ACCOUNT, "to": "0x" + "33" * 20, "value": "0x1"}, 0]])
        for method, params in (
            ("eth_getTransactionByBlockNumberAndIndex", ["latest", "0x0"]),
            ("eth_getTransactionByBlockNumberAndIndex", ["latest", "0x1"]),  # a null: asked beside a header
            ("eth_getTransactionByBlockNumberAndIndex", ["pending", "0x1"]),
            ("eth_getBlockByNumber", ["latest", False]),
            ("eth_getBalance", ["0x" + "33" * 20, "latest"]),
            ("eth_getLogs", [{"fromBlock": "0x40", "toBlock": "pending"}]),
            ("eth_getLogs", [{"fromBlock": "0x40", "toBlock": "latest"}]),
            ("eth_getLogs", [{"fromBlock": "0x40", "toBlock": hex(node.block_number())}]),
            ("eth_getBalance", ["0x" + "33" * 20, hex(node.block_number())]),
            ("eth_getBlockByNumber", [hex(node.block_number()), False]),
        ):
            body, cache = await answer(proxy, method, params)
            assert body.get("result") == node.rpc(method, *params) and cache == "BYPASS", (method, body, cache)
    finally:
        node.stop()


# --- 6. connection loss is identity loss ---------------------------------------------------------


async def test_a_silent_reconnect_checks_the_identity_before_an_answer_is_kept(make_proxy: ProxyFactory) -> None:
    port = free_port()
    node = Anvil(port=port)
    node.mine(70)
    # Slow polls and identity checks: nothing reaches the node while it restarts, so aiohttp
    # reconnects silently on the next call.
    proxy = await make_proxy(
        EVM_UPSTREAM=node.url, HEAD_POLL_INTERVAL="30", HEAD_STALE_AFTER="120", IDENTITY_CHECK_INTERVAL="300"
    )
    try:
        await proxy.head_at(70)
        node.stop()
        node = Anvil("--chain-id", "999", port=port)  # another chain on the same address
        node.mine(70)
        for _ in range(2):
            body, cache = await answer(proxy, "eth_getBlockByNumber", ["0x5", False])
            assert cache != "HIT", (body, cache)  # the new chain's block is never kept under the old identity
        await eventually(
            lambda: _true(proxy.metric("rpc_proxy_upstream_identity_mismatch", network="evm", upstream="0") == 1),
            10,
            "the identity to be checked again",
        )
    finally:
        node.stop()


# --- 7, 8. dev-node state changes through the proxy ----------------------------------------------


@pytest.fixture
async def dev_proxy(anvil: Anvil, make_proxy: ProxyFactory) -> Proxy:
    return await make_proxy(EVM_UPSTREAM=anvil.url, ALLOW_NAMESPACES="anvil,evm")


async def test_a_dev_node_state_change_through_the_proxy_drops_the_entries_it_made_stale(
    anvil: Anvil, dev_proxy: Proxy
) -> None:
    store = anvil.deploy_store()
    await dev_proxy.head_at(anvil.block_number())
    latest_hash = anvil.rpc("eth_getBlockByNumber", "latest", False)["hash"]
    reads = [[store, "0x0", "latest"], [store, "0x0", {"blockHash": latest_hash}]]
    for params in reads:
        await dev_proxy.result("eth_getStorageAt", params)
        _, cache = await answer(dev_proxy, "eth_getStorageAt", params)
        assert cache == "HIT"
    assert await dev_proxy.result("anvil_setStorageAt", [store, "0x0", "0x" + word(4242)]) is True
    for params in reads:  # at once: no block was mined
        assert await dev_proxy.result("eth_getStorageAt", params) == "0x" + word(4242)


async def test_a_rollback_through_the_proxy_sends_removed_logs_without_a_new_block(
    anvil: Anvil, dev_proxy: Proxy
) -> None:
    store = anvil.deploy_store()
    await dev_proxy.head_at(anvil.block_number())
    client = await connect(dev_proxy)
    logs = await client.subscribe("logs", {"address": store})
    receipt = anvil.send(store, selector("emitMany(uint256)") + word(1))
    await client.notes_until(1)
    top = anvil.block_number()
    assert await dev_proxy.result("anvil_rollback", [1]) is None
    await client.notes_until(2, timeout=10)  # no block is mined meanwhile
    assert anvil.block_number() == top - 1
    removed = [r for r in client.results(logs) if r["removed"]]
    assert [r["blockHash"] for r in removed] == [receipt["blockHash"]]


@pytest.mark.parametrize("shared", [False, True], ids=["memory", "redis"])
async def test_a_rollback_through_the_proxy_takes_the_shorter_chain_for_block_numbers_and_rolled_back_hashes(
    anvil: Anvil, make_proxy: ProxyFactory, request: pytest.FixtureRequest, shared: bool
) -> None:
    """A client shown the blocks a rollback removed is not held to them: `eth_blockNumber` follows the
    node down at once, and a removed block's hash is answered as the node answers it (null), not refused."""
    extra = {"REDIS_URL": request.getfixturevalue("redis_url")} if shared else {}
    dev_proxy = await make_proxy(EVM_UPSTREAM=anvil.url, ALLOW_NAMESPACES="anvil,evm", **extra)
    anvil.mine(3)
    top = anvil.block_number()
    await dev_proxy.head_at(top)
    gone = anvil.rpc("eth_getBlockByNumber", hex(top), False)["hash"]
    assert (await dev_proxy.result("eth_getBlockByHash", [gone, False]))["hash"] == gone  # block `top` shown
    assert await dev_proxy.result("eth_blockNumber", []) == hex(top)
    assert await dev_proxy.result("anvil_rollback", [2]) is None
    assert anvil.block_number() == top - 2
    assert await dev_proxy.result("eth_blockNumber", []) == hex(top - 2)  # at once, before the tracker's poll
    assert (await dev_proxy.result("eth_getBlockByNumber", ["latest", False]))["number"] == hex(top - 2)
    assert await dev_proxy.result("eth_getBlockByHash", [gone, False]) is None
    assert await dev_proxy.result("eth_getBlockReceipts", [gone]) is None
    assert anvil.rpc("eth_getBlockByHash", gone, False) is None  # as the node answers
