"""Replicas sharing one Redis whose nodes are on diverged forks of one chain (same genesis, each
finalizing its own blocks at the same heights): every answer a replica gives is its own node's, by
number, by hash, final or not; the replica whose chain is not the shared space's says so (a log line,
rpc_proxy_fork_disagreements_total, /readyz) and uses a key space of its own (forks.py)."""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from proxy.cache import policy as cp
from proxy.cache import sharing
from proxy.cache.redis_format import Entry, decode_value, encode_value
from proxy.chain.forks import (
    TRAIL_MARKS,
    TRAIL_TTL_MS,
    ForkGuard,
    Mark,
    MemoryTrails,
    RedisTrails,
    Trail,
    TrailStore,
    trail_key,
)
from proxy.chain.head_polls import Head
from proxy.http.app_keys import SERVICE
from proxy.metrics import Metrics
from proxy.redis_link import RedisLink, connect
from proxy.values import Decision, Mode, Plan
from tests.redis_relay import TrailStallingRelay
from tests.support import DEV_ACCOUNT, Anvil, Proxy, RedisServer, eventually, selector, settings_for, start_proxy, word

FORK_AT = 30
MINED = 120  # blocks each fork mines past the fork point: Anvil finalizes latest - 64


def _guard() -> tuple[ForkGuard, MemoryTrails]:
    trails = MemoryTrails()
    return ForkGuard("evm", trails, Metrics(CollectorRegistry())), trails


async def _never(_height: int) -> str:
    raise AssertionError("no node asked")


class TestForkGuard:
    async def test_a_space_is_named_only_once_its_trail_is_found_on_the_replicas_chain(self) -> None:
        guard, _ = _guard()
        assert guard.space("evm@1:aa") is None
        await guard.check("evm@1:aa", (10, "0x10"), {}, _never)
        assert guard.space("evm@1:aa") == "evm@1:aa"

    async def test_replicas_on_one_chain_share_the_space(self) -> None:
        first, trails = _guard()
        second = ForkGuard("evm", trails, Metrics(CollectorRegistry()))
        await first.check("s", (10, "0x10"), {11: "0x11"}, _never)
        await second.check("s", (9, "0x09"), {10: "0x10", 11: "0x11"}, _never)  # behind: finds 10 in its window
        await first.check("s", (11, "0x11"), {}, _never)  # ahead: adds its mark on top of its own
        assert (first.space("s"), second.space("s")) == ("s", "s")
        assert first.note is None and second.note is None

    async def test_a_replica_on_another_fork_uses_a_space_of_its_own_and_says_why(self) -> None:
        first, trails = _guard()
        second = ForkGuard("evm", trails, Metrics(CollectorRegistry()))
        await first.check("s", (10, "0x" + "b" * 64), {}, _never)

        async def own(height: int) -> str:
            return {5: "0x05"}[height]

        await second.check("s", (10, "0x" + "c" * 64), {}, own)
        assert first.space("s") == "s"
        assert second.space("s") == "s/" + "c" * 16
        assert second.note is not None and "own key space" in second.note

    async def test_a_mark_it_cannot_check_for_a_few_polls_moves_it_to_its_own_space(self) -> None:
        first, trails = _guard()
        second = ForkGuard("evm", trails, Metrics(CollectorRegistry()))
        await first.check("s", (500, "0x500"), {}, _never)

        for poll in range(3):  # the mark is above this node's head
            assert second.space("s") is None
            await second.check("s", (10 + poll, f"0x{10 + poll}"), {}, _never)
        assert second.space("s") == "s/12"


class StallingTrails(MemoryTrails):
    """Trails Redis would give (shared by replicas), but for the polls during which it does not answer."""

    shared = True

    def __init__(self) -> None:
        super().__init__()
        self.stalled = False

    async def mark(self, space: str, expected: str | None, new: Mark, floor: int) -> Trail | None:
        return None if self.stalled else await super().mark(space, expected, new, floor)


class TestForkGuardWithoutTrail:
    """A poll that cannot read the trail keeps the standing only up to the finalized block a check found on
    the trail's chain; past it, until a check passes, the head names a space of this process's own."""

    async def test_replicas_parting_while_their_trail_cannot_be_read_share_no_final_entries(self) -> None:
        trails = StallingTrails()
        first, second = (ForkGuard("evm", trails, Metrics(CollectorRegistry())) for _ in range(2))
        await first.check("s", (10, "0x" + "a" * 64), {}, _never)
        await second.check("s", (10, "0x" + "a" * 64), {}, _never)
        assert first.space("s") == second.space("s") == "s"
        trails.stalled = True  # Redis stalls as their chains part above block 10
        await first.check("s", (10, "0x" + "a" * 64), {}, _never)  # nothing final past the checked block
        assert first.space("s") == "s" and first.note is None
        for guard, parted in ((first, "0x" + "b" * 64), (second, "0x" + "c" * 64)):
            await guard.check("s", (15, "0x" + "9" * 64), {}, _never)  # aside at one block of both chains
            await guard.check("s", (20, parted), {}, _never)
        spaces = {first.space("s"), second.space("s")}
        assert len(spaces) == 2 and "s" not in spaces, spaces
        assert all(space is not None and space.startswith("s/") for space in spaces), spaces
        assert second.note is not None and "cannot read the shared cache's trail past block 10" in second.note
        await second.check("s", (21, "0x" + "d" * 64), {}, _never)  # still stalled: the same space of its own
        assert second.space("s") in spaces

        trails.stalled = False  # the first poll that reads the trail decides

        async def seconds_chain(height: int) -> str:
            return {10: "0x" + "a" * 64}[height]

        await first.check("s", (22, "0x" + "e" * 64), {}, _never)
        await second.check("s", (22, "0x" + "f" * 64), {}, seconds_chain)
        assert first.space("s") == "s" and first.note is None
        assert second.space("s") == "s/" + "f" * 16
        assert second.note is not None and "on another chain than the shared cache" in second.note

    async def test_a_space_just_made_is_named_aside_until_its_first_check_marks_the_trail(self) -> None:
        trails = StallingTrails()
        maker, taker = (ForkGuard("evm", trails, Metrics(CollectorRegistry())) for _ in range(2))
        maker.fresh("s~2")  # a new epoch (a dev node's state changed through it)
        made = maker.space("s~2")
        assert made is not None and made.startswith("s~2/") and maker.note is None
        trails.stalled = True  # its first check cannot read the trail
        await maker.check("s~2", (40, "0x" + "a" * 64), {}, _never)
        assert maker.space("s~2") == made
        trails.stalled = False  # another replica takes the epoch and starts the trail with its own chain
        await taker.check("s~2", (40, "0x" + "b" * 64), {}, _never)
        assert taker.space("s~2") == "s~2"  # the shared space: none of the maker's entries are in it

        async def makers_chain(height: int) -> str:
            raise AssertionError(f"block {height} is in the window")

        await maker.check("s~2", (41, "0x" + "c" * 64), {40: "0x" + "a" * 64}, makers_chain)
        assert maker.space("s~2") == "s~2/" + "c" * 16  # the trail is the other chain's: a fork space

    async def test_a_space_just_made_without_redis_is_named_at_once(self) -> None:
        guard, _ = _guard()  # no other replica reads it
        guard.fresh("s~2")
        assert guard.space("s~2") == "s~2"

    async def test_a_replica_that_never_read_its_trail_names_no_shared_space(self) -> None:
        trails = StallingTrails()
        trails.stalled = True
        guard = ForkGuard("evm", trails, Metrics(CollectorRegistry()))
        await guard.check("s", (10, "0x10" + "0" * 62), {}, _never)
        space = guard.space("s")
        assert space is not None and space.startswith("s/") and space != "s"
        assert guard.note == "cannot read the shared cache's trail: uses its own key space until it can"


@pytest.fixture(params=["memory", "redis"])
async def trails(request: pytest.FixtureRequest) -> Any:
    if request.param == "memory":
        yield MemoryTrails()
        return
    url = request.getfixturevalue("redis_url")
    link = RedisLink(connect(url, 1.0), timeout=1.0, metrics=Metrics(CollectorRegistry()))
    yield RedisTrails(link)
    await link.close()


class TestTrails:
    async def test_a_mark_is_added_only_on_top_of_the_mark_its_replica_found(self, trails: TrailStore) -> None:
        assert await trails.mark("s", None, (5, "0x05"), 5) == Trail(None, None)  # only read: nothing added
        assert await trails.mark("s", "", (5, "0x05"), 5) == Trail((5, "0x05"), (5, "0x05"))
        assert await trails.mark("s", "0xother", (6, "0x06"), 6) == Trail((5, "0x05"), None)  # another top
        assert await trails.mark("s", "0x05", (4, "0x04"), 4) == Trail((5, "0x05"), (5, "0x05"))  # never lower
        assert await trails.mark("s", "0x05", (9, "0x09"), 6) == Trail((9, "0x09"), (9, "0x09"))
        assert await trails.mark("s", None, (0, ""), 0) == Trail((9, "0x09"), (5, "0x05"))  # the lowest at or above
        assert await trails.mark("other", None, (0, ""), 0) == Trail(None, None)  # one trail per key space

    async def test_a_trail_key_of_another_type_is_no_trail_and_made_anew(self, redis_url: str) -> None:
        # Outside attack: a string at a trail's key failed every exchange (WRONGTYPE): the replicas
        # named their own spaces, sharing nothing, until an operator deleted it by hand.
        link = RedisLink(connect(redis_url, 1.0), timeout=1.0, metrics=Metrics(CollectorRegistry()))
        try:
            await link.client.set(trail_key("s"), "garbage")
            trails = RedisTrails(link)
            assert await trails.mark("s", "", (5, "0x05"), 5) == Trail((5, "0x05"), (5, "0x05"))
            assert link.up
        finally:
            await link.close()

    async def test_a_trail_keeps_its_last_marks_only(self, trails: TrailStore) -> None:
        top = ""
        for height in range(1, TRAIL_MARKS + 11):
            await trails.mark("s", top, (height, f"0x{height:x}"), height)
            top = f"0x{height:x}"
        assert await trails.mark("s", None, (0, ""), 0) == Trail((TRAIL_MARKS + 10, top), (11, "0xb"))


async def test_a_trail_in_redis_expires_once_no_replica_exchanges_with_it(redis_url: str) -> None:
    link = RedisLink(connect(redis_url, 1.0), timeout=1.0, metrics=Metrics(CollectorRegistry()))
    try:
        await RedisTrails(link).mark("dead", "", (5, "0x05"), 5)  # a space whose epoch then moved on
        ttl = await link.client.pttl(trail_key("dead"))
        assert 0 < ttl <= TRAIL_TTL_MS  # dead epochs' trails cannot pile up
    finally:
        await link.close()


def _plan(finalized: int, *, unvouched: str | None = None, tied: bool = False) -> Plan:
    head = Head(finalized + 10, finalized + 5, finalized, "0xtop", 0, 0)
    decision = Decision(Mode.TTL, 12.0, tied_to_answer=True) if tied else cp.IMMUTABLE
    nothing: Any = None
    return Plan(head, decision, "k", "m", [], False, None, None, True, 1, nothing, unvouched_hash=unvouched)


class TestSharing:
    def test_an_answer_for_a_hash_outside_the_window_is_tagged_with_the_writers_finalized_height(self) -> None:
        block = {"number": hex(40), "hash": "0xh"}
        assert sharing.share(_plan(50, unvouched="0xh"), "ok", block) == sharing.Share(True, 50)
        assert sharing.share(_plan(30, unvouched="0xh"), "ok", block) == sharing.Share(True, None)  # not final there
        assert sharing.share(_plan(50, unvouched="0xh"), "ok", "0x01") == sharing.Share(True, None)  # no block named

    def test_a_null_for_a_hash_outside_the_window_stays_in_the_writers_memory(self) -> None:
        assert sharing.share(_plan(50, unvouched="0xh"), "null", None) == sharing.Share(False, None)

    def test_a_transaction_goes_to_redis_only_once_its_block_is_final_for_the_writer(self) -> None:
        tx = {"blockNumber": hex(40), "blockHash": "0xh"}
        assert sharing.share(_plan(50, tied=True), "ok", tx).shared
        assert not sharing.share(_plan(30, tied=True), "ok", tx).shared

    def test_a_replica_takes_a_hash_outside_its_window_only_from_a_writer_final_below_its_own(self) -> None:
        vet = sharing.vet(_plan(50, unvouched="0xh"))
        assert vet is not None and vet(50) and vet(12)
        assert not vet(51) and not vet(None)
        assert sharing.vet(_plan(50)) is None  # numbered, or a hash of its own window

    def test_a_tagged_value_decodes_as_an_untagged_one(self) -> None:
        assert decode_value(encode_value((b'{"a":1}', False), 77)) == Entry((b'{"a":1}', False), 77)
        revert = b'{"code":3,"message":"execution reverted"}'
        assert decode_value(encode_value((revert, True))) == Entry((revert, True), None)


# --- real nodes: two forks of one chain behind two replicas sharing Redis ------------------------


def _diverge(node: Anvil, store: str, value: int) -> None:
    node.send(store, selector("setX(uint256)") + word(value))  # the first block of its own differs
    for i in range(3):
        node.send(store, selector("emitMany(uint256)") + word(i + value % 2))
    node.mine(MINED)


def _hashes(node: Anvil, first: int) -> tuple[list[str], list[str]]:
    blocks, transactions = [], []
    for n in range(first, node.block_number() + 1):
        block = node.rpc("eth_getBlockByNumber", hex(n), False)
        blocks.append(block["hash"])
        transactions.extend(block["transactions"])
    return blocks, transactions


def _calls(rng: random.Random, store: str, top: int, blocks: list[str], txs: list[str]) -> list[tuple[str, list[Any]]]:
    """First-class reads at numbers (final and not) and by hashes of both forks' blocks and transactions."""
    calls: list[tuple[str, list[Any]]] = []
    for _ in range(60):
        n = hex(rng.randint(0, top))
        calls += [
            rng.choice(
                [
                    ("eth_getBlockByNumber", [n, rng.random() < 0.5]),
                    ("eth_getBlockByHash", [rng.choice(blocks), False]),
                    ("eth_getTransactionByHash", [rng.choice(txs)]),
                    ("eth_getTransactionReceipt", [rng.choice(txs)]),
                    ("eth_getBlockReceipts", [n]),
                    ("eth_getStorageAt", [store, "0x0", n]),
                    ("eth_call", [{"from": DEV_ACCOUNT, "to": store, "data": selector("x()")}, n]),
                    (
                        "eth_getLogs",
                        [{"address": store, "fromBlock": hex(FORK_AT), "toBlock": hex(rng.randint(FORK_AT, top))}],
                    ),
                    ("eth_getBlockTransactionCountByNumber", [n]),
                    ("eth_getBalance", [DEV_ACCOUNT, n]),
                ]
            )
        ]
    return calls


async def _direct(session: aiohttp.ClientSession, url: str, method: str, params: Any) -> dict[str, Any]:
    async with session.post(url, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params}) as resp:
        return dict(await resp.json())


async def _compare(proxy: Proxy, node: Anvil, method: str, params: Any, tally: Counter[str], wrong: list[str]) -> None:
    _, reply, headers = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    truth = await _direct(proxy.session, node.url, method, params)
    error = reply.get("error")
    if error is not None and error.get("code") == -32002:
        tally["unavailable"] += 1
        return
    tally[headers.get("X-Cache", "none")] += 1
    same = (error is None and "result" in truth and reply.get("result") == truth["result"]) or (
        error is not None and "error" in truth and error.get("code") == truth["error"].get("code")
    )
    if not same:
        wrong.append(json.dumps({"method": method, "params": params, "cache": headers.get("X-Cache")})[:400])


@pytest.fixture
async def forks(redis_url: str) -> Any:
    """Two forks of one chain (not parted yet) behind two replicas, each reaching Redis through a relay
    that can keep it from reading the trail."""
    origin = Anvil()
    store = origin.deploy_store()
    origin.mine(FORK_AT - origin.block_number())
    nodes = [Anvil("--fork-url", origin.url, "--fork-block-number", str(FORK_AT)) for _ in range(2)]
    relays = [await TrailStallingRelay(redis_url).start() for _ in nodes]
    # Redis given time to answer on a busy machine: a stall these tests do not make is not theirs to see.
    settings = [
        settings_for(EVM_UPSTREAM=n.url, REDIS_URL=r.url, REDIS_TIMEOUT="2", ALLOW_NAMESPACES="anvil")
        for n, r in zip(nodes, relays, strict=True)
    ]
    proxies = [await start_proxy(s) for s in settings]
    try:
        for proxy in proxies:
            await proxy.head_at(FORK_AT)  # both replicas in one epoch before their chains part
        yield origin, store, nodes, proxies, relays
    finally:
        for proxy in proxies:
            await proxy.close()
        for relay in relays:
            await relay.close()
        for node in (*nodes, origin):
            node.stop()


async def _part(store: str, nodes: list[Anvil], proxies: list[Proxy]) -> int:
    """Each node finalizes its own blocks past the fork; once one replica has found its chain is not
    the trail's, its index (the other keeps the shared space)."""
    for value, node in zip((111, 222), nodes, strict=True):
        _diverge(node, store, value)
    for proxy, node in zip(proxies, nodes, strict=True):
        await proxy.head_at(node.block_number(), timeout=20)

    async def parted() -> bool:
        return sum(p.metric("rpc_proxy_fork_disagreements_total", network="evm") for p in proxies) >= 1

    await eventually(parted, 10, "one replica on the other fork than the trail's")
    return 1 if proxies[1].metric("rpc_proxy_fork_disagreements_total", network="evm") else 0


async def _read_final_blocks(proxy: Proxy, node: Anvil, tally: Counter[str], wrong: list[str]) -> None:
    """Blocks final on both forks past the fork point (each fork's own), read by number through `proxy`."""
    for height in range(FORK_AT + 1, FORK_AT + 41):
        await _compare(proxy, node, "eth_getBlockByNumber", [hex(height), False], tally, wrong)


async def _compare_both(
    proxies: list[Proxy], nodes: list[Anvil], store: str, seed: int, tally: Counter[str], wrong: list[str]
) -> None:
    """Reads over both forks' numbers and hashes, each asked twice of each replica in a random order:
    the other replica's answer is in the shared cache by the second time, were it shared."""
    found = [_hashes(node, FORK_AT - 2) for node in nodes]
    blocks = found[0][0] + found[1][0]
    txs = found[0][1] + found[1][1]
    top = max(node.block_number() for node in nodes)
    rng = random.Random(seed)
    for method, params in _calls(rng, store, top, blocks, txs):
        order = [0, 1] if rng.random() < 0.5 else [1, 0]
        for _ in range(2):
            for i in order:
                await _compare(proxies[i], nodes[i], method, params, tally, wrong)


async def test_replicas_on_diverged_forks_serve_only_their_own_nodes_answers(
    forks: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="proxy.chain")
    _origin, store, nodes, proxies, _relays = forks
    for value, node in zip((111, 222), nodes, strict=True):
        _diverge(node, store, value)
    for proxy, node in zip(proxies, nodes, strict=True):
        await proxy.head_at(node.block_number(), timeout=20)
    tally: Counter[str] = Counter()
    wrong: list[str] = []
    await _compare_both(proxies, nodes, store, 7, tally, wrong)
    assert wrong == [], "\n".join(wrong[:10])
    assert tally["HIT"] > 0 and tally["MISS"] > 0, dict(tally)
    disagreements = [p.metric("rpc_proxy_fork_disagreements_total", network="evm") for p in proxies]
    assert sum(disagreements) >= 1, disagreements
    assert any("uses its own key space" in r.getMessage() for r in caplog.records)
    forked = proxies[disagreements.index(max(disagreements))]
    async with forked.session.get(f"{forked.base}/readyz") as resp:
        ready = await resp.json()
    assert resp.status == 200 and "own key space" in ready["forks"]["evm"], ready
    assert all(p.metric("rpc_proxy_finality_violations_total", network="evm") == 0 for p in proxies)


async def test_replicas_whose_chains_part_while_redis_keeps_their_trail_unread_share_no_final_answers(
    forks: Any,
) -> None:
    _origin, store, nodes, proxies, relays = forks
    for relay in relays:
        relay.stalled = True  # Redis answers everything but the trail reads, for both replicas
    for value, node in zip((111, 222), nodes, strict=True):
        _diverge(node, store, value)  # each finalizes its own blocks past the fork
    for proxy, node in zip(proxies, nodes, strict=True):
        await proxy.head_at(node.block_number(), timeout=20)
    for proxy in proxies:

        async def aside(proxy: Proxy = proxy) -> bool:
            async with proxy.session.get(f"{proxy.base}/readyz") as resp:
                note = (await resp.json()).get("forks", {}).get("evm", "")
            return resp.status == 200 and "cannot read the shared cache's trail" in note

        await eventually(aside, 10, "a replica that cannot read its trail past its checked block says so")
    tally: Counter[str] = Counter()
    wrong: list[str] = []
    await _compare_both(proxies, nodes, store, 11, tally, wrong)
    assert all(relay.cut > 0 for relay in relays), [relay.cut for relay in relays]
    for relay in relays:
        relay.stalled = False  # the trail is read again: the fork is found, and still nothing is shared

    async def found() -> bool:
        return sum(p.metric("rpc_proxy_fork_disagreements_total", network="evm") for p in proxies) >= 1

    await eventually(found, 10, "a replica on the other fork than the trail's, once it reads the trail")
    await _compare_both(proxies, nodes, store, 12, tally, wrong)
    assert wrong == [], "\n".join(wrong[:10])
    assert tally["HIT"] > 0 and tally["MISS"] > 0, dict(tally)


async def test_a_new_epoch_made_while_redis_holds_the_trail_read_shares_nothing_with_a_replica_that_takes_it(
    forks: Any,
) -> None:
    _origin, store, nodes, proxies, relays = forks
    taker = await _part(store, nodes, proxies)
    maker = 1 - taker
    trackers = [p.app[SERVICE].networks["evm"].tracker for p in proxies]
    relays[maker].hanging = True  # Redis holds its trail reads unanswered
    # A state change through it: a new epoch, a space it just made, its finalized blocks read at once.
    await proxies[maker].result("anvil_setStorageAt", [store, "0x5", "0x" + "07".rjust(64, "0")])
    tally: Counter[str] = Counter()
    wrong: list[str] = []
    await _read_final_blocks(proxies[maker], nodes[maker], tally, wrong)

    async def taken() -> bool:  # the other replica polls the maker's epoch from Redis, and names it
        made, took = trackers[maker].head, trackers[taker].head
        return (
            made is not None
            and took is not None
            and None not in (made.space, took.space)
            and (made.space.split("/")[0] == took.space.split("/")[0])
        )

    await eventually(taken, 15, "the other replica taking the new epoch")
    for _ in range(2):
        await _read_final_blocks(proxies[taker], nodes[taker], tally, wrong)
    assert wrong == [], "\n".join(wrong[:10])
    assert relays[maker].cut > 0 and tally["HIT"] > 0, (relays[maker].cut, dict(tally))


async def test_a_replica_restarted_after_redis_is_flushed_takes_no_final_answer_written_where_the_trail_went(
    forks: Any, redis_server: RedisServer
) -> None:
    _origin, store, nodes, proxies, relays = forks
    other = await _part(store, nodes, proxies)
    owner = 1 - other  # the trail's chain: it keeps the shared space while its finalized block stays put
    relays[owner].stalled = True
    redis_server.flush()  # the epoch record and the trail go
    tally: Counter[str] = Counter()
    wrong: list[str] = []
    await _read_final_blocks(proxies[owner], nodes[owner], tally, wrong)  # written again; it cannot mark the trail
    await proxies[other].close()
    proxies[other] = await start_proxy(
        settings_for(EVM_UPSTREAM=nodes[other].url, REDIS_URL=relays[other].url, ALLOW_NAMESPACES="anvil")
    )
    tracker = proxies[other].app[SERVICE].networks["evm"].tracker

    async def named() -> bool:
        return tracker.head is not None and tracker.head.space is not None

    await eventually(named, 20, "the restarted replica naming a key space")
    for _ in range(2):
        await _read_final_blocks(proxies[other], nodes[other], tally, wrong)
    assert wrong == [], "\n".join(wrong[:10])
    assert tally["HIT"] > 0, dict(tally)


async def test_a_replica_started_on_an_already_diverged_fork_serves_its_own_nodes_answers(redis_url: str) -> None:
    origin = Anvil()
    store = origin.deploy_store()
    origin.mine(FORK_AT - origin.block_number())
    nodes = [Anvil("--fork-url", origin.url, "--fork-block-number", str(FORK_AT)) for _ in range(2)]
    for value, node in zip((111, 222), nodes, strict=True):
        _diverge(node, store, value)
    proxies: list[Proxy] = []
    try:
        for node in nodes:  # the second starts on a space the first's chain filled
            proxies.append(await start_proxy(settings_for(EVM_UPSTREAM=node.url, REDIS_URL=redis_url)))
            await proxies[-1].head_at(node.block_number(), timeout=20)
        height = hex(nodes[0].block_number() - 70)  # final on both, a block of each fork's own
        truths = [n.rpc("eth_getBlockByNumber", height, False)["hash"] for n in nodes]
        assert truths[0] != truths[1]
        for _ in range(2):
            for proxy, truth in zip(proxies, truths, strict=True):
                assert (await proxy.result("eth_getBlockByNumber", [height, False]))["hash"] == truth

        async def settled() -> bool:  # no epoch tug of war between the two: one disagreement, then quiet
            return sum(p.metric("rpc_proxy_fork_disagreements_total", network="evm") for p in proxies) >= 1

        await eventually(settled, 10, "the second replica to see it is on another fork")
        spaces = {p.app[SERVICE].networks["evm"].tracker.head.space for p in proxies}
        assert len(spaces) == 2, spaces
        # Another fork's checkpoint is no violation of this chain's finality: no epoch moves back and forth.
        assert all(p.metric("rpc_proxy_finality_violations_total", network="evm") == 0 for p in proxies)
    finally:
        for proxy in proxies:
            await proxy.close()
        for node in (*nodes, origin):
            node.stop()


async def test_a_block_or_transaction_of_another_fork_is_never_served_by_its_hash(forks: Any) -> None:
    _origin, store, nodes, proxies, _relays = forks
    sent = [node.send(store, selector("setX(uint256)") + word(v)) for v, node in zip((111, 222), nodes, strict=True)]
    for proxy, node in zip(proxies, nodes, strict=True):
        await proxy.head_at(node.block_number())
    calls: list[tuple[str, list[Any]]] = []
    for receipt in sent:
        calls += [
            ("eth_getBlockByHash", [receipt["blockHash"], False]),
            ("eth_getBlockReceipts", [receipt["blockHash"]]),
            ("eth_getTransactionByHash", [receipt["transactionHash"]]),
            ("eth_getTransactionReceipt", [receipt["transactionHash"]]),
            ("eth_getStorageAt", [store, "0x0", {"blockHash": receipt["blockHash"]}]),
        ]
    tally: Counter[str] = Counter()
    wrong: list[str] = []
    for i in (0, 1):  # each replica reads the blocks of both forks while both share one key space
        for method, params in calls:
            await _compare(proxies[i], nodes[i], method, params, tally, wrong)
    for proxy, node in zip(proxies, nodes, strict=True):  # the first finalizes past the fork first
        node.mine(MINED)
        await proxy.head_at(node.block_number(), timeout=20)
    for _ in range(2):
        for i in (1, 0):
            for method, params in calls:
                await _compare(proxies[i], nodes[i], method, params, tally, wrong)
    assert wrong == [], "\n".join(wrong[:10])
    assert tally["HIT"] > 0, dict(tally)
