"""A node's reply with a long hex result is read from its bytes, not parsed by orjson (which peaks at
about 13 times a long string's size): whatever the reply, the value read is the one a whole parse
gives, and the encoded result is the one orjson makes."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import orjson
import pytest

from proxy.rpc.jsonrpc import dumps_result
from proxy.rpc.large_replies import LONG, loads_reply

HEX = "0x" + "0a" * LONG


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
