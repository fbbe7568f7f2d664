"""eth_getBlockReceipts checked against the header's receiptsRoot (YP 4.3.1, EIP-2718): receipts of
legacy, EIP-2930 and EIP-1559 transactions, with logs and a revert, hash to the root Anvil sealed;
a dropped log, a changed gas figure, status, order or place is refused."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

from proxy.chain.blob_schedule import SCHEDULES, blob_base_fee, update_fraction
from proxy.chain.headers import Header, verify_header
from proxy.chain.receipts_root import RECEIPT_FIELDS, ReceiptError, receipts_root, verify_receipts
from proxy.chain.trie_root import trie_root
from proxy.upstream.standing import ChainIdentity
from tests.support import CONTRACTS, DEV_ACCOUNT, Anvil, selector, word

MAINNET = ChainIdentity(1, "0xd4e56740f876aef8c010b86a40d5f56745a118d0906a34e69aec8c0db1cb8fa3")

OTHER = "0x" + "44" * 20
STORE_BIN = "0x" + (CONTRACTS / "Store.bin").read_text().strip()


class Block(NamedTuple):
    header: Header
    receipts: list[dict[str, Any]]
    transactions: list[dict[str, Any]]


def _fees(kind: int) -> dict[str, Any]:
    if kind == 0:
        return {"type": "0x0", "gasPrice": hex(3 * 10**9)}
    if kind == 1:
        access = [{"address": OTHER, "storageKeys": ["0x" + word(1)]}]
        return {"type": "0x1", "gasPrice": hex(3 * 10**9), "accessList": access}
    return {"type": "0x2", "maxFeePerGas": hex(3 * 10**9), "maxPriorityFeePerGas": hex(10**9)}


def sealed_block(node: Anvil, store: str) -> Block:
    """A block of eight transactions of types 0, 1 and 2: log emitters, a revert, a transfer, a deploy."""
    node.rpc("evm_setAutomine", False)
    calls = [
        (store, selector("emitMany(uint256)") + word(3)),
        (store, selector("boom()")),
        (OTHER, "0x"),
        (store, selector("emitMany(uint256)") + word(1)),
        (None, STORE_BIN),
        (store, selector("setX(uint256)") + word(5)),
        (store, selector("emitMany(uint256)") + word(2)),
        (OTHER, "0x"),
    ]
    for index, (to, payload) in enumerate(calls):
        tx = {
            "from": DEV_ACCOUNT,
            "data": payload,
            "gas": hex(400_000),
            "value": "0x1" if to == OTHER else "0x0",
            **_fees(index % 3),
        }
        if to:
            tx["to"] = to
        node.rpc("eth_sendTransaction", tx)
    node.mine(1)
    node.rpc("evm_setAutomine", True)
    block = node.rpc("eth_getBlockByNumber", "latest", True)
    receipts = node.rpc("eth_getBlockReceipts", block["number"])
    return Block(verify_header(block), receipts, block["transactions"])


@pytest.fixture(scope="module")
def block() -> Iterator[Block]:
    node = Anvil()
    try:
        store = node.deploy_store()
        yield sealed_block(node, store)
    finally:
        node.stop()


class TestProven:
    def test_receipts_of_types_0_1_2_hash_to_the_headers_receipts_root(self, block: Block) -> None:
        assert sorted({int(r["type"], 16) for r in block.receipts}) == [0, 1, 2]
        assert len(block.receipts) == 8 and {r["status"] for r in block.receipts} == {"0x0", "0x1"}
        assert sum(len(r["logs"]) for r in block.receipts) == 6
        assert receipts_root(block.receipts) == block.header.receipts_root
        verify_receipts(block.receipts, block.header)

    def test_an_empty_block_has_the_empty_root(self) -> None:
        assert receipts_root([]).hex() == "56e81f171bcc55a6ff8345e692c0f86e5b48e01b996cadc001622fb5e363b421"

    def test_the_trie_builder_gives_the_ethereum_trie_test_roots(self) -> None:
        # ethereum/tests TrieTests/trieanyorder.json: branch values, extensions, embedded nodes.
        cases = {
            "8aad789dff2f538bca5d8ea56e8abe10f4c7ba3a5dea95fea4cd6e7c3a1168d3": {
                "doe": "reindeer",
                "dog": "puppy",
                "dogglesworth": "cat",
            },
            "5991bb8c6514148a29db676a14ac506cd2cd5775ace63c30a4fe457715e9ac84": {
                "do": "verb",
                "horse": "stallion",
                "doge": "coin",
                "dog": "puppy",
            },
            "17beaa1648bafa633cda809c90c04af50fc8aed3cb40d16efbddee6fdf63c4c3": {"foo": "bar", "food": "bass"},
            "3f67c7a47520f79faa29255d2d3c084a7a6df0453116ed7232ff10277a8be68b": {"be": "e", "dog": "puppy", "bed": "d"},
            "8452568af70d8d140f58d941338542f645fcca50094b20f3c3d8c3df49337928": {"test": "test", "te": "testy"},
        }
        for root, content in cases.items():
            assert trie_root([(k.encode(), v.encode()) for k, v in content.items()]).hex() == root


def _refused(block: Block, receipts: list[dict[str, Any]]) -> None:
    with pytest.raises(ReceiptError):
        verify_receipts(receipts, block.header)


class TestRefused:
    def test_a_dropped_log_is_refused(self, block: Block) -> None:
        receipts = copy.deepcopy(block.receipts)
        next(r for r in receipts if len(r["logs"]) > 1)["logs"].pop()
        _refused(block, receipts)

    @pytest.mark.parametrize("field", ["gasUsed", "cumulativeGasUsed", "status", "transactionIndex", "blockNumber"])
    def test_a_changed_number_is_refused(self, block: Block, field: str) -> None:
        for index in (0, 4, 7):
            receipts = copy.deepcopy(block.receipts)
            receipts[index][field] = hex(int(receipts[index][field], 16) ^ 1)
            _refused(block, receipts)

    def test_changed_log_data_topic_or_address_is_refused(self, block: Block) -> None:
        for field, value in (("data", "0x01"), ("topics", []), ("address", OTHER), ("logIndex", "0x9")):
            receipts = copy.deepcopy(block.receipts)
            receipts[0]["logs"][0][field] = value
            _refused(block, receipts)

    def test_reordered_missing_or_foreign_receipts_are_refused(self, block: Block) -> None:
        _refused(block, block.receipts[::-1])
        _refused(block, block.receipts[:-1])
        _refused(block, [dict(r, blockHash="0x" + "11" * 32) for r in block.receipts])

    def test_a_changed_type_an_unknown_type_or_field_is_refused(self, block: Block) -> None:
        for change in ({"type": "0x1"}, {"type": "0x7e"}, {"depositNonce": "0x1"}):
            receipts = copy.deepcopy(block.receipts)
            receipts[2].update(change)
            _refused(block, receipts)


class TestEncodingUnits:
    def test_a_receipt_with_both_or_neither_status_and_root_is_refused(self, block: Block) -> None:
        both = dict(block.receipts[0], root="0x" + "00" * 32)
        neither = {k: v for k, v in block.receipts[0].items() if k != "status"}
        for receipt in (both, neither):
            with pytest.raises(ReceiptError):
                receipts_root([receipt])

    def test_a_pre_byzantium_receipt_commits_to_its_post_state_root(self, block: Block) -> None:
        legacy = {k: v for k, v in block.receipts[0].items() if k not in ("status", "type")}
        first = receipts_root([dict(legacy, root="0x" + "00" * 32)])
        assert first != receipts_root([dict(legacy, root="0x" + "01" * 32)])


class TestFromTransactions:
    def test_fields_copied_from_the_proven_transactions_follow(self, block: Block) -> None:
        # Anvil's blocks have no excess blob gas: their blob gas price is settled (the minimum, 1).
        assert {r["blobGasPrice"] for r in block.receipts} == {"0x1"} and block.header.excess_blob_gas == 0
        assert verify_receipts(block.receipts, block.header, block.transactions) == frozenset()
        left = verify_receipts(block.receipts, block.header)
        assert left == {"transactionHash", "from", "to", "contractAddress", "effectiveGasPrice"}
        assert any(r["contractAddress"] for r in block.receipts)  # the deploy's address is computed

    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("transactionHash", "0x" + "00" * 32),
            ("from", OTHER),
            ("to", OTHER),
            ("contractAddress", OTHER),
            ("effectiveGasPrice", "0x1"),
            ("blockTimestamp", 1),
            ("blobGasUsed", "0x20000"),
        ],
    )
    def test_a_field_that_is_not_the_transactions_is_refused(self, block: Block, field: str, value: Any) -> None:
        receipts = copy.deepcopy(block.receipts)
        index = next(i for i, r in enumerate(receipts) if r.get(field) != value and (field != "to" or r["to"]))
        receipts[index][field] = value
        with pytest.raises(ReceiptError):
            verify_receipts(receipts, block.header, block.transactions)

    def test_a_creations_contract_address_is_refused_on_a_call(self, block: Block) -> None:
        receipts = copy.deepcopy(block.receipts)
        created = next(r["contractAddress"] for r in receipts if r["contractAddress"])
        receipts[0]["contractAddress"] = created
        with pytest.raises(ReceiptError, match="contractAddress"):
            verify_receipts(receipts, block.header, block.transactions)


class TestCompleteness:
    @pytest.mark.parametrize("field", sorted(RECEIPT_FIELDS - {"logs", "logsBloom", "cumulativeGasUsed"}))
    def test_a_receipt_without_a_field_of_the_interfaces_receipt_is_refused(self, block: Block, field: str) -> None:
        receipts = copy.deepcopy(block.receipts)
        del receipts[0][field]
        with pytest.raises(ReceiptError, match=field):
            verify_receipts(receipts, block.header, block.transactions)

    @pytest.mark.parametrize(
        "field", ["transactionHash", "blockHash", "blockNumber", "transactionIndex", "logIndex", "removed"]
    )
    def test_a_log_without_a_field_of_the_interfaces_log_is_refused(self, block: Block, field: str) -> None:
        receipts = copy.deepcopy(block.receipts)
        del next(r for r in receipts if r["logs"])["logs"][0][field]
        with pytest.raises(ReceiptError, match=field):
            verify_receipts(receipts, block.header, block.transactions)


class TestBlobGasPrice:
    def test_another_price_than_the_one_the_header_settles_is_left_unproven(self, block: Block) -> None:
        receipts = copy.deepcopy(block.receipts)
        receipts[0]["blobGasPrice"] = "0x2"
        assert verify_receipts(receipts, block.header, block.transactions) == {"blobGasPrice"}
        receipts = copy.deepcopy(block.receipts)
        for receipt in receipts:
            receipt["blobGasPrice"] = "0x01"  # not a quantity's one form
        with pytest.raises(ReceiptError):
            verify_receipts(receipts, block.header, block.transactions)

    def test_on_an_unknown_chain_the_header_settles_the_price_at_no_excess_and_before_prague_only(
        self, block: Block
    ) -> None:
        """EIP-4844: fake_exponential(1, excess, 3338477); Prague (EIP-7691) and the blob-parameter-only
        forks change the fraction, which the header does not name."""
        cancun = dataclasses.replace(block.header, requests=False)
        assert blob_base_fee(dataclasses.replace(cancun, excess_blob_gas=0)) == 1
        assert blob_base_fee(dataclasses.replace(block.header, excess_blob_gas=0)) == 1
        for excess in (2_314_057, 2_314_058, 10 * 1024 * 1024):  # go-ethereum's TestCalcBlobFee: 1, 2, 23
            assert (
                blob_base_fee(dataclasses.replace(cancun, excess_blob_gas=excess))
                == {
                    2_314_057: 1,
                    2_314_058: 2,
                    10 * 1024 * 1024: 23,
                }[excess]
            )
        for excess in (3_338_477, 10 * 3_338_477, 123_456_789):
            price = blob_base_fee(dataclasses.replace(cancun, excess_blob_gas=excess))
            assert price is not None and abs(price - math.exp(excess / 3_338_477)) <= 1 + price * 1e-6
        assert blob_base_fee(dataclasses.replace(block.header, excess_blob_gas=1)) is None  # Prague on
        assert blob_base_fee(dataclasses.replace(cancun, excess_blob_gas=None)) is None  # before Cancun

    @pytest.mark.parametrize(
        ("moment", "fraction"),
        [
            (1_710_338_135 - 1, None),  # before Cancun: no blob gas price at all
            (1_710_338_135, 3_338_477),  # Cancun
            (1_746_612_311 - 1, 3_338_477),
            (1_746_612_311, 5_007_716),  # Prague (EIP-7691); Osaka kept it
            (1_765_290_071 - 1, 5_007_716),
            (1_765_290_071, 8_346_193),  # BPO1
            (1_767_747_671 - 1, 8_346_193),
            (1_767_747_671, 11_684_671),  # BPO2
            (1_800_000_000, 11_684_671),
        ],
    )
    def test_on_mainnet_the_fraction_is_its_fork_at_the_blocks_time(
        self, block: Block, moment: int, fraction: int | None
    ) -> None:
        header = dataclasses.replace(block.header, timestamp=moment, requests=moment >= 1_746_612_311)
        assert update_fraction(MAINNET, header) == fraction
        price = blob_base_fee(dataclasses.replace(header, excess_blob_gas=50_000_000), MAINNET)
        if fraction is None:
            assert price is None
        else:
            assert price is not None and abs(price - math.exp(50_000_000 / fraction)) <= 1 + price * 1e-6

    def test_a_chain_is_known_by_its_id_and_genesis_both(self, block: Block) -> None:
        """A devnet of chain id 1 with its own genesis (or mainnet's genesis under another id) is not
        mainnet: from Prague's layout on, its price is not settled here."""
        header = dataclasses.replace(block.header, timestamp=1_770_000_000, requests=True, excess_blob_gas=1)
        assert update_fraction(MAINNET, header) == 11_684_671
        assert update_fraction(ChainIdentity(1, "0x" + "ab" * 32), header) is None
        assert update_fraction(ChainIdentity(5, MAINNET.genesis), header) is None
        assert update_fraction(ChainIdentity(1, MAINNET.genesis.upper().replace("0X", "0x")), header) == 11_684_671
        for chain_id, first in ((11155111, 1_706_655_072), (17000, 1_707_305_664), (560048, 0)):
            known = next(c for c in SCHEDULES if c[0] == chain_id)
            assert update_fraction(ChainIdentity(*known), dataclasses.replace(header, timestamp=first)) == 3_338_477

    def test_a_mainnet_blob_receipts_price_is_proven_by_its_schedule_and_another_is_left_unproven(
        self, block: Block
    ) -> None:
        """A Prague-layout block with excess blob gas: proven on mainnet by the fork's fraction, left
        unproven (never refuted) on a chain whose schedule is not known, or at another price."""
        header = dataclasses.replace(block.header, timestamp=1_770_000_000, requests=True, excess_blob_gas=90_000_000)
        price = blob_base_fee(header, MAINNET)
        assert price is not None and price > 1
        receipts = copy.deepcopy(block.receipts)
        for receipt in receipts:
            receipt["blobGasPrice"] = hex(price)
            for item in (receipt, *receipt["logs"]):
                if "blockTimestamp" in item:
                    item["blockTimestamp"] = hex(header.timestamp)
        assert verify_receipts(receipts, header, block.transactions, MAINNET) == frozenset()
        assert verify_receipts(receipts, header, block.transactions) == {"blobGasPrice"}
        receipts[0]["blobGasPrice"] = hex(price + 1)
        assert verify_receipts(receipts, header, block.transactions, MAINNET) == {"blobGasPrice"}

    def test_an_excess_past_any_chains_price_is_left_unproven_at_once(self, block: Block) -> None:
        """The series takes about excess/fraction terms: a header claiming 2**200 would sum for ever."""
        cancun = dataclasses.replace(block.header, requests=False)
        assert blob_base_fee(dataclasses.replace(cancun, excess_blob_gas=2**200)) is None
        assert blob_base_fee(dataclasses.replace(cancun, excess_blob_gas=400 * 3_338_477)) is not None
