"""Every answer is tied to the block it belongs to, on the node that produced it: a lagging backup's
partial answer is never stored, `latest` never goes backwards for it, and unfinalized reads are
pinned to the block hash their key holds."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.http.app_keys import SERVICE
from tests.fault_relay import FaultRelay
from tests.support import Anvil, Proxy, ProxyFactory, eventually, fake_server, selector, word

FORK_AT = 120


@pytest.fixture(scope="module")
def chain_with_logs() -> Iterator[tuple[Anvil, str]]:
    """A node with one log in each of blocks 110-130, all final (latest 200)."""
    node = Anvil()
    address = node.deploy_store()
    node.mine(109 - node.block_number())
    for _ in range(110, 131):
        node.send(address, selector("emitMany(uint256)") + word(1))
    node.mine(200 - node.block_number())
    yield node, address
    node.stop()


@pytest.fixture
async def lagging(chain_with_logs: tuple[Anvil, str]) -> AsyncIterator[tuple[Anvil, Anvil, FaultRelay, str]]:
    """The node behind a fault relay as primary, and a fork of it at block 120 as a backup."""
    node, address = chain_with_logs
    backup = Anvil("--fork-url", node.url, "--fork-block-number", str(FORK_AT))
    relay = await FaultRelay(node.url).start()
    yield node, backup, relay, address
    await relay.close()
    backup.stop()


def logs_request(address: str) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "eth_getLogs",
        "params": [{"address": address, "fromBlock": hex(110), "toBlock": hex(130)}],
    }


async def backup_head_known(proxy: Proxy) -> None:
    states = proxy.app[SERVICE].networks["evm"].per_upstream
    assert states is not None

    async def known() -> bool:
        return states.states.latest[1] == FORK_AT and states.states.verified[1]

    await eventually(known, 10, "the backup's own head to be known")


async def behind_relay_and_backup(
    make_proxy: ProxyFactory, relay: FaultRelay, backup: Anvil, **overrides: str
) -> Proxy:
    """A proxy over the relayed primary and the lagging backup, once it knows both heads."""
    proxy = await make_proxy(EVM_UPSTREAM=f"{relay.url},{backup.url}", **overrides)
    await proxy.head_at(200)
    await backup_head_known(proxy)
    return proxy


async def test_a_lagging_backups_partial_logs_are_never_stored(
    lagging: tuple[Anvil, Anvil, FaultRelay, str], make_proxy: ProxyFactory
) -> None:
    _node, backup, relay, address = lagging
    proxy = await behind_relay_and_backup(make_proxy, relay, backup)
    relay.inject("http500", method="eth_getLogs")  # one failure: the backup answers first
    _, body, _ = await proxy.post(logs_request(address))
    assert len(body["result"]) == 21  # the backup's 11 were replaced by the primary's answer
    _, body, headers = await proxy.post(logs_request(address))
    assert len(body["result"]) == 21 and headers["X-Cache"] == "HIT"


async def test_a_lagging_backups_answer_is_refused_when_no_upstream_has_the_blocks(
    lagging: tuple[Anvil, Anvil, FaultRelay, str],
    make_proxy: ProxyFactory,
) -> None:
    _node, backup, relay, address = lagging
    proxy = await behind_relay_and_backup(make_proxy, relay, backup)
    relay.inject("http500", method="eth_getLogs", times=2)  # the primary fails the call and its retry
    status, body, _ = await proxy.post(logs_request(address))
    assert status == 502 and body["error"]["code"] == -32002 and "block 130" in body["error"]["message"]
    assert proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason="lagging") == 1
    _, body, headers = await proxy.post(logs_request(address))
    assert len(body["result"]) == 21 and headers["X-Cache"] == "MISS"  # nothing partial was stored


async def test_a_chunk_past_a_lagging_backups_head_is_never_stored_from_it(
    lagging: tuple[Anvil, Anvil, FaultRelay, str],
    make_proxy: ProxyFactory,
) -> None:
    _node, backup, relay, address = lagging
    # Chunks of 10 blocks: 110-119 (the backup has them), 120-129 and 130 (past its head at 120).
    proxy = await make_proxy(EVM_UPSTREAM=f"{relay.url},{backup.url}", GETLOGS_CHUNK_BLOCKS="10")
    await proxy.head_at(200)
    await backup_head_known(proxy)
    relay.inject("http500", method="eth_getLogs", times=2)  # two chunks fail over to the backup
    _, body, headers = await proxy.post(logs_request(address))
    assert len(body["result"]) == 21 and headers["X-Cache"] == "MISS"
    _, body, headers = await proxy.post(logs_request(address))
    assert len(body["result"]) == 21 and headers["X-Cache"] == "HIT"  # no chunk held the backup's part


async def test_latest_never_goes_backwards_when_a_lagging_backup_answers(
    lagging: tuple[Anvil, Anvil, FaultRelay, str], caplog: pytest.LogCaptureFixture, make_proxy: ProxyFactory
) -> None:
    _node, backup, relay, _address = lagging
    proxy = await make_proxy(EVM_UPSTREAM=f"{relay.url},{backup.url}", HEAD_STALE_AFTER="30")
    await proxy.head_at(200)
    assert (await proxy.result("eth_blockNumber", [])) == hex(200)
    relay.inject("http500", times=None)  # the primary is down: only the backup (at 120) answers
    tracker = proxy.app[SERVICE].networks["evm"].tracker

    async def backup_answered() -> bool:  # logged once: repeated poll failures are throttled
        return "upstream #1 is behind the network head (120 < 200)" in caplog.text

    await eventually(backup_answered, 10, "the tracker to reach the backup")
    polls = len(proxy.upstreams["evm"].batches)

    async def polled_again() -> bool:  # three more polls, each answered by the backup alone
        return len(proxy.upstreams["evm"].batches) >= polls + 3

    await eventually(polled_again, 10, "the tracker to poll the backup again")
    assert tracker.head is not None and tracker.head.latest == 200
    assert (await proxy.result("eth_blockNumber", [])) == hex(200)  # the backup says 120


async def test_unfinalized_reads_are_pinned_to_the_hash_their_key_holds(anvil: Anvil, evm_proxy: Proxy) -> None:
    address = anvil.deploy_store()
    receipt = anvil.send(address, selector("emitMany(uint256)") + word(2))
    anvil.mine(2)
    await evm_proxy.head_at(anvil.block_number())
    number, block_hash = receipt["blockNumber"], receipt["blockHash"]
    for method, params in (
        ("eth_getStorageAt", [address, "0x0", number]),
        ("eth_call", [{"from": address, "to": address, "data": selector("x()")}, number]),
        # Logs first: once the block's receipts are held, its logs are answered from them.
        ("eth_getLogs", [{"address": address, "fromBlock": number, "toBlock": number}]),
        ("eth_getBlockReceipts", [number]),
    ):
        assert (await evm_proxy.call(method, params)).get("result") is not None
    sent = {method: params for method, params in evm_proxy.upstreams["evm"].params}
    assert sent["eth_getStorageAt"][2] == {"blockHash": block_hash}
    assert sent["eth_call"][1] == {"blockHash": block_hash}
    assert sent["eth_getBlockReceipts"] == [block_hash]
    assert sent["eth_getLogs"] == [{"address": [address], "blockHash": block_hash}]


async def test_an_unfinalized_log_range_is_kept_only_if_its_last_block_is_the_pinned_one(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    address = anvil.deploy_store()
    first = anvil.send(address, selector("emitMany(uint256)") + word(1))
    anvil.mine(2)
    top = anvil.block_number()
    await evm_proxy.head_at(top)
    request = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "eth_getLogs",
        "params": [{"address": address, "fromBlock": first["blockNumber"], "toBlock": hex(top)}],
    }
    _, body, headers = await evm_proxy.post(request)
    assert len(body["result"]) == 1 and headers["X-Cache"] == "MISS"
    batches = [calls for calls in evm_proxy.upstreams["evm"].params if calls[0] == "eth_getBlockByNumber"]
    assert ["eth_getBlockByNumber", [hex(top), False]] in [list(b) for b in batches]
    assert (await evm_proxy.post(request))[2]["X-Cache"] == "HIT"


async def test_data_from_one_fork_is_never_stored_under_another_forks_hash(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """One URL in front of two nodes on different forks: the tracker's polls reach one, data calls
    the other. Calls go out pinned to the tracker's hash, so the other fork's data is never kept."""
    address = anvil.deploy_store()
    other = Anvil("--fork-url", anvil.url, "--fork-block-number", str(anvil.block_number()))
    tracker_methods = {"eth_getBlockByNumber", "eth_blockNumber", "eth_chainId"}
    session = aiohttp.ClientSession()

    async def route(request: web.Request) -> web.Response:
        body = await request.read()
        calls = json.loads(body)
        first = calls[0] if isinstance(calls, list) else calls
        target = other.url if first.get("method") in tracker_methods else anvil.url
        async with session.post(target, data=body, headers={"Content-Type": "application/json"}) as resp:
            return web.Response(body=await resp.read(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/", route)
    balancer = await fake_server(app)
    proxy = await make_proxy(EVM_UPSTREAM=f"http://127.0.0.1:{balancer.port}/")
    try:
        anvil.send(address, selector("setX(uint256)") + word(1))  # this fork's block N+1
        other.send(address, selector("setX(uint256)") + word(2))  # the tracker's fork's block N+1
        top = other.block_number()
        await proxy.head_at(top)
        request = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [address, "0x0", hex(top)]}
        for _ in range(3):
            _, body, headers = await proxy.post(request)
            assert body.get("result") != "0x" + word(1)  # never the other fork's value under this key
            assert headers["X-Cache"] != "HIT"
        sent = [params[2] for method, params in proxy.upstreams["evm"].params if method == "eth_getStorageAt"]
        head = proxy.app[SERVICE].networks["evm"].tracker.head
        assert head is not None and {"blockHash": head.hashes[top]} in sent
    finally:
        await balancer.close()
        await session.close()
        other.stop()


async def test_a_stale_head_still_refuses_a_backups_answer_for_a_block_it_lacks(
    lagging: tuple[Anvil, Anvil, FaultRelay, str],
    make_proxy: ProxyFactory,
) -> None:
    # Found by an outside tester: with the primary down and the head stale, an explicit unfinalized
    # block number went to the lagging backup, and its null was served as the block.
    _node, backup, relay, _address = lagging
    proxy = await behind_relay_and_backup(make_proxy, relay, backup, HEAD_POLL_INTERVAL="0.2", HEAD_STALE_AFTER="1")
    relay.inject("http500", times=None)  # the primary is down: head polls fail, the head goes stale
    tracker = proxy.app[SERVICE].networks["evm"].tracker

    async def stale() -> bool:
        return tracker.head is not None and tracker.head.stale

    await eventually(stale, 10, "the head to go stale")
    status, body, _ = await proxy.post(
        {"jsonrpc": "2.0", "id": 1, "method": "eth_getBlockByNumber", "params": [hex(150), False]}
    )
    assert status == 502 and body["error"]["code"] == -32002, body


async def test_a_backups_not_mined_is_never_kept_for_a_transaction_in_a_block_it_lacks(
    lagging: tuple[Anvil, Anvil, FaultRelay, str],
    make_proxy: ProxyFactory,
) -> None:
    node, backup, relay, _address = lagging
    tx = node.rpc("eth_getBlockByNumber", hex(125), False)["transactions"][0]
    proxy = await behind_relay_and_backup(make_proxy, relay, backup)
    relay.inject("http500", method="eth_getTransactionReceipt", times=2)  # the primary fails call and retry
    request = {"jsonrpc": "2.0", "id": 1, "method": "eth_getTransactionReceipt", "params": [tx]}
    _, body, headers = await proxy.post(request)  # the backup's null: served at most, never kept
    assert body.get("result") is None and headers.get("X-Cache") != "MISS"
    assert proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason="behind_head") == 1
    _, body, headers = await proxy.post(request)
    assert body["result"] == node.rpc("eth_getTransactionReceipt", tx) and headers["X-Cache"] == "MISS"


async def test_a_backup_ahead_on_another_fork_is_never_asked_for_blocks_the_heads_node_lacks(
    make_proxy: ProxyFactory,
) -> None:
    """Rule: the proxy shows one chain, the one its head follows. A backup ahead of the primary on
    another fork (parted above finality) is not followed, and a block past the primary's head is not
    asked of it either: its block, balance or receipts at that height are another chain's, and
    `latest` (read-your-writes' floor) would rise to a block the head's chain does not have."""
    primary = Anvil()
    primary.mine(150)
    backup = Anvil("--fork-url", primary.url, "--fork-block-number", "150")
    try:
        top = primary.mine(3)
        backup.mine(20)
        proxy = await make_proxy(EVM_UPSTREAM=f"{primary.url},{backup.url}")
        await proxy.head_at(top)
        states = proxy.app[SERVICE].networks["evm"].per_upstream.states

        async def parted() -> bool:
            return states.parted[1] is not None and states.parted[1] <= top

        await eventually(parted, 10, "a poll to find the backup on another fork")
        past = hex(top + 7)
        for method, params in (
            ("eth_getBlockByNumber", [past, False]),
            ("eth_getBalance", ["0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266", past]),
            ("eth_getBlockReceipts", [past]),
        ):
            _, body, headers = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
            assert body.get("result") is None and headers["X-Cache"] != "HIT", (method, body)
        assert (await proxy.call("eth_blockNumber", []))["result"] == hex(top)
        latest = (await proxy.call("eth_getBlockByNumber", ["latest", False]))["result"]
        assert latest["hash"] == primary.rpc("eth_getBlockByNumber", hex(top), False)["hash"]
    finally:
        backup.stop()
        primary.stop()


async def test_a_reorg_of_the_heads_own_node_is_no_fork_its_reads_are_still_answered(
    make_proxy: ProxyFactory,
) -> None:
    """Rule: the upstream the head came from is never taken for one on another fork: a stalled
    primary beside a backup ahead that the head followed, then a reorg of the backup's last blocks,
    left every `latest` read refused (-32002) while the backup was marked parted (an outside attack
    on the rule above), and the head follows the reorg."""
    ahead = Anvil()
    ahead.mine(80)
    stalled = Anvil("--fork-url", ahead.url, "--fork-block-number", "80")
    try:
        top = ahead.mine(10)  # the stalled node holds block 80: the head follows the node ahead
        proxy = await make_proxy(EVM_UPSTREAM=f"{stalled.url},{ahead.url}")
        await proxy.head_at(top)
        ahead.rpc("anvil_reorg", 2, [])  # the head's block replaced on its own node
        ahead.mine(1)

        async def answered() -> bool:
            _, body, _ = await proxy.post(
                {"jsonrpc": "2.0", "id": 1, "method": "eth_getBlockByNumber", "params": ["latest", False]}
            )
            latest = body.get("result")
            return isinstance(latest, dict) and latest == ahead.rpc("eth_getBlockByNumber", latest["number"], False)

        await eventually(answered, 10, "`latest` answered from the reorged node's chain")
        states = proxy.app[SERVICE].networks["evm"].per_upstream.states
        assert states.parted[1] is None
        # And the head follows the reorg: the node ahead holds the stalled primary's latest block, which
        # the head's chain holds too (no upstream holds the replaced head: it stayed stale for good).
        tracker = proxy.app[SERVICE].networks["evm"].tracker

        async def followed() -> bool:
            head, tip = tracker.head, ahead.rpc("eth_getBlockByNumber", "latest", False)
            return head is not None and not head.stale and head.latest_hash == tip["hash"]

        await eventually(followed, 10, "the head to follow the reorged chain")
    finally:
        stalled.stop()
        ahead.stop()


async def test_a_same_height_reorg_of_the_heads_node_is_followed_while_it_cools_down(
    make_proxy: ProxyFactory,
) -> None:
    """Rule: a poll that reaches a backup behind (here on a fork of its own) asks the node ahead; when
    that node is the head's own and no longer holds the head, it reorged, and its chain is taken as a
    poll it answered directly would be. Before, while it cooled down (a rate limit's Retry-After),
    polls reached only the backup, the reorg was never taken, and every `latest` read was refused
    (-32002) until the cooldown ended (an outside attack: up to 26 s)."""
    node = Anvil()
    node.mine(5)
    backup = Anvil("--fork-url", node.url, "--fork-block-number", "5")
    relay = None
    try:
        backup.send("0x" + "bb" * 20, "0x")  # its latest block is its own: none the head's window holds
        top = node.mine(5)
        relay = await FaultRelay(node.url).start()
        proxy = await make_proxy(EVM_UPSTREAM=f"{relay.url},{backup.url}", HEAD_POLL_INTERVAL="0.5")
        await proxy.head_at(top)
        relay.inject("http429", method="eth_getBalance", retry_after="600")  # the node cools down 10 min
        assert "result" in await proxy.call("eth_getBalance", ["0x" + "aa" * 20, "latest"])
        node.rpc("anvil_reorg", 3, [])  # the head's block replaced, at the same height
        tracker = proxy.app[SERVICE].networks["evm"].tracker

        async def followed() -> bool:
            head, tip = tracker.head, node.rpc("eth_getBlockByNumber", "latest", False)
            return head is not None and not head.stale and head.latest_hash == tip["hash"]

        await eventually(followed, 20, "the head to follow its node's reorg")
        body = await proxy.call("eth_getBlockByNumber", ["latest", False])
        assert body["result"]["hash"] == node.rpc("eth_getBlockByNumber", "latest", False)["hash"], body
    finally:
        if relay is not None:
            await relay.close()
        backup.stop()
        node.stop()
