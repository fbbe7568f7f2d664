"""A block's transactions checked against its header's transactionsRoot (YP 4.3; EIP-2718). Pure.

The trie holds each transaction's signed encoding at key RLP(index), and a transaction's hash is
the keccak-256 of that encoding, so one encoding proves a transaction's fields, its hash and its
place in the block:

- type 0 (legacy): RLP([nonce, gasPrice, gas, to, value, input, v, r, s]);
- type 1 (EIP-2930): 0x01 || RLP([chainId, nonce, gasPrice, gas, to, value, input, accessList, yParity, r, s]);
- type 2 (EIP-1559): 0x02 || RLP([chainId, nonce, maxPriorityFeePerGas, maxFeePerGas, gas, to, value, input,
  accessList, yParity, r, s]);
- type 3 (EIP-4844): as type 2 with maxFeePerBlobGas and blobVersionedHashes after accessList;
- type 4 (EIP-7702): as type 2 with authorizationList ([chainId, address, nonce, yParity, r, s] each)
  after accessList.

A typed transaction's gasPrice (the price it paid) follows from its fees and the header's base fee.
`from` is not committed to: chain/senders.py recovers it from the signature. Fail safe: an unknown
type or field is refused (TransactionError).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from proxy.chain.fields import FieldError, block_time, data, keccak256, quantity
from proxy.chain.headers import Header
from proxy.chain.rlp import encode_bytes, encode_int, wrap_list
from proxy.chain.trie_root import ordered_trie_root

_CONTEXT = frozenset({"hash", "blockHash", "blockNumber", "transactionIndex", "from", "blockTimestamp", "type"})
UNPROVEN = frozenset({"from"})  # see chain/senders.py
# A blob transaction's network form (EIP-4844): not in the trie nor the hash, and KZG is not checked here.
SIDECAR = frozenset({"blobs", "commitments", "proofs", "cellProofs"})

# Each type's signed fields in order; "yParity" is read from yParity, or from v where a node gives only v.
_FIELDS: dict[int, tuple[str, ...]] = {
    0: ("nonce", "gasPrice", "gas", "to", "value", "input", "v", "r", "s"),
    1: ("chainId", "nonce", "gasPrice", "gas", "to", "value", "input", "accessList", "yParity", "r", "s"),
    2: (
        "chainId",
        "nonce",
        "maxPriorityFeePerGas",
        "maxFeePerGas",
        "gas",
        "to",
        "value",
        "input",
        "accessList",
        "yParity",
        "r",
        "s",
    ),
    3: (
        "chainId",
        "nonce",
        "maxPriorityFeePerGas",
        "maxFeePerGas",
        "gas",
        "to",
        "value",
        "input",
        "accessList",
        "maxFeePerBlobGas",
        "blobVersionedHashes",
        "yParity",
        "r",
        "s",
    ),
    4: (
        "chainId",
        "nonce",
        "maxPriorityFeePerGas",
        "maxFeePerGas",
        "gas",
        "to",
        "value",
        "input",
        "accessList",
        "authorizationList",
        "yParity",
        "r",
        "s",
    ),
}
_AUTHORIZATION = ("chainId", "address", "nonce", "yParity", "r", "s")


class TransactionError(ValueError):
    """Transactions that the header's transactionsRoot does not prove, or that cannot be encoded."""


def _int(value: Any, name: str) -> bytes:
    return encode_bytes(encode_int(quantity(value, name)))


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise TransactionError(f"{name} is not a list")
    return value


def _access_list(value: Any) -> bytes:
    entries = []
    for entry in _list(value, "accessList"):
        if not isinstance(entry, Mapping) or set(entry) != {"address", "storageKeys"}:
            raise TransactionError("an access list entry is not an address and its storage keys")
        keys = b"".join(encode_bytes(data(key, "storage key", 32)) for key in _list(entry["storageKeys"], "keys"))
        entries.append(wrap_list(encode_bytes(data(entry["address"], "address", 20)) + wrap_list(keys)))
    return wrap_list(b"".join(entries))


def _authorization(entry: Any) -> bytes:
    if not isinstance(entry, Mapping) or set(entry) != set(_AUTHORIZATION):
        raise TransactionError("an authorization is not (chainId, address, nonce, yParity, r, s)")
    return wrap_list(
        b"".join(
            encode_bytes(data(entry[name], name, 20)) if name == "address" else _int(entry[name], name)
            for name in _AUTHORIZATION
        )
    )


def _field(tx: Mapping[str, Any], name: str, kind: int) -> bytes:
    if name == "to":
        to = tx.get("to")
        if to is None and kind in (0, 1, 2):  # a contract creation
            return encode_bytes(b"")
        return encode_bytes(data(to, "to", 20))
    if name == "input":
        return encode_bytes(data(tx.get("input"), "input"))
    if name == "accessList":
        return _access_list(tx.get("accessList"))
    if name == "blobVersionedHashes":
        return wrap_list(b"".join(encode_bytes(data(h, "blob hash", 32)) for h in _list(tx.get(name), name)))
    if name == "authorizationList":
        return wrap_list(b"".join(_authorization(entry) for entry in _list(tx.get(name), name)))
    if name == "yParity":
        parity = tx.get("yParity", tx.get("v"))
        if "yParity" in tx and "v" in tx and quantity(tx["v"], "v") != quantity(parity, "yParity"):
            raise TransactionError("v and yParity differ")
        return _int(parity, "yParity")
    return _int(tx.get(name), name)


def _legacy_chain_id(tx: Mapping[str, Any]) -> None:
    """A legacy transaction's chainId is not signed as a field: it is what v says (EIP-155)."""
    v = quantity(tx.get("v"), "v")
    if v < 35 or (v - 35) // 2 != quantity(tx["chainId"], "chainId"):
        raise TransactionError("a legacy transaction's chainId is not the one its v gives")


def transaction_type(tx: Mapping[str, Any]) -> int:
    kind = quantity(tx["type"], "type") if "type" in tx else 0
    if kind not in _FIELDS:
        raise TransactionError(f"transaction type {kind} is not known")
    return kind


def signed_fields(tx: Mapping[str, Any], kind: int) -> list[bytes]:
    """The RLP of each of the type's fields, in order, the signature (v or yParity, r, s) last."""
    return [_field(tx, name, kind) for name in _FIELDS[kind]]


def transaction_encoding(tx: Mapping[str, Any]) -> bytes:
    """The transaction's signed encoding: the trie's value for it and the preimage of its hash."""
    try:
        kind = transaction_type(tx)
        fields = _FIELDS[kind]
        allowed = _CONTEXT | set(fields) | ({"gasPrice", "v"} if kind else {"chainId"})
        unknown = set(tx) - allowed
        if unknown & SIDECAR:
            raise TransactionError("a blob sidecar, which the transactionsRoot does not prove")
        if unknown:
            raise TransactionError(f"unknown transaction field {sorted(unknown)[0]}")
        if kind == 0 and "chainId" in tx:
            _legacy_chain_id(tx)
        body = wrap_list(b"".join(signed_fields(tx, kind)))
    except FieldError as exc:
        raise TransactionError(str(exc)) from exc
    return body if kind == 0 else bytes((kind,)) + body


def transactions_root(transactions: Sequence[Mapping[str, Any]]) -> bytes:
    return ordered_trie_root([transaction_encoding(tx) for tx in transactions])


def _paid(tx: Mapping[str, Any], base_fee: int | None) -> int | None:
    """What a typed transaction paid per gas (EIP-1559): None where it does not follow."""
    if "maxFeePerGas" not in tx or base_fee is None:
        return None
    return min(quantity(tx["maxFeePerGas"]), base_fee + quantity(tx["maxPriorityFeePerGas"]))


def verify_transactions(transactions: Any, header: Header) -> None:
    """eth_getBlockByNumber(n, true)'s transactions for a proven header: TransactionError unless the
    header's transactionsRoot proves them and each one's hash, place, time and price follow (`from`:
    senders.verify_senders)."""
    if not isinstance(transactions, list) or not all(isinstance(tx, Mapping) for tx in transactions):
        raise TransactionError("transactions are not a list of objects")
    encodings = [transaction_encoding(tx) for tx in transactions]
    if ordered_trie_root(encodings) != header.transactions_root:
        raise TransactionError("the transactions do not hash to the header's transactionsRoot")
    block_hash = "0x" + header.hash.hex()
    try:
        for index, (tx, encoding) in enumerate(zip(transactions, encodings, strict=True)):
            if data(tx.get("hash"), "hash", 32) != keccak256(encoding):
                raise TransactionError("a transaction's hash is not the hash of its fields")
            if quantity(tx.get("transactionIndex"), "transactionIndex") != index:
                raise TransactionError("a transaction out of its place")
            if str(tx.get("blockHash")).lower() != block_hash or quantity(tx.get("blockNumber")) != header.number:
                raise TransactionError("a transaction of another block")
            if "blockTimestamp" in tx and block_time(tx["blockTimestamp"]) != header.timestamp:
                raise TransactionError("a transaction's blockTimestamp is not the header's timestamp")
            paid = _paid(tx, header.base_fee)
            if paid is not None and quantity(tx.get("gasPrice"), "gasPrice") != paid:
                raise TransactionError("a gasPrice that the fees and base fee do not give")
            if paid is None and "gasPrice" in tx and "maxFeePerGas" in tx:
                raise TransactionError("a typed transaction's gasPrice without the header's base fee")
    except FieldError as exc:
        raise TransactionError(str(exc)) from exc
