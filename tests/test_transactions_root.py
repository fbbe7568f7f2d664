"""eth_getBlockByNumber(n, true)'s transactions checked against the header's transactionsRoot
(YP 4.3, EIP-2718): legacy, EIP-2930 and EIP-1559 transactions hash to their hash and to the root
Anvil sealed; a changed field, order, hash, price or type is refused."""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.chain.fields import keccak256
from proxy.chain.headers import verify_header
from proxy.chain.receipts_root import verify_receipts
from proxy.chain.senders import sender, verify_senders
from proxy.chain.transactions_root import (
    TransactionError,
    transaction_encoding,
    transactions_root,
    verify_transactions,
)
from tests.support import DEV_ACCOUNT, Anvil, anvil_binary
from tests.test_receipts_root import OTHER, Block, sealed_block


@pytest.fixture(scope="module")
def block() -> Iterator[Block]:
    node = Anvil()
    try:
        yield sealed_block(node, node.deploy_store())
    finally:
        node.stop()


def _refused(block: Block, transactions: list[dict[str, Any]]) -> None:
    with pytest.raises(TransactionError):
        verify_transactions(transactions, block.header)


class TestProven:
    def test_transactions_of_types_0_1_2_hash_to_the_headers_transactions_root(self, block: Block) -> None:
        assert sorted({int(tx["type"], 16) for tx in block.transactions}) == [0, 1, 2]
        assert any(tx["accessList"] for tx in block.transactions if tx["type"] == "0x1")
        assert any(tx.get("to") is None for tx in block.transactions)  # a contract creation
        assert transactions_root(block.transactions) == block.header.transactions_root
        verify_transactions(block.transactions, block.header)


class TestRefused:
    @pytest.mark.parametrize(
        "field", ["nonce", "value", "gas", "r", "s", "v", "gasPrice", "chainId", "transactionIndex", "blockNumber"]
    )
    def test_a_changed_number_is_refused(self, block: Block, field: str) -> None:
        for index in range(3):
            transactions = copy.deepcopy(block.transactions)
            if field in transactions[index]:
                transactions[index][field] = hex(int(transactions[index][field], 16) ^ 1)
                _refused(block, transactions)

    def test_changed_input_recipient_access_list_or_hash_is_refused(self, block: Block) -> None:
        access = next(i for i, tx in enumerate(block.transactions) if tx["type"] == "0x1" and tx["accessList"])
        for index, field, value in (
            (0, "input", "0x00"),
            (0, "to", OTHER),
            (access, "accessList", []),
            (1, "hash", "0x" + "00" * 32),
        ):
            transactions = copy.deepcopy(block.transactions)
            transactions[index][field] = value
            _refused(block, transactions)

    def test_a_flipped_signature_parity_is_refused(self, block: Block) -> None:
        transactions = copy.deepcopy(block.transactions)
        flipped = "0x1" if transactions[2]["yParity"] == "0x0" else "0x0"
        transactions[2].update(yParity=flipped, v=flipped)
        _refused(block, transactions)

    def test_reordered_or_missing_transactions_are_refused(self, block: Block) -> None:
        _refused(block, block.transactions[::-1])
        _refused(block, block.transactions[1:])

    def test_an_unknown_type_or_field_is_refused(self, block: Block) -> None:
        for change in ({"type": "0x7e"}, {"sourceHash": "0x" + "00" * 32}, {"type": "0x1"}):
            transactions = copy.deepcopy(block.transactions)
            transactions[2].update(change)
            _refused(block, transactions)


CAST = str(Path(anvil_binary()).with_name("cast"))
DEV_KEY = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80"  # anvil's first account
SECOND_KEY = "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d"
SIDECAR = ("blobs", "commitments", "proofs")


@pytest.fixture(scope="module")
def typed_blocks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    """Blocks with an EIP-4844 blob transaction and an EIP-7702 one, sent with cast."""
    node = Anvil()
    blob = tmp_path_factory.mktemp("blob") / "blob.txt"
    blob.write_text("hello blob")
    try:
        for extra in (
            ["--private-key", DEV_KEY, "--blob", "--eip4844", "--path", str(blob)],
            ["--private-key", SECOND_KEY, "--auth", "0x" + "55" * 20],
        ):
            subprocess.run(
                [CAST, "send", "--rpc-url", node.url, *extra, OTHER], check=True, capture_output=True, timeout=60
            )
        blocks = [node.rpc("eth_getBlockByNumber", hex(n), True) for n in range(1, node.block_number() + 1)]
        for found in blocks:
            found["receipts"] = node.rpc("eth_getBlockReceipts", found["number"])
        yield blocks
    finally:
        node.stop()


@pytest.mark.slow  # cast loads the KZG setup to build a blob: seconds
class TestBlobAndAuthorization:
    def test_an_eip7702_transaction_hashes_to_its_hash_and_the_headers_root(
        self, typed_blocks: list[dict[str, Any]]
    ) -> None:
        found = next(b for b in typed_blocks if b["transactions"][0]["type"] == "0x4")
        assert found["transactions"][0]["authorizationList"]
        header = verify_header({k: v for k, v in found.items() if k != "receipts"})
        verify_transactions(found["transactions"], header)
        verify_receipts(found["receipts"], header, found["transactions"])

    def test_a_blob_transaction_hashes_to_its_hash_without_its_sidecar(
        self, typed_blocks: list[dict[str, Any]]
    ) -> None:
        found = next(b for b in typed_blocks if b["transactions"][0]["type"] == "0x3")
        tx = {k: v for k, v in found["transactions"][0].items() if k not in SIDECAR}
        assert "0x" + keccak256(transaction_encoding(tx)).hex() == tx["hash"]
        header = verify_header({k: v for k, v in found.items() if k != "receipts"})
        assert found["receipts"][0]["blobGasUsed"] == "0x20000"  # one blob
        verify_receipts(found["receipts"], header, [tx])

    def test_a_blob_sidecar_in_a_block_is_refused_as_unproven(self, typed_blocks: list[dict[str, Any]]) -> None:
        # The trie commits to the transaction without blobs (EIP-4844); Anvil 1.7.1 seals its root over the
        # network form with the sidecar, so its blob blocks are refused either way: never kept unproven.
        found = next(b for b in typed_blocks if b["transactions"][0]["type"] == "0x3")
        header = verify_header({k: v for k, v in found.items() if k != "receipts"})
        with pytest.raises(TransactionError, match="sidecar"):
            verify_transactions(found["transactions"], header)
        stripped = [{k: v for k, v in tx.items() if k not in SIDECAR} for tx in found["transactions"]]
        with pytest.raises(TransactionError, match="transactionsRoot"):
            verify_transactions(stripped, header)


class TestSenders:
    def test_each_transactions_from_is_its_recovered_signer(self, block: Block) -> None:
        verify_senders(block.transactions)
        assert {sender(tx).hex() for tx in block.transactions} == {DEV_ACCOUNT[2:]}

    def test_the_signer_of_blob_and_authorization_transactions_is_recovered(
        self, typed_blocks: list[dict[str, Any]]
    ) -> None:
        verify_senders([b["transactions"][0] for b in typed_blocks])

    def test_a_pre_eip155_legacy_signature_recovers_its_signer(self) -> None:
        # Mainnet's first transaction (block 46147), v = 28: signed without a chain id.
        tx = {
            "type": "0x0",
            "nonce": "0x0",
            "gasPrice": "0x2d79883d2000",
            "gas": "0x5208",
            "to": "0x5df9b87991262f6ba471f09758cde1c0fc1de734",
            "value": "0x7a69",
            "input": "0x",
            "v": "0x1c",
            "r": "0x88ff6cf0fefd94db46111149ae4bfc179e9b94721fffd821d38d16464b3f71d0",
            "s": "0x45e0aff800961cfce805daef7016b9b675c137a6a41a548f7b60a3484c06a33a",
        }
        assert (
            "0x" + keccak256(transaction_encoding(tx)).hex()
            == "0x5c504ed432cb51138bcf09aa5e8a410dd4a1e204ef84bfed1be16dfba1b22060"
        )
        assert sender(tx).hex() == "a1e4380a3b1f749673e270229993ee55f35663b4"

    def test_a_from_that_is_not_the_signer_is_refused(self, block: Block) -> None:
        transactions = copy.deepcopy(block.transactions)
        transactions[1]["from"] = OTHER
        with pytest.raises(TransactionError, match="signer"):
            verify_senders(transactions)
        transactions = copy.deepcopy(block.transactions)
        transactions[0]["s"] = "0x0"
        with pytest.raises(TransactionError):
            verify_senders(transactions)
