"""The shape a method's result must have (spec "Conventions": binary values and quantities are strings
starting with `0x`; the Solana results' tables), judged on every reply from a node
(upstream/replies.py) before it is served or kept. A few string operations and one hex decode (or
match) in C: nothing per character in Python."""

from __future__ import annotations

import re
from binascii import unhexlify
from collections.abc import Callable
from typing import Any, NamedTuple


class Shape(NamedTuple):
    name: str  # what the message says the result is not
    fits: Callable[[Any], bool]
    null: bool = True  # a null result is the node's answer (judged as nodes mean it), else misshapen


# Short values are decoded with unhexlify (C), which refuses anything but an even number of hex digits
# (odd length, whitespace, a sign, `_`, non-ASCII); long ones are matched in place from position 2
# (no slice, no decoded copy: an eth_call's result may be megabytes, held to a bound: large_replies.py).
_HEX = re.compile(r"[0-9a-fA-F]*")
_SHORT = 4096


def _hex_digits(value: str) -> bool:
    """`value`'s characters after `0x` are hex digits, an even number of them."""
    if len(value) > _SHORT:
        return len(value) % 2 == 0 and _HEX.fullmatch(value, 2) is not None
    try:
        unhexlify(value[2:])
    except ValueError:  # binascii.Error is one
        return False
    return True


def is_data(value: Any) -> bool:
    """Hex data: `0x` and whole bytes, two hex digits each (`0x` alone: no bytes)."""
    return type(value) is str and value[:2] == "0x" and _hex_digits(value)


# A 256-bit word: `0x` and 64 hex digits. geth, Erigon, Nethermind, Besu and Anvil pad eth_getStorageAt's
# value to 32 bytes.
WORD_LENGTH = 66


def is_word(value: Any) -> bool:
    """A 32-byte word: `0x` and 64 hex digits (inline: every storage read's answer passes here)."""
    if type(value) is not str or len(value) != WORD_LENGTH or value[:2] != "0x":
        return False
    try:
        unhexlify(value[2:])
    except ValueError:
        return False
    return True


def is_quantity(value: Any) -> bool:
    """A quantity: `0x` and 1 to 64 hex digits (a 256-bit number at most)."""
    if type(value) is not str or not 2 < len(value) <= WORD_LENGTH or value[:2] != "0x":
        return False
    return _hex_digits(value if len(value) % 2 == 0 else "0x0" + value[2:])  # an odd count: one nibble padded


def _objects(value: Any) -> bool:
    """A JSON array of objects (logs, receipts): each element's type alone, the fields are the proofs'."""
    return type(value) is list and all(type(entry) is dict for entry in value)


DATA = Shape("hex data", is_data)
# eth_getLogs answers a list, empty when nothing matches, never null (a node without the blocks says
# so with an error); eth_getBlockReceipts is null for a block its node does not have.
LOGS = Shape("a list of logs", _objects, null=False)
RECEIPTS = Shape("a list of receipts", _objects)
WORD = Shape("a 32-byte hex word", is_word)
QUANTITY = Shape("a hex quantity", is_quantity)


# Solana (spec "Token account balance", "Largest-account entry"): an RpcResponse, context.slot an
# integer, context.apiVersion a string where there is one (spec Versioning 3), the value of the
# method's form. Agave answers a missing token account with an error, never null; getLargestAccounts
# may be null (spec getLargestAccounts 3: the node's answer, kept for CACHE_NEGATIVE_TTL at most).
_B58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")
_U64 = 2**64


def _count(value: Any) -> bool:
    """A JSON integer of 0 to 2**64 - 1 (not a bool, not a float)."""
    return type(value) is int and 0 <= value < _U64


def _rpc_response(result: Any) -> bool:
    if type(result) is not dict or type(result.get("context")) is not dict:
        return False
    context = result["context"]
    return _count(context.get("slot")) and type(context.get("apiVersion", "")) is str and "value" in result


def _token_amount(result: Any) -> bool:
    if not _rpc_response(result) or type(value := result["value"]) is not dict:
        return False
    amount, ui, decimals = value.get("amount"), value.get("uiAmount"), value.get("decimals")
    return (
        type(amount) is str
        and amount.isascii()
        and amount.isdigit()
        and (amount[0] != "0" or amount == "0")  # a u64 as Agave writes it: no leading zero
        and int(amount) < _U64
        and type(decimals) is int
        and 0 <= decimals < 256  # a mint's decimals: a u8
        and value.get("uiAmountString") == ui_amount_string(amount, decimals)
        and (ui is None or (type(ui) in (int, float) and _close(ui, value["uiAmountString"])))
    )


def ui_amount_string(amount: str, decimals: int) -> str:
    """Agave's uiAmountString (real_number_string_trimmed): the amount over 10**decimals in decimal,
    trailing zeros and a trailing point dropped."""
    if not decimals:
        return amount
    digits = amount.rjust(decimals + 1, "0")
    fraction = digits[-decimals:].rstrip("0")
    return digits[:-decimals] + ("." + fraction if fraction else "")


def _close(ui: float, written: str) -> bool:
    """uiAmount (a float Agave computes as amount / 10**decimals) says what uiAmountString does."""
    exact = float(written)
    return abs(ui - exact) <= 1e-9 * max(1.0, abs(exact))


def _base58_32(value: Any) -> bool:
    """32 bytes in base 58 (a public key, a block hash): 32 to 44 characters of its alphabet."""
    return type(value) is str and 32 <= len(value) <= 44 and _B58.issuperset(value)


def _account_entry(entry: Any) -> bool:
    return type(entry) is dict and _base58_32(entry.get("address")) and _count(entry.get("lamports"))


def _largest_accounts(result: Any) -> bool:
    return _rpc_response(result) and type(result["value"]) is list and all(map(_account_entry, result["value"]))


TOKEN_AMOUNT = Shape("an RpcResponse of a token amount", _token_amount, null=False)
LARGEST_ACCOUNTS = Shape("an RpcResponse of accounts and lamports", _largest_accounts)


# The read surface's Solana answers (Agave's shapes): an account, a block, a transaction.
def _account(value: Any) -> bool:
    return (
        type(value) is dict
        and _count(value.get("lamports"))
        and type(value.get("owner")) is str
        and type(value.get("executable")) is bool
        and type(value.get("data")) in (list, str, dict)  # [data, encoding], base58, or jsonParsed
    )


def _balance(result: Any) -> bool:
    return _rpc_response(result) and _count(result["value"])


def _account_info(result: Any) -> bool:
    return _rpc_response(result) and (result["value"] is None or _account(result["value"]))


def _accounts(result: Any) -> bool:
    return (
        _rpc_response(result)
        and type(value := result["value"]) is list
        and all(entry is None or _account(entry) for entry in value)
    )


def _block(result: Any) -> bool:
    return (
        type(result) is dict
        and _count(result.get("parentSlot"))
        and _base58_32(result.get("blockhash"))
        and _base58_32(result.get("previousBlockhash"))
    )


def _transaction(result: Any) -> bool:
    """An object with its slot, its transaction ({...} decoded, [data, encoding], or the legacy
    `binary` encoding's base-58 string) and its meta."""
    return (
        type(result) is dict
        and _count(result.get("slot"))
        and type(result.get("transaction")) in (dict, list, str)
        and "meta" in result
        and (result["meta"] is None or type(result["meta"]) is dict)
    )


BALANCE = Shape("an RpcResponse of lamports", _balance, null=False)
ACCOUNT_INFO = Shape("an RpcResponse of an account or null", _account_info, null=False)
ACCOUNTS = Shape("an RpcResponse of accounts", _accounts, null=False)
BLOCK = Shape("a block", _block)  # null: a slot its node has no block for (kept for CACHE_NEGATIVE_TTL)
TRANSACTION = Shape("a transaction", _transaction)
