"""The one table of method policies: validator, family, cache class and credit cost.

Adding a first-class method is one entry here. Block parameters sit wherever the validator
puts a `BlockRef` in the canonical params.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from proxy.rpc import params as p
from proxy.rpc import result_shapes as shapes


class CacheClass(Enum):
    BLOCK = "block"  # state at one block: immutable at/below finalized, short TTL above, keyed by hash
    LOGS = "logs"  # a block range: immutable when it ends at/below finalized, short TTL otherwise
    CONTENT = "content"  # addressed by block hash: immutable once non-null
    LARGEST_ACCOUNTS = "largest_accounts"  # TTL of at most two hours (spec)
    TOKEN_BALANCE = "token_balance"  # bounded staleness per commitment (SOLANA_BALANCE_MAX_AGE)
    IDENTITY = "identity"  # the chain's own data (net_version, getGenesisHash...): IDENTITY_CHECK_INTERVAL
    HEAD = "head"  # about the current head only (fees): the head's number and hash are part of the key
    FEE_HISTORY = "fee_history"  # a range ending at a block: immutable when final, else per head
    TRANSACTION = "transaction"  # by transaction hash: tied to the block the answer names (cache_policy)
    SOLANA_FINAL = "solana_final"  # getBlock/getTransaction: immutable at `finalized`, else not cached
    TRACKER = "tracker"  # answered from the head/slot tracker or the chain identity (from_trackers.py)
    NONE = "none"  # forwarded, never cached


Validator = Callable[[list[Any], p.Rules], list[Any]]

Family = Literal["evm", "solana"]
FAMILIES: tuple[Family, ...] = ("evm", "solana")


@dataclass(frozen=True, slots=True)
class MethodPolicy:
    name: str
    family: Family
    validate: Validator | None
    cache: CacheClass
    credits: int | None  # the spec's fixed cost; None: the credits table (prices.py), else DEFAULT_CREDITS
    gas_cap: bool = False  # spec: gas capped at 10x the block gas limit
    limits_logs: bool = False  # spec: eth_getLogs result, time and parameter limits
    caches_reverts: bool = False  # a revert (code 3) at a final block is deterministic: eth_call only
    # A by-number method whose unfinalized block is asked by hash: this sibling takes the same params
    # with the block's hash, so the node answers for the very block the key holds.
    by_hash: str | None = None
    # Canonical params from this position on are code or state the client supplies (state and block
    # overrides): an answer that depends on them is never cached (cache/policy.py decide).
    client_state: int | None = None
    # A read of the state at one block (balance, storage, code, nonce, a call, a proof): its answer is
    # never null, so a null from a node shown to have the block is that node lacking its state.
    reads_state: bool = False
    # The shape its result must have (a null aside): a reply of another shape is a bad node reply,
    # never served nor kept (upstream/replies.py).
    result: shapes.Shape | None = None
    # Small, bounded work for a node (a slot, an account, a header, one transaction): its miss may
    # share an upstream auto-batch with other callers' reads. A call whose params do not bound its cost
    # (code run, a block's receipts, a proof of many slots, a range) goes alone, so it times out alone
    # (docs/caching.md "Upstream batching"; a block joins as a header only: upstream/pool.py).
    batches: bool = False


POLICIES: dict[str, MethodPolicy] = {
    policy.name: policy
    for policy in (
        # spec "Limits / Credits per call".
        MethodPolicy(
            "eth_getStorageAt",
            "evm",
            p.eth_get_storage_at,
            CacheClass.BLOCK,
            80,
            reads_state=True,
            result=shapes.WORD,
            batches=True,
        ),
        MethodPolicy("eth_getLogs", "evm", p.eth_get_logs, CacheClass.LOGS, 255, limits_logs=True, result=shapes.LOGS),
        MethodPolicy(
            "eth_getUncleByBlockHashAndIndex",
            "evm",
            p.eth_get_uncle_by_block_hash_and_index,
            CacheClass.CONTENT,
            150,
            batches=True,
        ),
        MethodPolicy(
            "eth_call",
            "evm",
            p.eth_call,
            CacheClass.BLOCK,
            80,
            gas_cap=True,
            caches_reverts=True,
            client_state=2,
            reads_state=True,
            result=shapes.DATA,
        ),
        MethodPolicy(
            "eth_getBlockReceipts",
            "evm",
            p.eth_get_block_receipts,
            CacheClass.BLOCK,
            1000,
            result=shapes.RECEIPTS,
        ),
        MethodPolicy(
            "getTokenAccountBalance",
            "solana",
            p.get_token_account_balance,
            CacheClass.TOKEN_BALANCE,
            160,
            result=shapes.TOKEN_AMOUNT,
            batches=True,
        ),
        MethodPolicy(
            "getLargestAccounts",
            "solana",
            p.get_largest_accounts,
            CacheClass.LARGEST_ACCOUNTS,
            160,
            result=shapes.LARGEST_ACCOUNTS,
        ),
        # Forwarded, uncached, but under a spec rule.
        MethodPolicy("eth_estimateGas", "evm", p.eth_estimate_gas, CacheClass.NONE, None, gas_cap=True),
        # It runs the call too: the same call object, the same cap (else a way round it).
        MethodPolicy("eth_createAccessList", "evm", p.eth_estimate_gas, CacheClass.NONE, None, gas_cap=True),
        # --- the common read surface (README "Caching"); costs from prices.py ---
        # Chain identity and head: no upstream call per request.
        MethodPolicy("eth_chainId", "evm", p.no_params, CacheClass.TRACKER, None, result=shapes.QUANTITY, batches=True),
        MethodPolicy("net_version", "evm", p.no_params, CacheClass.IDENTITY, None, batches=True),
        MethodPolicy(
            "eth_blockNumber", "evm", p.no_params, CacheClass.TRACKER, None, result=shapes.QUANTITY, batches=True
        ),
        MethodPolicy("eth_accounts", "evm", p.no_params, CacheClass.TRACKER, None, batches=True),
        # Blocks: by number like eth_getBlockReceipts (pinned to the hash above finalized), by hash immutable.
        MethodPolicy(
            "eth_getBlockByNumber",
            "evm",
            p.eth_get_block_by_number,
            CacheClass.BLOCK,
            None,
            by_hash="eth_getBlockByHash",
            batches=True,
        ),
        MethodPolicy("eth_getBlockByHash", "evm", p.eth_get_block_by_hash, CacheClass.BLOCK, None, batches=True),
        MethodPolicy(
            "eth_getBlockTransactionCountByNumber",
            "evm",
            p.block_by_number_only,
            CacheClass.BLOCK,
            None,
            by_hash="eth_getBlockTransactionCountByHash",
            batches=True,
        ),
        MethodPolicy(
            "eth_getBlockTransactionCountByHash", "evm", p.block_hash_only, CacheClass.BLOCK, None, batches=True
        ),
        MethodPolicy(
            "eth_getUncleCountByBlockNumber",
            "evm",
            p.block_by_number_only,
            CacheClass.BLOCK,
            None,
            by_hash="eth_getUncleCountByBlockHash",
            batches=True,
        ),
        MethodPolicy("eth_getUncleCountByBlockHash", "evm", p.block_hash_only, CacheClass.BLOCK, None, batches=True),
        MethodPolicy(
            "eth_getUncleByBlockNumberAndIndex",
            "evm",
            p.block_number_and_index,
            CacheClass.BLOCK,
            None,
            by_hash="eth_getUncleByBlockHashAndIndex",
            batches=True,
        ),
        # Transactions: by block like blocks; by transaction hash tied to the block the answer names.
        MethodPolicy(
            "eth_getTransactionByBlockNumberAndIndex",
            "evm",
            p.block_number_and_index,
            CacheClass.BLOCK,
            None,
            by_hash="eth_getTransactionByBlockHashAndIndex",
            batches=True,
        ),
        MethodPolicy(
            "eth_getTransactionByBlockHashAndIndex", "evm", p.block_hash_and_index, CacheClass.BLOCK, None, batches=True
        ),
        MethodPolicy("eth_getTransactionByHash", "evm", p.transaction_hash, CacheClass.TRANSACTION, None, batches=True),
        MethodPolicy(
            "eth_getTransactionReceipt", "evm", p.transaction_hash, CacheClass.TRANSACTION, None, batches=True
        ),
        # State at a block: like eth_getStorageAt (EIP-1898 objects, pinned to the hash above finalized).
        *(
            MethodPolicy(
                name, "evm", p.address_at_block, CacheClass.BLOCK, None, reads_state=True, result=shape, batches=True
            )
            for name, shape in (
                ("eth_getBalance", shapes.QUANTITY),
                ("eth_getCode", shapes.DATA),
                ("eth_getTransactionCount", shapes.QUANTITY),
            )
        ),
        MethodPolicy("eth_getProof", "evm", p.eth_get_proof, CacheClass.BLOCK, None, reads_state=True),
        # Fees: for the current head only.
        MethodPolicy("eth_gasPrice", "evm", p.no_params, CacheClass.HEAD, None, batches=True),
        MethodPolicy("eth_maxPriorityFeePerGas", "evm", p.no_params, CacheClass.HEAD, None, batches=True),
        MethodPolicy("eth_blobBaseFee", "evm", p.no_params, CacheClass.HEAD, None, batches=True),
        MethodPolicy("eth_feeHistory", "evm", p.eth_fee_history, CacheClass.FEE_HISTORY, None),
        # Node-side filters, served per key by upstream/filters.py: criteria under eth_getLogs' rules.
        MethodPolicy("eth_newFilter", "evm", p.eth_get_logs, CacheClass.NONE, None),
        MethodPolicy("eth_newBlockFilter", "evm", p.no_params, CacheClass.NONE, None),
        MethodPolicy("eth_newPendingTransactionFilter", "evm", p.no_params, CacheClass.NONE, None),
        MethodPolicy("eth_getFilterChanges", "evm", p.filter_id, CacheClass.NONE, None),
        MethodPolicy("eth_getFilterLogs", "evm", p.filter_id, CacheClass.NONE, None),
        MethodPolicy("eth_uninstallFilter", "evm", p.filter_id, CacheClass.NONE, None),
        # Solana.
        MethodPolicy("getSlot", "solana", p.solana_commitment_only, CacheClass.TRACKER, None, batches=True),
        MethodPolicy("getBlockHeight", "solana", p.solana_commitment_only, CacheClass.TRACKER, None, batches=True),
        MethodPolicy(
            "getBalance",
            "solana",
            p.solana_balance,
            CacheClass.TOKEN_BALANCE,
            None,
            result=shapes.BALANCE,
            batches=True,
        ),
        MethodPolicy(
            "getAccountInfo",
            "solana",
            p.solana_account,
            CacheClass.TOKEN_BALANCE,
            None,
            result=shapes.ACCOUNT_INFO,
            batches=True,
        ),
        MethodPolicy(
            "getMultipleAccounts",
            "solana",
            p.get_multiple_accounts,
            CacheClass.TOKEN_BALANCE,
            None,
            result=shapes.ACCOUNTS,
        ),
        MethodPolicy("getBlock", "solana", p.get_block, CacheClass.SOLANA_FINAL, None, result=shapes.BLOCK),
        MethodPolicy(
            "getTransaction",
            "solana",
            p.get_transaction,
            CacheClass.SOLANA_FINAL,
            None,
            result=shapes.TRANSACTION,
            batches=True,
        ),
        MethodPolicy("getGenesisHash", "solana", p.no_params, CacheClass.IDENTITY, None, batches=True),
        MethodPolicy("getVersion", "solana", p.no_params, CacheClass.IDENTITY, None, batches=True),
        MethodPolicy("getEpochSchedule", "solana", p.no_params, CacheClass.IDENTITY, None, batches=True),
    )
}

# Namespaces named in the refusal of their methods (they stay refused like everything off the
# allow-list below, unless ALLOW_NAMESPACES lists them).
REFUSED_NAMESPACES = frozenset({"admin", "debug", "personal", "miner", "engine"})

# Solana pubsub: each subscribe method and its unsubscribe, relayed to the network's upstream WebSocket.
SOLANA_PUBSUB = {
    "accountSubscribe": "accountUnsubscribe",
    "logsSubscribe": "logsUnsubscribe",
    "programSubscribe": "programUnsubscribe",
    "rootSubscribe": "rootUnsubscribe",
    "signatureSubscribe": "signatureUnsubscribe",
    "slotSubscribe": "slotUnsubscribe",
}
SOLANA_PUBSUB_METHODS = frozenset(SOLANA_PUBSUB) | frozenset(SOLANA_PUBSUB.values())


def ends_signature(result: Any) -> bool:
    """Whether a signatureNotification's result ends its subscription (Agave ends it then): the
    processed result does; `receivedSignature` (asked with enableReceivedNotification) comes before it."""
    return not isinstance(result, dict) or result.get("value") != "receivedSignature"


# Subscription streams: served by the WebSocket transport (subscriptions.py), refused over HTTP.
# A forwarded write, or a dev node's call that mines a block, makes the head tracker poll at once and
# `latest` wait for that poll (heads.py, EvmHeadTracker.wrote).
WRITE_METHODS = frozenset({"eth_sendRawTransaction", "eth_sendTransaction", "anvil_mine", "evm_mine", "hardhat_mine"})
SUBSCRIPTION_METHODS = frozenset({"eth_subscribe", "eth_unsubscribe"}) | SOLANA_PUBSUB_METHODS

# Solana's JSON-RPC methods are camelCase without a namespace; EVM ones are namespace_method.
SOLANA_METHODS = frozenset(
    {
        "getAccountInfo",
        "getBalance",
        "getBlock",
        "getBlockCommitment",
        "getBlockHeight",
        "getBlockProduction",
        "getBlockTime",
        "getBlocks",
        "getBlocksWithLimit",
        "getClusterNodes",
        "getEpochInfo",
        "getEpochSchedule",
        "getFeeForMessage",
        "getFirstAvailableBlock",
        "getGenesisHash",
        "getHealth",
        "getHighestSnapshotSlot",
        "getIdentity",
        "getInflationGovernor",
        "getInflationRate",
        "getInflationReward",
        "getLargestAccounts",
        "getLatestBlockhash",
        "getLeaderSchedule",
        "getMaxRetransmitSlot",
        "getMaxShredInsertSlot",
        "getMinimumBalanceForRentExemption",
        "getMultipleAccounts",
        "getProgramAccounts",
        "getRecentPerformanceSamples",
        "getRecentPrioritizationFees",
        "getSignatureStatuses",
        "getSignaturesForAddress",
        "getSlot",
        "getSlotLeader",
        "getSlotLeaders",
        "getStakeMinimumDelegation",
        "getSupply",
        "getTokenAccountBalance",
        "getTokenAccountsByDelegate",
        "getTokenAccountsByOwner",
        "getTokenLargestAccounts",
        "getTokenSupply",
        "getTransaction",
        "getTransactionCount",
        "getVersion",
        "getVoteAccounts",
        "isBlockhashValid",
        "minimumLedgerSlot",
        "requestAirdrop",
        "sendTransaction",
        "simulateTransaction",
    }
)

# Everyday EVM methods that get their own metric label; anything else is labelled "other"
# so a client cannot grow the label set without bound.
COMMON_EVM_METHODS = frozenset(
    {
        "eth_chainId",
        "eth_blockNumber",
        "eth_getBalance",
        "eth_getCode",
        "eth_getTransactionCount",
        "eth_getBlockByNumber",
        "eth_getBlockByHash",
        "eth_getTransactionByHash",
        "eth_getTransactionReceipt",
        "eth_sendRawTransaction",
        "eth_sendTransaction",
        "eth_gasPrice",
        "eth_maxPriorityFeePerGas",
        "eth_feeHistory",
        "eth_syncing",
        "eth_accounts",
        "eth_getProof",
        "eth_createAccessList",
        "net_version",
        "web3_clientVersion",
        "eth_getBlockTransactionCountByNumber",
        "eth_getBlockTransactionCountByHash",
        "eth_getUncleCountByBlockHash",
        "eth_getUncleCountByBlockNumber",
        "eth_getUncleByBlockNumberAndIndex",
    }
)


# The methods served by default: the public read surface, raw-transaction submission and the
# Solana reads. Everything else (eth_sendTransaction signs with the node's unlocked account,
# eth_sign, anvil_*, evm_*, hardhat_*, txpool_*, ots_*, admin_*, debug_*...) is -32601 unless
# ALLOW_METHODS or ALLOW_NAMESPACES names it. Names are matched exactly, after validation.
DEFAULT_ALLOWED_METHODS = frozenset(
    {
        *POLICIES,
        "eth_blockNumber",
        "eth_chainId",
        "eth_syncing",
        "eth_gasPrice",
        "eth_maxPriorityFeePerGas",
        "eth_feeHistory",
        "eth_blobBaseFee",
        "eth_getBalance",
        "eth_getCode",
        "eth_getTransactionCount",
        "eth_getProof",
        "eth_createAccessList",
        "eth_getBlockByNumber",
        "eth_getBlockByHash",
        "eth_getBlockTransactionCountByNumber",
        "eth_getBlockTransactionCountByHash",
        "eth_getTransactionByHash",
        "eth_getTransactionByBlockHashAndIndex",
        "eth_getTransactionByBlockNumberAndIndex",
        "eth_getTransactionReceipt",
        "eth_getUncleCountByBlockHash",
        "eth_getUncleCountByBlockNumber",
        "eth_getUncleByBlockNumberAndIndex",
        "eth_protocolVersion",
        "eth_sendRawTransaction",
        "web3_clientVersion",
        # Node-side filters: ethers' JsonRpcProvider serves `contract.on` with them. They are forwarded,
        # uncached, and live on the node that created them (README "Clients").
        "eth_newFilter",
        "eth_newBlockFilter",
        "eth_newPendingTransactionFilter",
        "eth_getFilterChanges",
        "eth_getFilterLogs",
        "eth_uninstallFilter",
        # Subscriptions: served over WebSocket (subscriptions.py), refused over HTTP by their own rule.
        *SUBSCRIPTION_METHODS,
        *(m for m in SOLANA_METHODS if m != "requestAirdrop"),
    }
)
DEFAULT_ALLOWED_NAMESPACES = frozenset({"net"})


def refusal(method: str, allowed_methods: frozenset[str], allowed_namespaces: frozenset[str]) -> str | None:
    """Why a (validated) method name is not served here, or None when it is. Pure."""
    if method in DEFAULT_ALLOWED_METHODS or method in allowed_methods:
        return None
    ns = namespace(method)
    if ns is not None and (ns in DEFAULT_ALLOWED_NAMESPACES or ns in allowed_namespaces):
        return None
    if ns in REFUSED_NAMESPACES:
        return f"method not found: the {ns}_ namespace is disabled"
    return f"method not found: {method} is not offered (ALLOW_METHODS, ALLOW_NAMESPACES)"


def family_of(method: str) -> Family:
    """The family a method belongs to, for routing when nothing else names the network."""
    policy = POLICIES.get(method)
    if policy is not None:
        return policy.family
    return "solana" if method in SOLANA_METHODS or method in SOLANA_PUBSUB_METHODS else "evm"


def metric_label(method: str) -> str:
    if method in POLICIES or method in COMMON_EVM_METHODS or method in SOLANA_METHODS:
        return method
    return "other"


def namespace(method: str) -> str | None:
    head, sep, _ = method.partition("_")
    return head if sep else None


# Dev nodes' namespaces: their methods change the chain's state without a block (anvil_setStorageAt,
# evm_revert, anvil_rollback...), except these, which read or only add blocks.
DEV_NAMESPACES = frozenset({"anvil", "hardhat", "evm"})
DEV_READS = frozenset(
    {
        "anvil_mine",
        "evm_mine",
        "hardhat_mine",
        "anvil_nodeInfo",
        "anvil_metadata",
        "hardhat_metadata",
        "anvil_getAutomine",
        "hardhat_getAutomine",
        "evm_snapshot",
        "anvil_snapshot",
        "anvil_dumpState",
    }
)


def changes_dev_state(method: str) -> bool:
    """A forwarded dev-node method that may change state without a new block: a write hint."""
    return namespace(method) in DEV_NAMESPACES and method not in DEV_READS
