"""The pure rules of verified answers (chain/answer_proofs.py): which block an answer is about,
which calls prove it, and an eth_getLogs answer against a block's proven logs (complete, or
inclusion only)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from proxy.chain import answer_proofs as ap

STORE = "0x" + "11" * 20
HASH = "0x" + "ab" * 32


def _log(index: int, block: str = "0x5") -> dict[str, object]:
    return {"address": STORE, "blockNumber": block, "logIndex": hex(index), "topics": [], "removed": False}


def test_an_answer_is_about_the_block_its_params_or_its_result_name() -> None:
    assert ap.answer_block("eth_getStorageAt", [STORE, "0x0", "0x10"], "0x" + "00" * 32) == 16
    assert ap.answer_block("eth_getBalance", [STORE, {"blockHash": HASH}], "0x1") == HASH
    assert ap.answer_block("eth_getTransactionReceipt", [HASH], {"blockNumber": "0x7"}) == 7
    assert ap.answer_block("eth_getBlockByHash", [HASH, False], {"number": "0x9"}) == 9
    assert ap.answer_block("eth_getBalance", [STORE, "latest"], "0x1") is None  # a tag: no block


def test_a_state_read_is_proven_by_an_eth_get_proof_with_a_32_byte_slot() -> None:
    assert ap.extra_calls("eth_getStorageAt", [STORE, "0x1", "0x10"], "0x", 16) == [
        ("eth_getProof", [STORE, ["0x" + "00" * 31 + "01"], "0x10"])
    ]
    assert ap.extra_calls("eth_getProof", [STORE, [], "0x10"], {}, 16) == []
    assert ap.extra_calls("eth_getBlockByNumber", ["0x10", False], {"transactions": [HASH]}, 16) == [
        ("eth_getBlockByNumber", ["0x10", True])
    ]
    assert ap.extra_calls("eth_getBlockByNumber", ["0x10", False], {"transactions": []}, 16) == []


def test_only_a_state_read_about_a_final_block_past_genesis_has_its_proof_asked_beside_it() -> None:
    proof = ("eth_getProof", [STORE, ["0x" + "00" * 31 + "01"], "0x10"])
    assert ap.proof_beside("eth_getStorageAt", [STORE, "0x1", "0x10"], 16) == proof
    assert ap.proof_beside("eth_getBalance", [STORE, "0x10"], 20) == ("eth_getProof", [STORE, [], "0x10"])
    assert ap.proof_beside("eth_getCode", [STORE, "0x10"], 20) == ("eth_getProof", [STORE, [], "0x10"])
    assert ap.proof_beside("eth_getStorageAt", [STORE, "0x1", "0x10"], 15) is None  # not final yet
    assert ap.proof_beside("eth_getStorageAt", [STORE, "0x1", "0x10"], None) is None  # no finality known
    assert ap.proof_beside("eth_getBalance", [STORE, "0x0"], 20) is None  # genesis: never proven
    assert ap.proof_beside("eth_getBalance", [STORE, "latest"], 20) is None  # a tag: no block to prove it at
    assert ap.proof_beside("eth_getBalance", [STORE, {"blockHash": HASH}], 20) is None  # by hash
    assert ap.proof_beside("eth_getProof", [STORE, [], "0x10"], 20) is None  # carries its own proof
    assert ap.proof_beside("eth_call", [{"to": STORE}, "0x10"], 20) is None
    assert ap.proof_beside("eth_getStorageAt", [STORE, "0x" + "1" * 70, "0x10"], 20) is None  # no such slot


def test_a_log_list_must_be_the_blocks_proven_logs_or_within_them() -> None:
    proven = [_log(0), _log(1)]
    ap.prove_block_logs([_log(0), _log(1)], proven, complete=True)
    with pytest.raises(ap.AnswerError):
        ap.prove_block_logs([_log(0)], proven, complete=True)  # a log left out
    ap.prove_block_logs([_log(0)], proven, complete=False)  # inclusion only: a subset passes
    with pytest.raises(ap.AnswerError):
        ap.prove_block_logs([_log(2)], proven, complete=False)  # made up


def test_a_removed_log_is_no_final_blocks_log() -> None:
    assert ap.logs_by_block([_log(0), _log(0, "0x6")]) == {5: [_log(0)], 6: [_log(0, "0x6")]}
    with pytest.raises(ap.AnswerError):
        ap.logs_by_block([{**_log(0), "removed": True}])
    with pytest.raises(ap.AnswerError):
        ap.logs_by_block({"not": "a list"})


@pytest.mark.parametrize(
    ("method", "params", "result"),
    [
        ("eth_getTransactionByHash", [HASH], {"hash": "0x" + "cd" * 32, "blockNumber": "0x5"}),
        ("eth_getTransactionReceipt", [HASH], {"transactionHash": "0x" + "cd" * 32, "blockNumber": "0x5"}),
        ("eth_getTransactionByBlockNumberAndIndex", ["0x5", "0x0"], {"blockNumber": "0x5", "transactionIndex": "0x1"}),
        ("eth_getTransactionByBlockNumberAndIndex", ["0x5", "0x0"], {"blockNumber": "0x6", "transactionIndex": "0x0"}),
        ("eth_getTransactionByBlockHashAndIndex", [HASH, "0x0"], {"blockHash": HASH, "transactionIndex": "0x1"}),
        (
            "eth_getTransactionByBlockHashAndIndex",
            [HASH, "0x0"],
            {"blockHash": "0x" + "cd" * 32, "transactionIndex": "0x0"},
        ),
        ("eth_getTransactionByHash", [HASH], {"blockNumber": "0x5"}),  # no hash at all
    ],
)
def test_a_transaction_or_receipt_other_than_the_one_asked_for_is_refuted_before_its_block_is_read(
    method: str, params: list[str], result: dict[str, str]
) -> None:
    """Rule: a block's proofs prove each of its items, so an item is proven only as the one its call
    names (refuted here before the header or the block, which are not given, would be read)."""
    with pytest.raises(ap.AnswerError, match="not the item asked for"):
        ap.prove(method, params, result, cast(Any, None), [])


def test_a_call_names_its_block_by_hash_only_where_its_block_param_is_one() -> None:
    upper = "0x" + "AB" * 32
    assert ap.named_hash("eth_getStorageAt", [STORE, "0x0", {"blockHash": upper}]) == HASH  # lower-cased
    assert ap.named_hash("eth_getBalance", [STORE, HASH]) == HASH
    assert ap.named_hash("eth_getLogs", [{"blockHash": HASH}]) == HASH
    assert ap.named_hash("eth_getBlockReceipts", [HASH]) == HASH
    assert ap.named_hash("eth_getUncleByBlockHashAndIndex", [HASH, "0x0"]) == HASH
    assert ap.named_hash("eth_getBlockReceipts", ["0x10"]) is None  # by number
    assert ap.named_hash("eth_getLogs", [{"fromBlock": "0x1", "toBlock": "0x2"}]) is None
    assert ap.named_hash("eth_getTransactionByHash", [HASH]) is None  # a transaction's hash, not a block's
    assert ap.named_hash("eth_getBalance", [STORE, "latest"]) is None
    assert ap.named_hash("eth_getStorageAt", [STORE]) is None  # too few params: nothing named


def test_the_proofs_calls_for_a_block_above_finality_name_it_by_its_hash() -> None:
    """Rule: a block above finality is asked for by hash, so a reorg between the answer and its proof
    cannot put another block's parts in the proof."""
    calls: list[ap.Call] = [
        ("eth_getBlockByNumber", ["0x10", True]),
        ("eth_getBlockReceipts", ["0x10"]),
        ("eth_getProof", [STORE, [], "0x10"]),
        ("eth_getBlockByHash", [HASH, False]),  # already by hash
    ]
    assert ap.by_hash(calls, 16, HASH) == [
        ("eth_getBlockByHash", [HASH, True]),
        ("eth_getBlockReceipts", [HASH]),
        ("eth_getProof", [STORE, [], {"blockHash": HASH}]),
        ("eth_getBlockByHash", [HASH, False]),
    ]
