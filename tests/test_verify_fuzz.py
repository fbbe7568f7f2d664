"""Fail safe on any input: a real answer (header, proof, receipts, transactions, block) with any one
value replaced by arbitrary JSON is refused with the module's named error, never another exception,
and is still proven only when the value is unchanged or one of the fields named unproven."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.chain.block_body import BlockError, verify_block
from proxy.chain.headers import HeaderError, verify_header
from proxy.chain.receipts_root import ReceiptError, verify_receipts
from proxy.chain.senders import verify_senders
from proxy.chain.transactions_root import TransactionError, verify_transactions
from proxy.chain.trie_proof import ProofError, verify_account
from tests.support import DEV_ACCOUNT, Anvil, word
from tests.test_receipts_root import sealed_block

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from(["0x", "0x0", "0x00", "0x1", "0x" + "00" * 32, "0x" + "ff" * 20, "zz", ""])
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


class Answers(NamedTuple):
    block: dict[str, Any]
    receipts: list[dict[str, Any]]
    proof: dict[str, Any]
    store: str
    keys: list[str]


@pytest.fixture(scope="module")
def answers() -> Iterator[Answers]:
    node = Anvil()
    try:
        store = node.deploy_store()
        sealed = sealed_block(node, store)
        number = hex(sealed.header.number)
        keys = ["0x" + word(0), "0x" + word(7)]
        yield Answers(
            node.rpc("eth_getBlockByNumber", number, True),
            sealed.receipts,
            node.rpc("eth_getProof", store, keys, number),
            store,
            keys,
        )
    finally:
        node.stop()


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(value, dict):
        for key, inner in value.items():
            found += _paths(inner, (*prefix, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            found += _paths(inner, (*prefix, index))
    return found


def _replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    changed = copy.deepcopy(value)
    holder = changed
    for step in path[:-1]:
        holder = holder[step]
    holder[path[-1]] = new
    return changed


UNPROVEN = {"totalDifficulty", "blobGasPrice"}  # named unproven by verify_block and verify_receipts


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


def _same_slot(old: Any, new: Any) -> bool:
    """A storage key written shorter ("0x0") is the same 32-byte slot."""
    try:
        return isinstance(new, str) and new.startswith("0x") and int(new, 16) == int(old, 16)
    except ValueError:
        return False


def _only_named(
    check: Callable[[Any], object],
    value: Any,
    errors: tuple[type[Exception], ...],
    pick: int,
    new: Any,
    unproven: frozenset[str] = frozenset(UNPROVEN),
) -> None:
    paths = _paths(value)
    path = paths[pick % len(paths)]
    try:
        check(_replaced(value, path, new))
    except errors:
        return
    old = _at(value, path)
    named = any(step in unproven for step in path if isinstance(step, str))
    assert old == new or named or (path and path[-1] == "key" and _same_slot(old, new))


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class TestOnlyNamedErrors:
    @FUZZ
    @given(pick=st.integers(0, 10**6), new=json_values)
    def test_a_header_with_any_value_replaced(self, answers: Answers, pick: int, new: Any) -> None:
        header = {k: v for k, v in answers.block.items() if k != "transactions"}
        # The body's fields are verify_block's to check, not the header's.
        body = frozenset({"size", "uncles", "withdrawals", *UNPROVEN})
        _only_named(verify_header, header, (HeaderError,), pick, new, body)

    @FUZZ
    @given(pick=st.integers(0, 10**6), new=json_values)
    def test_a_proof_with_any_value_replaced(self, answers: Answers, pick: int, new: Any) -> None:
        root = verify_header(answers.block).state_root
        _only_named(
            lambda reply: verify_account(root, reply, answers.store, answers.keys),
            answers.proof,
            (ProofError,),
            pick,
            new,
        )

    @FUZZ
    @given(pick=st.integers(0, 10**6), new=json_values)
    def test_receipts_with_any_value_replaced(self, answers: Answers, pick: int, new: Any) -> None:
        header = verify_header(answers.block)
        _only_named(
            lambda receipts: verify_receipts(receipts, header, answers.block["transactions"]),
            answers.receipts,
            (ReceiptError,),
            pick,
            new,
        )

    @FUZZ
    @given(pick=st.integers(0, 10**6), new=json_values)
    def test_transactions_with_any_value_replaced(self, answers: Answers, pick: int, new: Any) -> None:
        header = verify_header(answers.block)

        def check(transactions: Any) -> None:
            verify_transactions(transactions, header)
            verify_senders(transactions)

        _only_named(check, answers.block["transactions"], (TransactionError,), pick, new)

    @FUZZ
    @given(pick=st.integers(0, 10**6), new=json_values)
    def test_a_block_with_any_value_replaced(self, answers: Answers, pick: int, new: Any) -> None:
        _only_named(verify_block, answers.block, (BlockError,), pick, new)


def test_the_unfuzzed_answers_are_proven(answers: Answers) -> None:
    header = verify_header(answers.block)
    verify_block(answers.block)
    verify_receipts(answers.receipts, header, answers.block["transactions"])
    assert verify_account(header.state_root, answers.proof, answers.store, answers.keys).storage
    assert DEV_ACCOUNT
