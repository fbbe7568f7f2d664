"""Recursive Length Prefix (Yellow Paper appendix B): the byte form that Ethereum hashes headers,
transactions, receipts and trie nodes in. Pure.

The encoder takes byte strings, non-negative ints (minimal big-endian, 0 is the empty string) and
lists of those. The decoder reads trie nodes a node sent us, so it is strict: an encoding that is
not the one canonical form of its value (a single byte below 0x80 wrapped in a prefix, a length
that fits in the short form given in the long one, a length with leading zeros, bytes after the
item) is refused, so one value has exactly one encoding and one hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

Item: TypeAlias = "bytes | list[Item]"  # what the decoder returns
Encodable: TypeAlias = "bytes | bytearray | int | Sequence[Encodable]"  # what the encoder takes

_SHORT = 56  # payloads shorter than this have their length in the prefix byte itself
_DEEPEST = 32  # lists nested deeper are refused: no node of ours nests so, and Python's stack is finite


class RlpError(ValueError):
    """Bytes that are not one canonical RLP item."""


def encode_int(value: int) -> bytes:
    """An int as RLP integers are: minimal big-endian bytes, 0 as the empty string."""
    if value < 0:
        raise RlpError("RLP integers are non-negative")
    return value.to_bytes((value.bit_length() + 7) // 8, "big")


def _length_prefix(length: int, offset: int) -> bytes:
    if length < _SHORT:
        return bytes((offset + length,))
    size = encode_int(length)
    return bytes((offset + 55 + len(size),)) + size


def encode_bytes(value: bytes) -> bytes:
    """A byte string's encoding: a single byte below 0x80 is its own encoding."""
    if len(value) == 1 and value[0] < 0x80:
        return bytes(value)
    return _length_prefix(len(value), 0x80) + value


def wrap_list(payload: bytes) -> bytes:
    """A list's encoding from the concatenated encodings of its items (for nodes built by hand)."""
    return _length_prefix(len(payload), 0xC0) + payload


def encode(item: Encodable) -> bytes:
    """The RLP encoding of bytes, an int or a (nested) list of them."""
    if isinstance(item, bytes | bytearray):
        return encode_bytes(bytes(item))
    if isinstance(item, bool):  # a bool is an int to Python, never meant as one here
        raise RlpError("bool is not RLP-encodable")
    if isinstance(item, int):
        return encode_bytes(encode_int(item))
    if isinstance(item, str):
        raise RlpError("str is not RLP-encodable: pass bytes")
    return wrap_list(b"".join(encode(part) for part in item))


def _read(data: bytes, start: int, depth: int = 0) -> tuple[Item, int]:
    """The item at `start` and where the next one begins."""
    if start >= len(data):
        raise RlpError("truncated item")
    first = data[start]
    if first < 0x80:
        return data[start : start + 1], start + 1
    is_list = first >= 0xC0
    short = (first - 0xC0) if is_list else (first - 0x80)
    if short < _SHORT:
        length, begin = short, start + 1
    else:
        size = short - 55
        begin = start + 1 + size
        if begin > len(data):
            raise RlpError("truncated length")
        if data[start + 1] == 0:
            raise RlpError("length with a leading zero")
        length = int.from_bytes(data[start + 1 : begin], "big")
        if length < _SHORT:
            raise RlpError("a short length in the long form")
    end = begin + length
    if end > len(data):
        raise RlpError("truncated payload")
    if not is_list:
        if length == 1 and data[begin] < 0x80:
            raise RlpError("a single byte below 0x80 with a prefix")
        return data[begin:end], end
    if depth == _DEEPEST:
        raise RlpError("lists nested too deep")
    items: list[Item] = []
    at = begin
    while at < end:
        head = data[at]
        if 0x80 <= head < 0xB8 and head != 0x81:  # a short string inline: a branch's hashes, most nodes' items
            after = at + head - 0x7F
            if after > end:
                raise RlpError("list items overrun the list")
            items.append(data[at + 1 : after])
            at = after
            continue
        item, at = _read(data, at, depth + 1)
        items.append(item)
    if at != end:
        raise RlpError("list items overrun the list")
    return items, end


def decode(data: bytes) -> Item:
    """The one item `data` encodes, canonically and without trailing bytes."""
    item, end = _read(data, 0)
    if end != len(data):
        raise RlpError("bytes after the item")
    return item


def decode_int(item: Item) -> int:
    """An RLP integer item: a byte string without leading zeros."""
    if not isinstance(item, bytes):
        raise RlpError("an integer is a byte string, not a list")
    if item[:1] == b"\x00":
        raise RlpError("an integer with a leading zero")
    return int.from_bytes(item, "big")
