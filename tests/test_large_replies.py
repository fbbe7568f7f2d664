"""A node's reply with a long hex result is read from its bytes, not parsed by orjson (which peaks at
about 13 times a long string's size): whatever the reply, the value read is the one a whole parse
gives, and the encoded result is the one orjson makes. From a real node's socket (Anvil), a reply of
S bytes is read into one buffer (about S), and once its result is read it is gone: what stays is the
result's text and its encoding (2 S)."""

from __future__ import annotations

import gc
import json
import tracemalloc
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

import orjson
import pytest
from prometheus_client import CollectorRegistry

from proxy.metrics import Metrics
from proxy.rpc.jsonrpc import dumps_result
from proxy.rpc.large_replies import LONG, STRING_TOKEN, TEXT_STRING_TOKEN, crowded, loads_reply
from proxy.upstream.http_client import HostPool
from proxy.upstream.pool import HttpUpstream
from tests.answer_attack import start_node, zero_call
from tests.support import Anvil

HEX = "0x" + "0a" * LONG
T = TypeVar("T")


def reply(rid: int, result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "result": result}


@pytest.mark.parametrize(
    "value",
    [
        reply(1, HEX),  # one reply
        [reply(1, HEX), reply(2, "0x1"), {"jsonrpc": "2.0", "id": 3, "error": {"code": -1, "message": "x"}}],
        [reply(1, HEX), reply(2, HEX + "ff")],  # two long results in one batch
        reply(1, {"result": HEX}),  # nested deeper than a reply's member: parsed whole
        {"jsonrpc": "2.0", "id": 1, "error": {"code": 3, "message": "reverted", "data": {"result": HEX}}},
        reply(1, "\u0000" + "0" * LONG),  # a node's own NUL-led text is its own
        [reply(1, HEX), reply(2, "\u00000:0")],
        reply(1, "0x" + "zz" * LONG),  # not hex
        [1, 2, HEX],
    ],
)
def test_a_reply_read_from_its_bytes_is_what_a_whole_parse_gives(value: Any) -> None:
    for data in (orjson.dumps(value), json.dumps(value, indent=1).encode()):
        assert loads_reply(data) == orjson.loads(data)


def test_a_long_hex_result_is_read_in_about_two_times_its_size() -> None:
    data = orjson.dumps(reply(1, "0x" + "00" * 2_000_000))
    tracemalloc.start()
    try:
        parsed = loads_reply(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parsed["result"] == "0x" + "00" * 2_000_000
    assert peak < 1.5 * len(data)  # its text (the reply's bytes are the caller's); orjson: about 13 times


@pytest.mark.parametrize("value", [HEX, "0x1", "a" * LONG + '"', "a" * LONG + "\\", "é" * LONG, "\n" * LONG, 5, None])
def test_a_result_is_encoded_as_orjson_encodes_it(value: Any) -> None:
    assert dumps_result(value) == orjson.dumps(value)


SIZE = 4_000_000  # bytes of hex a real node's long result holds


@pytest.fixture(scope="module")
def node() -> Iterator[Anvil]:
    """A real Anvil whose contract returns as many zero bytes as asked (tests/answer_attack.py)."""
    node = start_node()
    yield node
    node.stop()


async def traced(read: Awaitable[T]) -> tuple[T, float, float]:
    """What `read` gives, and what tracemalloc counts once it has (in SIZEs) and at its peak meanwhile."""
    gc.collect()
    tracemalloc.start()
    try:
        value = await read
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return value, held / SIZE, peak / SIZE


async def test_a_reply_in_many_reads_is_read_into_one_buffer_not_joined_from_its_reads(node: Anvil) -> None:
    """The reads of a 4 MB reply grow one buffer: its reads kept and joined at the end cost 2 S."""
    pool = HostPool(node.url, limit=1, idle_timeout=30.0, on_connect=lambda _alone: None)
    body = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "eth_call", "params": zero_call(1, SIZE)["params"]})
    try:
        await pool.post(body, 30, 2 * SIZE)  # warm: its connection open
        response, _, peak = await traced(pool.post(body, 30, 2 * SIZE))
    finally:
        pool.close()
    assert orjson.loads(response.body)["result"] == "0x" + "0" * SIZE
    assert peak < 1.3, peak  # the buffer (grown by an eighth at most) and a read or two


async def test_a_long_result_once_read_holds_its_text_and_encoding_not_the_reply_it_came_in(node: Anvil) -> None:
    """From the node's socket to an answer: the reply's bytes are gone once its result is read (the
    future that brought them is held until the caller's step ends), and the result is encoded in one
    copy besides its quoted one."""
    pool = HttpUpstream("evm", [node.url], timeout=30, metrics=Metrics(CollectorRegistry()))
    try:
        await pool.ask(0, "eth_chainId", [], timeout=10)  # warm: its connection open
        answer, held, peak = await traced(pool.ask(0, "eth_call", zero_call(1, SIZE)["params"], timeout=30))
    finally:
        await pool.close()
    assert answer.result == "0x" + "0" * SIZE and answer.payload == b'"%s"' % answer.result.encode()
    assert held < 2.2, held  # its text and its encoding (3 S with the reply's bytes)
    assert peak < 3.3, peak  # its text, its bytes and their quoted copy


class TestCrowded:
    """The crowded check (large_replies.crowded): containers outside strings, in one pass over any reply."""

    def test_a_string_that_never_closes_is_one_token_to_the_replys_end(self) -> None:
        """Rule: an unclosed string (a broken or hostile reply) is skipped to the end in one match; were it
        no match, every later `"` would start a scan to the end again (quadratic: 120 KB took 18 s)."""
        tail = b'"' + b'\\"{' * 40_000
        for text in (tail, tail + b"\\"):
            assert STRING_TOKEN.fullmatch(text) is not None
            assert TEXT_STRING_TOKEN.fullmatch(text.decode()) is not None
        reply = b'{"jsonrpc":"2.0","id":1,"result":' + tail
        assert not crowded(reply) and not crowded(reply.decode())  # its braces are a string's: orjson refuses it

    def test_braces_inside_strings_do_not_count_and_objects_outside_do(self) -> None:
        dense_text = b'{"jsonrpc":"2.0","id":1,"error":{"code":3,"message":"' + b'{\\"[' * 60_000 + b'"}}'
        assert not crowded(dense_text)
        assert crowded(b"[" + b"{}," * 60_000 + b"{}]")
