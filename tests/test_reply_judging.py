"""Judging a node's reply purely (upstream/replies.py, upstream/judging.py, rpc/result_shapes.py): the
shape each method's result must have, and a reply the proxy could not encode again, fail its try."""

from __future__ import annotations

import pytest

from proxy.rpc.result_shapes import is_data, is_quantity, is_word
from proxy.upstream.judging import UNENCODABLE, batch_answers, single_answer
from proxy.upstream.posting import Failed
from proxy.upstream.replies import batch_problem, single_problem
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

    def test_a_single_reply_of_the_wrong_shape_is_a_problem_naming_its_method_not_its_bytes(self) -> None:
        problem = single_problem({"jsonrpc": "2.0", "id": 4, "result": "a" * 1000}, 4, "eth_call")
        assert problem is not None and "malformed result" in problem and "eth_call" in problem
        assert "aaaa" not in problem
        assert single_problem({"id": 4, "result": None}, 4, "eth_call") is None  # a null: judged as before
        assert single_problem({"id": 4, "error": {"code": 3, "message": "x"}}, 4, "eth_call") is None
        assert single_problem({"id": 4, "result": [1]}, 4, "eth_syncing") is None  # no shape: any JSON

    def test_a_batch_reply_is_judged_item_by_item_against_each_calls_method(self) -> None:
        reply = [{"id": 8, "result": "0x" + word(1)}, {"id": 7, "result": "0x1"}]
        assert batch_problem(reply, range(7, 9), ["eth_blockNumber", "eth_getStorageAt"]) is None
        problem = batch_problem(reply, range(7, 9), ["eth_getStorageAt", "eth_blockNumber"])
        assert problem is not None and "eth_getStorageAt" in problem

    def test_a_reply_nested_past_what_orjson_writes_fails_its_try(self) -> None:
        assert single_answer({"id": 1, "result": nested(254)}, 1, "eth_syncing", 0.1, 0).payload.startswith(b"[[")
        with pytest.raises(Failed) as failed:
            single_answer({"id": 1, "result": nested(255)}, 1, "eth_syncing", 0.1, 0)
        assert failed.value.kind == "mismatch" and failed.value.detail == UNENCODABLE
        with pytest.raises(Failed):
            single_answer({"id": 1, "error": {"code": -1, "message": "x", "data": nested(300)}}, 1, "eth_syncing", 0, 0)
        with pytest.raises(Failed):
            batch_answers(
                [{"id": 1, "result": "0x1"}, {"id": 2, "result": nested(300)}], range(1, 3), ["a", "b"], 2, 0, 0
            )
