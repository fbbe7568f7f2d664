"""Credit costs per method: the one table (README "Limits and credits").

The spec fixes the cost of its seven methods; they are not configurable. Every other method costs
its entry in METHOD_CREDITS, else DEFAULT_CREDITS. CREDITS_FILE (a TOML file with a `[credits]`
table, `method = credits`) overrides or adds entries of METHOD_CREDITS; config_files.py validates it.

The defaults are this proxy's choice, on the scale of the spec's seven: identity reads cost 5, a
plain read 80 like eth_call, by-index reads and proofs 150 like eth_getUncleByBlockHashAndIndex,
more for work the node does per call; operators set their own with CREDITS_FILE.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from proxy.rpc.methods import POLICIES, SOLANA_PUBSUB

# spec "Limits / Credits per call": fixed, on the seven methods' rows of the policy table.
SPEC_CREDITS: Mapping[str, int] = MappingProxyType(
    {name: policy.credits for name, policy in POLICIES.items() if policy.credits is not None}
)

METHOD_CREDITS: Mapping[str, int] = MappingProxyType(
    {
        # Chain identity and node status.
        "eth_chainId": 5,
        "net_version": 5,
        "net_listening": 5,
        "eth_syncing": 5,
        "web3_clientVersion": 80,
        "eth_protocolVersion": 5,
        "eth_accounts": 5,  # answered by the proxy itself (an empty list), as eth_chainId is
        # Head and fees.
        "eth_blockNumber": 80,
        "eth_gasPrice": 80,
        "eth_maxPriorityFeePerGas": 80,
        "eth_feeHistory": 80,
        "eth_blobBaseFee": 300,
        # State at a block.
        "eth_getBalance": 80,
        "eth_getCode": 80,
        "eth_getTransactionCount": 80,
        "eth_getProof": 150,
        # Blocks and transactions.
        "eth_getBlockByNumber": 80,
        "eth_getBlockByHash": 80,
        "eth_getTransactionByHash": 80,
        "eth_getTransactionReceipt": 80,
        "eth_getBlockTransactionCountByNumber": 150,
        "eth_getBlockTransactionCountByHash": 150,
        "eth_getUncleCountByBlockNumber": 150,
        "eth_getUncleCountByBlockHash": 150,
        "eth_getUncleByBlockNumberAndIndex": 150,
        "eth_getTransactionByBlockHashAndIndex": 150,
        "eth_getTransactionByBlockNumberAndIndex": 150,
        # Work the node does per call.
        "eth_estimateGas": 300,
        "eth_createAccessList": 80,
        "eth_sendRawTransaction": 720,
        "eth_newFilter": 80,
        "eth_newBlockFilter": 80,
        "eth_newPendingTransactionFilter": 80,
        "eth_getFilterChanges": 140,
        "eth_getFilterLogs": 255,
        "eth_uninstallFilter": 80,
        # Solana: slot and identity reads are cheap, account and block reads priced like the spec's two.
        "getSlot": 5,
        "getBlockHeight": 5,
        "getGenesisHash": 5,
        "getVersion": 5,
        "getEpochSchedule": 5,
        "getHealth": 5,
        "getBalance": 80,
        "getAccountInfo": 80,
        "getMultipleAccounts": 160,
        "getBlock": 160,
        "getTransaction": 160,
        "sendTransaction": 720,
        "simulateTransaction": 300,
    }
)


def credits_of(method: str, table: Mapping[str, int], default: int) -> int:
    """What one call of `method` costs: the spec's price, else the table's, else DEFAULT_CREDITS."""
    spec = SPEC_CREDITS.get(method)
    if spec is not None:
        return spec
    return table.get(method, default)


# Credits of WebSocket subscriptions: `subscribe` for each eth_subscribe (or Solana *Subscribe) accepted,
# then each notification by its kind; `other` for kinds not listed. SUBSCRIPTION_CREDITS overrides entries.
SUBSCRIPTION_CREDITS: Mapping[str, int] = {
    "subscribe": 5,
    "newHeads": 50,
    "logs": 300,
    "newPendingTransactions": 200,
    "other": 50,
}
# The kinds SUBSCRIPTION_CREDITS may price: its own rows, EVM's relayed `syncing`, and Solana's
# subscribe methods (a notification is charged by the method that made it).
SUBSCRIPTION_KINDS = (*SUBSCRIPTION_CREDITS, "syncing", *SOLANA_PUBSUB)
