"""Replicas on a real Redis Cluster and on a Sentinel-watched primary, through HTTP: the shared tier,
the credit ledger and cross-replica coalescing work on a cluster as on one Redis, and a failover
(a cluster primary killed, or SENTINEL FAILOVER) serves nothing wrong: every answer is the node's,
and a failure is a JSON-RPC error, never a 500."""

from __future__ import annotations

import asyncio
import contextlib
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio.cluster import NodesManager

from proxy.cache.tiers import GET_OR_LOCK_SCRIPT, RedisTier, shared_keys
from proxy.credits.accounts import derived_name
from proxy.credits.lease_exchange import ledger_key
from proxy.credits.leases import LeasedLedger
from proxy.credits.ledger_storage import LedgerStorageError, check_ledger_storage
from proxy.http.app_keys import LEDGER
from proxy.metrics import Metrics
from proxy.redis_link import RedisLink, RedisUnavailable, connect, of_one_key
from tests.redis_cluster import LocalCluster, LocalSentinel, command
from tests.support import ROOT, Anvil, Proxy, ProxyFactory, eventually, settings_for, start_proxy, wait_until, word
from tests.test_cache import SlowUpstream, finalized_store, one_space, replicas, shared_through_redis, storage
from tests.test_credits import keys_file


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Three primaries, no replicas: shared by this module's tests, emptied before each."""
    local = LocalCluster(masters=3)
    yield local
    local.stop()


@pytest.fixture
def cluster_url(cluster: LocalCluster) -> str:
    for node in cluster.primaries():
        command(node.port, "FLUSHALL")
    return cluster.url


async def test_two_replicas_on_a_cluster_share_entries_spread_over_every_primary(
    anvil: Anvil,
    cluster: LocalCluster,
    cluster_url: str,
    make_proxy: ProxyFactory,
) -> None:
    first, second = await replicas(make_proxy, anvil, cluster_url)
    store, block = await shared_through_redis(anvil, first, second)

    async def kept() -> bool:
        # A miss its proof could not settle in time (a busy machine) is served, never kept: asked again.
        for position in range(1, 40):
            assert (await first.post(storage(store, hex(position), hex(block))))[0] == 200
        return sum(cluster.keys_per_primary("rcp:c:*")) == 40

    await eventually(kept, 60, "every entry kept in Redis")
    # Single-key entries are not held together by a tag: they spread over the cluster.
    per_primary = cluster.keys_per_primary("rcp:c:*")
    assert len(per_primary) == 3 and sum(per_primary) == 40 and min(per_primary) > 0, per_primary
    assert first.metric("rpc_proxy_redis_errors_total", operation="cache_set") == 0


async def test_identical_misses_on_two_replicas_on_a_cluster_make_one_upstream_call(
    anvil: Anvil,
    cluster_url: str,
    make_proxy: ProxyFactory,
) -> None:
    # Redis given time to answer on a busy machine (the rule is one call, not REDIS_TIMEOUT's): at
    # 0.25 s a lookup timed out under load, and each replica asked the node.
    first, second = await replicas(make_proxy, anvil, cluster_url, SlowUpstream, REDIS_TIMEOUT="2")
    store, block = await finalized_store(anvil, first)
    await second.head_at(anvil.block_number())
    await one_space(first, second)
    replies = await asyncio.gather(
        *((first if i % 2 else second).post(storage(store, "0x0", hex(block), rid=i)) for i in range(20))
    )
    assert sorted(body["id"] for _, body, _ in replies) == list(range(20))
    assert all(body["result"] == "0x" + word(7) for _, body, _ in replies)
    assert sum(p.upstreams["evm"].calls["eth_getStorageAt"] for p in (first, second)) == 1
    for proxy in (first, second):  # the lookup with its lock, the store with its release, the polls
        for operation in ("cache_get", "cache_set", "fill_lock", "fill_unlock", "fill_poll"):
            assert proxy.metric("rpc_proxy_redis_errors_total", operation=operation) == 0


def ledger_storage(rid: Any, position: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": "eth_getStorageAt", "params": ["0x" + "11" * 20, position, "latest"]}


async def test_concurrent_debits_on_two_replicas_on_a_cluster_never_overdraw(
    anvil: Anvil,
    cluster_url: str,
    tmp_path: Path,
) -> None:
    path = keys_file(tmp_path, alice={"daily_credits": 80 * 40}, bob={"daily_credits": 80 * 25})
    settings = settings_for(
        EVM_UPSTREAM=anvil.url, API_KEYS_FILE=path, REDIS_URL=cluster_url, CREDITS_PER_SECOND="1000000"
    )  # the script's second key, the window, is used too
    # Inline, not make_proxy: both replicas are closed before `keys usage` reads what they spent.
    first, second = await start_proxy(settings), await start_proxy(settings)
    try:
        requests = [
            (first if i % 2 else second).post(ledger_storage(i, hex(i)), key=("alice", "bob")[i % 3 == 0])
            for i in range(150)
        ]
        replies = await asyncio.gather(*requests)
        by_key: dict[str, list[int]] = {"alice": [], "bob": []}
        for i, (status, _, _) in enumerate(replies):
            by_key[("alice", "bob")[i % 3 == 0]].append(status)
        assert by_key["alice"].count(200) == 40 and set(by_key["alice"]) == {200, 402}
        assert by_key["bob"].count(200) == 25 and set(by_key["bob"]) == {200, 402}
        for key in ("alice", "bob"):
            _, _, headers = await first.post(ledger_storage(0, "0x0"), key=key)
            assert headers["X-Credits-Remaining"] == "0"
        assert first.metric("rpc_proxy_redis_errors_total", operation="credits_lease") == 0
    finally:
        await first.close()
        await second.close()
    env = {"PATH": "/usr/bin:/bin", "REDIS_URL": cluster_url, "API_KEYS_FILE": path}
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "proxy", "keys", "usage"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert "3200 credits used, 0 left of 3200" in result.stdout and "2000 credits used, 0 left of 2000" in result.stdout


async def test_an_evicting_primary_anywhere_in_the_cluster_is_refused_for_the_ledger(
    cluster: LocalCluster,
    cluster_url: str,
) -> None:
    link = RedisLink(connect(cluster_url, 2.0), timeout=2.0, metrics=Metrics(CollectorRegistry()))
    last = cluster.primaries()[-1]  # redis-py would ask only one node: not necessarily this one
    try:
        await check_ledger_storage(link, require_noeviction=True)  # every primary: noeviction
        command(last.port, "CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
        with pytest.raises(LedgerStorageError, match="allkeys-lru"):
            await check_ledger_storage(link, require_noeviction=True)
    finally:
        command(last.port, "CONFIG", "SET", "maxmemory-policy", "noeviction")
        await link.close()


@pytest.mark.parametrize("topology", ["cluster", "single", "sentinel"])
async def test_a_burst_of_concurrent_commands_is_not_refused_for_connections(
    topology: str,
    request: pytest.FixtureRequest,
) -> None:
    # redis-py 8's pools refuse commands past 100 connections (per node) by default: under load that
    # would count as an outage and skip Redis for everyone.
    fixture = {"cluster": "cluster_url", "single": "redis_url", "sentinel": "sentinel"}[topology]
    value = request.getfixturevalue(fixture)
    url = value.url if isinstance(value, LocalSentinel) else value
    metrics = Metrics(CollectorRegistry())
    # The rule is about refusals, not speed: 500 connections opened at once (through Sentinel, each
    # finds the master first) may take more than the usual bound on a busy machine.
    link = RedisLink(connect(url, 10.0), timeout=10.0, metrics=metrics)
    try:
        await link.run("cache_set", lambda c: c.set("rcp:c:{burst}", b"r1"))
        replies = await asyncio.gather(*(link.run("cache_get", lambda c: c.get("rcp:c:{burst}")) for _ in range(500)))
        assert replies == [b"r1"] * 500
        assert metrics.registry.get_sample_value("rpc_proxy_redis_errors_total", {"operation": "cache_get"}) is None
    finally:
        await link.close()


# --- failovers -------------------------------------------------------------------------------


KEY = "alice"  # keys_file's [keys.alice] declares the secret "alice"


async def shared_again(first: Proxy, second: Proxy, anvil: Anvil, store: str, block: int, where: str) -> None:
    """Poll until an entry stored by one replica (at a new position each time) is a Redis hit on the other."""
    position = iter(range(1000, 100_000))

    async def shared() -> bool:
        p = next(position)
        await check_answers((first,), anvil, store, block, range(p, p + 1))
        return (await check_answers((second,), anvil, store, block, range(p, p + 1))) == ["HIT"]

    await eventually(shared, 30, f"the shared tier to work on {where}")


async def check_answers(
    proxies: tuple[Proxy, ...], anvil: Anvil, store: str, block: int, positions: range, key: str = KEY
) -> list[str]:
    """Ask every replica for every position; each answer must be the node's (or a JSON-RPC error).
    Returns the X-Cache values seen."""
    seen = []
    for proxy in proxies:
        for position in positions:
            status, reply, headers = await proxy.post(storage(store, hex(position), hex(block), rid=position), key=key)
            assert status != 500 and reply is not None and reply.get("id") == position, (status, reply)
            if "error" in reply:
                assert isinstance(reply["error"].get("code"), int), reply
                continue
            assert status == 200, (status, reply)
            assert reply["result"] == anvil.rpc("eth_getStorageAt", store, hex(position), hex(block)), reply
            seen.append(headers["X-Cache"])
    return seen


@pytest.fixture
def replicated_cluster() -> Iterator[LocalCluster]:
    local = LocalCluster(masters=3, replicas=1)
    try:
        wait_until(local.replicas_synced, 30, "every replica to sync")
        yield local
    finally:
        local.stop()


@pytest.mark.slow  # a primary's failure is noticed after the cluster's node timeout (1 s here)
async def test_after_a_failover_pipelined_reads_alone_find_the_promoted_replica(
    replicated_cluster: LocalCluster,
) -> None:
    # Every cache lookup is a pipeline (GET + PTTL), and redis-py re-reads the slot map after a
    # failed command but not after a failed pipeline: without the link's own rediscovery, a
    # replica that only reads would ask the dead primary forever.
    # The rule is the rediscovery, not the speed (a dead primary refuses connections at once): on a
    # loaded machine a command took over 0.5 s, reading the slot map up to 2 s (at 0.5, its whole
    # budget), and the client's first discovery (CLUSTER SLOTS, then COMMAND) seconds: made within
    # the first SET's budget, the setup timed out (RedisUnavailable).
    metrics = Metrics(CollectorRegistry())
    link = RedisLink(
        connect(replicated_cluster.url, 2.0),
        timeout=2.0,
        metrics=metrics,
        min_backoff=0.05,
        max_backoff=0.2,
    )
    tier = RedisTier(link, metrics)
    stored = (b'"0x01"', False)
    key = "v1|lookup"
    try:
        await link.client.initialize()  # the cluster discovered before the first command, not within it
        await tier.set(key, stored, math.inf)
        replicated_cluster.primary_of(shared_keys(key)[0]).kill()
        await asyncio.to_thread(
            wait_until, lambda: len(replicated_cluster.primaries()) == 3, 30, "a replica to be promoted"
        )

        async def found() -> bool:
            with contextlib.suppress(RedisUnavailable):
                found = await tier.get(key)
                return found is not None and (found.stored, found.ttl) == (stored, math.inf)
            return False

        await eventually(found, 20, "the read to reach the promoted replica")
    finally:
        await link.close()


@pytest.fixture
async def keyed_pair(
    anvil: Anvil,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    make_proxy: ProxyFactory,
) -> tuple[Proxy, Proxy]:
    """Two replicas with one API key, on the Redis topology named by the test's parameter."""
    url = request.getfixturevalue(request.param).url
    path = keys_file(tmp_path, **{KEY: {"daily_credits": 10_000_000}})
    settings = settings_for(EVM_UPSTREAM=anvil.url, REDIS_URL=url, API_KEYS_FILE=path)
    return await make_proxy(settings), await make_proxy(settings)


@pytest.mark.slow  # a primary's failure is noticed after the cluster's node timeout (1 s here)
@pytest.mark.parametrize("keyed_pair", ["replicated_cluster"], indirect=True)
async def test_a_cluster_primary_killed_mid_traffic_serves_nothing_wrong_and_the_tier_comes_back(
    anvil: Anvil,
    replicated_cluster: LocalCluster,
    keyed_pair: tuple[Proxy, Proxy],
) -> None:
    first, second = keyed_pair
    store, block = await finalized_store(anvil, first)
    await second.head_at(anvil.block_number())
    await check_answers((first,), anvil, store, block, range(0, 30))

    # The primary that holds the key's ledger (and about a third of the cached answers) dies.
    victim = replicated_cluster.primary_of(ledger_key(derived_name(KEY), int(time.time()) // 86400))
    victim.kill()
    deadline = time.monotonic() + 60
    # Traffic while the cluster notices, elects and promotes: every answer right, never a 500.
    while not (len(replicated_cluster.primaries()) == 3 and replicated_cluster.healthy()):
        assert time.monotonic() < deadline, "no replica was promoted"
        await check_answers((first, second), anvil, store, block, range(0, 30, 3))
    await check_answers((first, second), anvil, store, block, range(0, 60))

    # The promoted replica serves the slots: an entry stored by one replica is a Redis hit on the other.
    try:
        await shared_again(first, second, anvil, store, block, "the promoted replica")
    except TimeoutError:
        raise AssertionError(f"the shared tier did not come back: {redis_state(first, second)}") from None

    async def settled() -> bool:  # debits decided while the ledger was unreachable reached Redis
        await check_answers((first, second), anvil, store, block, range(0, 1))
        ledgers = [p.app[LEDGER] for p in (first, second)]
        return all(isinstance(ledger, LeasedLedger) and ledger.settled for ledger in ledgers)

    await eventually(settled, 30, "the ledger to be written back")


def redis_state(*proxies: Proxy) -> list[dict[str, float]]:
    """Each replica's Redis metrics, for a failure message."""
    return [
        {
            f"{sample.name}{sample.labels}": sample.value
            for metric in p.registry.collect()
            for sample in metric.samples
            if "redis" in sample.name
        }
        for p in proxies
    ]


@pytest.fixture
def sentinel() -> Iterator[LocalSentinel]:
    local = LocalSentinel()
    yield local
    local.stop()


@pytest.mark.slow  # Sentinel promotes after its own checks, seconds
@pytest.mark.parametrize("keyed_pair", ["sentinel"], indirect=True)
async def test_a_sentinel_failover_mid_traffic_serves_nothing_wrong_and_writes_reach_the_new_primary(
    anvil: Anvil,
    sentinel: LocalSentinel,
    keyed_pair: tuple[Proxy, Proxy],
) -> None:
    first, second = keyed_pair
    store, block = await finalized_store(anvil, first)
    await second.head_at(anvil.block_number())
    await check_answers((first,), anvil, store, block, range(0, 20))
    old = sentinel.primary_port()

    failover = asyncio.ensure_future(asyncio.to_thread(sentinel.failover))
    while not failover.done():  # traffic while Sentinel promotes the replica and demotes the primary
        await check_answers((first, second), anvil, store, block, range(0, 20, 2))
    new = await failover
    assert new != old
    await check_answers((first, second), anvil, store, block, range(0, 40))

    # Entries stored after the failover went to the new primary (the old one, now a replica, refuses
    # writes): stored by one replica, a Redis hit on the other.
    await shared_again(first, second, anvil, store, block, "the new primary")
    # Sentinel turns the old primary into a replica of the new one: then it refuses writes, and a
    # connection still open to it is dropped and made again to the new primary.
    await asyncio.to_thread(
        wait_until, lambda: "role:slave" in command(old, "INFO", "replication"), 30, "the old primary to be demoted"
    )
    await check_answers((first, second), anvil, store, block, range(40, 80))
    # Everything was written to the new primary: the demoted one, once synced from it, holds the same.
    await asyncio.to_thread(
        wait_until, lambda: command(new, "DBSIZE") == command(old, "DBSIZE"), 30, "the demoted primary to sync"
    )

    async def settled() -> bool:
        await check_answers((first, second), anvil, store, block, range(0, 1))
        ledgers = [p.app[LEDGER] for p in (first, second)]
        return all(isinstance(ledger, LeasedLedger) and ledger.settled for ledger in ledgers)

    await eventually(settled, 30, "the ledger to be written back")


async def test_a_cluster_url_naming_a_plain_server_is_an_outage_not_a_crash(redis_url: str) -> None:
    # redis-py's RedisClusterException is no RedisError: unmapped, it stopped the server.
    link = RedisLink(
        connect("redis+cluster://" + redis_url.split("://", 1)[1].rsplit("/", 1)[0], 2.0),
        timeout=2.0,
        metrics=Metrics(CollectorRegistry()),
    )
    try:
        with pytest.raises(RedisUnavailable):
            await link.run("cache_get", lambda c: c.get("rcp:c:{x}"))
    finally:
        await link.close()


async def test_a_cluster_whose_discovery_outlasts_one_command_is_still_reached(
    cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # redis-py discovers a cluster (CLUSTER SLOTS, then COMMAND) within the first command; cut off at the
    # command's budget, the discovery's work was thrown away and the next command began it again, so a
    # replica whose discovery took longer than REDIS_TIMEOUT (1 to 4 s on a loaded machine, an outside
    # analysis) never reached the cluster. The link discovers it in the background, on a budget of its own.
    read_slots = NodesManager.initialize

    async def slow_slots(self: NodesManager, *args: Any, **kwargs: Any) -> None:  # a loaded machine's: past 0.25 s
        await asyncio.sleep(0.6)
        await read_slots(self, *args, **kwargs)

    monkeypatch.setattr(NodesManager, "initialize", slow_slots)
    link = RedisLink(
        connect(cluster_url, 0.25),
        timeout=0.25,
        metrics=Metrics(CollectorRegistry()),
        min_backoff=0.05,
        max_backoff=0.2,
    )
    try:

        async def answered() -> bool:
            try:
                await link.run("cache_get", lambda c: c.get("rcp:c:{x}"))
            except RedisUnavailable:
                return False
            return True

        await eventually(answered, 20, "a command once the cluster is discovered")
    finally:
        await link.close()


async def test_a_slot_moving_between_primaries_is_a_miss_of_its_keys_and_the_tier_stays_up(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    """Rule (docs/scaling.md): a slot being resharded (MIGRATING/IMPORTING, its key moved: each
    two-key lookup script answered TRYAGAIN until redis-py's redirections ran out) fails that key's
    lookup, a miss; it opened the breaker, so every other key missed Redis through every reshard."""
    local = LocalCluster(masters=3)  # its own: a slot is left moved
    try:
        first, second = await replicas(make_proxy, anvil, local.url)
        store, block = await shared_through_redis(anvil, first, second)
        before = set(_stored(local))
        assert (await first.post(storage(store, "0x1", hex(block))))[2]["X-Cache"] == "MISS"
        [key] = set(_stored(local)) - before
        _start_moving(local, key)
        third = await make_proxy(settings_for(EVM_UPSTREAM=anvil.url, REDIS_URL=local.url))
        await third.head_at(anvil.block_number())
        _, reply, headers = await third.post(storage(store, "0x1", hex(block)))
        assert reply["result"] == "0x" + word(0) and headers["X-Cache"] == "MISS", reply
        assert third.metric("rpc_proxy_redis_up") == 1  # the breaker stayed shut: it opened at once before

        async def shared() -> bool:  # another slot's entry is a Redis hit on a replica with nothing in memory
            # (a fresh replica each try: the link reads the slot map again after the failed lookup, and a
            # lookup made while it does may miss once; a miss kept in memory would hide every later hit)
            fresh = await make_proxy(settings_for(EVM_UPSTREAM=anvil.url, REDIS_URL=local.url))
            await fresh.head_at(anvil.block_number())
            _, answer, seen = await fresh.post(storage(store, "0x0", hex(block)))
            assert answer["result"] == "0x" + word(7), answer
            return bool(seen["X-Cache"] == "HIT" and fresh.metric("rpc_proxy_redis_up") == 1)

        await eventually(shared, 20, "another slot's entry served from Redis")
    finally:
        local.stop()


async def test_a_key_of_a_slot_being_moved_fails_alone_within_the_timeout_and_spares_commands_in_flight() -> None:
    """Rule (docs/scaling.md): a lookup of a key whose slot is half moved fails that key alone, within
    REDIS_TIMEOUT. redis-py followed 16 redirections (ASK, TRYAGAIN, MOVED in a loop, sleeping 50 ms on
    the later TRYAGAINs), past the default 0.25 s, and on every fifth MOVED closed every connection of
    every node: another key's command in flight failed, and either failure opened the breaker."""
    local = LocalCluster(masters=3)
    link = RedisLink(connect(local.url, 2.0), timeout=2.0, metrics=Metrics(CollectorRegistry()))
    try:
        moving, lock = shared_keys("moving")
        await link.run("cache_set", lambda c: c.set(moving, b"x"))
        elsewhere = (f"rcp:wait:{{{n}}}" for n in range(1000))
        waiting = next(key for key in elsewhere if local.primary_of(key) is not local.primary_of(moving))
        _start_moving(local, moving)
        blocked = asyncio.ensure_future(link.run("wait", lambda c: c.blpop([waiting], timeout=1)))
        node = local.primary_of(waiting)
        await asyncio.to_thread(
            wait_until, lambda: "cmd=blpop" in command(node.port, "CLIENT", "LIST"), 10, "the BLPOP to be in flight"
        )
        sent_before = _evals_sent(local)
        for _ in range(6):  # past redis-py's fifth MOVED (counted across commands)
            with pytest.raises(RedisUnavailable) as failed:
                await link.run(
                    "cache_get",
                    lambda c: c.eval(GET_OR_LOCK_SCRIPT, 2, moving, lock, "token", "1000"),
                    timeout=0.25,
                )
            assert of_one_key(failed.value.__cause__), repr(failed.value.__cause__)
        # Four tries each (ASK, TRYAGAIN, MOVED, ASK), none of redis-py's sleeps: timing them would
        # prove nothing on a loaded host, counting them does.
        assert _evals_sent(local) - sent_before <= 6 * 4
        assert await blocked is None  # timed out as BLPOP does, not cut off
        assert link.up
    finally:
        await link.close()
        local.stop()


def _start_moving(cluster: LocalCluster, key: str) -> None:
    """Leave `key`'s slot half moved, as a reshard does: MIGRATING on its primary, IMPORTING on
    another, the key itself already moved."""
    source = cluster.primary_of(key)
    target = next(n for n in cluster.primaries() if n is not source)
    slot = command(source.port, "CLUSTER", "KEYSLOT", key)
    command(target.port, "CLUSTER", "SETSLOT", slot, "IMPORTING", command(source.port, "CLUSTER", "MYID"))
    command(source.port, "CLUSTER", "SETSLOT", slot, "MIGRATING", command(target.port, "CLUSTER", "MYID"))
    command(source.port, "MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", key)


def _evals_sent(cluster: LocalCluster) -> int:
    """EVALs the cluster's primaries were sent: run, failed or refused with a redirection."""
    total = 0
    for node in cluster.primaries():
        for line in command(node.port, "INFO", "commandstats").splitlines():
            if line.startswith("cmdstat_eval:"):
                fields = dict(field.split("=") for field in line.split(":", 1)[1].split(","))
                total += sum(int(fields.get(name, 0)) for name in ("calls", "rejected_calls", "failed_calls"))
    return total


def _stored(cluster: LocalCluster) -> list[str]:
    return [key for node in cluster.primaries() for key in command(node.port, "--scan", "--pattern", "rcp:c:*").split()]
