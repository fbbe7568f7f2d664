"""Differential test: two proxy replicas sharing Redis, in front of a canonical Anvil behind a
fault-injecting relay (HTTP 500/413, wrong ids, duplicate ids, partial batches, slow answers) and a
lagging fork of it that also diverges when the canonical node reorgs below its fork point. A seeded,
randomized workload of the seven methods at tags, numbers and hashes runs in rounds, with mining and
`anvil_reorg` between them. Every answer the proxy gives is compared with the canonical node's answer
to the same call: 0 mismatches. A -32002 (no upstream could answer) is an outage, not a wrong answer;
it is counted apart.

More configurations (issue 25), each in a shorter run: a backup that diverged (mines blocks of its
own), a stalled backup across the canonical node's shallow reorgs, a load balancer in front of the
canonical node and a lagging member (fee reads and tag reads go to the lagging one), a devnet
restarted with the same genesis and other transactions, and both replicas restarted on the same Redis
after a reorg below finality. And replicas on diverged forks (issue "Nodes as they are"): the second
replica in front of the fork alone, both forks finalizing blocks of their own past the fork point;
each replica's answers are compared with its own node's.

Soak mode: DIFFERENTIAL_ROUNDS=300 DIFFERENTIAL_SEED=<n> pytest tests/test_differential.py -s
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from proxy.http.app_keys import SERVICE
from tests.fake_solana import LARGEST, TOKEN_ACCOUNT, FakeSolana
from tests.fault_relay import FaultRelay
from tests.support import (
    DEV_ACCOUNT,
    Anvil,
    Proxy,
    balancer,
    eventually,
    free_port,
    mapping_slot,
    selector,
    settings_for,
    start_proxy,
    word,
)

SEED = int(os.environ.get("DIFFERENTIAL_SEED", "9"))
ROUNDS = int(os.environ.get("DIFFERENTIAL_ROUNDS", "8"))
CALLS_PER_ROUND = int(os.environ.get("DIFFERENTIAL_CALLS", "40"))
FAULT_RATE = 0.25
TAGS = ("latest", "safe", "finalized", "earliest")
CONFIG_ROUNDS = int(os.environ.get("DIFFERENTIAL_CONFIG_ROUNDS", "4"))  # each issue-25 configuration
# The load balancer's, at least: its lagging member's unproven answers (a batch that failed, the call
# then sent alone) come in most runs only after round 4; 4c1e84a served one in every run of 12 rounds.
BALANCER_ROUNDS = int(os.environ.get("DIFFERENTIAL_BALANCER_ROUNDS", "12"))
CONFIGS = ("diverged_backup", "stalled_backup", "balancer", "devnet_restart", "proxy_restart", "forked_replicas")
FIXED_GENESIS = ("--timestamp", "1700000000")  # a devnet restarted with the same genesis


@dataclass
class World:
    node: Anvil
    lagging: Anvil
    relay: FaultRelay
    solana: FakeSolana
    proxies: list[Proxy]
    store: str
    session: aiohttp.ClientSession
    hashes: list[str] = field(default_factory=list)  # every block hash seen, old forks included
    tally: Counter[str] = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)
    config: str = "lagging_backup"
    settings: Any = None


async def direct(session: aiohttp.ClientSession, url: str, method: str, params: Any) -> dict[str, Any]:
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
    async with session.post(url, json=body) as resp:
        return dict(await resp.json())


async def mutate(world: World, rng: random.Random, round_number: int) -> None:
    """Mine blocks with writes, or reorg the canonical node's tip (blocks the fork may hold too);
    in the issue-25 configurations, their event on round 2."""
    node = world.node
    if world.config in ("diverged_backup", "forked_replicas"):
        world.lagging.send(world.store, selector("setX(uint256)") + word(rng.randint(1, 10**6)))
    if round_number == 2 and world.config == "devnet_restart":
        restart_devnet(world, rng)
    if round_number == 2 and world.config == "proxy_restart":
        node.rpc("anvil_reorg", 80, [])  # below finality: the replicas move to a new epoch, then restart
        await finality_violated(world)
        for proxy in world.proxies:
            await proxy.close()
        # Inline, not make_proxy: the replicas are closed and restarted mid-test.
        world.proxies = [await start_proxy(world.settings), await start_proxy(world.settings)]
    if round_number == 1 and world.config == "forked_replicas":  # both forks final past the fork point
        node.mine(70)
        world.lagging.mine(70)
    if rng.random() < 0.4:
        node.rpc("anvil_reorg", rng.randint(1, 4), [])
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.5:
            node.send(world.store, selector("setX(uint256)") + word(rng.randint(1, 10**6)))
        else:
            node.send(world.store, selector("emitMany(uint256)") + word(rng.randint(0, 3)))
    top = node.block_number()
    recent = range(max(0, top - 6), top + 1)
    world.hashes.extend(node.rpc("eth_getBlockByNumber", hex(n), False)["hash"] for n in recent)
    if world.config == "forked_replicas":  # the fork's own blocks, read by hash on both replicas
        top = world.lagging.block_number()
        world.hashes.extend(
            world.lagging.rpc("eth_getBlockByNumber", hex(n), False)["hash"] for n in range(top - 6, top + 1)
        )


def restart_devnet(world: World, rng: random.Random) -> None:
    """The canonical devnet restarted on its port with the same genesis and other transactions,
    longer than before (the old chain's blocks, hashes included, are gone)."""
    top = world.node.block_number()
    world.node.stop()
    world.node = Anvil(*FIXED_GENESIS, port=world.node.port)
    world.store = world.node.deploy_store()
    for _ in range(3):
        world.node.send(world.store, selector("emitMany(uint256)") + word(rng.randint(0, 3)))
    world.node.mine(top + 5 - world.node.block_number())


async def finality_violated(world: World) -> None:
    async def seen() -> bool:
        return all(p.metric("rpc_proxy_finality_violations_total", network="evm") >= 1 for p in world.proxies)

    await eventually(seen, 20, "both replicas to see the finality violation")


async def synced(world: World) -> None:
    """Both replicas' trackers at the canonical head (answers within a poll interval are documented stale)."""
    nodes = [world.node, world.lagging if world.config == "forked_replicas" else world.node]
    latest = [n.rpc("eth_getBlockByNumber", "latest", False)["hash"] for n in nodes]

    async def both() -> bool:
        heads = [p.app[SERVICE].networks["evm"].tracker.head for p in world.proxies]
        return all(h is not None and h.latest_hash == top and not h.stale for h, top in zip(heads, latest, strict=True))

    await eventually(both, 20, "both replicas to follow the canonical head")


def block_param(world: World, rng: random.Random, *, objects: bool = True) -> Any:
    top = world.node.block_number()
    kind = rng.choice(["number", "number", "tag", "hash", "object"] if objects else ["number", "number", "tag"])
    if kind == "number":
        return hex(rng.randint(0, top))
    if kind == "tag":
        return rng.choice(TAGS)
    block_hash = rng.choice(world.hashes)
    if kind == "hash":
        return {"blockHash": block_hash}
    return {"blockHash": block_hash, "requireCanonical": rng.random() < 0.5}


def random_call(world: World, rng: random.Random) -> tuple[str, list[Any]]:
    store = world.store
    method = rng.choice(
        [
            "eth_getStorageAt",
            "eth_call",
            "eth_getLogs",
            "eth_getLogs",
            "eth_getBlockReceipts",
            "eth_getUncleByBlockHashAndIndex",
            "getTokenAccountBalance",
            "getLargestAccounts",
        ]
    )
    if method == "eth_getStorageAt":
        slot = rng.choice(["0x0", mapping_slot(DEV_ACCOUNT, 1)])
        return method, [store, slot, block_param(world, rng)]
    if method == "eth_call":
        data = rng.choice([selector("x()"), selector("bal(address)") + word(DEV_ACCOUNT)])
        return method, [{"from": DEV_ACCOUNT, "to": store, "data": data}, block_param(world, rng)]
    if method == "eth_getLogs":
        if rng.random() < 0.2:
            return method, [{"address": store, "blockHash": rng.choice(world.hashes)}]
        top = world.node.block_number()
        start = rng.randint(0, top)
        end = rng.choice([hex(rng.randint(start, top)), "latest"])
        return method, [{"address": store, "fromBlock": hex(start), "toBlock": end}]
    if method == "eth_getBlockReceipts":
        param = block_param(world, rng, objects=False)
        return method, [rng.choice(world.hashes) if rng.random() < 0.3 else param]
    if method == "eth_getUncleByBlockHashAndIndex":
        return method, [rng.choice(world.hashes), "0x0"]
    if method == "getTokenAccountBalance":
        return method, [TOKEN_ACCOUNT, {"commitment": rng.choice(["finalized", "confirmed", "processed"])}]
    return method, [{"commitment": "finalized"}]


async def expected(world: World, method: str, params: list[Any], index: int = 0) -> dict[str, Any]:
    """The canonical node's answer (for Solana, the fake's value; its slot moves on every call); the
    fork's for the second replica of forked_replicas."""
    if method in ("getTokenAccountBalance", "getLargestAccounts"):
        reply = await direct(world.session, world.solana.url, method, params)
        return {"result": reply["result"]["value"]}
    own = world.lagging if world.config == "forked_replicas" and index % 2 == 1 else world.node
    reply = await direct(world.session, own.url, method, params)
    if method == "eth_getUncleByBlockHashAndIndex" and (reply.get("error") or {}).get("code") == -32001:
        return {"result": None}  # the interface: null when no block is found (Anvil: -32001 "Resource not found")
    return reply


async def check(world: World, rng: random.Random, index: int) -> None:
    method, params = random_call(world, rng)
    world.relay.inject_random(rng, FAULT_RATE)
    if world.config != "forked_replicas":
        await compare(world, method, params, index % len(world.proxies))
        return
    for replica in (index % 2, 1 - index % 2):  # the other replica's answer is in the shared cache by now
        await compare(world, method, params, replica)


async def compare(world: World, method: str, params: list[Any], index: int) -> None:
    """One replica's answer to the call against its own node's."""
    proxy = world.proxies[index]
    network = "solana" if method in ("getTokenAccountBalance", "getLargestAccounts") else "evm"
    _, reply, headers = await proxy.post(
        {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}, network=network
    )
    truth = await expected(world, method, params, index)
    got = reply.get("result")
    if method in ("getTokenAccountBalance", "getLargestAccounts") and isinstance(got, dict):
        got = got.get("value")
    error = reply.get("error")
    if error is not None and error.get("code") == -32002:
        world.tally["unavailable"] += 1
        return
    world.tally[headers.get("X-Cache", "none")] += 1
    same = (
        (error is None and "result" in truth and got == truth["result"])
        or (error is not None and "error" in truth and error.get("code") == truth["error"].get("code"))
        or (error is not None and "error" in truth and error.get("code") == -32602)
    )
    if not same:
        world.mismatches.append(
            json.dumps(
                {
                    "method": method,
                    "params": params,
                    "cache": headers.get("X-Cache"),
                    "faults": world.relay.applied[-3:],
                    "sizes": [_size(reply), _size(truth)],
                    "proxy": reply,
                    "node": truth,
                }
            )[:900]
        )


def _size(reply: dict[str, Any]) -> int | None:
    """How many items a list result holds (a mismatch's summary), else None."""
    result = reply.get("result")
    return len(result) if isinstance(result, list) else None


@pytest.fixture(params=["lagging_backup", *CONFIGS])
async def world(request: pytest.FixtureRequest, redis_url: str, solana: FakeSolana) -> AsyncIterator[World]:
    config = request.param
    node = Anvil(*FIXED_GENESIS, port=free_port()) if config == "devnet_restart" else Anvil()
    store = node.deploy_store()
    for i in range(12):
        node.send(store, selector("emitMany(uint256)") + word(i % 3))
    node.mine(70 if config != "proxy_restart" else 100)
    fork_at = node.block_number() - (0 if config == "stalled_backup" else 3)
    lagging = Anvil("--fork-url", node.url, "--fork-block-number", str(fork_at))
    if config == "stalled_backup":  # it holds the blocks the canonical node's shallow reorgs replace
        for n in range(fork_at - 6, fork_at + 1):
            lagging.rpc("eth_getBlockByNumber", hex(n), False)
    relay = await FaultRelay(node.url).start()
    async with AsyncExitStack() as stack:
        upstreams = f"{relay.url},{lagging.url}"
        if config == "balancer":  # one URL: fee reads and every third request reach the lagging member
            turn = iter(range(10**9))

            def route(calls: list[dict[str, Any]]) -> str:
                fees = any(c.get("method") in ("eth_gasPrice", "eth_feeHistory") for c in calls)
                return lagging.url if fees or next(turn) % 3 == 2 else relay.url

            upstreams = await stack.enter_async_context(balancer(route))
        elif config in ("devnet_restart", "proxy_restart", "forked_replicas"):
            upstreams = relay.url
        settings = settings_for(
            EVM_UPSTREAM=upstreams, SOLANA_UPSTREAM=solana.url, REDIS_URL=redis_url, UPSTREAM_TIMEOUT="5"
        )
        # Inline, not make_proxy: the world's replicas are replaced mid-test (proxy_restart).
        proxies = [await start_proxy(settings), await start_proxy(settings)]
        if config == "forked_replicas":  # the second replica in front of the fork alone
            await proxies[1].close()
            proxies[1] = await start_proxy(
                settings_for(EVM_UPSTREAM=lagging.url, SOLANA_UPSTREAM=solana.url, REDIS_URL=redis_url)
            )
        session = aiohttp.ClientSession()
        hashes = [node.rpc("eth_getBlockByNumber", hex(n), False)["hash"] for n in range(node.block_number() + 1)]
        world = World(node, lagging, relay, solana, proxies, store, session, hashes, config=config, settings=settings)
        yield world
        await session.close()
        for proxy in world.proxies:
            await proxy.close()
    await relay.close()
    lagging.stop()
    world.node.stop()


async def test_the_proxy_never_answers_differently_from_the_canonical_node(world: World) -> None:
    rng = random.Random(SEED)
    assert LARGEST  # the fake's accounts are fixed: the Solana answers compare by value
    rounds = ROUNDS if world.config == "lagging_backup" else CONFIG_ROUNDS
    if world.config == "balancer":
        rounds = max(rounds, BALANCER_ROUNDS)
    for round_number in range(rounds):
        if round_number:
            await mutate(world, rng, round_number)
        world.relay.clear()
        await synced(world)
        for index in range(CALLS_PER_ROUND):
            await check(world, rng, index)
        # A few identical calls at once on both replicas: coalesced misses and hits compared too.
        world.relay.clear()
        await asyncio.gather(*(check(world, random.Random(SEED + round_number), i) for i in range(4)))
    print(
        f"differential {world.config} seed={SEED} rounds={rounds}: {dict(world.tally)}, "
        f"faults {Counter(world.relay.applied)}"
    )
    assert world.mismatches == [], "\n".join(world.mismatches[:10])
    assert world.tally["HIT"] > 0 and world.tally["MISS"] > 0, dict(world.tally)
    # -32002 when no upstream could answer (the primary faulted, the backup lacks the block): bounded.
    assert world.tally["unavailable"] < rounds * CALLS_PER_ROUND / 3, dict(world.tally)
