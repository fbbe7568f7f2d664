"""The tables the workers of one host share (workers/shared_table.py): held counts that hold across
processes and give back what a dead process held, and the filter table two workers' Filters share,
with an injected clock so FILTER_TIMEOUT passes in a test. The counts replicas share through a real
redis-server (workers/replica_counts.py): one cap for all, a dead replica's entries lapse."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from proxy.cache.admission_sync import DeploymentSpend
from proxy.gateway.filters import FILTER_TIMEOUT, Filters
from proxy.metrics import Metrics
from proxy.redis_link import RedisLink, connect
from proxy.rpc.jsonrpc import Call
from proxy.values import Answer
from proxy.workers.replica_counts import ReplicaCounts
from proxy.workers.shared_table import LocalCounts, SharedCounts
from tests.support import settings_for


def _take_and_die(directory: str) -> None:
    assert SharedCounts(directory, "held").take("k1", 5, 3)


def test_a_held_count_is_one_number_for_every_process_of_the_host(tmp_path: Path) -> None:
    first, second = SharedCounts(str(tmp_path), "held"), SharedCounts(str(tmp_path), "held")
    second._pid = "1"  # another worker's entries (pid 1 is alive: never reaped)
    assert first.take("k1", 3) and second.take("k1", 3, 2)
    assert not first.take("k1", 3) and not second.take("k1", 3)
    assert first.take("k2", 3)  # another key counts apart
    second.release("k1")
    assert first.take("k1", 3) and first.count("k1") == 3


def test_what_a_dead_worker_held_is_given_back_when_it_stands_in_the_way(tmp_path: Path) -> None:
    dying = multiprocessing.get_context("spawn").Process(target=_take_and_die, args=(str(tmp_path),))
    dying.start()
    dying.join(30)
    counts = SharedCounts(str(tmp_path), "held")
    assert counts.count("k1") == 3
    assert counts.take("k1", 5, 5) and counts.count("k1") == 5


def test_settling_tells_the_table_what_this_process_holds_now(tmp_path: Path) -> None:
    counts = SharedCounts(str(tmp_path), "held")
    assert counts.take("10.0.0.1", 4, 4)
    counts.settle({"10.0.0.1": 1})
    assert counts.count("10.0.0.1") == 1
    counts.settle({"10.0.0.1": 0})
    assert counts.count("10.0.0.1") == 0


def test_local_counts_hold_the_same_cap_in_one_process() -> None:
    counts = LocalCounts()
    assert counts.take("k1", 2) and counts.take("k1", 2) and not counts.take("k1", 2)
    counts.release("k1")
    assert counts.count("k1") == 1


class _Node:
    """A node's filter methods: ids 0x1, 0x2, ...; what was asked, in order."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer:
        self.asked.append(method)
        result: Any = [] if method == "eth_getFilterChanges" else True
        if method.startswith("eth_new"):
            result = hex(sum(m.startswith("eth_new") for m in self.asked))
        return Answer(orjson.dumps(result), result)


async def _unused(*_args: Any) -> Any:
    raise AssertionError("not asked in these tests")


def _prepared(network: Any, method: str, params: list[Any]) -> Any:
    return SimpleNamespace(call=Call(method, params, 1), network=network, params=params)


async def test_a_filter_polled_through_another_worker_stays_counted_and_alive(tmp_path: Path) -> None:
    settings = settings_for(EVM_UPSTREAM="http://127.0.0.1:1", API_KEYS="k1", MAX_FILTERS_PER_KEY="2")
    now = [1000.0]
    workers = [Filters(settings, _unused, _unused, lambda: now[0], run_dir=str(tmp_path)) for _ in range(2)]
    network = SimpleNamespace(name="evm", upstream=_Node(), tracker=None)  # no head to tell of blocks shown
    made = [
        orjson.loads((await workers[0].execute(_prepared(network, "eth_newBlockFilter", []), "k1")).payload)
        for _ in range(2)
    ]
    refused = await workers[1].execute(_prepared(network, "eth_newBlockFilter", []), "k1")
    assert refused.is_error and b"MAX_FILTERS_PER_KEY" in refused.payload  # the cap is the host's
    for _ in range(3):  # polled through the second worker only, each time within FILTER_TIMEOUT
        now[0] += FILTER_TIMEOUT * 0.8
        for own_id in made:
            polled = await workers[1].execute(_prepared(network, "eth_getFilterChanges", [own_id]), "k1")
            assert polled.payload == b"[]"
    # The first worker, which made them, still counts them: the node keeps them alive.
    assert (await workers[0].execute(_prepared(network, "eth_newBlockFilter", []), "k1")).is_error
    assert (await workers[0].execute(_prepared(network, "eth_uninstallFilter", [made[0]]), "k1")).payload == b"true"
    assert not (await workers[1].execute(_prepared(network, "eth_newBlockFilter", []), "k1")).is_error
    now[0] += FILTER_TIMEOUT + 1  # unpolled past the node's deadline: gone for every worker
    assert not (await workers[0].execute(_prepared(network, "eth_newBlockFilter", []), "k1")).is_error
    assert network.upstream.asked.count("eth_newBlockFilter") == 4


def _link(url: str) -> RedisLink:
    return RedisLink(connect(url, 2.0), timeout=2.0, metrics=Metrics(CollectorRegistry()))


async def test_replicas_sharing_redis_hold_one_count_and_a_dead_ones_lapses(redis_url: str) -> None:
    links = [_link(redis_url) for _ in range(2)]
    now = [1000.0]
    replicas = [ReplicaCounts(link, "ws", LocalCounts(), ttl=10.0, clock=lambda: now[0]) for link in links]
    try:
        assert await replicas[0].take("k1", 5, 3) == "redis"
        assert await replicas[1].take("k1", 5, 2) == "redis"
        assert await replicas[1].take("k1", 5) is None  # 3 + 2: the cap is the deployment's
        await replicas[1].release("k1", "redis")
        assert await replicas[1].take("k1", 5) == "redis"
        now[0] += 6
        await replicas[1].renew()  # the second keeps renewing; the first has died
        now[0] += 6
        assert await replicas[1].take("k1", 5, 3) == "redis"  # the dead one's 3 are given back
        assert await replicas[1].take("k1", 5) is None
    finally:
        for link in links:
            await link.close()


async def test_without_redis_a_take_is_counted_for_the_host_and_given_back_there() -> None:
    link = _link("redis://127.0.0.1:1/0")
    local = LocalCounts()
    counts = ReplicaCounts(link, "ws", local)
    try:
        hold = await counts.take("k1", 2)
        assert hold == "host" and local.count("k1") == 1
        await counts.release("k1", hold)
        assert local.count("k1") == 0
    finally:
        await link.close()


async def test_what_one_replica_stored_for_a_key_this_minute_counts_in_the_others(redis_url: str) -> None:
    links = [_link(redis_url) for _ in range(2)]
    now = [6000.0]
    first, second = (DeploymentSpend(link, 100, 60.0, lambda: now[0]) for link in links)
    try:
        for _ in range(12):
            assert first.allows("k1", 5)
            first.spent("k1", 5)
        await first.sync()
        assert second.allows("k1", 5)  # not read yet this minute: blind until its next sync
        await second.sync()
        assert not second.allows("k1", 45) and second.allows("k1", 40)
        second.spent("k1", 40)
        await second.sync()
        await first.sync()
        assert not first.allows("k1", 1) and not second.allows("k1", 1)
        now[0] += 60  # the next minute: a new count
        assert first.allows("k1", 100)
    finally:
        for link in links:
            await link.close()
