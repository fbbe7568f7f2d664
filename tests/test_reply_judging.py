"""Judging a node's reply purely (upstream/replies.py, upstream/judging.py, rpc/result_shapes.py): the
shape each method's result must have, and a reply the proxy could not encode again, fail its try."""

from __future__ import annotations

import pytest

from proxy.rpc.result_shapes import is_data, is_quantity, is_word
from proxy.upstream.judging import UNENCODABLE, batch_answers, single_answer
from proxy.upstream.posting import Failed
from tests.lying_relay import nested
from tests.support import word


class TestShapes:
    def test_hex_data_is_0x_and_whole_bytes(self) -> None:
        assert all(is_data(v) for v in ("0x", "0x00", "0xdeadBEEF", "0x" + "ab" * 40_000))
        assert not any(is_data(v) for v in ("", "0x1", "deadbeef", "0xzz", "0x00 ", "0x 00", "0x\u00e900", 7, None))

    def test_a_storage_word_is_0x_and_64_hex_digits(self) -> None:
        assert is_word("0x" + word(7)) and is_word("0x" + "F" * 64)
        assert not any(is_word(v) for v in ("0x7", "0x" + word(7) + "00", "0x" + "g" * 64, [["0x" + word(7)]]))

    def test_a_quantity_is_0x_and_1_to_64_hex_digits(self) -> None:
        assert all(is_quantity(v) for v in ("0x0", "0x1", "0x10", "0xabc", "0x" + "f" * 64))
        assert not any(is_quantity(v) for v in ("0x", "1", "0x" + "f" * 65, "0x-1", "0x_1", "0x1 ", 1, 1.5))

    def test_a_single_answer_of_the_wrong_shape_fails_its_try_naming_its_method_not_its_bytes(self) -> None:
        with pytest.raises(Failed) as failed:
            single_answer(4, "eth_call", {"jsonrpc": "2.0", "id": 4, "result": "a" * 1000}, 0.1, 0)
        assert failed.value.kind == "mismatch" and "malformed result" in failed.value.detail
        assert "eth_call" in failed.value.detail and "aaaa" not in failed.value.detail
        assert single_answer(4, "eth_call", {"id": 4, "result": None}, 0, 0).result is None  # a null: as before
        assert single_answer(4, "eth_call", {"id": 4, "error": {"code": 3, "message": "x"}}, 0, 0).is_error
        assert single_answer(4, "eth_syncing", {"id": 4, "result": [1]}, 0, 0).result == [1]  # no shape: any JSON

    def test_an_answer_with_both_a_result_and_an_error_fails_its_try_and_jsonrpc_may_be_left_out(self) -> None:
        both = {"id": 4, "result": "0x1", "error": {"code": -32000, "message": "x"}}
        with pytest.raises(Failed) as failed:
            single_answer(4, "eth_blockNumber", both, 0, 0)
        assert failed.value.kind == "mismatch" and failed.value.detail == "malformed reply: both a result and an error"
        with pytest.raises(Failed):
            batch_answers(range(4, 5), ["eth_blockNumber"], 1, [both], 0, 0)
        assert single_answer(4, "eth_blockNumber", {"id": 4, "result": "0x1"}, 0, 0).result == "0x1"  # no "jsonrpc"
        assert single_answer(4, "eth_blockNumber", {"id": 4, "result": "0x1", "error": None}, 0, 0).result == "0x1"

    def test_a_batch_answer_is_judged_against_its_own_calls_method(self) -> None:
        reply = [{"id": 8, "result": "0x" + word(1)}, {"id": 7, "result": "0x1"}]
        judged = batch_answers(range(7, 9), ["eth_blockNumber", "eth_getStorageAt"], 2, reply, 0, 0)
        assert judged is not None and [a.result for a in judged.answers] == ["0x1", "0x" + word(1)]
        with pytest.raises(Failed) as failed:
            batch_answers(range(7, 9), ["eth_getStorageAt", "eth_blockNumber"], 2, reply, 0, 0)
        assert "eth_getStorageAt" in failed.value.detail
        # Only the answers the caller takes are judged (proof headers beside them are read for their hash).
        assert batch_answers(range(7, 9), ["eth_blockNumber", "eth_getStorageAt"], 1, reply, 0, 0) is not None

    def test_a_reply_nested_past_what_orjson_writes_fails_its_try(self) -> None:
        assert single_answer(1, "eth_syncing", {"id": 1, "result": nested(254)}, 0.1, 0).payload.startswith(b"[[")
        with pytest.raises(Failed) as failed:
            single_answer(1, "eth_syncing", {"id": 1, "result": nested(255)}, 0.1, 0)
        assert failed.value.kind == "mismatch" and failed.value.detail == UNENCODABLE
        with pytest.raises(Failed):
            single_answer(1, "eth_syncing", {"id": 1, "error": {"code": -1, "message": "x", "data": nested(300)}}, 0, 0)
        deep_second = [{"id": 1, "result": "0x1"}, {"id": 2, "result": nested(300)}]
        with pytest.raises(Failed):
            batch_answers(range(1, 3), ["eth_syncing", "eth_syncing"], 2, deep_second, 0, 0)

    def test_an_error_without_an_integer_code_fails_its_try_and_an_uncles_no_block_is_null(self) -> None:
        # JSON-RPC 2.0 5.1: an error's code is an integer; a string one is a malformed reply.
        bad = [{"code": code, "message": "x"} for code in ("-32000 server error", None, True, 1.5)]
        bad += [{"code": -32000}, {"code": -32000, "message": ["x"]}, "upstream says: boom", 123, [1], False]
        for error in bad:
            with pytest.raises(Failed) as failed:
                single_answer(2, "eth_call", {"id": 2, "error": error}, 0, 0)
            assert "integer code and a message" in failed.value.detail, error
        with pytest.raises(Failed):
            batch_answers(range(2, 3), ["eth_call"], 1, [{"id": 2, "error": {"code": "1", "message": "x"}}], 0, 0)
        # The interface: an uncle of a block no node has is null (Anvil: -32001 "Resource not found").
        missing = {"id": 2, "error": {"code": -32001, "message": "Resource not found"}}
        uncle = single_answer(2, "eth_getUncleByBlockHashAndIndex", missing, 0, 0)
        assert (uncle.payload, uncle.is_error) == (b"null", False)
        assert single_answer(2, "eth_getBlockByHash", missing, 0, 0).is_error  # only the uncle's null is so specified
        for code, message in ((-32601, "the method could not be found"), (-32005, "resource not found in quota")):
            other = {"id": 2, "error": {"code": code, "message": message}}
            assert single_answer(2, "eth_getUncleByBlockHashAndIndex", other, 0, 0).is_error  # not "no such block"
