"""A network's epoch record in Redis (proxy/chain/epochs.py): a record Redis no longer holds (flushed,
or its key evicted) is never made again under an epoch a replica has held, so no replica takes up a
space whose trail is gone, nor goes back to a state it has left."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from proxy.chain.epochs import MISSING, Checkpoint, EpochKeeper, MemoryEpochs, RedisEpochs, parse_record, record_key
from proxy.chain.forks import MemoryTrails
from proxy.http.app_keys import SERVICE
from proxy.metrics import Metrics
from proxy.redis_link import RedisLink, connect
from tests.support import (
    DEV_ACCOUNT,
    Anvil,
    Proxy,
    ProxyFactory,
    RedisServer,
    eventually,
    settings_for,
    start_proxy,
)


class SharedTrails(MemoryTrails):
    shared = True


class SharedEpochs(MemoryEpochs):
    """Records as Redis keeps them for every replica, which an operator may flush."""

    def __init__(self) -> None:
        super().__init__()
        self.trails = SharedTrails()

    def flush(self) -> None:
        self._records.clear()


async def _synced(keeper: EpochKeeper, base: str = "evm@1:aa", final: tuple[int, str] = (10, "0x10")) -> str:
    await keeper.sync(base, *final, violated=False)
    return keeper.epoch


class TestEpochRecords:
    async def test_a_record_made_in_redis_names_an_epoch_of_its_own(self) -> None:
        store = SharedEpochs()
        keeper = EpochKeeper(store)
        epoch = await _synced(keeper)
        assert epoch != "" and keeper.loaded
        assert await store.advance("evm@1:aa", "?", Checkpoint("", 0, "")) == Checkpoint(epoch, 10, "0x10")

    async def test_without_redis_the_first_epoch_is_unnamed(self) -> None:
        keeper = EpochKeeper(MemoryEpochs())
        assert await _synced(keeper) == "" and keeper.loaded

    async def test_a_replica_whose_record_is_gone_moves_on_and_never_goes_back(self) -> None:
        store = SharedEpochs()
        first = EpochKeeper(store)
        held = {await _synced(first)}
        first.move_on()  # a state change through it
        held.add(await _synced(first))
        store.flush()
        await _synced(first)
        assert not first.loaded and first.epoch not in held  # no key named until a record is made anew
        second = EpochKeeper(store)  # a replica started meanwhile makes the record
        made = await _synced(second)
        assert made not in held | {""}
        await _synced(first)
        await _synced(first)
        assert first.epoch == made and first.loaded

    async def test_a_record_made_again_by_the_replica_that_lost_it_is_a_new_epoch(self) -> None:
        store = SharedEpochs()
        keeper = EpochKeeper(store)
        old = await _synced(keeper)
        store.flush()
        await _synced(keeper)
        new = await _synced(keeper)
        assert new != old and keeper.loaded
        assert await store.advance("evm@1:aa", "?", Checkpoint("", 0, "")) not in (None, MISSING)

    async def test_a_state_change_here_supersedes_an_epoch_another_replica_wrote_before_this_one_polled(
        self,
    ) -> None:
        store = SharedEpochs()
        first, second = EpochKeeper(store), EpochKeeper(store)
        await _synced(first)
        await _synced(second)
        await _synced(second)
        first.move_on()  # a state change through the first replica
        after_first = await _synced(first)
        second.move_on()  # another through the second, before its next poll read the first's epoch
        after_second = second.epoch
        assert await _synced(second) == after_second and second.loaded  # written over the first's
        await _synced(first)
        assert first.epoch == after_second != after_first  # both in the epoch after the later change

    async def test_a_chain_come_back_to_after_its_record_went_gets_a_new_epoch(self) -> None:
        store = SharedEpochs()
        keeper = EpochKeeper(store)
        left = await _synced(keeper, "evm@1:aa")
        keeper.forget()  # another chain on the same upstreams (a devnet restarted)
        await _synced(keeper, "evm@1:bb")
        store.flush()
        keeper.forget()  # the first chain again
        assert await _synced(keeper, "evm@1:aa") not in (left, "")


@pytest.mark.parametrize(
    "fields",
    [
        {"epoch": "abc"},
        {"epoch": "abc", "number": "x1", "hash": "0x10"},
        {"epoch": "abc", "number": "0x10", "hash": "h"},
    ],
)
async def test_an_epoch_record_not_whole_is_made_anew_not_read_forever_as_unreadable(
    redis_url: str, fields: dict[str, str]
) -> None:
    # An operator's hand-made record (or one cut short): read as none, and replaced by a whole one.
    link = RedisLink(connect(redis_url, 1.0), timeout=1.0, metrics=Metrics(CollectorRegistry()))
    try:
        await link.client.hset(record_key("evm@1:aa"), mapping=fields)
        keeper = EpochKeeper(RedisEpochs(link))
        for _ in range(3):
            await _synced(keeper)
        assert keeper.loaded and keeper.epoch not in ("", "abc")
        assert parse_record(await link.client.hmget(record_key("evm@1:aa"), "epoch", "number", "hash")) == (
            Checkpoint(keeper.epoch, 10, "0x10")
        )
        assert link.up  # no script error opened the breaker
    finally:
        await link.close()


@pytest.mark.parametrize("kind", ["string", "list"])
async def test_an_epoch_record_of_another_type_is_no_record_and_made_anew(redis_url: str, kind: str) -> None:
    # Outside attack: a string at the record's key failed every exchange (WRONGTYPE): no replica
    # shared its space until an operator deleted it by hand.
    link = RedisLink(connect(redis_url, 1.0), timeout=1.0, metrics=Metrics(CollectorRegistry()))
    try:
        key = record_key("evm@1:aa")
        await (link.client.set(key, "garbage") if kind == "string" else link.client.rpush(key, "a"))
        keeper = EpochKeeper(RedisEpochs(link))
        for _ in range(3):
            await _synced(keeper)
        assert keeper.loaded and keeper.epoch
        assert parse_record(await link.client.hmget(key, "epoch", "number", "hash")) == (
            Checkpoint(keeper.epoch, 10, "0x10")
        )
    finally:
        await link.close()


async def test_a_flushed_epoch_record_never_brings_back_a_state_the_replicas_left(
    anvil: Anvil, redis_server: RedisServer
) -> None:
    if redis_server.proc is None:
        redis_server.start()
    redis_server.flush()
    settings = settings_for(EVM_UPSTREAM=anvil.url, REDIS_URL=redis_server.url, ALLOW_NAMESPACES="anvil")
    first = await start_proxy(settings)
    second = None
    try:
        await first.head_at(anvil.block_number())
        read = ("eth_getStorageAt", [DEV_ACCOUNT, "0x5", "latest"])
        before = anvil.rpc(read[0], *read[1])
        assert await first.result(*read) == before and await first.result(*read) == before  # kept
        changed = "0x" + "07".rjust(64, "0")
        await first.result("anvil_setStorageAt", [DEV_ACCOUNT, "0x5", changed])
        assert await first.result(*read) == changed
        trackers: list[Any] = [first.app[SERVICE].networks["evm"].tracker]
        redis_server.flush()  # the epoch record, the trail and the entries go
        second = await start_proxy(settings)  # it makes the record anew
        trackers.append(second.app[SERVICE].networks["evm"].tracker)
        await second.head_at(anvil.block_number())

        async def one_epoch() -> bool:
            spaces = [t.head.space if t.head is not None else None for t in trackers]
            return None not in spaces and len({s.split("/")[0] for s in spaces}) == 1

        await eventually(one_epoch, 15, "both replicas in the epoch made after the flush")
        for proxy in (first, second, first, second):
            assert await proxy.result(*read) == changed
    finally:
        await first.close()
        if second is not None:
            await second.close()


FINALITY = 64  # anvil: finalized = latest - 64


async def _final_read(proxy: Proxy, block: int) -> str:
    """X-Cache of a read of a final block's state."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [DEV_ACCOUNT, "0x0", hex(block)]}
    status, reply, headers = await proxy.post(body)
    assert status == 200 and "result" in reply, reply
    return str(headers.get("X-Cache"))


async def _forks_note(proxy: Proxy) -> str:
    async with proxy.session.get(f"{proxy.base}/readyz") as resp:
        ready = await resp.json()
    assert resp.status == 200, ready
    return str(ready.get("forks", {}).get("evm", ""))


async def _aside_until_redis_answers(proxy: Proxy, answers: Callable[[], Awaitable[None]]) -> None:
    """A replica that could not read its epoch's record since it started: its memory tier serves in a
    space of its own (said on /readyz), and the shared space is named once Redis answers."""
    tracker = proxy.app[SERVICE].networks["evm"].tracker
    assert [await _final_read(proxy, 1) for _ in range(3)] == ["MISS", "HIT", "HIT"]
    assert "cannot read the shared cache's trail" in await _forks_note(proxy)
    assert tracker.head is not None and tracker.head.space is not None and "/~" in tracker.head.space
    await answers()

    async def shared() -> bool:
        space = tracker.head.space if tracker.head is not None else None
        return space is not None and "/~" not in space and await _forks_note(proxy) == ""

    await eventually(shared, 15, "the shared key space named once Redis answers")
    assert [await _final_read(proxy, 2) for _ in range(2)] == ["MISS", "HIT"]


async def test_a_replica_started_while_redis_is_down_caches_in_a_space_of_its_own_until_redis_answers(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    redis = RedisServer()
    try:
        redis.stop()
        proxy = await make_proxy(EVM_UPSTREAM=anvil.url, REDIS_URL=redis.url)
        await proxy.head_at(anvil.mine(FINALITY + 4))

        async def answers() -> None:
            redis.start()

        await _aside_until_redis_answers(proxy, answers)
    finally:
        redis.stop()


async def test_a_replica_started_on_a_full_noeviction_redis_caches_in_a_space_of_its_own_until_it_has_room(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    redis = RedisServer("--maxmemory-policy", "noeviction")
    client = aioredis.from_url(redis.url)
    try:
        await client.set("filler", "x" * 100_000)
        await client.config_set("maxmemory", "1")  # every write refused (OOM); reads still answered
        proxy = await make_proxy(EVM_UPSTREAM=anvil.url, REDIS_URL=redis.url)
        await proxy.head_at(anvil.mine(FINALITY + 4))

        async def answers() -> None:
            await client.config_set("maxmemory", "0")

        await _aside_until_redis_answers(proxy, answers)
    finally:
        await client.aclose()
        redis.stop()
