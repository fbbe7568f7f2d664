"""The one table of method policies: validator, family, cache class and credit cost.

Adding a first-class method is one entry here. Block parameters sit wherever the validator
puts a `BlockRef` in the canonical params.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from . import params as p
from .config import Family


class CacheClass(Enum):
    BLOCK = "block"  # state at one block: immutable at/below finalized, short TTL above, keyed by hash
    LOGS = "logs"  # a block range: immutable when it ends at/below finalized, short TTL otherwise
    CONTENT = "content"  # addressed by block hash: immutable once non-null
    LARGEST_ACCOUNTS = "largest_accounts"  # TTL of at most two hours (spec)
    TOKEN_BALANCE = "token_balance"  # bounded staleness per commitment
    NONE = "none"  # forwarded, never cached


Validator = Callable[[list[Any], p.Rules], list[Any]]


@dataclass(frozen=True, slots=True)
class MethodPolicy:
    name: str
    family: Family
    validate: Validator | None
    cache: CacheClass
    credits: int | None  # None: the configured default cost
    gas_cap: bool = False  # spec: gas capped at 10x the block gas limit
    limits_logs: bool = False  # spec: eth_getLogs result, time and parameter limits
    caches_reverts: bool = False  # a revert (code 3) at a final block is deterministic: eth_call only


POLICIES: dict[str, MethodPolicy] = {
    policy.name: policy
    for policy in (
        # spec "Limits / Credits per call".
        MethodPolicy("eth_getStorageAt", "evm", p.eth_get_storage_at, CacheClass.BLOCK, 80),
        MethodPolicy("eth_getLogs", "evm", p.eth_get_logs, CacheClass.LOGS, 255, limits_logs=True),
        MethodPolicy(
            "eth_getUncleByBlockHashAndIndex", "evm", p.eth_get_uncle_by_block_hash_and_index,
            CacheClass.CONTENT, 150,
        ),
        MethodPolicy("eth_call", "evm", p.eth_call, CacheClass.BLOCK, 80, gas_cap=True, caches_reverts=True),
        MethodPolicy("eth_getBlockReceipts", "evm", p.eth_get_block_receipts, CacheClass.BLOCK, 1000),
        MethodPolicy(
            "getTokenAccountBalance", "solana", p.get_token_account_balance, CacheClass.TOKEN_BALANCE, 160
        ),
        MethodPolicy("getLargestAccounts", "solana", p.get_largest_accounts, CacheClass.LARGEST_ACCOUNTS, 160),
        # Forwarded, uncached, but under a spec rule.
        MethodPolicy("eth_estimateGas", "evm", p.eth_estimate_gas, CacheClass.NONE, None, gas_cap=True),
        # It runs the call too: the same call object, the same cap (else a way round it).
        MethodPolicy("eth_createAccessList", "evm", p.eth_estimate_gas, CacheClass.NONE, None, gas_cap=True),
    )
}

# Namespaces named in the refusal of their methods (they stay refused like everything off the
# allow-list below, unless ALLOW_NAMESPACES lists them).
REFUSED_NAMESPACES = frozenset({"admin", "debug", "personal", "miner", "engine"})

# Solana pubsub: each subscribe method and its unsubscribe, relayed to the network's upstream WebSocket.
SOLANA_PUBSUB = {
    "accountSubscribe": "accountUnsubscribe", "logsSubscribe": "logsUnsubscribe",
    "programSubscribe": "programUnsubscribe", "rootSubscribe": "rootUnsubscribe",
    "signatureSubscribe": "signatureUnsubscribe", "slotSubscribe": "slotUnsubscribe",
}
SOLANA_PUBSUB_METHODS = frozenset(SOLANA_PUBSUB) | frozenset(SOLANA_PUBSUB.values())

# Subscription streams: served by the WebSocket transport (subscriptions.py), refused over HTTP.
SUBSCRIPTION_METHODS = frozenset({"eth_subscribe", "eth_unsubscribe"}) | SOLANA_PUBSUB_METHODS

# Solana's JSON-RPC methods are camelCase without a namespace; EVM ones are namespace_method.
SOLANA_METHODS = frozenset({
    "getAccountInfo", "getBalance", "getBlock", "getBlockCommitment", "getBlockHeight", "getBlockProduction",
    "getBlockTime", "getBlocks", "getBlocksWithLimit", "getClusterNodes", "getEpochInfo", "getEpochSchedule",
    "getFeeForMessage", "getFirstAvailableBlock", "getGenesisHash", "getHealth", "getHighestSnapshotSlot",
    "getIdentity", "getInflationGovernor", "getInflationRate", "getInflationReward", "getLargestAccounts",
    "getLatestBlockhash", "getLeaderSchedule", "getMaxRetransmitSlot", "getMaxShredInsertSlot",
    "getMinimumBalanceForRentExemption", "getMultipleAccounts", "getProgramAccounts",
    "getRecentPerformanceSamples", "getRecentPrioritizationFees", "getSignatureStatuses",
    "getSignaturesForAddress", "getSlot", "getSlotLeader", "getSlotLeaders", "getStakeMinimumDelegation",
    "getSupply", "getTokenAccountBalance", "getTokenAccountsByDelegate", "getTokenAccountsByOwner",
    "getTokenLargestAccounts", "getTokenSupply", "getTransaction", "getTransactionCount", "getVersion",
    "getVoteAccounts", "isBlockhashValid", "minimumLedgerSlot", "requestAirdrop", "sendTransaction",
    "simulateTransaction",
})

# Everyday EVM methods that get their own metric label; anything else is labelled "other"
# so a client cannot grow the label set without bound.
COMMON_EVM_METHODS = frozenset({
    "eth_chainId", "eth_blockNumber", "eth_getBalance", "eth_getCode", "eth_getTransactionCount",
    "eth_getBlockByNumber", "eth_getBlockByHash", "eth_getTransactionByHash", "eth_getTransactionReceipt",
    "eth_sendRawTransaction", "eth_sendTransaction", "eth_gasPrice", "eth_maxPriorityFeePerGas",
    "eth_feeHistory", "eth_syncing", "eth_accounts", "eth_getProof", "eth_createAccessList", "net_version",
    "web3_clientVersion", "eth_getBlockTransactionCountByNumber", "eth_getBlockTransactionCountByHash",
    "eth_getUncleCountByBlockHash", "eth_getUncleCountByBlockNumber", "eth_getUncleByBlockNumberAndIndex",
})


# The methods served by default: the public read surface, raw-transaction submission and the
# Solana reads. Everything else (eth_sendTransaction signs with the node's unlocked account,
# eth_sign, anvil_*, evm_*, hardhat_*, txpool_*, ots_*, admin_*, debug_*...) is -32601 unless
# ALLOW_METHODS or ALLOW_NAMESPACES names it. Names are matched exactly, after validation.
DEFAULT_ALLOWED_METHODS = frozenset({
    *POLICIES,
    "eth_blockNumber", "eth_chainId", "eth_syncing", "eth_gasPrice", "eth_maxPriorityFeePerGas", "eth_feeHistory",
    "eth_blobBaseFee", "eth_getBalance", "eth_getCode", "eth_getTransactionCount", "eth_getProof",
    "eth_createAccessList", "eth_getBlockByNumber", "eth_getBlockByHash", "eth_getBlockTransactionCountByNumber",
    "eth_getBlockTransactionCountByHash", "eth_getTransactionByHash", "eth_getTransactionByBlockHashAndIndex",
    "eth_getTransactionByBlockNumberAndIndex", "eth_getTransactionReceipt", "eth_getUncleCountByBlockHash",
    "eth_getUncleCountByBlockNumber", "eth_getUncleByBlockNumberAndIndex", "eth_protocolVersion",
    "eth_sendRawTransaction", "web3_clientVersion",
    # Node-side filters: ethers' JsonRpcProvider serves `contract.on` with them. They are forwarded,
    # uncached, and live on the node that created them (README "Clients").
    "eth_newFilter", "eth_newBlockFilter", "eth_newPendingTransactionFilter", "eth_getFilterChanges",
    "eth_getFilterLogs", "eth_uninstallFilter",
    # Subscriptions: served over WebSocket (subscriptions.py), refused over HTTP by their own rule.
    *SUBSCRIPTION_METHODS,
    *(m for m in SOLANA_METHODS if m != "requestAirdrop"),
})
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
