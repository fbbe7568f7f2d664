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


class FilterBits:
    """A log filter's addresses and topics as bloom masks (the three bits each sets, as one 2048-bit
    number), each value hashed once: a filter of 5,000 addresses checked against 1,000 blocks' blooms
    hashed each address per block, five million keccaks on the event loop."""

    def __init__(self, addresses: Sequence[str] | str | None, topics: Sequence[Sequence[str] | str | None] | None):
        self._addresses = _masks(addresses)
        self._topics = [masks for position in topics or [] if (masks := _masks(position)) is not None]
        # Masks one bloom is checked against at most: a caller bounds its work by it (blooms x cost).
        self.cost = len(self._addresses or ()) + sum(map(len, self._topics))

    def may_match(self, bloom: bytes) -> bool:
        """Whether a block with this bloom may hold a log the filter matches (a bloom has false
        positives, never false negatives)."""
        word = int.from_bytes(bloom, "big")
        if not word:
            return self._addresses is None and not self._topics  # a block without logs: an empty filter's only
        if self._addresses is not None and not any(word & mask == mask for mask in self._addresses):
            return False
        return all(any(word & mask == mask for mask in position) for position in self._topics)


# Masks checked against blooms for one answer at most (a filter's values x the blocks' blooms, about
# 0.1 s of Python): past it the answer's bloom check is not made (verifying.py, cache/integrity.py),
# as for a range of too many blocks. 5,000 addresses over a 1,000-block chunk were 0.7 s of the event
# loop's time per call, and twenty such calls in flight held every other client for 12 s.
MASK_CHECKS_MAX = 200_000


def _masks(values: Sequence[str] | str | None) -> tuple[int, ...] | None:
    """The masks of a filter's address or topic position; None when it allows any (absent, null or
    empty). A value that is not hex matches nothing."""
    if isinstance(values, str):
        values = [values]
    if not values:
        return None
    masks = set()
    for value in values:
        try:
            raw = bytes.fromhex(value[2:] if value.startswith("0x") else value)
        except (AttributeError, ValueError):
            continue
        masks.add(sum(1 << bit for bit in set(_bits(raw))))  # bit i of the bloom is bit i of the number
    return tuple(masks)


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
