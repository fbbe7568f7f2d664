"""A whole eth_getBlockByNumber / eth_getBlockByHash answer checked against its header (YP 4.3,
EIP-4895): the header's hash, the transactions (with their signers), the withdrawals, the uncles and
the block's RLP size. Pure.

A block's answer carries its transactions in full or as hashes; hashes alone are not proven by the
root (it commits to the transactions' encodings), so they are checked against the block's proven
full transactions when given, and refused otherwise. Uncles appear as hashes: an empty list is proven
by sha3Uncles, a non-empty one needs the uncle headers (eth_getUncleByBlockHashAndIndex). What no
check covers (totalDifficulty, which the header does not hold) is named in `ProvenBlock.unproven`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.chain.fields import FieldError, data, keccak256, quantity
from proxy.chain.headers import Header, HeaderError, header_rlp, verify_header
from proxy.chain.rlp import encode_bytes, encode_int, wrap_list
from proxy.chain.senders import verify_senders
from proxy.chain.transactions_root import TransactionError, transaction_encoding, verify_transactions
from proxy.chain.trie_root import ordered_trie_root

EMPTY_UNCLES = keccak256(wrap_list(b""))  # sha3Uncles of a block without uncles
UNPROVEN = frozenset({"totalDifficulty"})
_WITHDRAWAL = frozenset({"index", "validatorIndex", "address", "amount"})


class BlockError(ValueError):
    """A block answer that its header does not prove."""


@dataclass(frozen=True, slots=True)
class ProvenBlock:
    header: Header
    unproven: frozenset[str]  # fields of the answer that no check covered


def _withdrawal(entry: Any) -> bytes:
    if not isinstance(entry, Mapping) or set(entry) != _WITHDRAWAL:
        raise BlockError("a withdrawal is not (index, validatorIndex, address, amount)")
    return wrap_list(
        encode_bytes(encode_int(quantity(entry["index"], "index")))
        + encode_bytes(encode_int(quantity(entry["validatorIndex"], "validatorIndex")))
        + encode_bytes(data(entry["address"], "address", 20))
        + encode_bytes(encode_int(quantity(entry["amount"], "amount")))
    )


def withdrawals_root(withdrawals: Sequence[Any]) -> bytes:
    """The withdrawalsRoot of these withdrawals, in order (EIP-4895)."""
    return ordered_trie_root([_withdrawal(entry) for entry in withdrawals])


def _body_item(encoding: bytes) -> bytes:
    """A transaction as the block's RLP holds it: a legacy one as its list, a typed one as a string."""
    return encoding if encoding[0] >= 0xC0 else encode_bytes(encoding)


def _transactions(block: Mapping[str, Any], header: Header, full: Sequence[Mapping[str, Any]] | None) -> list[bytes]:
    """The block's transactions proven; their encodings."""
    shown = block.get("transactions")
    if not isinstance(shown, list):
        raise BlockError("transactions are not a list")
    if shown and all(isinstance(tx, str) for tx in shown):
        if full is None:
            raise BlockError("transaction hashes alone are not proven: the full transactions are needed")
        if [str(tx.get("hash")).lower() for tx in full] != [tx.lower() for tx in shown]:
            raise BlockError("the transaction hashes are not the block's")
        transactions = list(full)
    else:
        transactions = shown
    verify_transactions(transactions, header)
    verify_senders(transactions)
    return [transaction_encoding(tx) for tx in transactions]


def _uncles(block: Mapping[str, Any], uncles: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """The uncles' header encodings, proven by sha3Uncles."""
    shown = block.get("uncles")
    if not isinstance(shown, list):
        raise BlockError("uncles are not a list")
    if len(uncles) != len(shown):
        raise BlockError("uncle hashes alone are not proven: the uncle headers are needed")
    encodings = []
    for uncle, uncle_hash in zip(uncles, shown, strict=True):
        if "0x" + verify_header(uncle).hash.hex() != str(uncle_hash).lower():
            raise BlockError("an uncle header that is not the block's uncle")
        encodings.append(header_rlp(uncle))
    if keccak256(wrap_list(b"".join(encodings))) != data(block.get("sha3Uncles"), "sha3Uncles", 32):
        raise BlockError("the uncles do not hash to the header's sha3Uncles")
    return encodings


def verify_uncles(block: Mapping[str, Any], uncles: Sequence[Mapping[str, Any]]) -> None:
    """The block's `uncles` hashes, proven by its sha3Uncles with the uncle headers in their order
    (none for an empty list); BlockError otherwise. The block's own header is proven by the caller."""
    try:
        _uncles(block, uncles)
    except (HeaderError, FieldError) as exc:
        raise BlockError(str(exc)) from exc


def _sizes(parts: list[bytes]) -> set[int]:
    """The block's RLP size: of [header, transactions, uncles, withdrawals] (geth, reth), or without
    the withdrawals (Anvil, whose block type holds none)."""
    return {len(wrap_list(b"".join(parts))), len(wrap_list(b"".join(parts[:3])))}


def verify_block(
    block: Any,
    *,
    transactions: Sequence[Mapping[str, Any]] | None = None,
    uncles: Sequence[Mapping[str, Any]] = (),
) -> ProvenBlock:
    """A block answer whose every field but `unproven` follows from its header's hash; BlockError
    otherwise. `transactions`: the block's full transactions when the answer shows hashes;
    `uncles`: its uncle headers, in order, when it has any."""
    if not isinstance(block, Mapping):
        raise BlockError("a block is not an object")
    try:
        header = verify_header(block)
        encodings = _transactions(block, header, transactions)
        uncle_encodings = _uncles(block, uncles)
        parts = [
            header_rlp(block),
            wrap_list(b"".join(_body_item(e) for e in encodings)),
            wrap_list(b"".join(uncle_encodings)),
        ]
        if header.withdrawals_root is not None:
            withdrawals = block.get("withdrawals")
            if not isinstance(withdrawals, list) or withdrawals_root(withdrawals) != header.withdrawals_root:
                raise BlockError("the withdrawals do not hash to the header's withdrawalsRoot")
            parts.append(wrap_list(b"".join(_withdrawal(entry) for entry in withdrawals)))
        elif "withdrawals" in block:
            raise BlockError("withdrawals in a block whose header has no withdrawalsRoot")
        if "size" in block and quantity(block["size"], "size") not in _sizes(parts):
            raise BlockError("size is not the block's RLP size")
    except (HeaderError, FieldError, TransactionError) as exc:
        raise BlockError(str(exc)) from exc
    return ProvenBlock(header, UNPROVEN & set(block))
