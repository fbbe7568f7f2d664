"""Solana params: base-58 keys and signatures, commitments, config objects, the Solana methods."""

from __future__ import annotations

from typing import Any

from proxy.rpc.jsonrpc import invalid_params
from proxy.rpc.params.common import Rules, _arity, _object

COMMITMENTS = ("finalized", "confirmed", "processed")
LARGEST_ACCOUNTS_FILTERS = ("circulating", "nonCirculating")
_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}


def _base58_size(value: str) -> int:
    """The bytes a base-58 string (of alphabet characters only) decodes to: each leading '1' is a zero byte."""
    number = 0
    for char in value:
        number = number * 58 + _B58_INDEX[char]
    return len(value) - len(value.lstrip("1")) + (number.bit_length() + 7) // 8


def base58_pubkey(name: str, value: Any) -> str:
    """A base-58 encoded 32-byte public key, returned unchanged (base-58 is case-sensitive)."""
    if not isinstance(value, str) or not 32 <= len(value) <= 44:
        raise invalid_params(name, "expected a base-58 encoded 32-byte public key")
    bad = next((char for char in value if char not in _B58_INDEX), None)
    if bad is not None:
        raise invalid_params(name, f"invalid base-58 character {bad!r}")
    size = _base58_size(value)
    if size != 32:
        raise invalid_params(name, f"decodes to {size} bytes, expected a 32-byte public key")
    return value


# --- the seven methods: Solana's two ----------------------------------------------------


def _solana_config(name: str, value: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if value is None:
        value = {}
    obj = _object(name, value, allowed)
    commitment = obj.get("commitment", "finalized")  # spec: default finalized
    if commitment not in COMMITMENTS:
        raise invalid_params(f"{name}.commitment", f"expected one of {', '.join(COMMITMENTS)}")
    out: dict[str, Any] = {"commitment": commitment}
    if "filter" in allowed and obj.get("filter") is not None:
        if obj["filter"] not in LARGEST_ACCOUNTS_FILTERS:
            raise invalid_params(f"{name}.filter", f"expected one of {', '.join(LARGEST_ACCOUNTS_FILTERS)}")
        out["filter"] = obj["filter"]
    return out


def get_token_account_balance(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("address", "config"), 1)
    out: list[Any] = [base58_pubkey("address", params[0])]
    out.append(_solana_config("config", params[1] if len(params) > 1 else None, ("commitment",)))
    return out


def get_largest_accounts(params: list[Any], rules: Rules) -> list[Any]:
    """The forms clients send, one canonical config (so one cache key, and what is sent upstream):
    `[]`, `[null]`, `[{commitment, filter, sortResults}]` (Agave, @solana/web3.js, @solana/kit) and the filter as
    a second positional param (solana-py: `[{"commitment": ...}, "nonCirculating"]`). A bare commitment
    string is refused, as Agave refuses it."""
    # spec: with an empty params array, defaults apply.
    _arity(params, ("config", "filter"), 0)
    config = params[0] if params else None
    if len(params) > 1 and not isinstance(params[1], (str, type(None))):  # not solana-py's filter name
        raise invalid_params("params", f"expected at most 1 parameter (a config object), got {len(params)}")
    if len(params) > 1 and params[1] is not None:
        if not isinstance(config, (dict, type(None))) or (config or {}).get("filter", params[1]) != params[1]:
            raise invalid_params("filter", "given twice with different values")
        config = {**(config or {}), "filter": params[1]}
    out = _solana_config("config", config, ("commitment", "filter", "sortResults"))
    # Agave's `sortResults` (newer releases): kept as given, so a sorted and an unsorted list are two keys.
    sort = config.get("sortResults") if isinstance(config, dict) else None
    if sort is not None:
        if not isinstance(sort, bool):
            raise invalid_params("config.sortResults", "expected true or false")
        out["sortResults"] = sort
    return [out]


# --- the common read surface (issue 13): cached like the seven ---------------------------


# Solana: config fields each method takes (Agave's RpcXxxConfig). `minContextSlot` is accepted and
# forwarded; a call that sets it is not cached (cache_policy.solana_bypass).
_ACCOUNT_CONFIG = ("commitment", "encoding", "dataSlice", "minContextSlot")
# Agave's UiAccountEncoding and UiTransactionEncoding (`binary`: legacy base-58): one list let an
# account be asked in `json` and a block in `base64+zstd`, which Agave refuses.
_ACCOUNT_ENCODINGS = ("binary", "base58", "base64", "base64+zstd", "jsonParsed")
_TRANSACTION_ENCODINGS = ("binary", "base58", "base64", "json", "jsonParsed")


def _solana_options(
    name: str, value: Any, allowed: tuple[str, ...], encodings: tuple[str, ...] = _ACCOUNT_ENCODINGS
) -> dict[str, Any]:
    """A Solana config object: commitment defaulted (spec: finalized), other known fields checked."""
    raw = {} if value is None else _object(name, value, allowed)
    out = _solana_config(name, {k: v for k, v in raw.items() if k == "commitment"}, ("commitment",))
    for key, item in raw.items():
        if key == "commitment" or item is None:
            continue
        where = f"{name}.{key}"
        if key == "encoding":
            if item not in encodings:
                raise invalid_params(where, f"expected one of {', '.join(encodings)}")
        elif key in ("minContextSlot", "maxSupportedTransactionVersion"):
            if not isinstance(item, int) or isinstance(item, bool) or not 0 <= item < 2**64:
                raise invalid_params(where, "expected a non-negative integer")
        elif key == "dataSlice":
            slice_ = _object(where, item, ("offset", "length"))
            if set(slice_) != {"offset", "length"} or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64 for v in slice_.values()
            ):
                raise invalid_params(where, "expected {offset, length} as non-negative integers")
        elif key == "rewards":
            if not isinstance(item, bool):
                raise invalid_params(where, "expected true or false")
        elif key == "transactionDetails" and item not in ("full", "accounts", "signatures", "none"):
            raise invalid_params(where, "expected one of full, accounts, signatures, none")
        out[key] = item
    return out


def solana_commitment_only(params: list[Any], rules: Rules) -> list[Any]:
    """getSlot, getBlockHeight: an optional {commitment, minContextSlot}."""
    _arity(params, ("config",), 0)
    return [_solana_options("config", params[0] if params else None, ("commitment", "minContextSlot"))]


def solana_account(params: list[Any], rules: Rules) -> list[Any]:
    """getAccountInfo."""
    _arity(params, ("address", "config"), 1)
    return [
        base58_pubkey("address", params[0]),
        _solana_options("config", params[1] if len(params) > 1 else None, _ACCOUNT_CONFIG),
    ]


def solana_balance(params: list[Any], rules: Rules) -> list[Any]:
    """getBalance: Agave's config takes commitment and minContextSlot only."""
    _arity(params, ("address", "config"), 1)
    return [
        base58_pubkey("address", params[0]),
        _solana_options("config", params[1] if len(params) > 1 else None, ("commitment", "minContextSlot")),
    ]


def get_multiple_accounts(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("addresses", "config"), 1)
    keys = params[0]
    if not isinstance(keys, list) or not 1 <= len(keys) <= 100:  # Agave: MAX_MULTIPLE_ACCOUNTS = 100
        raise invalid_params("addresses", "expected an array of 1 to 100 base-58 public keys")
    return [
        [base58_pubkey(f"addresses[{i}]", k) for i, k in enumerate(keys)],
        _solana_options("config", params[1] if len(params) > 1 else None, _ACCOUNT_CONFIG),
    ]


def _encoding_config(params: list[Any]) -> Any:
    """getBlock's and getTransaction's config, which Agave also takes as an encoding alone (its
    deprecated form, RpcEncodingConfigWrapper): read as {"encoding": ...}, one key for both."""
    config = params[1] if len(params) > 1 else None
    return {"encoding": config} if isinstance(config, str) else config


def get_block(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("slot", "config"), 1)
    slot = params[0]
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < 2**64:
        raise invalid_params("slot", "expected a slot number (a non-negative integer)")
    config = _solana_options(
        "config",
        _encoding_config(params),
        ("commitment", "encoding", "transactionDetails", "rewards", "maxSupportedTransactionVersion"),
        _TRANSACTION_ENCODINGS,
    )
    if config["commitment"] == "processed":  # Agave: getBlock does not serve `processed`
        raise invalid_params("config.commitment", "getBlock takes finalized or confirmed")
    return [slot, config]


def _signature(name: str, value: Any) -> str:
    """A base-58 encoded 64-byte transaction signature, returned unchanged."""
    if not isinstance(value, str) or not 64 <= len(value) <= 88 or any(c not in _B58_INDEX for c in value):
        raise invalid_params(name, "expected a base-58 encoded 64-byte signature")
    size = _base58_size(value)
    if size != 64:
        raise invalid_params(name, f"decodes to {size} bytes, expected a 64-byte signature")
    return value


def get_transaction(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("signature", "config"), 1)
    config = _solana_options(
        "config",
        _encoding_config(params),
        ("commitment", "encoding", "maxSupportedTransactionVersion"),
        _TRANSACTION_ENCODINGS,
    )
    if config["commitment"] == "processed":  # Agave: getTransaction does not serve `processed`
        raise invalid_params("config.commitment", "getTransaction takes finalized or confirmed")
    return [_signature("signature", params[0]), config]
