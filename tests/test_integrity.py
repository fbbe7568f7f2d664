"""Integrity before "forever": an answer about to be kept forever is confirmed by a second upstream
(confirm_immutable) or checked against the blocks' logsBloom (confirm_logs_bloom). A relay that
leaves a log out of eth_getLogs answers is the lying upstream; Anvil is the honest one."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from proxy.chain import bloom
from proxy.chain.bloom import BLOOM_BYTES, _bits
from proxy.http.app_keys import SERVICE
from tests.fault_relay import FaultRelay
from tests.support import (
    Anvil,
    Proxy,
    ProxyFactory,
    RedisServer,
    eventually,
    selector,
    settings_for,
    start_proxy,
    word,
)
from tests.test_upstream_batching import relay


def _bloom_of(*values: str) -> bytes:
    raw = bytearray(BLOOM_BYTES)
    for value in values:
        for bit in _bits(bytes.fromhex(value[2:])):
            raw[BLOOM_BYTES - 1 - bit // 8] |= 1 << (bit % 8)
    return bytes(raw)


def _one(filled: bytes, position: Any) -> bool:
    """A filter's address or topic position against a bloom, each value looked up alone."""
    position = [position] if isinstance(position, str) else position
    return not position or any(bloom.contains(filled, v) for v in position)


class TestBloom:
    ADDRESS = "0x" + "11" * 20
    TOPIC = "0x" + "22" * 32

    def test_a_value_set_in_a_bloom_is_found_and_others_are_not(self) -> None:
        filled = _bloom_of(self.ADDRESS, self.TOPIC)
        assert bloom.contains(filled, self.ADDRESS) and bloom.contains(filled, self.TOPIC)
        assert not bloom.contains(filled, "0x" + "33" * 20)

    def test_a_filter_may_match_only_a_block_whose_bloom_has_its_address_and_topics(self) -> None:
        filled = _bloom_of(self.ADDRESS, self.TOPIC)
        assert bloom.FilterBits([self.ADDRESS], [[self.TOPIC], None]).may_match(filled)
        assert not bloom.FilterBits(["0x" + "33" * 20], None).may_match(filled)
        assert not bloom.FilterBits(None, [["0x" + "44" * 32]]).may_match(filled)

    def test_a_filters_masks_match_as_each_value_looked_up_alone_does(self) -> None:
        """Rule: FilterBits hashes each value once and decides as bloom.contains per value would: an
        address among those asked, and for each topic position one of its values (a lone string is
        one value; null, absent or empty allows any; a value not hex matches nothing)."""
        rng = random.Random(7)
        values = ["0x" + rng.randbytes(20 if i % 2 else 32).hex() for i in range(40)]
        for _ in range(300):
            filled = _bloom_of(*rng.sample(values, rng.randint(0, 6)))
            addresses = rng.choice([None, [], rng.choice(values), rng.sample(values, 3), ["0xzz"]])
            positions = rng.randint(0, 3)
            topics = [rng.choice([None, [], rng.choice(values), rng.sample(values, 2)]) for _ in range(positions)]
            expected = _one(filled, addresses) and all(_one(filled, position) for position in topics)
            assert bloom.FilterBits(addresses, topics).may_match(filled) == expected, (addresses, topics)

    def test_a_filters_cost_is_its_masks_and_bounds_the_work_on_an_answer(self) -> None:
        """Rule: a filter's values times the blooms checked is bounded (bloom.MASK_CHECKS_MAX): past it
        the check is not made, as for a range of too many blocks (twenty calls of 5,000 addresses over
        1,000 blocks held every other client for 12 s, an outside attack)."""
        addresses = ["0x" + (i + 1).to_bytes(20, "big").hex() for i in range(5000)]
        bits = bloom.FilterBits(addresses, [["0x" + "22" * 32, "0x" + "33" * 32], None])
        assert bits.cost == 5002 and bits.cost * 1000 > bloom.MASK_CHECKS_MAX
        assert not bits.may_match(bytes(BLOOM_BYTES))  # a block without logs: no filter's
        assert bloom.FilterBits(None, None).may_match(bytes(BLOOM_BYTES))  # the empty filter: as before

    def test_a_log_outside_its_blocks_bloom_was_made_up(self) -> None:
        blooms = {5: _bloom_of(self.ADDRESS, self.TOPIC)}
        real = {"blockNumber": "0x5", "address": self.ADDRESS, "topics": [self.TOPIC]}
        assert bloom.logs_in_blooms([real], blooms)
        assert not bloom.logs_in_blooms([{**real, "address": "0x" + "33" * 20}], blooms)
        assert not bloom.logs_in_blooms([{**real, "blockNumber": "0x6"}], blooms)

    def test_a_bloom_is_256_bytes_of_hex(self) -> None:
        assert bloom.parse("0x" + "00" * 256) == bytes(256)
        assert bloom.parse("0x00") is None and bloom.parse(None) is None and bloom.parse("0xzz") is None


def _networks(tmp_path: Path, urls: list[str], **fields: Any) -> str:
    """The votes and the bloom check on their own: verify = "off" (a proof would settle the answer first)."""
    fields.setdefault("verify", "off")
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())
    path = tmp_path / "networks.toml"
    path.write_text(f'[networks.evm]\nfamily = "evm"\n{extra}upstreams = {json.dumps(urls)}\n')
    return str(path)


async def _final_logs(anvil: Anvil, proxy: Proxy) -> dict[str, Any]:
    """A store contract's logs, one per block in three blocks, then enough blocks that they are final."""
    store = anvil.deploy_store()
    first = anvil.block_number() + 1
    for _ in range(3):
        anvil.send(store, selector("emitMany(uint256)") + word(1))
    latest = anvil.mine(100)
    await proxy.head_at(latest)
    per = proxy.app[SERVICE].networks["evm"].per_upstream
    if per is not None:  # an upstream whose own head is not known to hold the blocks is asked no vote

        async def vouched() -> bool:
            return all(per.states.vouches(index, latest) for index in range(per.states.size))

        await eventually(vouched, 20, "every upstream's own head at the logs' blocks")
    return {"address": store, "fromBlock": hex(first), "toBlock": hex(first + 2)}


async def _get_logs(proxy: Proxy, log_filter: dict[str, Any]) -> tuple[list[Any], str]:
    status, body, headers = await proxy.post(
        {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [log_filter]}
    )
    assert status == 200 and "result" in body, body
    return body["result"], headers.get("X-Cache", "")


async def test_a_lying_upstreams_log_list_is_never_kept_when_two_must_agree(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    liar = await FaultRelay(anvil.url).start()
    proxy = await make_proxy(NETWORKS_FILE=_networks(tmp_path, [liar.url, anvil.url], confirm_immutable=2))
    try:
        log_filter = await _final_logs(anvil, proxy)
        liar.inject("droplog", method="eth_getLogs", times=None)
        for _ in range(2):
            _logs, cache = await _get_logs(proxy, log_filter)
            assert cache != "HIT"  # never kept
        assert (
            proxy.metric("rpc_proxy_upstream_disagreements_total", network="evm", upstream="1") >= 1
            or proxy.metric("rpc_proxy_upstream_disagreements_total", network="evm", upstream="0") >= 1
        )
        assert proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason="disagreement") >= 2
        liar.clear()
        logs, _ = await _get_logs(proxy, log_filter)  # both agree now: kept
        assert len(logs) == 3
        assert (await _get_logs(proxy, log_filter))[1] == "HIT"
    finally:
        await liar.close()


async def test_the_bloom_check_catches_a_missing_log_with_one_upstream(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    liar = await FaultRelay(anvil.url).start()
    proxy = await make_proxy(NETWORKS_FILE=_networks(tmp_path, [liar.url], confirm_logs_bloom=True))
    try:
        log_filter = await _final_logs(anvil, proxy)
        liar.inject("droplog", method="eth_getLogs", times=None)
        logs, cache = await _get_logs(proxy, log_filter)
        assert len(logs) == 2 and cache != "HIT"
        assert proxy.metric("rpc_proxy_uncached_answers_total", network="evm", reason="logs_missing") == 1
        assert (await _get_logs(proxy, log_filter))[1] != "HIT"  # never kept
        liar.clear()
        logs, _ = await _get_logs(proxy, log_filter)  # an honest answer passes the check and is kept
        assert len(logs) == 3
        assert (await _get_logs(proxy, log_filter))[1] == "HIT"
    finally:
        await liar.close()


async def test_the_bloom_check_reads_final_headers_from_the_cache_and_keeps_those_it_asked_for(
    anvil: Anvil,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    relay = await FaultRelay(anvil.url).start()
    # A chunk of 10 blocks: each check reads the headers of its chunk.
    proxy = await make_proxy(
        NETWORKS_FILE=_networks(tmp_path, [relay.url], confirm_logs_bloom=True), GETLOGS_CHUNK_BLOCKS="10"
    )
    try:
        log_filter = await _final_logs(anvil, proxy)
        first, last = int(log_filter["fromBlock"], 16), int(log_filter["toBlock"], 16)
        blocks = range(first - first % 10, last - last % 10 + 10)  # the chunks the range is read in
        assert len((await _get_logs(proxy, log_filter))[0]) == 3
        assert _headers_asked(relay, blocks) == len(blocks) - (0 in blocks)  # each once
        for number in blocks:  # kept as the service keeps a final block: a client's read is a hit
            status, body, headers = await proxy.post(
                {"jsonrpc": "2.0", "id": 1, "method": "eth_getBlockByNumber", "params": [hex(number), False]}
            )
            assert status == 200 and body["result"]["number"] == hex(number) and headers["X-Cache"] == "HIT"
        # Another filter over the same blocks: another answer to check, with headers from the cache.
        wider = {**log_filter, "address": [log_filter["address"], "0x" + "11" * 20]}
        logs, _ = await _get_logs(proxy, wider)
        assert len(logs) == 3 and _headers_asked(relay, blocks) == len(blocks) - (0 in blocks)
        assert (await _get_logs(proxy, wider))[1] == "HIT"  # checked, and kept
    finally:
        await relay.close()


async def test_the_bloom_check_keeps_no_header_asked_alone(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    """A node that refuses the batch of headers answers each alone: the finalized block's header beside
    them no longer shows which chain they are on (a load balancer's members differ), so none is kept."""
    async with relay(anvil.url, refuse_batches_over=3) as seen:  # a read, its proof: batches of up to 3 pass
        proxy = await make_proxy(
            NETWORKS_FILE=_networks(tmp_path, [seen.url], confirm_logs_bloom=True), GETLOGS_CHUNK_BLOCKS="10"
        )
        log_filter = await _final_logs(anvil, proxy)
        first = int(log_filter["fromBlock"], 16)
        assert len((await _get_logs(proxy, log_filter))[0]) == 3
        assert seen.refused  # the headers' batch was refused
        status, body, headers = await proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_getBlockByNumber", "params": [hex(first), False]}
        )
        assert status == 200 and body["result"]["number"] == hex(first) and headers["X-Cache"] != "HIT"


def _headers_asked(relay: FaultRelay, blocks: range) -> int:
    numbers = {hex(n) for n in blocks if n}  # the genesis block: asked by the identity checks too
    return sum(1 for c in relay.calls if c.get("method") == "eth_getBlockByNumber" and c["params"][0] in numbers)


async def test_the_bloom_check_takes_the_headers_another_replica_kept_in_redis(
    anvil: Anvil,
    tmp_path: Path,
    redis_server: RedisServer,
    make_proxy: ProxyFactory,
) -> None:
    redis_server.flush()
    relay = await FaultRelay(anvil.url).start()
    settings = settings_for(
        NETWORKS_FILE=_networks(tmp_path, [relay.url], confirm_logs_bloom=True),
        GETLOGS_CHUNK_BLOCKS="10",
        REDIS_URL=redis_server.url,
    )
    # Inline, not make_proxy: closed mid-test, before another replica starts with an empty memory.
    first = await start_proxy(settings)
    try:
        log_filter = await _final_logs(anvil, first)
        assert len((await _get_logs(first, log_filter))[0]) == 3
    finally:
        await first.close()
    start, end = int(log_filter["fromBlock"], 16), int(log_filter["toBlock"], 16)
    blocks = range(start - start % 10, end - end % 10 + 10)
    asked = _headers_asked(relay, blocks)
    second = await make_proxy(settings)  # another replica: its memory is empty
    try:
        await second.head_at(anvil.block_number())
        wider = {**log_filter, "address": [log_filter["address"], "0x" + "11" * 20]}
        logs, _ = await _get_logs(second, wider)
        assert len(logs) == 3 and _headers_asked(relay, blocks) == asked
        assert (await _get_logs(second, wider))[1] == "HIT"  # checked, and kept
    finally:
        await relay.close()


async def test_a_tie_is_broken_by_a_third_upstream_and_the_disputed_answer_is_never_kept(
    anvil: Anvil, tmp_path: Path
) -> None:
    """confirm_immutable = 2, a log-dropping upstream first, two honest ones after it: the 1-1 tie
    is settled by asking the third; the agreed answer is served, but a disputed answer is never kept."""
    liar = await FaultRelay(anvil.url).start()
    honest = await FaultRelay(anvil.url).start()
    proxy = await start_proxy(
        settings_for(NETWORKS_FILE=_networks(tmp_path, [liar.url, anvil.url, honest.url], confirm_immutable=2))
    )
    try:
        log_filter = await _final_logs(anvil, proxy)
        liar.inject("droplog", method="eth_getLogs", times=None)
        for _ in range(2):
            logs, cache = await _get_logs(proxy, log_filter)
            assert len(logs) == 3 and cache != "HIT"
        assert any(c.get("method") == "eth_getLogs" for c in honest.calls)  # asked to break the tie
        assert proxy.metric("rpc_proxy_upstream_disagreements_total", network="evm", upstream="0") >= 2
    finally:
        await proxy.close()
        await liar.close()
        await honest.close()


async def test_a_proof_beats_a_vote(anvil: Anvil, tmp_path: Path) -> None:
    """verify = "auto" with confirm_immutable = 2: the liar's answer is refuted by its block's
    receipts, the honest one proven, served and kept, with no vote taken."""
    liar = await FaultRelay(anvil.url).start()
    proxy = await start_proxy(
        settings_for(NETWORKS_FILE=_networks(tmp_path, [liar.url, anvil.url], confirm_immutable=2, verify="auto"))
    )
    try:
        log_filter = await _final_logs(anvil, proxy)
        liar.inject("droplog", method="eth_getLogs", times=None)
        logs, _ = await _get_logs(proxy, log_filter)
        assert len(logs) == 3
        assert (await _get_logs(proxy, log_filter)) == (logs, "HIT")
        assert (
            proxy.metric("rpc_proxy_verifications_total", network="evm", method="eth_getLogs", outcome="refuted") >= 1
        )
    finally:
        await proxy.close()
        await liar.close()
