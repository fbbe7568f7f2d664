"""Parameter validation and canonical forms for the first-class methods. Pure: no I/O.

Each validator takes the raw positional params and returns canonical params: lower-case hex,
normalised quantities, 32-byte storage words, defaults filled in, and block parameters as
`BlockRef` values that the service resolves to numbers. Two requests that mean the same thing
get equal canonical params; the forwarded request is built from them too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

from proxy.rpc.jsonrpc import LIMIT_EXCEEDED, JsonRpcError, invalid_params

TAGS = ("latest", "earliest", "pending", "safe", "finalized")
COMMITMENTS = ("finalized", "confirmed", "processed")
LARGEST_ACCOUNTS_FILTERS = ("circulating", "nonCirculating")
# Used with fullmatch only: `$` would also accept a trailing newline ("0x...\n").
_HEX = re.compile(r"0x[0-9a-fA-F]*")
_DECIMAL = re.compile(r"[0-9]{1,20}")  # 2**64 has 20 digits; longer is never a block number
_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}
UINT256_MAX = 2**256 - 1
PROOF_MAX_KEYS = 1024  # eth_getProof storage keys in one call: a proof of each is work for the node


@dataclass(frozen=True, slots=True)
class Rules:
    """The settings validation depends on."""

    eth_call_require_from: bool = False
    getlogs_max_params: int = 5_000


@dataclass(frozen=True, slots=True, eq=False)
class BlockRef:
    """A block parameter as the caller gave it: exactly one of tag, number, hash is set.

    Compared by identity: two equal-looking refs in one request (fromBlock/toBlock) stay distinct.
    """

    tag: str | None = None
    number: int | None = None
    hash: str | None = None
    object_form: bool = False  # EIP-1898 object ({"blockHash": ...} / {"blockNumber": ...})
    require_canonical: bool = False  # EIP-1898: the hash must name a block of the canonical chain
    # How this position takes a block hash in place of a number: "object" (EIP-1898), "plain" (the
    # hash itself), None (it cannot). Unfinalized reads are sent pinned to the hash this way.
    hash_form: str | None = None

    def encode_hash(self, block_hash: str) -> Any:
        """The JSON value that names block `block_hash` here, or None where no hash is accepted."""
        if self.hash_form == "object":
            return {"blockHash": block_hash}
        return block_hash if self.hash_form == "plain" else None

    def encode(self, number: int | None = None) -> Any:
        """The JSON value sent upstream; `number` replaces a resolved tag."""
        if self.hash is not None:
            if self.require_canonical:
                return {"blockHash": self.hash, "requireCanonical": True}
            return {"blockHash": self.hash} if self.object_form else self.hash
        n = number if number is not None else self.number
        if n is None:
            return self.tag
        return {"blockNumber": hex(n)} if self.object_form else hex(n)


# --- scalar validators ------------------------------------------------------------------


def hex_bytes(name: str, value: Any, size: int | None = None) -> str:
    """A 0x-prefixed hex byte string, lower-cased; `size` in bytes when fixed."""
    if not isinstance(value, str) or not _HEX.fullmatch(value):
        raise invalid_params(name, "expected a 0x-prefixed hex string")
    digits = len(value) - 2
    if size is not None and digits != size * 2:
        raise invalid_params(name, f"expected {size} bytes (0x followed by {size * 2} hex digits)")
    if digits % 2:
        raise invalid_params(name, "hex string has an odd number of digits")
    return value.lower()


def address(name: str, value: Any) -> str:
    return hex_bytes(name, value, 20)


def hash32(name: str, value: Any) -> str:
    return hex_bytes(name, value, 32)


def _uint256(name: str, value: Any, expected: str, too_big: str) -> int:
    if not isinstance(value, str) or not _HEX.fullmatch(value) or len(value) < 3:
        raise invalid_params(name, expected)
    number = int(value, 16)
    if number > UINT256_MAX:
        raise invalid_params(name, too_big)
    return number


def quantity_int(name: str, value: Any) -> int:
    return _uint256(name, value, "expected a hex quantity such as 0x1", "quantity exceeds 256 bits")


def quantity(name: str, value: Any) -> str:
    """A hex quantity, normalised: 0x0 == 0x00 == 0x000."""
    return hex(quantity_int(name, value))


def storage_word(name: str, value: Any) -> str:
    """A storage position as a 32-byte word, so 0x0 and 0x00...00 are one position."""
    number = _uint256(name, value, "expected a hex storage position such as 0x0", "storage position exceeds 32 bytes")
    return "0x" + format(number, "064x")


def base58_pubkey(name: str, value: Any) -> str:
    """A base-58 encoded 32-byte public key, returned unchanged (base-58 is case-sensitive)."""
    if not isinstance(value, str) or not 32 <= len(value) <= 44:
        raise invalid_params(name, "expected a base-58 encoded 32-byte public key")
    number = 0
    for char in value:
        digit = _B58_INDEX.get(char)
        if digit is None:
            raise invalid_params(name, f"invalid base-58 character {char!r}")
        number = number * 58 + digit
    leading_zeros = len(value) - len(value.lstrip("1"))
    size = leading_zeros + (number.bit_length() + 7) // 8
    if size != 32:
        raise invalid_params(name, f"decodes to {size} bytes, expected a 32-byte public key")
    return value


def block_param(
    name: str, value: Any, *, allow_hash: bool = False, allow_decimal: bool = False, allow_object: bool = True
) -> BlockRef:
    """spec: a hex block number, or one of latest/earliest/pending/safe/finalized."""
    if isinstance(value, str):
        if value in TAGS:
            return BlockRef(tag=value)
        if allow_hash and _HEX.fullmatch(value) and len(value) == 66:
            return BlockRef(hash=value.lower())
        if allow_decimal and value.isascii() and value.isdigit():
            if not _DECIMAL.fullmatch(value) or int(value) >= 2**64:
                raise invalid_params(name, "block number exceeds 64 bits")
            return BlockRef(number=int(value))
        if _HEX.fullmatch(value) and len(value) > 2:
            number = quantity_int(name, value)
            if number >= 2**64:
                raise invalid_params(name, "block number exceeds 64 bits")
            return BlockRef(number=number)
    elif allow_decimal and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        if value >= 2**64:
            raise invalid_params(name, "block number exceeds 64 bits")
        return BlockRef(number=value)
    elif allow_object and isinstance(value, dict):
        # EIP-1898: {"blockHash": h, "requireCanonical"?: bool} or {"blockNumber": n}.
        keys = set(value) - {"requireCanonical"}
        if keys == {"blockHash"}:
            canonical = value.get("requireCanonical", False)
            if not isinstance(canonical, bool):
                raise invalid_params(f"{name}.requireCanonical", "expected true or false")
            return BlockRef(hash=hash32(f"{name}.blockHash", value["blockHash"]), object_form=True,
                            require_canonical=canonical)
        if keys == {"blockNumber"}:  # requireCanonical means nothing for a number (geth ignores it too)
            inner = block_param(f"{name}.blockNumber", value["blockNumber"], allow_object=False)
            return BlockRef(tag=inner.tag, number=inner.number, object_form=True)
        raise invalid_params(name, "expected an EIP-1898 object with blockHash or blockNumber")
    expected = "a hex block number"
    if allow_decimal:
        expected += ", a decimal block number"
    if allow_hash:
        expected += ", a 32-byte block hash"
    raise invalid_params(name, f"expected {expected} or one of {', '.join(TAGS)}")


def _hash_form(ref: BlockRef, form: str) -> BlockRef:
    return replace(ref, hash_form=form)


def _arity(params: list[Any], names: tuple[str, ...], required: int) -> None:
    if len(params) < required:
        missing = names[len(params)]
        raise invalid_params(missing, "missing required parameter")
    if len(params) > len(names):
        raise invalid_params("params", f"expected at most {len(names)} parameters, got {len(params)}")


def _object(name: str, value: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid_params(name, "expected an object")
    for key in value:
        if key not in allowed:
            raise invalid_params(f"{name}.{key}", "unknown field")
    return value


# --- the seven methods ------------------------------------------------------------------


def _block_or_latest(params: list[Any], index: int) -> BlockRef:
    """A block parameter that nodes (Anvil, and geth for eth_call) default to latest when absent or null."""
    value = params[index] if len(params) > index else None
    return BlockRef(tag="latest") if value is None else block_param("block", value)


def eth_get_storage_at(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("address", "position", "block"), 2)
    return [
        address("address", params[0]),
        storage_word("position", params[1]),
        _hash_form(_block_or_latest(params, 2), "object"),
    ]


_CALL_QUANTITIES = (
    "gas", "gasPrice", "maxPriorityFeePerGas", "maxFeePerGas", "value", "nonce", "type", "chainId",
    "maxFeePerBlobGas",
)
_CALL_LISTS = ("accessList", "authorizationList", "blobs", "commitments", "proofs")  # forwarded as they are
_CALL_FIELDS = ("from", "to", "data", "input", "blobVersionedHashes", *_CALL_LISTS, *_CALL_QUANTITIES)


def call_object(name: str, value: Any, rules: Rules) -> dict[str, Any]:
    obj = _object(name, value, _CALL_FIELDS)
    out: dict[str, Any] = {}
    if obj.get("from") is not None:
        out["from"] = address(f"{name}.from", obj["from"])
    elif rules.eth_call_require_from:
        raise invalid_params(f"{name}.from", "missing required field")
    if obj.get("to") is not None:
        out["to"] = address(f"{name}.to", obj["to"])
    for field_name in _CALL_QUANTITIES:
        if obj.get(field_name) is not None:
            out[field_name] = quantity(f"{name}.{field_name}", obj[field_name])
    data = obj.get("data")
    data_input = obj.get("input")
    if data is not None:
        out["data"] = hex_bytes(f"{name}.data", data)
    if data_input is not None:
        checked = hex_bytes(f"{name}.input", data_input)
        if data is not None and checked != out["data"]:
            raise invalid_params(f"{name}.input", "differs from data; send one of them")
        out["data"] = checked
    if obj.get("blobVersionedHashes") is not None:
        hashes = obj["blobVersionedHashes"]
        if not isinstance(hashes, list):
            raise invalid_params(f"{name}.blobVersionedHashes", "expected an array of 32-byte hashes")
        out["blobVersionedHashes"] = [hash32(f"{name}.blobVersionedHashes", h) for h in hashes]
    for field_name in _CALL_LISTS:  # geth's TransactionArgs has each of these
        if obj.get(field_name) is not None:
            if not isinstance(obj[field_name], list):
                raise invalid_params(f"{name}.{field_name}", "expected an array")
            out[field_name] = obj[field_name]
    return out


def eth_call(params: list[Any], rules: Rules) -> list[Any]:
    names = ("transaction", "block", "stateOverrides", "blockOverrides")
    _arity(params, names, 1)
    # An absent (or null) block resolves like "latest", so it shares latest's cache entries.
    out = [call_object("transaction", params[0], rules), _hash_form(_block_or_latest(params, 1), "object")]
    overrides = [*params[2:], None, None][:2]
    for name, value in zip(names[2:], overrides, strict=True):
        if value is not None and not isinstance(value, dict):
            raise invalid_params(name, "expected an object")
    # Overrides are forwarded and part of the key; a trailing null is dropped, an inner one kept.
    while overrides and overrides[-1] is None:
        overrides.pop()
    return out + overrides


def eth_estimate_gas(params: list[Any], rules: Rules) -> list[Any]:
    """spec: eth_estimateGas takes eth_call's call object, under the same rules (and gas cap); its
    block parameter is optional. Decimal or JSON-number gas, `0X`, `gasLimit`: all -32602."""
    _arity(params, ("transaction", "block", "stateOverrides"), 1)
    out: list[Any] = [call_object("transaction", params[0], rules)]
    block = params[1] if len(params) > 1 else None
    overrides = params[2] if len(params) > 2 else None
    if block is not None or overrides is not None:
        out.append(BlockRef(tag="latest") if block is None else block_param("block", block))
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise invalid_params("stateOverrides", "expected an object")
        out.append(overrides)
    return out


def eth_get_uncle_by_block_hash_and_index(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("blockHash", "index"), 2)
    return [hash32("blockHash", params[0]), quantity("index", params[1])]


def eth_get_block_receipts(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("block",), 1)
    ref = block_param("block", params[0], allow_hash=True, allow_decimal=True)
    if ref.tag == "pending":
        # spec: the tag `pending` returns the same data as `latest`.
        ref = BlockRef(tag="latest", object_form=ref.object_form)
    return [_hash_form(ref, "plain")]


def _topic_position(name: str, value: Any) -> list[str] | None:
    """One topics entry: null (any), a hash, or an OR-list of hashes; canonically None or a sorted list."""
    if value is None:
        return None
    if isinstance(value, str):
        return [hash32(name, value)]
    if isinstance(value, list):
        # A null inside an OR-list matches anything, as does an empty list (go-ethereum's reading).
        if not value or any(v is None for v in value):
            return None
        return sorted({hash32(f"{name}[{i}]", v) for i, v in enumerate(value)})
    raise invalid_params(name, "expected null, a 32-byte hash or an array of hashes")


def log_filter(value: Any, rules: Rules) -> dict[str, Any]:
    obj = _object("filter", value, ("address", "fromBlock", "toBlock", "topics", "blockHash"))
    out: dict[str, Any] = {}
    if "blockHash" in obj and obj["blockHash"] is not None:
        # spec: when blockHash is present, fromBlock and toBlock are not allowed.
        if obj.get("fromBlock") is not None or obj.get("toBlock") is not None:
            raise invalid_params("filter.blockHash", "blockHash excludes fromBlock and toBlock")
        out["blockHash"] = BlockRef(hash=hash32("filter.blockHash", obj["blockHash"]))
    else:
        # spec: fromBlock and toBlock default to latest.
        for field_name in ("fromBlock", "toBlock"):
            raw = obj.get(field_name)
            out[field_name] = BlockRef(tag="latest") if raw is None else block_param(
                f"filter.{field_name}", raw, allow_object=False
            )
    count = 0
    raw_address = obj.get("address")
    if raw_address is not None:
        if isinstance(raw_address, str):
            addresses = [address("filter.address", raw_address)]
        elif isinstance(raw_address, list):
            addresses = sorted({address(f"filter.address[{i}]", a) for i, a in enumerate(raw_address)})
        else:
            raise invalid_params("filter.address", "expected an address or an array of addresses")
        if addresses:
            out["address"] = addresses
            count += len(addresses)
    raw_topics = obj.get("topics")
    if raw_topics is not None:
        if not isinstance(raw_topics, list):
            raise invalid_params("filter.topics", "expected an array")
        if len(raw_topics) > 4:
            raise invalid_params("filter.topics", f"at most 4 topic positions, got {len(raw_topics)}")
        topics = [_topic_position(f"filter.topics[{i}]", t) for i, t in enumerate(raw_topics)]
        # Trailing wildcards are kept: go-ethereum skips a log with fewer topics than the filter has
        # positions, so [A, null] and [A] differ there (other nodes may read them alike).
        if topics:
            out["topics"] = topics
            count += sum(len(t) for t in topics if t)
    # spec: at most 5,000 parameters (addresses plus topic values) in one request.
    if count > rules.getlogs_max_params:
        raise JsonRpcError(
            LIMIT_EXCEEDED,
            f"query has {count} parameters (addresses plus topic values); the limit is {rules.getlogs_max_params}",
        )
    return out


def eth_get_logs(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("filter",), 1)
    return [log_filter(params[0], rules)]


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
    # spec: with an empty params array, defaults apply.
    _arity(params, ("config",), 0)
    return [_solana_config("config", params[0] if params else None, ("commitment", "filter"))]


def block_refs(value: Any) -> list[BlockRef]:
    """Every BlockRef inside canonical params, in order."""
    kind = type(value)
    if kind is BlockRef:
        return [value]
    if kind is list:
        return [ref for item in value for ref in block_refs(item)]
    if kind is dict:
        return [ref for item in value.values() for ref in block_refs(item)]
    return []


def substitute(value: Any, replace: dict[int, Any]) -> Any:
    """Copy of canonical params with each BlockRef replaced by replace[id(ref)]."""
    kind = type(value)
    if kind is BlockRef:
        return replace[id(value)]
    if kind is list:
        return [substitute(item, replace) for item in value]
    if kind is dict:
        return {k: substitute(v, replace) for k, v in value.items()}
    return value


# --- the common read surface (issue 13): cached like the seven ---------------------------


def no_params(params: list[Any], rules: Rules) -> list[Any]:
    """eth_chainId, eth_blockNumber, fee reads...: nothing to validate; extra params are refused."""
    _arity(params, (), 0)
    return []


def _full_tx(params: list[Any], index: int) -> bool:
    value = params[index] if len(params) > index else False
    if not isinstance(value, bool):
        raise invalid_params("fullTransactions", "expected true or false")
    return value


def _number_block(params: list[Any], index: int) -> BlockRef:
    """A block-by-number position: a hex number or tag (no EIP-1898 object, no hash). When the key
    pins an unfinalized block, the call goes upstream as its by-hash sibling (methods.py)."""
    return _hash_form(block_param("block", params[index], allow_object=False), "plain")


def eth_get_block_by_number(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("block", "fullTransactions"), 1)
    return [_number_block(params, 0), _full_tx(params, 1)]


def _hash_ref(params: list[Any]) -> BlockRef:
    """A block hash position, as a BlockRef so the tracker resolves it: a hash a reorg replaced is
    never answered from the cache (chain.py orphans)."""
    return BlockRef(hash=hash32("blockHash", params[0]), hash_form="plain")


def eth_get_block_by_hash(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("blockHash", "fullTransactions"), 1)
    return [_hash_ref(params), _full_tx(params, 1)]


def block_by_number_only(params: list[Any], rules: Rules) -> list[Any]:
    """eth_getBlockTransactionCountByNumber, eth_getUncleCountByBlockNumber."""
    _arity(params, ("block",), 1)
    return [_number_block(params, 0)]


def block_hash_only(params: list[Any], rules: Rules) -> list[Any]:
    """eth_getBlockTransactionCountByHash, eth_getUncleCountByBlockHash."""
    _arity(params, ("blockHash",), 1)
    return [_hash_ref(params)]


def block_number_and_index(params: list[Any], rules: Rules) -> list[Any]:
    """eth_getUncleByBlockNumberAndIndex, eth_getTransactionByBlockNumberAndIndex."""
    _arity(params, ("block", "index"), 2)
    return [_number_block(params, 0), quantity("index", params[1])]


def block_hash_and_index(params: list[Any], rules: Rules) -> list[Any]:
    """eth_getTransactionByBlockHashAndIndex (eth_getUncleByBlockHashAndIndex has its own, above)."""
    _arity(params, ("blockHash", "index"), 2)
    return [_hash_ref(params), quantity("index", params[1])]


def transaction_hash(params: list[Any], rules: Rules) -> list[Any]:
    """eth_getTransactionByHash, eth_getTransactionReceipt."""
    _arity(params, ("transactionHash",), 1)
    return [hash32("transactionHash", params[0])]


def address_at_block(params: list[Any], rules: Rules) -> list[Any]:
    """eth_getBalance, eth_getCode, eth_getTransactionCount: like eth_getStorageAt without a position."""
    _arity(params, ("address", "block"), 1)
    return [address("address", params[0]), _hash_form(_block_or_latest(params, 1), "object")]


def eth_get_proof(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("address", "storageKeys", "block"), 2)
    keys = params[1]
    if not isinstance(keys, list):
        raise invalid_params("storageKeys", "expected an array of storage positions")
    if len(keys) > PROOF_MAX_KEYS:
        raise invalid_params("storageKeys", f"at most {PROOF_MAX_KEYS} storage positions")
    # The proof lists the keys in the order asked: the order is part of the key, duplicates too.
    return [
        address("address", params[0]),
        [storage_word(f"storageKeys[{i}]", k) for i, k in enumerate(keys)],
        _hash_form(_block_or_latest(params, 2), "object"),
    ]


def eth_fee_history(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("blockCount", "newestBlock", "rewardPercentiles"), 2)
    count = params[0]
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        blocks = count  # geth takes a JSON number too (web3.py sends one)
    else:
        blocks = quantity_int("blockCount", count)
    if not 1 <= blocks <= 1024:
        raise invalid_params("blockCount", "expected 1 to 1024 blocks")
    out: list[Any] = [hex(blocks), block_param("newestBlock", params[1], allow_object=False)]
    if len(params) > 2 and params[2] is not None:
        percentiles = params[2]
        if not isinstance(percentiles, list) or len(percentiles) > 100 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 100 for v in percentiles
        ):
            raise invalid_params("rewardPercentiles", "expected at most 100 numbers from 0 to 100")
        if any(b < a for a, b in pairwise(percentiles)):
            raise invalid_params("rewardPercentiles", "expected percentiles in increasing order")
        out.append([float(v) for v in percentiles])
    return out


# Solana: config fields each method takes (Agave's RpcXxxConfig). `minContextSlot` is accepted and
# forwarded; a call that sets it is not cached (cache_policy.solana_bypass).
_ACCOUNT_CONFIG = ("commitment", "encoding", "dataSlice", "minContextSlot")
_SOLANA_ENCODINGS = ("base58", "base64", "base64+zstd", "jsonParsed", "json")


def _solana_options(name: str, value: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    """A Solana config object: commitment defaulted (spec: finalized), other known fields checked."""
    raw = {} if value is None else _object(name, value, allowed)
    out = _solana_config(name, {k: v for k, v in raw.items() if k == "commitment"}, ("commitment",))
    for key, item in raw.items():
        if key == "commitment" or item is None:
            continue
        where = f"{name}.{key}"
        if key == "encoding":
            if item not in _SOLANA_ENCODINGS:
                raise invalid_params(where, f"expected one of {', '.join(_SOLANA_ENCODINGS)}")
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


def solana_no_params(params: list[Any], rules: Rules) -> list[Any]:
    """getGenesisHash, getVersion, getEpochSchedule."""
    _arity(params, (), 0)
    return []


def solana_account(params: list[Any], rules: Rules) -> list[Any]:
    """getAccountInfo."""
    _arity(params, ("address", "config"), 1)
    return [base58_pubkey("address", params[0]),
            _solana_options("config", params[1] if len(params) > 1 else None, _ACCOUNT_CONFIG)]


def solana_balance(params: list[Any], rules: Rules) -> list[Any]:
    """getBalance: Agave's config takes commitment and minContextSlot only."""
    _arity(params, ("address", "config"), 1)
    return [base58_pubkey("address", params[0]),
            _solana_options("config", params[1] if len(params) > 1 else None, ("commitment", "minContextSlot"))]


def get_multiple_accounts(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("addresses", "config"), 1)
    keys = params[0]
    if not isinstance(keys, list) or not 1 <= len(keys) <= 100:  # Agave: MAX_MULTIPLE_ACCOUNTS = 100
        raise invalid_params("addresses", "expected an array of 1 to 100 base-58 public keys")
    return [[base58_pubkey(f"addresses[{i}]", k) for i, k in enumerate(keys)],
            _solana_options("config", params[1] if len(params) > 1 else None, _ACCOUNT_CONFIG)]


def get_block(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("slot", "config"), 1)
    slot = params[0]
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < 2**64:
        raise invalid_params("slot", "expected a slot number (a non-negative integer)")
    config = _solana_options("config", params[1] if len(params) > 1 else None, (
        "commitment", "encoding", "transactionDetails", "rewards", "maxSupportedTransactionVersion"))
    if config["commitment"] == "processed":  # Agave: getBlock does not serve `processed`
        raise invalid_params("config.commitment", "getBlock takes finalized or confirmed")
    return [slot, config]


def _signature(name: str, value: Any) -> str:
    """A base-58 encoded 64-byte transaction signature, returned unchanged."""
    if not isinstance(value, str) or not 64 <= len(value) <= 88 or any(c not in _B58_INDEX for c in value):
        raise invalid_params(name, "expected a base-58 encoded 64-byte signature")
    number = 0
    for char in value:
        number = number * 58 + _B58_INDEX[char]
    size = len(value) - len(value.lstrip("1")) + (number.bit_length() + 7) // 8
    if size != 64:
        raise invalid_params(name, f"decodes to {size} bytes, expected a 64-byte signature")
    return value


def get_transaction(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("signature", "config"), 1)
    config = _solana_options("config", params[1] if len(params) > 1 else None, (
        "commitment", "encoding", "maxSupportedTransactionVersion"))
    if config["commitment"] == "processed":  # Agave: getTransaction does not serve `processed`
        raise invalid_params("config.commitment", "getTransaction takes finalized or confirmed")
    return [_signature("signature", params[0]), config]
