"""EVM params: the spec's five EVM methods and the common read surface (blocks, transactions, fees)."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from proxy.rpc.jsonrpc import LIMIT_EXCEEDED, JsonRpcError, invalid_params
from proxy.rpc.params.common import (
    _HEX,
    BlockRef,
    Rules,
    _arity,
    _hash_form,
    _object,
    address,
    block_param,
    hash32,
    hex_bytes,
    quantity,
    quantity_int,
    storage_word,
)
from proxy.rpc.params.overrides import block_overrides, state_overrides

PROOF_MAX_KEYS = 1024  # eth_getProof storage keys in one call: a proof of each is work for the node


# --- the seven methods: the five EVM ones (Solana's two are in solana.py) ---------------


def _block_or_latest(params: list[Any], index: int) -> BlockRef:
    """A state read's block parameter, as geth reads it: a number, a tag, an EIP-1898 object or a plain
    32-byte block hash (web3.py's and ethers' `block_identifier`/`blockTag` by hash); nodes default it to
    latest when null (Anvil), or absent (eth_call: geth, Anvil)."""
    value = params[index] if len(params) > index else None
    return BlockRef(tag="latest") if value is None else block_param("block", value, allow_hash=True)


def eth_get_storage_at(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("address", "position", "block"), 3)  # spec: required (geth, Anvil); null is latest (Anvil)
    return [
        address("address", params[0]),
        storage_word("position", params[1]),
        _hash_form(_block_or_latest(params, 2), "object"),
    ]


_CALL_QUANTITIES = (
    "gas",
    "gasPrice",
    "maxPriorityFeePerGas",
    "maxFeePerGas",
    "value",
    "nonce",
    "type",
    "chainId",
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
    state, block = [*params[2:], None, None][:2]
    # Overrides are forwarded and part of the key, in the node's reading of them (overrides.py);
    # a trailing null is dropped, an inner one kept.
    overrides = [
        None if state is None else state_overrides(names[2], state),
        None if block is None else block_overrides(names[3], block),
    ]
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
        out.append(BlockRef(tag="latest") if block is None else block_param("block", block, allow_hash=True))
    if overrides is not None:
        out.append(state_overrides("stateOverrides", overrides))
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
            out[field_name] = (
                BlockRef(tag="latest") if raw is None else block_param(f"filter.{field_name}", raw, allow_object=False)
            )
    # spec: at most 5,000 parameters (addresses plus topic values) in one request: every value given
    # counts, before the sets below fold repeats and spellings of one value (checked before any is).
    count = _given_values(obj.get("address"), obj.get("topics"))
    if count > rules.getlogs_max_params:
        raise JsonRpcError(
            LIMIT_EXCEEDED,
            f"query has {count} parameters (addresses plus topic values); the limit is {rules.getlogs_max_params}",
        )
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
    return out


def _given_values(raw_address: Any, raw_topics: Any) -> int:
    """The addresses and topic values a filter gives, repeats included (a wildcard null is none);
    a field of the wrong type counts nothing here and is refused by its own check."""
    count = 1 if isinstance(raw_address, str) else len(raw_address) if isinstance(raw_address, list) else 0
    if isinstance(raw_topics, list):
        for position in raw_topics:
            if isinstance(position, str):
                count += 1
            elif isinstance(position, list):
                count += len(position) - position.count(None)
    return count


def eth_get_logs(params: list[Any], rules: Rules) -> list[Any]:
    _arity(params, ("filter",), 1)
    return [log_filter(params[0], rules)]


def filter_id(params: list[Any], rules: Rules) -> list[Any]:
    """eth_getFilterChanges, eth_getFilterLogs, eth_uninstallFilter: one filter id (the proxy's own)."""
    _arity(params, ("filterId",), 1)
    value = params[0]
    if not isinstance(value, str) or len(value) > 200 or not _HEX.fullmatch(value) or len(value) < 3:
        raise invalid_params("filterId", "expected a hex filter id such as 0x1f (as eth_newFilter returned)")
    return [value.lower()]


# --- the common read surface (issue 13): cached like the seven ---------------------------


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
        if (
            not isinstance(percentiles, list)
            or len(percentiles) > 100
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 100 for v in percentiles)
        ):
            raise invalid_params("rewardPercentiles", "expected at most 100 numbers from 0 to 100")
        if any(b < a for a, b in pairwise(percentiles)):
            raise invalid_params("rewardPercentiles", "expected percentiles in increasing order")
        out.append([float(v) for v in percentiles])
    return out
