"""Merkle-Patricia proofs (Yellow Paper appendix D; EIP-1186 eth_getProof): what a node says about
an account or a storage slot, checked against a state root from a header whose hash is known. Pure.

A proof is the list of trie nodes on the path from the root to the key. Each node must hash to the
reference its parent holds (the root for the first), so with keccak-256 collision resistant the
nodes are the trie's own and the walk along the key's nibbles reaches the value the trie holds, or
proves there is none (an empty branch slot, a leaf or an extension for another path). Anything else
(a node that does not hash to its reference, a malformed node, a path the nodes do not cover, nodes
left over) raises ProofError: nothing unproven is returned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.chain.fields import FieldError, data, keccak256, quantity
from proxy.chain.rlp import Item, RlpError, decode, decode_int, encode
from proxy.memo import ByteBoundMemo

EMPTY_ROOT = keccak256(b"\x80")  # the root of the empty trie: keccak-256 of RLP("")
EMPTY_CODE_HASH = keccak256(b"")
_HASH = 32  # a child reference of 32 bytes is a hash; a node whose RLP is shorter is embedded in its parent

_NIBBLE = bytes.maketrans(b"0123456789abcdef", bytes(range(16)))


class ProofError(ValueError):
    """A proof that does not prove what it is said to: tampered, malformed, or for another root or key."""


# Nodes already checked, by their bytes: (their keccak-256, their decoded RLP). Both are pure functions
# of the bytes, so a node met again (a trie's upper levels are in every proof at its root; the same
# account's path in every read of its storage at one block) is neither hashed nor decoded again. At
# most KNOWN_NODE_BYTES of node bytes (a decoded node takes some three times its bytes), the oldest
# forgotten first; a node enters only once it hashed to the reference that led to it.
KNOWN_NODE_BYTES = 1024 * 1024
_known: ByteBoundMemo[bytes, tuple[bytes, Item]] = ByteBoundMemo(KNOWN_NODE_BYTES)


def _checked_node(raw: bytes, ref: bytes) -> Item:
    """The decoded node when `raw` hashes to `ref`; ProofError otherwise."""
    known = _known.get(raw)
    if known is not None:
        if known[0] != ref:
            raise ProofError("a node does not hash to its parent's reference")
        return known[1]
    digest = keccak256(raw)
    if digest != ref:
        raise ProofError("a node does not hash to its parent's reference")
    try:
        node = decode(raw)
    except RlpError as exc:
        raise ProofError(f"a node is not RLP: {exc}") from exc
    _known.keep(raw, (digest, node), len(raw))
    return node


# The trie keys of addresses and slots (their keccak-256), as many as KNOWN_KEYS, the oldest forgotten first.
KNOWN_KEYS = 4096
_known_keys: dict[bytes, bytes] = {}


def _trie_key(key: bytes) -> bytes:
    hashed = _known_keys.get(key)
    if hashed is None:
        hashed = keccak256(key)
        if len(_known_keys) >= KNOWN_KEYS:
            del _known_keys[next(iter(_known_keys))]
        _known_keys[key] = hashed
    return hashed


def _nibbles(key: bytes) -> bytes:
    """The key's nibbles, one a byte: its hex digits mapped to 0-15."""
    return key.hex().encode().translate(_NIBBLE)


def _hex_prefix(encoded: Item) -> tuple[bytes, bool]:
    """A leaf's or an extension's path (nibbles) and whether it is a leaf (YP appendix C)."""
    if not isinstance(encoded, bytes) or not encoded:
        raise ProofError("a node's path is not a hex-prefix string")
    flag = encoded[0] >> 4
    if flag > 3:
        raise ProofError("a hex-prefix flag above 3")
    odd = flag & 1
    if not odd and encoded[0] & 0x0F:
        raise ProofError("an even hex-prefix path with a non-zero pad nibble")
    path = (bytes((encoded[0] & 0x0F,)) if odd else b"") + _nibbles(encoded[1:])
    leaf = flag >= 2
    if not leaf and not path:
        raise ProofError("an extension with an empty path")
    return path, leaf


def _reference(child: Item) -> Item:
    """A child reference: a 32-byte hash, or a node embedded because its RLP is under 32 bytes."""
    if isinstance(child, bytes):
        if len(child) != _HASH:
            raise ProofError("a child reference that is neither a hash nor a node")
        return child
    if len(encode(child)) >= _HASH:
        raise ProofError("an embedded node of 32 bytes or more")
    return child


def prove(root: bytes, key: bytes, proof: Sequence[bytes]) -> bytes | None:
    """The value the trie with this root holds at `key` (for the state and storage tries, the keccak-256
    of the address or slot), or None when the proof shows it holds none. ProofError otherwise."""
    if root == EMPTY_ROOT and not proof:  # geth proves an empty storage trie with no nodes
        return None
    path = _nibbles(key)
    at = 0
    used = 0
    ref: Item = root
    while True:
        if isinstance(ref, bytes):
            if used == len(proof):
                raise ProofError("the proof ends before the path does")
            raw = proof[used]
            used += 1
            node = _checked_node(raw, ref)
            if node == b"" and used == 1:  # the empty trie's root node: RLP("")
                value = None
                break
        else:
            node = ref
        if not isinstance(node, list):
            raise ProofError("a node is not a list")
        if len(node) == 17:
            if at == len(path):
                end = node[16]
                if not isinstance(end, bytes):
                    raise ProofError("a branch's value is not a string")
                value = end or None
                break
            child = node[path[at]]
            at += 1
            if child == b"":
                value = None
                break
            ref = _reference(child)
        elif len(node) == 2:
            part, leaf = _hex_prefix(node[0])
            if leaf:
                stored = node[1]
                if not isinstance(stored, bytes) or not stored:
                    raise ProofError("a leaf's value is not a non-empty string")
                value = stored if path[at:] == part else None
                break
            if path[at : at + len(part)] != part:
                value = None
                break
            at += len(part)
            ref = _reference(node[1])
        else:
            raise ProofError("a node that is neither a branch, an extension nor a leaf")
    if used != len(proof):
        raise ProofError("nodes left over after the path's end")
    return value


@dataclass(frozen=True, slots=True)
class ProvenAccount:
    """An account and storage values, each proven against a state root; `exists` False for an
    account the state does not hold (its fields are then the empty account's)."""

    address: bytes
    exists: bool
    nonce: int
    balance: int
    storage_hash: bytes
    code_hash: bytes
    storage: Mapping[bytes, int]  # 32-byte slot -> value


def slot_key(value: Any) -> bytes:
    """A storage key as 32 bytes: 0x and up to 64 hex digits, left-padded."""
    if not isinstance(value, str) or not value.startswith("0x") or not 2 < len(value) <= 66:
        raise ProofError("a storage key is not up to 32 bytes of hex")
    try:
        # bytes.fromhex, not int(): a 64-digit key read as a number costs more than the rest of
        # the key's check (several per verified storage read). Whitespace between digit pairs,
        # which fromhex skips, leaves fewer than 32 bytes; underscores and signs it refuses.
        key = bytes.fromhex(value[2:].rjust(64, "0"))
    except ValueError:
        raise ProofError("a storage key is not up to 32 bytes of hex") from None
    if len(key) != 32:
        raise ProofError("a storage key is not up to 32 bytes of hex")
    return key


def _nodes(value: Any) -> list[bytes]:
    if not isinstance(value, list):
        raise ProofError("a proof is not a list of nodes")
    return [data(node, "proof node") for node in value]


_Fields = tuple[bool, int, int, bytes, bytes]  # an account's: exists, nonce, balance, storage hash, code hash


def _account(value: bytes | None) -> _Fields:
    """The state trie's value for an account: RLP([nonce, balance, storageRoot, codeHash])."""
    if value is None:
        return False, 0, 0, EMPTY_ROOT, EMPTY_CODE_HASH
    try:
        fields = decode(value)
        if not isinstance(fields, list) or len(fields) != 4:
            raise ProofError("an account is not four fields")
        nonce, balance, storage, code = fields
        if not (isinstance(storage, bytes) and isinstance(code, bytes) and len(storage) == len(code) == _HASH):
            raise ProofError("an account's storage root or code hash is not 32 bytes")
        return True, decode_int(nonce), decode_int(balance), storage, code
    except RlpError as exc:
        raise ProofError(f"an account is not RLP: {exc}") from exc


def _storage_value(value: bytes | None) -> int:
    """A storage trie's value: RLP of the slot's value as a minimal integer. A slot written back to zero
    leaves the trie in geth, but Anvil keeps a leaf holding zero: the root commits to it, so it proves
    the zero the node shows."""
    if value is None:
        return 0
    try:
        return decode_int(decode(value))
    except RlpError as exc:
        raise ProofError(f"a storage value is not an RLP integer: {exc}") from exc


# Accounts proven, by (state root, address): the account's part of the reply as the node wrote it (its
# proof's nodes, its four fields) and what it proved. That part proven again is the same pure check of
# the same text, so a read of one account's storage slot by slot at one block proves the account once.
# At most KNOWN_ACCOUNT_BYTES of proof text, the oldest forgotten first.
KNOWN_ACCOUNT_BYTES = 512 * 1024
_known_accounts: ByteBoundMemo[tuple[bytes, bytes], tuple[Any, tuple[Any, ...], _Fields]] = ByteBoundMemo(
    KNOWN_ACCOUNT_BYTES
)


def _proven_account(state_root: bytes, address: bytes, reply: Mapping[str, Any]) -> _Fields:
    """The account's fields (exists, nonce, balance, storage hash, code hash), each of the reply's
    checked against what its account proof shows at `state_root`; ProofError otherwise."""
    nodes: Any = reply.get("accountProof")
    texts = (reply.get("nonce"), reply.get("balance"), reply.get("storageHash"), reply.get("codeHash"))
    known = _known_accounts.get((state_root, address))
    if known is not None and known[0] == nodes and known[1] == texts:
        return known[2]
    account = _account(prove(state_root, _trie_key(address), _nodes(nodes)))
    claimed = (
        quantity(texts[0], "nonce"),
        quantity(texts[1], "balance"),
        data(texts[2], "storageHash", _HASH),
        data(texts[3], "codeHash", _HASH),
    )
    if claimed != account[1:]:
        raise ProofError("the account's fields are not the proven ones")
    size = sum(len(node) for node in nodes)  # strings, or _nodes would have refused them
    _known_accounts.keep((state_root, address), (list(nodes), texts, account), size)
    return account


def verify_account(state_root: bytes, reply: Mapping[str, Any], address: str, keys: Sequence[str]) -> ProvenAccount:
    """An eth_getProof reply for `address` and storage `keys`, every field of it checked against
    `state_root`; ProofError when any field is not what the proofs show."""
    if not isinstance(reply, Mapping):
        raise ProofError("a proof is not an object")
    try:
        asked = data(address, "address", 20)
        if data(reply.get("address"), "address", 20) != asked:
            raise ProofError("the proof is for another address")
        exists, nonce, balance, storage_hash, code_hash = _proven_account(state_root, asked, reply)
        entries = reply.get("storageProof")
        if not isinstance(entries, list) or len(entries) != len(keys):
            raise ProofError("not one storage proof per key asked")
        storage: dict[bytes, int] = {}
        for wanted, entry in zip(keys, entries, strict=True):
            slot = slot_key(wanted)
            if not isinstance(entry, Mapping) or slot_key(entry.get("key")) != slot:
                raise ProofError("a storage proof for another key")
            value = _storage_value(prove(storage_hash, _trie_key(slot), _nodes(entry.get("proof"))))
            if quantity(entry.get("value"), "storage value") != value:
                raise ProofError("a storage value is not the proven one")
            storage[slot] = value
    except FieldError as exc:
        raise ProofError(str(exc)) from exc
    return ProvenAccount(asked, exists, nonce, balance, storage_hash, code_hash, storage)


def verify_code(code: Any, code_hash: bytes) -> bytes:
    """eth_getCode's answer when its keccak-256 is the proven codeHash; ProofError otherwise."""
    try:
        raw = data(code, "code")
    except FieldError as exc:
        raise ProofError(str(exc)) from exc
    if keccak256(raw) != code_hash:
        raise ProofError("the code does not hash to the account's codeHash")
    return raw
