"""A block's hash from the header fields a node shows (eth_getBlockByNumber, eth_getBlockByHash,
an uncle): keccak-256 of the RLP list of the header's fields (Yellow Paper 4.3). Pure.

A header whose fields hash to the hash that the tracker holds for its height is the chain's header,
so the roots in it (stateRoot, transactionsRoot, receiptsRoot) can prove what a node says about the
block. Fail safe: a block with a field this module does not know, or a field missing, malformed or
out of its fork's order, is refused (HeaderError), never hashed by a guess.

Each fork appends fields to the end of the list, so the fields a header has are the fifteen of
Frontier and then a prefix of the later ones. Only whole forks' prefixes are taken: were any subset
allowed, a node could rename a field (call London's baseFeePerGas a blobGasUsed) and keep the hash.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.chain.fields import FieldError, data, keccak256, quantity
from proxy.chain.rlp import encode_bytes, encode_int, wrap_list


class HeaderError(ValueError):
    """Header fields that cannot be hashed: unknown, missing, malformed or out of order."""


# How each field is written: a hash or address of exactly this many bytes, "int" a quantity, "bytes"
# a byte string of any length.
_FRONTIER: tuple[tuple[str, int | str], ...] = (
    ("parentHash", 32),
    ("sha3Uncles", 32),
    ("miner", 20),
    ("stateRoot", 32),
    ("transactionsRoot", 32),
    ("receiptsRoot", 32),
    ("logsBloom", 256),
    ("difficulty", "int"),
    ("number", "int"),
    ("gasLimit", "int"),
    ("gasUsed", "int"),
    ("timestamp", "int"),
    ("extraData", "bytes"),
    ("mixHash", 32),
    ("nonce", 8),
)
_LATER: tuple[tuple[str, int | str], ...] = (
    ("baseFeePerGas", "int"),  # London (EIP-1559)
    ("withdrawalsRoot", 32),  # Shanghai (EIP-4895)
    ("blobGasUsed", "int"),
    ("excessBlobGas", "int"),
    ("parentBeaconBlockRoot", 32),  # Cancun (EIP-4844, 4788)
    ("requestsHash", 32),  # Prague (EIP-7685)
)
_FORK_ENDS = frozenset({0, 1, 2, 5, 6})  # how many of _LATER a header may have: whole forks only
_LATER_NAMES = tuple(name for name, _ in _LATER)

# Fields of a block object that are not in its header: derived from it or from the body.
_NOT_HEADER = frozenset({"hash", "size", "totalDifficulty", "uncles", "transactions", "withdrawals"})
_KNOWN = _NOT_HEADER | {name for name, _ in _FRONTIER} | set(_LATER_NAMES)


@dataclass(frozen=True, slots=True)
class Header:
    """The fields of a header whose hash was computed from them; the roots prove the block's parts."""

    hash: bytes
    number: int
    timestamp: int
    parent_hash: bytes
    state_root: bytes
    transactions_root: bytes
    receipts_root: bytes
    withdrawals_root: bytes | None
    base_fee: int | None  # London on
    excess_blob_gas: int | None = None  # Cancun on
    requests: bool = False  # Prague on: the header has requestsHash


def _field(block: Mapping[str, Any], name: str, form: int | str) -> bytes:
    """The field's RLP encoding, in the form its name says."""
    if name not in block:
        raise HeaderError(f"{name} is missing")
    if form == "int":
        return encode_bytes(encode_int(quantity(block[name], name)))
    return encode_bytes(data(block[name], name, None if form == "bytes" else int(form)))


def _later_fields(block: Mapping[str, Any]) -> int:
    present = [name in block for name in _LATER_NAMES]
    count = sum(present)
    if not all(present[:count]) or count not in _FORK_ENDS:
        raise HeaderError("header fields do not match one fork's set")
    return count


def header_rlp(block: Mapping[str, Any]) -> bytes:
    """The header's RLP encoding from a block object's fields; HeaderError when it cannot be built."""
    if not isinstance(block, Mapping):
        raise HeaderError("a block is not an object")
    unknown = set(block) - _KNOWN
    if unknown:
        raise HeaderError(f"unknown header field {sorted(unknown)[0]}")
    fields = _FRONTIER + _LATER[: _later_fields(block)]
    try:
        return wrap_list(b"".join(_field(block, name, form) for name, form in fields))
    except FieldError as exc:
        raise HeaderError(str(exc)) from exc


def header_hash(block: Mapping[str, Any]) -> bytes:
    """keccak-256 of the header's RLP: the block's hash."""
    return keccak256(header_rlp(block))


def verify_header(block: Mapping[str, Any]) -> Header:
    """The header, when its fields hash to the block's `hash`; HeaderError otherwise."""
    computed = header_hash(block)
    try:
        claimed = data(block.get("hash"), "hash", 32)
    except FieldError as exc:
        raise HeaderError(str(exc)) from exc
    if computed != claimed:
        raise HeaderError("header fields do not hash to the block's hash")
    # Every field below was read when the header was encoded: none can fail now.
    withdrawals = block.get("withdrawalsRoot")
    base_fee = block.get("baseFeePerGas")
    excess = block.get("excessBlobGas")
    return Header(
        hash=computed,
        number=quantity(block["number"], "number"),
        timestamp=quantity(block["timestamp"], "timestamp"),
        parent_hash=data(block["parentHash"], size=32),
        state_root=data(block["stateRoot"], size=32),
        transactions_root=data(block["transactionsRoot"], size=32),
        receipts_root=data(block["receiptsRoot"], size=32),
        withdrawals_root=None if withdrawals is None else data(withdrawals, size=32),
        base_fee=None if base_fee is None else quantity(base_fee),
        excess_blob_gas=None if excess is None else quantity(excess),
        requests="requestsHash" in block,
    )
