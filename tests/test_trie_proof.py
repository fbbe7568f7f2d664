"""eth_getProof checked against a header's stateRoot (EIP-1186, YP appendix D): an account, its
storage slots and its code are proven, an absent account's exclusion is proven, and a proof with any
tampered node, value, order or length, or for another root or key, is refused."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.chain import trie_proof
from proxy.chain.fields import keccak256
from proxy.chain.headers import verify_header
from proxy.chain.rlp import encode
from proxy.chain.trie_proof import (
    EMPTY_CODE_HASH,
    EMPTY_ROOT,
    ProofError,
    prove,
    slot_key,
    verify_account,
    verify_code,
)
from proxy.chain.trie_root import ordered_trie_root, trie_proof_nodes, trie_root
from proxy.memo import ByteBoundMemo
from tests.support import DEV_ACCOUNT, Anvil, mapping_slot, word

ABSENT = "0x" + "12" * 20


class Chain(NamedTuple):
    node: Anvil
    store: str
    keys: list[str]
    number: int
    state_root: bytes
    reply: dict[str, Any]


@pytest.fixture(scope="module")
def chain() -> Iterator[Chain]:
    """A Store contract with slot 0 (x = 9), its mapping's entry for the deployer (42), forty slots
    written with anvil_setStorageAt (a trie of branches, extensions and leaves), at a final block."""
    node = Anvil()
    try:
        store = node.deploy_store()
        node.send(store, "0x4018d9aa" + word(9))  # setX(9)
        for slot in range(100, 140):
            node.rpc("anvil_setStorageAt", store, "0x" + word(slot), "0x" + word(slot * 1000 + 1))
        node.mine(1)
        number = node.block_number()
        header = verify_header(node.rpc("eth_getBlockByNumber", hex(number), False))
        keys = ["0x" + word(0), mapping_slot(DEV_ACCOUNT, 1), "0x" + word(5), "0x" + word(117)]
        reply = node.rpc("eth_getProof", store, keys, hex(number))
        node.send(store, "0x4018d9aa" + word(11))  # a later block with another state root
        yield Chain(node, store, keys, number, header.state_root, reply)
    finally:
        node.stop()


class TestProven:
    def test_an_account_and_its_slots_are_proven_against_the_headers_state_root(self, chain: Chain) -> None:
        account = verify_account(chain.state_root, chain.reply, chain.store, chain.keys)
        assert account.exists and account.nonce == 1
        assert list(account.storage.values()) == [9, 42, 0, 117001]

    def test_code_is_proven_by_the_accounts_code_hash(self, chain: Chain) -> None:
        account = verify_account(chain.state_root, chain.reply, chain.store, chain.keys)
        code = chain.node.rpc("eth_getCode", chain.store, hex(chain.number))
        assert verify_code(code, account.code_hash) == bytes.fromhex(code[2:])
        with pytest.raises(ProofError):
            verify_code(code[:-2] + "00", account.code_hash)

    def test_an_absent_accounts_exclusion_is_proven(self, chain: Chain) -> None:
        reply = chain.node.rpc("eth_getProof", ABSENT, ["0x" + word(0)], hex(chain.number))
        account = verify_account(chain.state_root, reply, ABSENT, ["0x" + word(0)])
        assert not account.exists and account.code_hash == EMPTY_CODE_HASH and account.storage_hash == EMPTY_ROOT
        with pytest.raises(ProofError, match="fields"):
            verify_account(chain.state_root, dict(reply, balance="0x1"), ABSENT, ["0x" + word(0)])

    def test_an_account_without_storage_proves_each_slot_empty(self, chain: Chain) -> None:
        reply = chain.node.rpc("eth_getProof", DEV_ACCOUNT, ["0x" + word(3)], hex(chain.number))
        account = verify_account(chain.state_root, reply, DEV_ACCOUNT, ["0x" + word(3)])
        assert account.storage == {(3).to_bytes(32, "big"): 0} and account.storage_hash == EMPTY_ROOT
        geth_style = copy.deepcopy(reply)
        geth_style["storageProof"][0]["proof"] = []  # geth proves the empty storage trie with no nodes
        assert verify_account(chain.state_root, geth_style, DEV_ACCOUNT, ["0x" + word(3)]).exists


def _refused(chain: Chain, reply: dict[str, Any], root: bytes | None = None) -> None:
    with pytest.raises(ProofError):
        verify_account(root or chain.state_root, reply, chain.store, chain.keys)


def _flip(node: str, at: int) -> str:
    raw = bytearray.fromhex(node[2:])
    raw[at % len(raw)] ^= 0x01
    return "0x" + raw.hex()


class TestRefused:
    def test_another_blocks_state_root_is_refused(self, chain: Chain) -> None:
        later = verify_header(chain.node.rpc("eth_getBlockByNumber", "latest", False))
        _refused(chain, chain.reply, later.state_root)

    @pytest.mark.parametrize("field", ["nonce", "balance"])
    def test_a_changed_account_field_is_refused(self, chain: Chain, field: str) -> None:
        _refused(chain, dict(chain.reply, **{field: hex(int(chain.reply[field], 16) + 1)}))

    def test_a_changed_storage_value_is_refused(self, chain: Chain) -> None:
        for index in range(len(chain.keys)):
            reply = copy.deepcopy(chain.reply)
            reply["storageProof"][index]["value"] = hex(int(reply["storageProof"][index]["value"], 16) + 1)
            _refused(chain, reply)

    def test_a_flipped_byte_in_any_node_is_refused(self, chain: Chain) -> None:
        for index, node in enumerate(chain.reply["accountProof"]):
            for at in (0, 1, len(node) // 4, len(node) // 2 - 1):
                reply = copy.deepcopy(chain.reply)
                reply["accountProof"][index] = _flip(node, at)
                _refused(chain, reply)
        for index, node in enumerate(chain.reply["storageProof"][3]["proof"]):
            reply = copy.deepcopy(chain.reply)
            reply["storageProof"][3]["proof"][index] = _flip(node, 7)
            _refused(chain, reply)

    def test_swapped_truncated_or_padded_proofs_are_refused(self, chain: Chain) -> None:
        nodes = chain.reply["accountProof"]
        assert len(nodes) >= 2
        for changed in (nodes[::-1], nodes[:-1], [*nodes, nodes[-1]], [nodes[0], *nodes]):
            _refused(chain, dict(chain.reply, accountProof=changed))
        reply = copy.deepcopy(chain.reply)
        reply["storageProof"][3]["proof"] = reply["storageProof"][3]["proof"][:-1]
        _refused(chain, reply)

    def test_a_proof_for_another_key_is_refused(self, chain: Chain) -> None:
        reply = copy.deepcopy(chain.reply)
        reply["storageProof"][0], reply["storageProof"][3] = reply["storageProof"][3], reply["storageProof"][0]
        _refused(chain, reply)
        reply = copy.deepcopy(chain.reply)
        reply["storageProof"][0]["proof"] = reply["storageProof"][3]["proof"]
        _refused(chain, reply)
        with pytest.raises(ProofError):
            verify_account(chain.state_root, chain.reply, DEV_ACCOUNT, chain.keys)

    def test_a_reply_missing_a_key_or_field_is_refused(self, chain: Chain) -> None:
        _refused(chain, dict(chain.reply, storageProof=chain.reply["storageProof"][:-1]))
        reply = dict(chain.reply)
        del reply["codeHash"]
        _refused(chain, reply)
        _refused(chain, dict(chain.reply, accountProof="0x00"))

    def test_nodes_known_from_an_earlier_proof_stay_within_their_byte_bound_and_prove_nothing_elsewhere(
        self, chain: Chain, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(trie_proof, "_known", ByteBoundMemo(600))
        # Every account's proof walked node by node:
        monkeypatch.setattr(trie_proof, "_known_accounts", ByteBoundMemo(0))
        verify_account(chain.state_root, chain.reply, chain.store, chain.keys)
        verify_account(chain.state_root, chain.reply, chain.store, chain.keys)  # met again: from memory
        held = trie_proof._known
        assert held and held.held == sum(map(len, held)) <= 600
        held.bound = 1024 * 1024
        verify_account(chain.state_root, chain.reply, chain.store, chain.keys)
        nodes = chain.reply["accountProof"]
        assert all(bytes.fromhex(node[2:]) in trie_proof._known for node in nodes)
        # A node already known proves nothing but its own place: out of order, or under another root.
        _refused(chain, dict(chain.reply, accountProof=nodes[::-1]))
        _refused(chain, dict(chain.reply, accountProof=[nodes[0], *nodes]))
        later = verify_header(chain.node.rpc("eth_getBlockByNumber", "latest", False))
        _refused(chain, chain.reply, later.state_root)

    def test_an_account_proven_once_is_not_walked_again_but_any_change_to_its_part_is_checked_anew(
        self, chain: Chain, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The account's part of a reply (its proof's nodes and four fields) proven at a state root is
        # remembered as proven for exactly that text: the same text is the same pure check.
        monkeypatch.setattr(trie_proof, "_known_accounts", ByteBoundMemo(trie_proof.KNOWN_ACCOUNT_BYTES))
        walked: list[bytes] = []
        prove = trie_proof.prove
        monkeypatch.setattr(trie_proof, "prove", lambda root, *rest: walked.append(root) or prove(root, *rest))
        first = verify_account(chain.state_root, chain.reply, chain.store, chain.keys)
        assert walked.count(chain.state_root) == 1
        again = verify_account(chain.state_root, copy.deepcopy(chain.reply), chain.store, chain.keys)
        assert again == first and walked.count(chain.state_root) == 1  # its storage proven again, not the account
        nonce = hex(int(chain.reply["nonce"], 16) + 1)
        balance = hex(int(chain.reply["balance"], 16) + 1)
        storage_hash = "0x" + "00" * 32
        nodes = chain.reply["accountProof"]
        for changed in (
            {"nonce": nonce},
            {"balance": balance},
            {"storageHash": storage_hash},
            {"codeHash": chain.reply["storageHash"]},
            {"accountProof": [*nodes[:-1], _flip(nodes[-1], 7)]},
            {"accountProof": nodes[:-1]},
        ):
            _refused(chain, dict(chain.reply, **changed))
        _refused(chain, chain.reply, verify_header(chain.node.rpc("eth_getBlockByNumber", "latest", False)).state_root)
        assert verify_account(chain.state_root, chain.reply, chain.store, chain.keys) == first

    def test_accounts_known_as_proven_stay_within_their_byte_bound(
        self, chain: Chain, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        size = sum(map(len, chain.reply["accountProof"]))
        known = ByteBoundMemo[Any, Any](size + 1)
        monkeypatch.setattr(trie_proof, "_known_accounts", known)
        verify_account(chain.state_root, chain.reply, chain.store, chain.keys)
        absent = chain.node.rpc("eth_getProof", ABSENT, [], hex(chain.number))
        absent_size = sum(map(len, absent["accountProof"]))
        verify_account(chain.state_root, absent, ABSENT, [])  # the first one forgotten to make room
        assert [address for _, address in known] == [bytes.fromhex(ABSENT[2:])]
        assert known.held == absent_size <= size + 1
        too_small = ByteBoundMemo[Any, Any](10)  # a proof larger than the bound is not kept
        monkeypatch.setattr(trie_proof, "_known_accounts", too_small)
        verify_account(chain.state_root, chain.reply, chain.store, chain.keys)
        assert too_small == {} and too_small.held == 0

    @settings(max_examples=150, deadline=None)
    @given(which=st.integers(0, 20), at=st.integers(0, 10_000), bit=st.integers(0, 7))
    def test_any_single_bit_flip_in_the_proof_is_refused(self, chain: Chain, which: int, at: int, bit: int) -> None:
        reply = copy.deepcopy(chain.reply)
        proofs = [reply["accountProof"], *(entry["proof"] for entry in reply["storageProof"])]
        nodes = [(proof, i) for proof in proofs for i in range(len(proof))]
        proof, i = nodes[which % len(nodes)]
        raw = bytearray.fromhex(proof[i][2:])
        raw[at % len(raw)] ^= 1 << bit
        proof[i] = "0x" + raw.hex()
        _refused(chain, reply)


class TestProveUnits:
    def test_the_empty_trie_proves_every_key_absent(self) -> None:
        assert prove(EMPTY_ROOT, keccak256(b"k"), []) is None
        assert prove(EMPTY_ROOT, keccak256(b"k"), [b"\x80"]) is None
        with pytest.raises(ProofError):
            prove(EMPTY_ROOT, keccak256(b"k"), [b"\x80", b"\x80"])

    @pytest.mark.parametrize("key", ["0x1", "0x01", "0x" + "0" * 63 + "1", "0xA", "0x" + "f" * 64])
    def test_a_storage_key_is_its_number_as_32_bytes_in_any_length_of_hex(self, key: str) -> None:
        assert slot_key(key) == int(key, 16).to_bytes(32, "big")

    @pytest.mark.parametrize(
        "key", ["0x", "1", "0x" + "1" * 65, "0x1_0", "0x+1", "0x 1", "0x1 ", "0x00 11", "0xg", "0x-1", 1, None]
    )
    def test_a_storage_key_not_plain_hex_of_up_to_32_bytes_is_refused(self, key: object) -> None:
        with pytest.raises(ProofError):
            slot_key(key)


class TestProofsOfBuiltTries:
    """Tries built whole (trie_root) with their proofs: short keys give branch values, extensions and nodes
    under 32 bytes embedded in their parents, which a state trie's hashed keys rarely show."""

    @settings(max_examples=200, deadline=None)
    @given(
        content=st.dictionaries(st.binary(max_size=4), st.binary(min_size=1, max_size=40), max_size=24),
        other=st.binary(max_size=4),
    )
    def test_every_key_of_a_built_trie_is_proven_and_others_proven_absent(
        self, content: dict[bytes, bytes], other: bytes
    ) -> None:
        items = list(content.items())
        root = trie_root(items)
        for key, value in items:
            assert prove(root, key, trie_proof_nodes(items, key)) == value
        assert prove(root, other, trie_proof_nodes(items, other)) == content.get(other)

    def test_a_receipts_trie_with_embedded_leaves_proves_each_index(self) -> None:
        values = [bytes((i % 7 + 1,)) for i in range(40)]  # one-byte values: leaves of a few bytes, embedded
        root = ordered_trie_root(values)
        for index, value in enumerate(values):
            key = encode(index)
            nodes = trie_proof_nodes(list(zip((encode(i) for i in range(40)), values, strict=True)), key)
            assert prove(root, key, nodes) == value
            assert all(len(node) >= 32 for node in nodes[1:])  # the short ones travel inside their parents
            if len(nodes) > 1:
                with pytest.raises(ProofError):
                    prove(root, key, nodes[:1])  # the path runs past the nodes sent
