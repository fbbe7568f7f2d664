"""gzip of large answers: the decoded bytes are exactly the uncompressed answer (and the node's result),
for a miss, a hit spliced from the kept deflate of its result, and a batch; small answers stay plain."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from typing import Any

import aiohttp
import pytest

from proxy.http import compression
from proxy.http.compression import APART_BYTES, Compressor, accepts_gzip
from proxy.rpc import jsonrpc
from tests.fake_evm import FakeEvm
from tests.memory_fill import big_call
from tests.support import Anvil, ProxyFactory, selector, word

GZIP = {"Accept-Encoding": "gzip, deflate"}


class TestSplicedGzip:
    def test_a_spliced_member_decodes_to_the_body_for_any_id(self) -> None:
        compressor = Compressor(1, 1 << 20)
        payload = json.dumps([{"data": "0x" + "ab" * 64, "n": i} for i in range(500)]).encode()
        for rid in (1, 'a,"result":b', 2**53, None):
            body = jsonrpc.encode_result(rid, payload)
            assert gzip.decompress(compressor.gzip(body)) == body
        batch = b"[" + jsonrpc.encode_result(1, payload) + b"]"
        assert gzip.decompress(compressor.gzip(batch)) == batch

    async def test_a_member_made_in_a_worker_thread_is_the_one_made_on_the_loop(self) -> None:
        threads: list[int] = []
        real = compression._deflated

        def deflated(payload: bytes) -> bytes:
            threads.append(threading.get_ident())
            return real(payload)

        compressor = Compressor(1, 1 << 24)
        payload = json.dumps([{"data": "0x" + "cd" * 64, "n": i} for i in range(5000)]).encode()
        bodies = [jsonrpc.encode_result(rid, payload) for rid in (1, "x", 2**53)]
        on_the_loop = [Compressor(1, 1 << 20).gzip(body) for body in bodies]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(compression, "_deflated", deflated)
            # Deflated once, in a worker thread, then spliced from the kept deflate: the same bytes.
            assert [await compressor.gzip_apart(body) for body in bodies] == on_the_loop
            batch = b"[" + jsonrpc.encode_result(1, payload) + b"]"
            assert gzip.decompress(await compressor.gzip_apart(batch)) == batch
        assert len(threads) == 1 and threading.get_ident() not in threads  # once, in another thread

    def test_accept_encoding_is_read_with_its_q_values(self) -> None:
        assert accepts_gzip("gzip, br")
        assert accepts_gzip("deflate, *")
        assert not accepts_gzip("gzip;q=0, br")
        assert not accepts_gzip("identity") and not accepts_gzip(None)
        assert accepts_gzip("x-gzip") and not accepts_gzip("x-gzip;q=0")  # x-gzip is gzip (RFC 9110 8.4.1.3)


def _logs_request(address: str, block: int, rid: Any) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": rid,
        "method": "eth_getLogs",
        "params": [{"address": address, "fromBlock": hex(block), "toBlock": hex(block)}],
    }


async def test_gzip_answers_equal_the_nodes_bytes_after_decoding(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    address = anvil.deploy_store()
    block = int(anvil.send(address, selector("emitMany(uint256)") + word(200), gas=8_000_000)["blockNumber"], 16)
    anvil.mine(70)  # final: cached for good
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url)
    await proxy.head_at(block + 64)
    async with aiohttp.ClientSession(auto_decompress=False) as raw:
        async with raw.post(anvil.url, json=_logs_request(address, block, 7)) as resp:
            node_bytes = await resp.read()
            node = json.loads(node_bytes)["result"]
        plain = None
        for rid, cache in ((7, "MISS"), (7, "HIT"), ("other-id", "HIT")):
            async with raw.post(proxy.url(), json=_logs_request(address, block, rid), headers=GZIP) as resp:
                assert resp.headers["Content-Encoding"] == "gzip" and resp.headers["X-Cache"] == cache
                compressed = await resp.read()
            decoded = gzip.decompress(compressed)
            assert len(compressed) * 5 < len(decoded)
            assert json.loads(decoded) == {"jsonrpc": "2.0", "id": rid, "result": node}
            if rid == 7:
                async with raw.post(
                    proxy.url(), json=_logs_request(address, block, 7), headers={"Accept-Encoding": "identity"}
                ) as resp:
                    assert "Content-Encoding" not in resp.headers  # not asked for: not compressed
                    plain = await resp.read()
                assert decoded == plain == node_bytes  # the node's own bytes, id and all
        batch = [_logs_request(address, block, 1), _logs_request(address, block, 2)]
        async with raw.post(proxy.url(), json=batch, headers=GZIP) as resp:
            assert resp.headers["Content-Encoding"] == "gzip"
            assert [a["result"] for a in json.loads(gzip.decompress(await resp.read()))] == [node, node]
        async with raw.post(
            proxy.url(), json={"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}, headers=GZIP
        ) as resp:
            assert "Content-Encoding" not in resp.headers  # under COMPRESS_MIN_BYTES


async def test_a_large_answer_is_compressed_while_the_event_loop_serves_others(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rule: an answer of APART_BYTES or more is compressed in a worker thread. Before, a batch answer
    # (never cached) and a large single answer were compressed on the event loop at each request: a
    # 30 MB batch answer held every other client about 1 s (an outside attack). Here the batch's
    # compression waits until another client has had its answer, which it could never have had if
    # the compression held the loop.
    started, released = threading.Event(), threading.Event()
    real = compression.gzip_whole

    def held_gzip(body: bytes) -> bytes:
        started.set()
        assert released.wait(20), "the other client was not answered while the batch was compressed"
        return real(body)

    monkeypatch.setattr(compression, "gzip_whole", held_gzip)
    node = await FakeEvm(call_result_bytes=APART_BYTES // 2 + 1000).start()
    try:
        proxy = await make_proxy(EVM_UPSTREAM=node.url)
        batch = asyncio.ensure_future(proxy.post([big_call(1), big_call(2)], headers=GZIP))
        assert await asyncio.to_thread(started.wait, 20)
        status, body, _ = await proxy.post({"jsonrpc": "2.0", "id": 9, "method": "eth_chainId", "params": []})
        assert status == 200 and body["id"] == 9
        released.set()
        status, answers, headers = await asyncio.wait_for(batch, 30)
        assert status == 200 and headers["Content-Encoding"] == "gzip"  # decoded by the client
        assert [answer["id"] for answer in answers] == [1, 2]
        assert all(len(answer["result"]) > APART_BYTES // 2 for answer in answers)
    finally:
        released.set()
        await node.close()
