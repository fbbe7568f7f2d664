"""A transaction's sender recovered from its signature (secp256k1, YP appendix F; EIP-155, EIP-2718):
what proves a transaction's `from`, which no root commits to. Pure.

The signer signs keccak-256 of the transaction without its signature: for a typed transaction the
type byte and the RLP of its fields up to yParity; for a legacy one RLP([nonce, gasPrice, gas, to,
value, input]), with [chainId, 0, 0] appended under EIP-155 (v = 35 + 2 chainId + parity) and v =
27 + parity without it. The sender is the last 20 bytes of keccak-256 of the recovered public key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coincurve import PublicKey

from proxy.chain.fields import FieldError, data, keccak256, quantity
from proxy.chain.rlp import encode_bytes, encode_int, wrap_list
from proxy.chain.transactions_root import TransactionError, signed_fields, transaction_type

_ORDER = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141  # secp256k1's group order


def _signing_hash_and_parity(tx: Mapping[str, Any]) -> tuple[bytes, int]:
    kind = transaction_type(tx)
    fields = signed_fields(tx, kind)[:-3]  # all but the signature (v or yParity, r, s)
    if kind:
        return keccak256(bytes((kind,)) + wrap_list(b"".join(fields))), quantity(tx.get("yParity", tx.get("v")))
    v = quantity(tx.get("v"), "v")
    if v in (27, 28):
        return keccak256(wrap_list(b"".join(fields))), v - 27
    if v < 35:
        raise TransactionError("a legacy v that is neither 27, 28 nor EIP-155's")
    chain_id = (v - 35) // 2
    replay = encode_bytes(encode_int(chain_id)) + encode_bytes(b"") + encode_bytes(b"")
    return keccak256(wrap_list(b"".join(fields) + replay)), (v - 35) % 2


def sender(tx: Mapping[str, Any]) -> bytes:
    """The 20-byte address that signed the transaction; TransactionError when none can be recovered."""
    try:
        digest, parity = _signing_hash_and_parity(tx)
        r, s = quantity(tx.get("r"), "r"), quantity(tx.get("s"), "s")
    except FieldError as exc:
        raise TransactionError(str(exc)) from exc
    if parity > 1 or not (0 < r < _ORDER and 0 < s < _ORDER):
        raise TransactionError("a signature out of secp256k1's range")
    signature = r.to_bytes(32, "big") + s.to_bytes(32, "big") + bytes((parity,))
    try:
        key = PublicKey.from_signature_and_message(signature, digest, hasher=None)
    except ValueError as exc:  # coincurve: no point recovers from this signature
        raise TransactionError("a signature that recovers no key") from exc
    return keccak256(key.format(compressed=False)[1:])[-20:]


def verify_senders(transactions: Any) -> None:
    """Each transaction's `from` is its signer: TransactionError otherwise. (Run after
    verify_transactions has proven the signed fields.)"""
    if not isinstance(transactions, list):
        raise TransactionError("transactions are not a list")
    for tx in transactions:
        try:
            claimed = data(tx.get("from"), "from", 20)
        except FieldError as exc:
            raise TransactionError(str(exc)) from exc
        if sender(tx) != claimed:
            raise TransactionError("a transaction's from is not its signer")
