"""A block's hash from its header fields (Yellow Paper 4.3): every fork's field set from Frontier to
Prague hashes to the block's hash, and a header with an unknown, missing, renamed or tampered field is
refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.chain.headers import HeaderError, header_hash, verify_header
from tests.support import CONTRACTS, DEV_ACCOUNT, Anvil

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ANVIL_HEADERS: dict[str, dict[str, Any]] = json.loads((FIXTURES / "anvil_headers.json").read_text())
HARDFORKS = [
    "frontier",
    "homestead",
    "byzantium",
    "istanbul",
    "berlin",
    "london",
    "paris",
    "shanghai",
    "cancun",
    "prague",
]
EMPTY_ROOT = "0x56e81f171bcc55a6ff8345e692c0f86e5b48e01b996cadc001622fb5e363b421"
ZERO32 = "0x" + "00" * 32

MAINNET_GENESIS = {
    "hash": "0xd4e56740f876aef8c010b86a40d5f56745a118d0906a34e69aec8c0db1cb8fa3",
    "parentHash": ZERO32,
    "sha3Uncles": "0x1dcc4de8dec75d7aab85b567b6ccd41ad312451b948a7413f0a142fd40d49347",
    "miner": "0x" + "00" * 20,
    "stateRoot": "0xd7f8974fb5ac78d9ac099b9ad5018bedc2ce0a72dad1827a1709da30580f0544",
    "transactionsRoot": EMPTY_ROOT,
    "receiptsRoot": EMPTY_ROOT,
    "logsBloom": "0x" + "00" * 256,
    "difficulty": "0x400000000",
    "number": "0x0",
    "gasLimit": "0x1388",
    "gasUsed": "0x0",
    "timestamp": "0x0",
    "extraData": "0x11bbe8db4e347b4e8c937c1c8370e4b5ed33adb3db69cbdb7a38e1e50b1b82fa",
    "mixHash": ZERO32,
    "nonce": "0x0000000000000042",
    "totalDifficulty": "0x400000000",
    "size": "0x21c",
    "uncles": [],
    "transactions": [],
}
MAINNET_BLOCK_1 = dict(
    MAINNET_GENESIS,
    hash="0x88e96d4537bea4d9c05d12549907b32561d3bf31f45aae734cdc119f13406cb6",
    parentHash=MAINNET_GENESIS["hash"],
    miner="0x05a56e2d52c817161883f50c441c3228cfe54d9f",
    stateRoot="0xd67e4d450343046425ae4271474353857ab860dbc0a1dde64b41b5cd3a532bf3",
    difficulty="0x3ff800000",
    number="0x1",
    timestamp="0x55ba4224",
    extraData="0x476574682f76312e302e302f6c696e75782f676f312e342e32",
    mixHash="0x969b900de27b6ac6a67742365dd65f55a0526c41fd18e1b16f1a1215c2e66f59",
    nonce="0x539bd4979fef1ec4",
)


class TestFixtures:
    @pytest.mark.parametrize("block", [MAINNET_GENESIS, MAINNET_BLOCK_1], ids=["genesis", "block1"])
    def test_mainnet_frontier_headers_hash_to_their_hash(self, block: dict[str, Any]) -> None:
        assert "0x" + verify_header(block).hash.hex() == block["hash"]

    @pytest.mark.parametrize("fork", HARDFORKS)
    def test_each_forks_header_hashes_to_its_hash(self, fork: str) -> None:
        header = verify_header(ANVIL_HEADERS[fork])
        assert header.number == 1 and header.receipts_root.hex() == ANVIL_HEADERS[fork]["receiptsRoot"][2:]


PRAGUE = ANVIL_HEADERS["prague"]


class TestRefusals:
    def test_a_header_with_an_unknown_field_is_refused(self) -> None:
        with pytest.raises(HeaderError, match="unknown header field"):
            header_hash(dict(PRAGUE, futureRoot=ZERO32))

    @pytest.mark.parametrize("field", ["stateRoot", "nonce", "requestsHash"])
    def test_a_header_with_a_missing_field_is_refused(self, field: str) -> None:
        block = dict(PRAGUE)
        del block[field]  # without requestsHash the rest is a Cancun header: it hashes, to another hash
        with pytest.raises(HeaderError):
            verify_header(block)

    def test_a_later_fork_field_without_the_earlier_ones_is_refused(self) -> None:
        # London's baseFeePerGas renamed Cancun's blobGasUsed would encode the same list: refused by name.
        block = dict(ANVIL_HEADERS["london"])
        block["blobGasUsed"] = block.pop("baseFeePerGas")
        with pytest.raises(HeaderError, match="fork"):
            header_hash(block)

    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("stateRoot", "0x" + "11" * 32),
            ("gasUsed", "0x1"),
            ("extraData", "0x00"),
            ("nonce", "0x0000000000000001"),
            ("timestamp", "0x1"),
            ("requestsHash", ZERO32),
        ],
    )
    def test_a_tampered_field_does_not_hash_to_the_blocks_hash(self, field: str, value: str) -> None:
        with pytest.raises(HeaderError, match="do not hash"):
            verify_header(dict(PRAGUE, **{field: value}))

    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("gasUsed", "0x01"),
            ("gasUsed", "0x"),
            ("gasUsed", 5),
            ("miner", "0x" + "00" * 19),
            ("nonce", "0x00"),
            ("stateRoot", "0x" + "zz" * 32),
            ("extraData", "0x0"),
            ("baseFeePerGas", None),
        ],
    )
    def test_a_malformed_field_is_refused(self, field: str, value: Any) -> None:
        with pytest.raises(HeaderError):
            header_hash(dict(PRAGUE, **{field: value}))

    def test_anvils_pre_cancun_genesis_with_blob_fields_but_no_base_fee_is_refused(self) -> None:
        # Anvil shows blobGasUsed and excessBlobGas on a pre-Cancun genesis: no fork's header has them so.
        block = dict(ANVIL_HEADERS["frontier"], blobGasUsed="0x0", excessBlobGas="0x0")
        with pytest.raises(HeaderError, match="fork"):
            header_hash(block)


@pytest.mark.parametrize("fork", ["frontier", "byzantium", "london", "shanghai", "cancun", "prague"])
def test_every_block_anvil_mines_hashes_to_its_hash(fork: str) -> None:
    node = Anvil("--hardfork", fork)
    try:
        fees = {} if fork in {"london", "shanghai", "cancun", "prague"} else {"gasPrice": hex(2 * 10**9)}
        node.rpc("evm_setAutomine", False)
        for value in range(1, 4):
            node.rpc("eth_sendTransaction", {"from": DEV_ACCOUNT, "to": "0x" + "44" * 20, "value": hex(value), **fees})
        node.rpc(
            "eth_sendTransaction",
            {"from": DEV_ACCOUNT, "data": "0x" + (CONTRACTS / "Store.bin").read_text().strip(), **fees},
        )
        node.mine(3)
        for number in range(1, node.block_number() + 1):
            block = node.rpc("eth_getBlockByNumber", hex(number), False)
            assert "0x" + verify_header(block).hash.hex() == block["hash"]
    finally:
        node.stop()
