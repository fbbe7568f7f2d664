"""A block's receipts checked against its header's receiptsRoot (YP 4.3.1; EIP-2718 typed receipts).
Pure.

The trie holds each receipt's consensus encoding at key RLP(index): RLP([status or post-state root,
cumulativeGasUsed, logsBloom, logs]) for a legacy receipt, the type byte followed by that RLP for a
typed one (types 1 to 4: EIP-2930, 1559, 4844, 7702), each log RLP([address, topics, data]). So
the root proves those fields and the receipts' order; the fields a node derives from them and from
the header (gasUsed, transactionIndex, logIndex, blockHash, blockNumber) are checked to follow.
Fail safe: a receipt of an unknown type, or with a field this module does not know, is refused.

What comes from the transactions (transactionHash, from, to, contractAddress, effectiveGasPrice,
blobGasUsed) is checked against the block's transactions when the caller has proven them
(transactions_root.verify_transactions, senders.verify_senders). blobGasPrice depends on the chain's
blob schedule, which the header does not name: it is proven only where the chain's schedule is known
(blob_schedule.py). `verify_receipts` returns the fields it left unproven. Every field of
the interface's receipt and log objects must be there: an answer without one is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from proxy.chain.blob_schedule import blob_base_fee
from proxy.chain.fields import FieldError, block_time, data, keccak256, quantity
from proxy.chain.headers import Header
from proxy.chain.rlp import encode_bytes, encode_int, wrap_list
from proxy.chain.trie_root import ordered_trie_root
from proxy.upstream.standing import ChainIdentity

TYPES = frozenset({0, 1, 2, 3, 4})
PROVEN = frozenset({"type", "status", "root", "cumulativeGasUsed", "logsBloom", "logs"})
DERIVED = frozenset({"gasUsed", "transactionIndex", "blockHash", "blockNumber"})
FROM_TRANSACTIONS = frozenset({"transactionHash", "from", "to", "contractAddress", "effectiveGasPrice", "blobGasUsed"})
UNPROVEN = frozenset({"blobGasPrice"})
_BLOB_GAS = 2**17  # gas per blob (EIP-4844 GAS_PER_BLOB)
# A receipt's and a log's fields every node shows (the interface's receipt and log objects; status or
# root, and type, are checked where the receipt is encoded).
RECEIPT_FIELDS = frozenset(
    {
        "blockHash",
        "blockNumber",
        "contractAddress",
        "cumulativeGasUsed",
        "from",
        "to",
        "gasUsed",
        "effectiveGasPrice",
        "logs",
        "logsBloom",
        "transactionHash",
        "transactionIndex",
    }
)
_KNOWN = PROVEN | DERIVED | FROM_TRANSACTIONS | UNPROVEN | {"blockTimestamp"}
_LOG_FIELDS = frozenset(
    {
        "address",
        "topics",
        "data",
        "logIndex",
        "transactionIndex",
        "transactionHash",
        "blockHash",
        "blockNumber",
        "blockTimestamp",
        "removed",
    }
)
_LOG_REQUIRED = _LOG_FIELDS - {"blockTimestamp"}
_FROM_RECEIPT = ("transactionHash", "blockHash", "blockNumber", "transactionIndex")  # a log's, as its receipt's


class ReceiptError(ValueError):
    """Receipts that the header's receiptsRoot does not prove, or that cannot be encoded."""


def _log(log: Any) -> bytes:
    if not isinstance(log, Mapping) or set(log) - _LOG_FIELDS:
        raise ReceiptError("a log with a field this module does not know")
    topics = log.get("topics")
    if not isinstance(topics, list):
        raise ReceiptError("a log's topics are not a list")
    return wrap_list(
        encode_bytes(data(log.get("address"), "address", 20))
        + wrap_list(b"".join(encode_bytes(data(topic, "topic", 32)) for topic in topics))
        + encode_bytes(data(log.get("data"), "log data"))
    )


def receipt_type(receipt: Mapping[str, Any]) -> int:
    """The receipt's EIP-2718 type; a receipt without one is legacy (type 0)."""
    kind = quantity(receipt["type"], "type") if "type" in receipt else 0
    if kind not in TYPES:
        raise ReceiptError(f"receipt type {kind} is not known")
    return kind


def receipt_encoding(receipt: Mapping[str, Any]) -> bytes:
    """The receipt's consensus encoding: the value the receipts trie holds for it."""
    unknown = set(receipt) - _KNOWN
    if unknown:
        raise ReceiptError(f"unknown receipt field {sorted(unknown)[0]}")
    try:
        kind = receipt_type(receipt)
        if ("status" in receipt) == ("root" in receipt):
            raise ReceiptError("a receipt has one of status (Byzantium on) and root (before)")
        if "status" in receipt:
            status = quantity(receipt["status"], "status")
            if status > 1:
                raise ReceiptError("a status other than 0 or 1")
            outcome = encode_bytes(encode_int(status))
        else:
            outcome = encode_bytes(data(receipt["root"], "root", 32))
        logs = receipt.get("logs")
        if not isinstance(logs, list):
            raise ReceiptError("a receipt's logs are not a list")
        body = wrap_list(
            outcome
            + encode_bytes(encode_int(quantity(receipt.get("cumulativeGasUsed"), "cumulativeGasUsed")))
            + encode_bytes(data(receipt.get("logsBloom"), "logsBloom", 256))
            + wrap_list(b"".join(_log(log) for log in logs))
        )
    except FieldError as exc:
        raise ReceiptError(str(exc)) from exc
    return body if kind == 0 else bytes((kind,)) + body


def receipts_root(receipts: Sequence[Mapping[str, Any]]) -> bytes:
    """The receiptsRoot of a block with these receipts, in order."""
    return ordered_trie_root([receipt_encoding(receipt) for receipt in receipts])


def _derived(receipts: Sequence[Mapping[str, Any]], header: Header) -> None:
    """gasUsed, indexes, block hash, number and time follow from the proven fields and the header."""
    block_hash = "0x" + header.hash.hex()
    previous = 0
    log_index = 0
    for index, receipt in enumerate(receipts):
        missing = RECEIPT_FIELDS - receipt.keys()
        if missing:
            raise ReceiptError(f"a receipt without {sorted(missing)[0]}")
        cumulative = quantity(receipt["cumulativeGasUsed"], "cumulativeGasUsed")
        if quantity(receipt.get("gasUsed"), "gasUsed") != cumulative - previous:
            raise ReceiptError("gasUsed is not the step in cumulativeGasUsed")
        previous = cumulative
        if quantity(receipt.get("transactionIndex"), "transactionIndex") != index:
            raise ReceiptError("a receipt out of its place")
        if str(receipt.get("blockHash")).lower() != block_hash or quantity(receipt.get("blockNumber")) != header.number:
            raise ReceiptError("a receipt of another block")
        if "blockTimestamp" in receipt and block_time(receipt["blockTimestamp"]) != header.timestamp:
            raise ReceiptError("a receipt's blockTimestamp is not the header's timestamp")
        for log in receipt["logs"]:
            missing = _LOG_REQUIRED - log.keys()
            if missing:
                raise ReceiptError(f"a log without {sorted(missing)[0]}")
            same = all(log[name] == receipt[name] for name in _FROM_RECEIPT)
            if "blockTimestamp" in log and block_time(log["blockTimestamp"]) != header.timestamp:
                same = False
            if log.get("removed", False) is not False:  # a final block's logs are never removed
                same = False
            if not same or quantity(log.get("logIndex"), "logIndex") != log_index:
                raise ReceiptError("a log's place does not follow from its receipt")
            log_index += 1


def _created(tx: Mapping[str, Any]) -> str:
    """The address a creation makes: keccak-256(RLP([sender, nonce]))[12:] (YP 7)."""
    sender = data(tx.get("from"), "from", 20)
    return (
        "0x"
        + keccak256(wrap_list(encode_bytes(sender) + encode_bytes(encode_int(quantity(tx.get("nonce"))))))[12:].hex()
    )


def _from_transactions(receipts: Sequence[Mapping[str, Any]], transactions: Sequence[Mapping[str, Any]]) -> None:
    """The fields a receipt copies or computes from its proven transaction."""
    if len(transactions) != len(receipts):
        raise ReceiptError("not one receipt per transaction")
    for receipt, tx in zip(receipts, transactions, strict=True):
        creation = tx.get("to") is None
        expected = {
            "transactionHash": str(tx.get("hash")).lower(),
            "from": str(tx.get("from")).lower(),
            "to": None if creation else str(tx.get("to")).lower(),
            "contractAddress": _created(tx) if creation else None,
            "effectiveGasPrice": hex(quantity(tx.get("gasPrice"), "gasPrice")),
            "type": hex(quantity(tx.get("type", "0x0"), "type")),
        }
        for name, value in expected.items():
            shown = receipt.get(name)
            if name in receipt and (shown.lower() if isinstance(shown, str) else shown) != value:
                raise ReceiptError(f"a receipt's {name} is not its transaction's")
        if "blobGasUsed" in receipt:
            blobs = len(tx.get("blobVersionedHashes") or ())
            if quantity(receipt["blobGasUsed"], "blobGasUsed") != blobs * _BLOB_GAS:
                raise ReceiptError("a receipt's blobGasUsed is not its transaction's blobs")


def _blob_prices(receipts: Sequence[Mapping[str, Any]], header: Header, chain: ChainIdentity | None) -> bool:
    """Whether every receipt's blobGasPrice (those that show one) is the one the header settles."""
    shown = [quantity(receipt["blobGasPrice"], "blobGasPrice") for receipt in receipts if "blobGasPrice" in receipt]
    if not shown:
        return True
    settled = blob_base_fee(header, chain)
    return all(price == settled for price in shown)


def verify_receipts(
    receipts: Any,
    header: Header,
    transactions: Sequence[Mapping[str, Any]] | None = None,
    chain: ChainIdentity | None = None,
) -> frozenset[str]:
    """eth_getBlockReceipts' answer for a block whose header is proven: ReceiptError unless the
    header's receiptsRoot proves every receipt and the derived fields follow. With the block's proven
    transactions, the fields taken from them are checked too; with the chain's identity, the blob gas
    price by its schedule (blob_schedule.py). Returns the fields present but unproven."""
    if not isinstance(receipts, list) or not all(isinstance(receipt, Mapping) for receipt in receipts):
        raise ReceiptError("receipts are not a list of objects")
    if receipts_root(receipts) != header.receipts_root:
        raise ReceiptError("the receipts do not hash to the header's receiptsRoot")
    try:
        _derived(receipts, header)
        if transactions is not None:
            _from_transactions(receipts, transactions)
        blob_prices = _blob_prices(receipts, header, chain)
    except FieldError as exc:
        raise ReceiptError(str(exc)) from exc
    unproven = (UNPROVEN - {"blobGasPrice"} if blob_prices else UNPROVEN) | (
        frozenset() if transactions is not None else FROM_TRANSACTIONS
    )
    return frozenset(name for receipt in receipts for name in receipt if name in unproven)
