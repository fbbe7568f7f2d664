"""The root of a Merkle-Patricia trie built from its whole content (YP appendix D): how a header's
transactionsRoot, receiptsRoot and withdrawalsRoot commit to a block's lists, each item at the key
RLP(index). Pure.

A node is RLP([hex-prefix path, value]) for a leaf or an extension, or RLP of sixteen child
references and a value for a branch. A parent holds its child's keccak-256, or the child's RLP
itself when that is under 32 bytes; the root is always hashed.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.chain.fields import keccak256
from proxy.chain.rlp import encode, encode_bytes, encode_int, wrap_list

_EMBEDDED_BELOW = 32
_NIBBLE = bytes.maketrans(b"0123456789abcdef", bytes(range(16)))


def _hex_prefix(path: bytes, leaf: bool) -> bytes:
    flag = 2 if leaf else 0
    if len(path) % 2:
        first = bytes((((flag + 1) << 4) | path[0],))
        rest = path[1:]
    else:
        first = bytes((flag << 4,))
        rest = path
    return first + bytes((rest[i] << 4) | rest[i + 1] for i in range(0, len(rest), 2))


def _reference(node: bytes) -> bytes:
    """What a parent holds for a child node: the node's RLP when short, else the RLP of its hash."""
    return node if len(node) < _EMBEDDED_BELOW else encode_bytes(keccak256(node))


def _node(pairs: Sequence[tuple[bytes, bytes]], depth: int, path: bytes | None, out: list[bytes]) -> bytes:
    """The RLP of the node holding `pairs` (nibble paths, sorted, distinct; values) below `depth`.
    When `path` is given, the node lies on it, and the hashed nodes on it are added to `out`, deepest first."""
    node = _build(pairs, depth, path, out)
    if path is not None and len(node) >= _EMBEDDED_BELOW:
        out.append(node)
    return node


def _build(pairs: Sequence[tuple[bytes, bytes]], depth: int, path: bytes | None, out: list[bytes]) -> bytes:
    if len(pairs) == 1:
        key, value = pairs[0]
        return wrap_list(encode_bytes(_hex_prefix(key[depth:], True)) + encode_bytes(value))
    first, last = pairs[0][0], pairs[-1][0]  # sorted: the common prefix of all is that of these two
    shared = depth
    while shared < min(len(first), len(last)) and first[shared] == last[shared]:
        shared += 1
    if shared > depth:
        on_path = path if path is not None and path[depth:shared] == first[depth:shared] else None
        child = _node(pairs, shared, on_path, out)
        return wrap_list(encode_bytes(_hex_prefix(first[depth:shared], False)) + _reference(child))
    slots = [b"\x80"] * 16
    value = b""
    start = 0
    if len(pairs[0][0]) == depth:  # a key that ends here (never with RLP(index) keys: none is another's prefix)
        value = pairs[0][1]
        start = 1
    while start < len(pairs):
        nibble = pairs[start][0][depth]
        end = start
        while end < len(pairs) and pairs[end][0][depth] == nibble:
            end += 1
        on_path = path if path is not None and len(path) > depth and path[depth] == nibble else None
        slots[nibble] = _reference(_node(pairs[start:end], depth + 1, on_path, out))
        start = end
    return wrap_list(b"".join(slots) + encode_bytes(value))


def _nibbles(key: bytes) -> bytes:
    """The key's nibbles, one a byte: its hex digits mapped to 0-15."""
    return key.hex().encode().translate(_NIBBLE)


def trie_root(items: Sequence[tuple[bytes, bytes]]) -> bytes:
    """The root hash of the trie holding these (key, value) pairs; values must be non-empty."""
    if not items:
        return keccak256(encode(b""))
    pairs = sorted((_nibbles(key), value) for key, value in items)
    return keccak256(_build(pairs, 0, None, []))


def trie_proof_nodes(items: Sequence[tuple[bytes, bytes]], key: bytes) -> list[bytes]:
    """The proof of `key` in the trie of `items` (EIP-1186 order: root first), as a node would send it."""
    if not items:
        return []
    pairs = sorted((_nibbles(k), value) for k, value in items)
    path = _nibbles(key)
    out: list[bytes] = []
    root = _build(pairs, 0, path, out)
    return [root, *reversed(out)]  # the root is hashed whatever its size


def ordered_trie_root(values: Sequence[bytes]) -> bytes:
    """The root of the trie of a block's list: value i at key RLP(i)."""
    return trie_root([(encode_bytes(encode_int(index)), value) for index, value in enumerate(values)])
