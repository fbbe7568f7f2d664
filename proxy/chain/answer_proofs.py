"""What proves a node's answer about a final block, per method, given the block's proven header. Pure.

A call's answer is proven from its block's header (header_chain.py) and, where the answer itself does
not carry its proof, from further calls (`extra_calls`) whose answers are proven against the same
header first: an eth_getProof for a state read, the block with its full transactions for a receipt,
a transaction or a block with hashes, the block's receipts for a single receipt, the block with its
uncle hashes (and then, `follow_up_calls`, its uncle headers) for an uncle. `prove` raises
AnswerError when the answer is not what the proofs show (a lie, or a node on another chain), and
Unprovable when no proof can be had here (a block answer with uncles, an error answer): that answer
is not refuted, only not proven.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from proxy.chain.block_body import BlockError, verify_block, verify_uncles
from proxy.chain.fields import FieldError, data, quantity
from proxy.chain.headers import Header, HeaderError, header_rlp, verify_header
from proxy.chain.receipts_root import ReceiptError, verify_receipts
from proxy.chain.rlp import wrap_list
from proxy.chain.trie_proof import ProofError, slot_key, verify_account, verify_code
from proxy.rpc.jsonrpc import dumps_canonical
from proxy.upstream.standing import ChainIdentity

# State reads: the position of their block parameter.
STATE = {"eth_getStorageAt": 2, "eth_getBalance": 1, "eth_getCode": 1, "eth_getTransactionCount": 1, "eth_getProof": 2}
TRANSACTIONS = frozenset(
    {"eth_getTransactionByHash", "eth_getTransactionByBlockNumberAndIndex", "eth_getTransactionByBlockHashAndIndex"}
)
BLOCKS = frozenset({"eth_getBlockByNumber", "eth_getBlockByHash"})
RECEIPTS = frozenset({"eth_getBlockReceipts", "eth_getTransactionReceipt"})
UNCLE = "eth_getUncleByBlockHashAndIndex"
PROVABLE = frozenset(STATE) | TRANSACTIONS | BLOCKS | RECEIPTS | {"eth_getLogs", UNCLE}
# Methods whose null is proven too (no uncle or transaction at that index of a final block): as final
# as the block.
NULL_PROVABLE = frozenset({UNCLE, "eth_getTransactionByBlockNumberAndIndex"})
MAX_UNCLES = 16  # uncle headers asked to prove one answer (Ethereum allowed 2 a block)

Call = tuple[str, Any]


class AnswerError(ValueError):
    """The answer is not what the block's proofs show."""


class Unprovable(ValueError):
    """No proof of the answer can be had: neither proven nor refuted."""


def _block_param(value: Any) -> int | str | None:
    """A block parameter as a number, or a hash (EIP-1898 `{"blockHash": H}`); None for a tag."""
    if isinstance(value, dict):
        value = value.get("blockNumber", value.get("blockHash"))
    if not isinstance(value, str) or not value.startswith("0x"):
        return None
    if len(value) == 66:
        return value.lower()
    try:
        return int(value, 16)
    except ValueError:
        return None


def answer_block(method: str, params: Any, result: Any) -> int | str | None:
    """The block an answer is about: its number, else its hash; None when neither is known."""
    params = params if isinstance(params, list) else []
    if method in STATE:
        return _block_param(params[STATE[method]]) if len(params) > STATE[method] else None
    if method in ("eth_getBlockReceipts", "eth_getBlockByNumber", "eth_getTransactionByBlockNumberAndIndex", UNCLE):
        return _block_param(params[0]) if params else None  # an uncle's own number is not its block's
    item = result[0] if isinstance(result, list) and result else result
    if not isinstance(item, dict):
        return None
    return _block_param(item.get("blockNumber", item.get("number")))


# Calls that name their block by hash in their first param (the block's hash, not an item's).
BY_BLOCK_HASH = frozenset(
    {"eth_getBlockByHash", "eth_getBlockReceipts", "eth_getTransactionByBlockHashAndIndex", UNCLE}
)


def named_hash(method: str, params: Any) -> str | None:
    """The block hash a call names (lower-case), where it names its block by hash: EIP-1898
    `{"blockHash": H}`, an eth_getLogs `blockHash` filter, the by-hash block methods; else None."""
    params = params if isinstance(params, list) else []
    if method in STATE:
        named = _block_param(params[STATE[method]]) if len(params) > STATE[method] else None
    elif method == "eth_getLogs":
        named = _block_param(params[0].get("blockHash")) if params and isinstance(params[0], dict) else None
    else:
        named = _block_param(params[0]) if method in BY_BLOCK_HASH and params else None
    return named if isinstance(named, str) else None


def by_hash(calls: Sequence[Call], number: int, block_hash: str) -> list[Call]:
    """The proof's calls with the block named by its hash instead of its number: for a block above
    finality, whose number another block may take by a reorg while the proof is asked."""
    block = hex(number)
    pinned: list[Call] = []
    for method, params in calls:
        if method == "eth_getBlockByNumber" and params[0] == block:
            method, params = "eth_getBlockByHash", [block_hash, *params[1:]]
        elif method == "eth_getBlockReceipts" and params[0] == block:
            params = [block_hash]
        elif method == "eth_getProof" and params[2] == block:
            params = [*params[:2], {"blockHash": block_hash}]
        pinned.append((method, params))
    return pinned


def extra_calls(method: str, params: Any, result: Any, number: int) -> list[Call]:
    """The calls whose answers, with the header, prove this answer (asked of the same node)."""
    block = hex(number)
    if method in STATE and method != "eth_getProof":
        keys = [_slot(params[1])] if method == "eth_getStorageAt" else []
        return [("eth_getProof", [params[0], keys, block])]
    if method in BLOCKS:
        shown = result.get("transactions") if isinstance(result, dict) else None
        hashes = isinstance(shown, list) and any(isinstance(tx, str) for tx in shown)
        return [("eth_getBlockByNumber", [block, True])] if hashes else []
    if method == "eth_getTransactionReceipt":
        return [("eth_getBlockByNumber", [block, True]), ("eth_getBlockReceipts", [block])]
    if method in TRANSACTIONS or method == "eth_getBlockReceipts":
        return [("eth_getBlockByNumber", [block, True])]
    if method == UNCLE:
        return [("eth_getBlockByHash", [params[0], False])]
    return []


def proof_beside(method: str, params: Any, finalized: int | None) -> Call | None:
    """The eth_getProof that proves a state read (eth_getStorageAt, eth_getBalance,
    eth_getTransactionCount, eth_getCode) about a final block other than genesis, to ask in the
    read's own batch of the same node (pool.py), so proving it costs no second round trip; None for
    any other read (nothing asked that its answer could not use)."""
    if finalized is None or method not in STATE or method == "eth_getProof":
        return None
    block = answer_block(method, params, None)
    if not isinstance(block, int) or not 0 < block <= finalized:
        return None
    try:
        return extra_calls(method, params, None, block)[0]
    except Unprovable:
        return None  # a slot no eth_getProof takes: the read goes alone, and stays unproven


class _Heads(Protocol):
    """A head tracker (heads.EvmHeadTracker): its head, None before the first."""

    @property
    def head(self) -> Any: ...


def proof_beside_head(tracker: _Heads, method: str, params: Any) -> Call | None:
    """proof_beside for the tracker's head now: only a block final by it (verifying.py proves only
    those), so nothing is asked that the read's verification would not use; none before the head's
    finalized block's hash is known."""
    head = tracker.head
    return proof_beside(method, params, head.finalized if head is not None and head.final_hash else None)


def follow_up_calls(method: str, params: Any, extras: Sequence[Any]) -> list[Call]:
    """Calls that the extra calls' answers show are needed too: an uncle's proof needs every uncle
    header of its block (sha3Uncles commits to them all), as many as the block lists."""
    block = extras[0] if method == UNCLE and extras else None
    shown = block.get("uncles") if isinstance(block, dict) else None
    if not isinstance(shown, list) or not shown:
        return []
    if len(shown) > MAX_UNCLES:
        raise Unprovable(f"a block listing {len(shown)} uncles")
    return [(UNCLE, [params[0], hex(j)]) for j in range(len(shown))]


def _slot(value: Any) -> str:
    """A storage slot as the 32 bytes of hex eth_getProof takes (Anvil takes no shorter key)."""
    try:
        return "0x" + slot_key(value).hex()
    except ProofError as exc:
        raise Unprovable(str(exc)) from exc


def prove(
    method: str, params: Any, result: Any, header: Header, extras: Sequence[Any], chain: ChainIdentity | None = None
) -> None:
    """Return when `result` is proven by `header` and the `extras` answers (extra_calls' order);
    AnswerError when it is refuted, Unprovable when it cannot be told. `chain`: the network's
    identity, which names its blob schedule (a receipt's blobGasPrice)."""
    try:
        _asked_for(method, params, result)
        if method in STATE:
            _prove_state(method, params, result, header, extras)
        elif method in BLOCKS:
            _prove_block(result, header, extras[0] if extras else None)
        elif method == UNCLE:
            _prove_uncle(params, result, header, extras)
        else:
            _prove_from_block(method, params, result, header, extras, chain)
    except (ProofError, BlockError, ReceiptError, FieldError, HeaderError) as exc:
        raise AnswerError(str(exc)) from exc


def _prove_state(method: str, params: Any, result: Any, header: Header, extras: Sequence[Any]) -> None:
    if method == "eth_getProof":
        keys = params[1] if isinstance(params[1], list) else []
        verify_account(header.state_root, result, params[0], keys)
        return
    account = verify_account(header.state_root, extras[0], params[0], [_slot(params[1])] if len(params) > 2 else [])
    if method == "eth_getStorageAt":
        if int.from_bytes(data(result, "storage word", 32), "big") != account.storage[slot_key(params[1])]:
            raise AnswerError("the storage word is not the proven one")
    elif method == "eth_getBalance":
        if quantity(result, "balance") != account.balance:
            raise AnswerError("the balance is not the proven one")
    elif method == "eth_getTransactionCount":
        if quantity(result, "nonce") != account.nonce:
            raise AnswerError("the nonce is not the proven one")
    else:
        verify_code(result, account.code_hash)


def _proven_block(block: Any, header: Header, transactions: Sequence[Mapping[str, Any]] | None = None) -> None:
    if isinstance(block, dict) and block.get("uncles"):
        raise Unprovable("a block with uncles: their headers are not asked")
    proven = verify_block(block, transactions=transactions)
    if proven.header.hash != header.hash:
        raise AnswerError("the block is not the chain's block at its height")


def _prove_block(result: Any, header: Header, full: Any) -> None:
    if result is None:
        raise AnswerError("no block at a final height")
    transactions = full.get("transactions") if isinstance(full, dict) else None
    if full is not None:
        _proven_block(full, header)
    _proven_block(result, header, transactions)


def _prove_uncle(params: Any, result: Any, header: Header, extras: Sequence[Any]) -> None:
    """The block (with uncle hashes) proven by the header's hash and its uncles by sha3Uncles with
    their headers; then a null is proven by no uncle at the index, an uncle by its header's hash."""
    block, uncles = extras[0], extras[1:]
    if not isinstance(block, dict):
        raise AnswerError("no block for a final block's hash")
    if verify_header(block).hash != header.hash:
        raise AnswerError("the block is not the chain's block at its height")
    verify_uncles(block, uncles)
    shown, index = block["uncles"], quantity(params[1], "index")
    if result is None:
        if index < len(shown):
            raise AnswerError("null for an uncle the block has")
        return
    if index >= len(shown):
        raise AnswerError("an uncle the block does not have")
    if not isinstance(result, dict) or "0x" + verify_header(result).hash.hex() != str(shown[index]).lower():
        raise AnswerError("an uncle header that is not the block's uncle at its index")
    # The size of an uncle answer: its header's block with no body (geth); other reckonings not proven.
    if "size" in result and quantity(result["size"], "size") != len(wrap_list(header_rlp(result) + b"\xc0\xc0")):
        raise Unprovable("an uncle's size that is not its header's bare block")


def prove_receipts(full: Any, receipts: Any, header: Header) -> None:
    """A block's receipts against its header, with its full transactions (proven first)."""
    try:
        _proven_block(full, header)
        verify_receipts(receipts, header, full["transactions"])  # the logs need none of the fields left
    except (BlockError, ReceiptError, FieldError) as exc:
        raise AnswerError(str(exc)) from exc


def _receipts_proven(
    receipts: Any, header: Header, transactions: Sequence[Mapping[str, Any]], chain: ChainIdentity | None
) -> None:
    """Receipts proven by the header and the block's proven transactions, every field of them: one the
    header does not settle (a blobGasPrice of a blob schedule not known here) leaves them unproven."""
    left = verify_receipts(receipts, header, transactions, chain)
    if left:
        raise Unprovable(f"a receipt's {sorted(left)[0]}, which the header does not settle")


def _prove_from_block(
    method: str, params: Any, result: Any, header: Header, extras: Sequence[Any], chain: ChainIdentity | None
) -> None:
    """Receipts and transactions: the block's full transactions proven first, then the answer (a null
    by index: no transaction there)."""
    full = extras[0]
    _proven_block(full, header)
    transactions = full["transactions"]
    if method in TRANSACTIONS:
        if result is None and method in NULL_PROVABLE:
            if quantity(params[1], "index") < len(transactions):
                raise AnswerError("null for a transaction the block has")
            return
        _same_item(result, transactions, "transaction")
        return
    receipts = extras[1] if method == "eth_getTransactionReceipt" else result
    _receipts_proven(receipts, header, transactions, chain)
    if method == "eth_getTransactionReceipt":
        _same_item(result, receipts, "receipt")


# What names the one transaction or receipt a call asks for: (the answer's field, the param's
# position). A block's proofs prove each of its items, so an item is proven only as the one asked for.
ITEM_FIELDS = {
    "eth_getTransactionByHash": (("hash", 0),),
    "eth_getTransactionReceipt": (("transactionHash", 0),),
    "eth_getTransactionByBlockNumberAndIndex": (("blockNumber", 0), ("transactionIndex", 1)),
    "eth_getTransactionByBlockHashAndIndex": (("blockHash", 0), ("transactionIndex", 1)),
}
# A block, or each of a block's receipts, names its block in these fields (by hash, by number): the
# block the call's first param names, or the answer is another block's, proven by its own header.
BLOCK_FIELDS = {
    "eth_getBlockByHash": ("hash", "number"),
    "eth_getBlockByNumber": ("hash", "number"),
    "eth_getBlockReceipts": ("blockHash", "blockNumber"),
}


def other_item(method: str, params: Any, result: Any) -> str | None:
    """The field by which an answer is not the block, transaction or receipt its call names (by hash,
    number or index), or None: a node may answer with another one, whole and true of its own block.
    A param that names nothing to compare (a tag) is not compared."""
    params = params if isinstance(params, list) else []
    if method == "eth_getLogs":
        return log_outside(params[0] if params else None, result)
    fields = BLOCK_FIELDS.get(method)
    if fields is not None:
        asked = _block_param(params[0]) if params else None
        if asked is None:
            return None
        name = fields[0] if isinstance(asked, str) else fields[1]
        for item in result if isinstance(result, list) else [result]:
            if isinstance(item, dict) and _block_param(item.get(name)) != asked:
                return name
        return None
    if not isinstance(result, dict):
        return None  # null, or not an item (_same_item says so when it is to be proven)
    for name, position in ITEM_FIELDS.get(method, ()):
        asked = _block_param(params[position]) if len(params) > position else None
        if asked is not None and _block_param(result.get(name)) != asked:
            return name
    return None


def log_outside(log_filter: Any, logs: Any) -> str | None:
    """The field by which a log of an eth_getLogs answer is outside its filter (a block before
    `fromBlock` or past `toBlock`, another `blockHash`, an address or a topic not asked for), or None.
    A node on another block or chain, or one that ignored the filter, answers so; no proof is needed
    to see it. A tag (a bound not yet a number) is not compared."""
    if not isinstance(log_filter, dict) or not isinstance(logs, list):
        return None
    by_hash = _block_param(log_filter.get("blockHash"))
    low, high = _block_param(log_filter.get("fromBlock")), _block_param(log_filter.get("toBlock"))
    addresses = _lowered(log_filter.get("address"))
    topics = log_filter.get("topics")
    wanted = [_lowered(t) for t in topics] if isinstance(topics, list) else []
    ranged = isinstance(low, int) or isinstance(high, int)
    for log in logs:
        if not isinstance(log, dict):
            return "log"
        if isinstance(by_hash, str) and _block_param(log.get("blockHash")) != by_hash:
            return "blockHash"
        if ranged:
            number = _block_param(log.get("blockNumber"))
            if (
                not isinstance(number, int)
                or (isinstance(low, int) and number < low)
                or (isinstance(high, int) and number > high)
            ):
                return "blockNumber"
        if addresses is not None and str(log.get("address", "")).lower() not in addresses:
            return "address"
        if not wanted:
            continue
        got = log.get("topics")
        if not isinstance(got, list) or len(got) < len(wanted):
            return "topics"
        for position, allowed in enumerate(wanted):
            if allowed is not None and str(got[position]).lower() not in allowed:
                return "topics"
    return None


def _lowered(value: Any) -> frozenset[str] | None:
    """A filter's address or topic position as the set of lower-cased values it allows; None: any."""
    if isinstance(value, str):
        return frozenset((value.lower(),))
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return frozenset(v.lower() for v in value)
    return None


def _asked_for(method: str, params: Any, result: Any) -> None:
    """Refute an answer that is not what its call names: another final block, or another block's or
    index's item, would be proven by its own block's proofs."""
    name = other_item(method, params, result)
    if name is not None:
        raise AnswerError(f"the answer is not the item asked for: its {name} is not the call's")


def _same_item(result: Any, items: Sequence[Any], what: str) -> None:
    """`result` is the proven list's item at its transactionIndex, field for field."""
    if not isinstance(result, dict):
        raise Unprovable(f"a {what} that is not an object")
    index = quantity(result.get("transactionIndex"), "transactionIndex")
    if index >= len(items) or dumps_canonical(items[index]) != dumps_canonical(result):
        raise AnswerError(f"the {what} is not the block's at its index")


def logs_by_block(logs: Any) -> dict[int, list[Any]]:
    """An eth_getLogs answer's logs by block number; AnswerError when it is not a list of logs."""
    if not isinstance(logs, list):
        raise AnswerError("logs are not a list")
    found: dict[int, list[Any]] = {}
    for entry in logs:
        if not isinstance(entry, dict) or entry.get("removed", False) is not False:
            raise AnswerError("a log that is not a final block's")
        try:
            found.setdefault(quantity(entry.get("blockNumber"), "blockNumber"), []).append(entry)
        except FieldError as exc:
            raise AnswerError(str(exc)) from exc
    return found


def prove_block_logs(shown: Sequence[Any], expected: Sequence[Any], *, complete: bool) -> None:
    """One block's logs in an answer against the logs of its proven receipts that match the filter:
    the same list (`complete`), or each one among them (inclusion only)."""
    proven = [dumps_canonical({k: v for k, v in e.items() if k != "removed"}) for e in expected]
    given = [dumps_canonical({k: v for k, v in e.items() if k != "removed"}) for e in shown]
    if complete and given != proven:
        raise AnswerError("the logs are not the block's proven logs")
    if not complete and not set(given) <= set(proven):
        raise AnswerError("a log that is in none of the block's proven receipts")
