"""A block's logsBloom (Yellow Paper 4.3.1): 2048 bits, in which each log's address and each of its
topics set three bits taken from the keccak-256 of its bytes. Pure: whether a filter may match a
block, and whether logs are in their blocks' blooms."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from proxy.chain.fields import keccak256

BLOOM_BYTES = 256


def _bits(value: bytes) -> list[int]:
    digest = keccak256(value)
    return [((digest[i] << 8) | digest[i + 1]) & 2047 for i in (0, 2, 4)]


def parse(bloom: Any) -> bytes | None:
    """A header's logsBloom as bytes; None when it is not 256 bytes of hex."""
    if not isinstance(bloom, str) or not bloom.startswith("0x"):
        return None
    try:
        raw = bytes.fromhex(bloom[2:])
    except ValueError:
        return None
    return raw if len(raw) == BLOOM_BYTES else None


def contains(bloom: bytes, value: str) -> bool:
    """Whether `value` (an address or a topic, hex) has its three bits set in `bloom`."""
    try:
        raw = bytes.fromhex(value[2:] if value.startswith("0x") else value)
    except ValueError:
        return False
    return all(bloom[BLOOM_BYTES - 1 - bit // 8] & (1 << (bit % 8)) for bit in _bits(raw))


def may_match(bloom: bytes, addresses: Sequence[str] | None, topics: Sequence[Sequence[str] | None] | None) -> bool:
    """Whether a block with this bloom may hold a log the filter matches (a bloom has false
    positives, never false negatives)."""
    if addresses and not any(contains(bloom, a) for a in addresses):
        return False
    return all(not position or any(contains(bloom, t) for t in position) for position in (topics or []))


def logs_in_blooms(logs: Sequence[Any], blooms: Mapping[int, bytes]) -> bool:
    """Every log's address and topics are in its block's bloom (a log outside it was made up)."""
    for entry in logs:
        try:
            bloom = blooms[int(entry["blockNumber"], 16)]
        except (KeyError, TypeError, ValueError):
            return False
        values = [entry.get("address", ""), *entry.get("topics", [])]
        if not all(isinstance(v, str) and contains(bloom, v) for v in values):
            return False
    return True
