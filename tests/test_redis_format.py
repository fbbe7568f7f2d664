"""The Redis tier takes back only what the proxy writes (proxy/cache/redis_format.py): a value of
another program's, tampered, truncated or of an older format is a miss, asked of the node and written
over, never spliced into a response nor kept in memory."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis.asyncio as aioredis

from proxy.cache import tiers
from proxy.cache.redis_format import Entry, decode_value, encode_value
from proxy.logs import Throttled
from tests.support import Anvil, Proxy, ProxyFactory, eventually, settings_for, word
from tests.test_cache import finalized_store, storage

# Values the proxy never writes, each of a kind the outside tester's report showed spliced into answers.
NOT_WRITTEN = {
    "garbage": b"garbage",
    "forged_envelope_fields": b'r"0x01","id":999,"x":"',
    "truncated_json": b'r{"a":[1,',
    "unbalanced": b"r{{{",
    "kind_alone": b"r",
    "empty": b"",
    "tag_without_digits": b'f:r"0x1"',
    "tag_of_letters": b"fabc:r1",
    "binary": b"\xff\xfe\x00binary",
    "unprefixed": b'"0x01"',
    "error_not_an_object": b"e[1]",
}


class TestDecodeValue:
    @pytest.mark.parametrize("value", NOT_WRITTEN.values(), ids=NOT_WRITTEN.keys())
    def test_a_value_the_proxy_does_not_write_decodes_to_none_and_never_raises(self, value: bytes) -> None:
        assert decode_value(value) is None

    @pytest.mark.parametrize(
        "value",
        [
            b'r"0x01" 2',  # two JSON values
            b'r"\\ud800"',  # a lone surrogate: not text
            b"r nul\x00l",
            b"f007:r1",  # a height %d never writes
            b"f-1:r1",
            b"f" + b"9" * 30 + b":r1",  # past any height (and int()'s digit limit, were it longer)
            b"f12r1",  # a tag without its end
            b"enull",
            b'e{"message":"no code"}',
            b'e{"code":true,"message":"a bool is not an integer"}',
            b'e{"code":1}',  # JSON-RPC 2.0 5.1: an error object has a message
            b'e{"code":1,"message":7}',
            b"x1",
        ],
    )
    def test_a_payload_must_be_one_json_value_and_a_tag_as_encode_writes_it(self, value: bytes) -> None:
        assert decode_value(value) is None

    @pytest.mark.parametrize(
        ("stored", "final_at"),
        [
            ((b'"0x01"', False), None),
            ((b'{"a":1}', False), 77),
            ((b"null", False), 0),
            ((b'{"code":3,"message":"execution reverted","data":"0x"}', True), None),
            ((b'{"code":3,"message":"execution reverted"}', True), 12),
        ],
    )
    def test_what_encode_writes_decodes_to_itself(self, stored: tuple[bytes, bool], final_at: int | None) -> None:
        assert decode_value(encode_value(stored, final_at)) == Entry(stored, final_at)
        assert decode_value(encode_value(stored, final_at, proven=True)) == Entry(stored, final_at, proven=True)


# --- through HTTP, two replicas on one Redis ---------------------------------------------------


async def entry_key(client: aioredis.Redis, method: str) -> bytes:
    keys = [key async for key in client.scan_iter(match="rcp:c:*") if method.encode() in key]
    assert len(keys) == 1, keys
    return keys[0]


async def tampered_replicas(
    anvil: Anvil, redis_url: str, make_proxy: ProxyFactory, client: aioredis.Redis, value: bytes
) -> tuple[Proxy, str, int, bytes]:
    """A final storage entry the first replica wrote, its Redis value then replaced with `value`;
    the second replica (its memory empty) and the entry's store, block and Redis key."""
    settings = settings_for(EVM_UPSTREAM=anvil.url, REDIS_URL=redis_url)
    first = await make_proxy(settings)
    second = await make_proxy(settings)
    store, block = await finalized_store(anvil, first)
    await second.head_at(anvil.block_number())
    assert (await first.post(storage(store, "0x0", hex(block))))[2]["X-Cache"] == "MISS"
    key = await entry_key(client, "eth_getStorageAt")
    await client.set(key, value)
    return second, store, block, key


@pytest.fixture
async def redis_client(redis_url: str) -> Any:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.mark.parametrize("value", NOT_WRITTEN.values(), ids=NOT_WRITTEN.keys())
async def test_a_redis_value_the_proxy_did_not_write_is_a_miss_answered_by_the_node_and_written_over(
    anvil: Anvil, redis_url: str, make_proxy: ProxyFactory, redis_client: aioredis.Redis, value: bytes
) -> None:
    second, store, block, key = await tampered_replicas(anvil, redis_url, make_proxy, redis_client, value)
    status, reply, headers = await second.post(storage(store, "0x0", hex(block), rid=4))
    assert status == 200 and reply == {"jsonrpc": "2.0", "id": 4, "result": "0x" + word(7)}
    assert headers["X-Cache"] == "MISS" and second.upstreams["evm"].calls["eth_getStorageAt"] == 1
    proven = encode_value((b'"0x' + word(7).encode() + b'"', False), proven=True)  # proven against its header
    assert await redis_client.get(key) == proven
    assert second.metric("rpc_proxy_redis_invalid_values_total", operation="cache_get") == 1
    # The bad value was never kept in memory: what memory serves now is the node's answer.
    await redis_client.delete(key)
    _, reply, headers = await second.post(storage(store, "0x0", hex(block), rid=5))
    assert headers["X-Cache"] == "HIT" and reply == {"jsonrpc": "2.0", "id": 5, "result": "0x" + word(7)}


async def test_a_value_forging_envelope_fields_is_not_spliced_into_a_batch(
    anvil: Anvil, redis_url: str, make_proxy: ProxyFactory, redis_client: aioredis.Redis
) -> None:
    forged = NOT_WRITTEN["forged_envelope_fields"]
    second, store, block, _ = await tampered_replicas(anvil, redis_url, make_proxy, redis_client, forged)
    batch = [storage(store, "0x0", hex(block), rid=5), {"jsonrpc": "2.0", "id": 6, "method": "eth_chainId"}]
    status, reply, _ = await second.post(batch)
    assert status == 200 and reply[0] == {"jsonrpc": "2.0", "id": 5, "result": "0x" + word(7)}
    assert reply[1]["id"] == 6 and len(reply) == 2


async def test_values_the_proxy_did_not_write_are_logged_once_an_interval_without_their_bytes(
    anvil: Anvil,
    redis_url: str,
    make_proxy: ProxyFactory,
    redis_client: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This test's own interval (raising=False: so the test says what the code before the rule did).
    monkeypatch.setattr(tiers, "throttled", Throttled(logging.getLogger("proxy.cache")), raising=False)
    second, store, block, _ = await tampered_replicas(anvil, redis_url, make_proxy, redis_client, b"r-secret-ish")
    more = [storage(store, hex(position), hex(block)) for position in (1, 2)]
    for call in more:  # two more entries, then tampered too
        await second.post(call)
    async for key in redis_client.scan_iter(match="rcp:c:*"):
        if b"eth_getStorageAt" in key:
            await redis_client.set(key, b"r-secret-ish")
    third = await make_proxy(settings_for(EVM_UPSTREAM=anvil.url, REDIS_URL=redis_url))
    await third.head_at(anvil.block_number())
    for call in [storage(store, "0x0", hex(block)), *more]:
        assert (await third.post(call))[2]["X-Cache"] == "MISS"
    assert third.metric("rpc_proxy_redis_invalid_values_total", operation="cache_get") == 3
    lines = [r for r in caplog.records if r.name == "proxy.cache" and r.levelno == logging.WARNING]
    assert len(lines) == 1 and "not one this proxy writes" in lines[0].getMessage()
    assert "secret-ish" not in caplog.text


@pytest.mark.parametrize("kind", ["list", "hash"])
async def test_a_key_of_another_type_is_a_miss_of_its_own_written_over_and_the_tier_stays_up(
    anvil: Anvil, redis_url: str, make_proxy: ProxyFactory, redis_client: aioredis.Redis, kind: str
) -> None:
    """Rule (docs/caching.md): another program's value is a miss, written over, and Redis serves every
    other key; a key of another type (WRONGTYPE) opened the breaker, so Redis was skipped for every
    key, and that key, never written over, did so again on every replica and restart."""
    second, store, block, key = await tampered_replicas(anvil, redis_url, make_proxy, redis_client, b"x")
    await redis_client.delete(key)
    await (redis_client.rpush(key, "a", "b") if kind == "list" else redis_client.hset(key, "a", "b"))
    status, reply, headers = await second.post(storage(store, "0x0", hex(block), rid=4))
    assert status == 200 and reply["result"] == "0x" + word(7) and headers["X-Cache"] == "MISS", reply
    assert second.metric("rpc_proxy_redis_up") == 1

    async def written_over() -> bool:
        return bool(await redis_client.type(key) == b"string")

    await eventually(written_over, 10, "the entry written over")
    await redis_client.delete(key)  # so its next read can only be memory's or the node's
    third = await make_proxy(settings_for(EVM_UPSTREAM=anvil.url, REDIS_URL=redis_url))
    await third.head_at(anvil.block_number())
    assert (await second.post(storage(store, "0x0", hex(block))))[2]["X-Cache"] == "HIT"  # from its memory
    _, _, headers = await second.post(storage(store, "0x1", hex(block)))
    assert headers["X-Cache"] == "MISS"  # a new entry, written to Redis by a tier that stayed up ...
    _, _, headers = await third.post(storage(store, "0x1", hex(block)))
    assert headers["X-Cache"] == "HIT" and third.upstreams["evm"].calls["eth_getStorageAt"] == 0  # ... and shared
