"""A whole block answer checked against its header (YP 4.3, EIP-4895): transactions in full or as
hashes with the full ones, signers, withdrawals, uncles and RLP size follow from the hash; hashes
alone, a changed size, a missing withdrawal list or unproven uncles are refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.chain.block_body import EMPTY_UNCLES, BlockError, verify_block, withdrawals_root
from proxy.chain.fields import keccak256
from proxy.chain.headers import header_hash, header_rlp
from proxy.chain.rlp import wrap_list
from proxy.chain.trie_proof import EMPTY_ROOT
from tests.support import Anvil
from tests.test_receipts_root import sealed_block


@pytest.fixture(scope="module")
def blocks() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """The same Anvil block of eight transactions, in full and with hashes."""
    node = Anvil()
    try:
        sealed = sealed_block(node, node.deploy_store())
        number = hex(sealed.header.number)
        yield node.rpc("eth_getBlockByNumber", number, True), node.rpc("eth_getBlockByNumber", number, False)
    finally:
        node.stop()


class TestProven:
    def test_a_full_block_with_its_size_follows_from_its_hash(self, blocks: tuple[dict[str, Any], ...]) -> None:
        full, _ = blocks
        proven = verify_block(full)
        assert proven.header.number == int(full["number"], 16) and proven.unproven == {"totalDifficulty"}

    def test_a_block_of_hashes_is_proven_with_its_full_transactions(self, blocks: tuple[dict[str, Any], ...]) -> None:
        full, hashes = blocks
        verify_block(hashes, transactions=full["transactions"])

    def test_an_empty_blocks_uncles_and_withdrawals_are_the_empty_ones(self) -> None:
        assert EMPTY_UNCLES.hex() == "1dcc4de8dec75d7aab85b567b6ccd41ad312451b948a7413f0a142fd40d49347"
        assert withdrawals_root([]).hex() == "56e81f171bcc55a6ff8345e692c0f86e5b48e01b996cadc001622fb5e363b421"


class TestRefused:
    def test_transaction_hashes_alone_are_refused(self, blocks: tuple[dict[str, Any], ...]) -> None:
        _, hashes = blocks
        with pytest.raises(BlockError, match="full transactions"):
            verify_block(hashes)
        with pytest.raises(BlockError, match="hashes"):
            verify_block(hashes, transactions=blocks[0]["transactions"][::-1])

    def test_a_changed_size_or_missing_withdrawals_are_refused(self, blocks: tuple[dict[str, Any], ...]) -> None:
        full, _ = blocks
        for wrong in (int(full["size"], 16) - 1, int(full["size"], 16) + 2):
            with pytest.raises(BlockError, match="size"):
                verify_block(dict(full, size=hex(wrong)))
        without = {k: v for k, v in full.items() if k != "withdrawals"}
        with pytest.raises(BlockError, match="withdrawals"):
            verify_block(without)
        with pytest.raises(BlockError, match="withdrawals"):
            verify_block(
                dict(
                    full,
                    withdrawals=[
                        {"index": "0x0", "validatorIndex": "0x1", "address": "0x" + "11" * 20, "amount": "0x1"}
                    ],
                )
            )

    def test_uncle_hashes_without_their_headers_are_refused(self, blocks: tuple[dict[str, Any], ...]) -> None:
        full, _ = blocks
        with pytest.raises(BlockError, match="uncle"):
            verify_block(dict(full, uncles=["0x" + "22" * 32]))

    def test_a_changed_signer_is_refused(self, blocks: tuple[dict[str, Any], ...]) -> None:
        full, _ = blocks
        transactions = [dict(tx) for tx in full["transactions"]]
        transactions[3]["from"] = "0x" + "33" * 20
        with pytest.raises(BlockError, match="signer"):
            verify_block(dict(full, transactions=transactions))


def test_uncles_are_proven_by_their_headers_and_sha3uncles() -> None:
    # A self-consistent block built from Anvil headers (Anvil seals no uncles): two of them as its uncles.
    headers = json.loads((Path(__file__).resolve().parent / "fixtures/anvil_headers.json").read_text())
    uncles = [headers["frontier"], headers["berlin"]]
    block = {k: v for k, v in headers["frontier"].items() if k != "size"}
    block.update(
        uncles=[u["hash"] for u in uncles],
        sha3Uncles="0x" + keccak256(wrap_list(b"".join(header_rlp(u) for u in uncles))).hex(),
        transactions=[],
        transactionsRoot="0x" + EMPTY_ROOT.hex(),
    )
    block["hash"] = "0x" + header_hash(block).hex()
    verify_block(block, uncles=uncles)
    for wrong in (uncles[::-1], [uncles[0], headers["london"]], uncles[:1]):
        with pytest.raises(BlockError, match="uncle"):
            verify_block(block, uncles=wrong)
