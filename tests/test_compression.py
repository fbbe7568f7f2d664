"""gzip of large answers: the decoded bytes are exactly the uncompressed answer (and the node's result),
for a miss, a hit spliced from the kept deflate of its result, and a batch; small answers stay plain."""

from __future__ import annotations

import gzip
import json
from typing import Any

import aiohttp

from proxy.http.compression import Compressor, accepts_gzip
from proxy.rpc import jsonrpc
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

    def test_accept_encoding_is_read_with_its_q_values(self) -> None:
        assert accepts_gzip("gzip, br")
        assert accepts_gzip("deflate, *")
        assert not accepts_gzip("gzip;q=0, br")
        assert not accepts_gzip("identity") and not accepts_gzip(None)


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
