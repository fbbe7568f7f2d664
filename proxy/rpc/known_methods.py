"""Method names nodes serve beyond the method-policy table (methods.py): the Ethereum execution API's
eth_, net_ and web3_ names with the debug_, trace_, txpool_, engine_ and admin_ names clients commonly
call, clients' and providers' own namespaces (Otterscan ots_, Arbitrum arbtrace_, Erigon erigon_,
Parity parity_, Polygon bor_, Alchemy alchemy_, QuickNode qn_), and Solana's JSON-RPC methods, HTTP
and WebSocket. Only for telling a typo from a real name (config.doubts): a name here is never warned
about, a near miss of one is (near_miss)."""

from __future__ import annotations

import difflib
from collections.abc import Collection

_ETH = """
accounts blobBaseFee blockNumber call callBundle callMany chainId coinbase config createAccessList
estimateGas feeHistory fillTransaction gasPrice getAccount getBalance getBlockByHash getBlockByNumber
getBlockReceipts getBlockTransactionCountByHash getBlockTransactionCountByNumber getCode
getFilterChanges getFilterLogs getHeaderByHash getHeaderByNumber getLogs getProof
getRawTransactionByBlockHashAndIndex getRawTransactionByBlockNumberAndIndex getRawTransactionByHash
getStorageAt getTransactionByBlockHashAndIndex getTransactionByBlockNumberAndIndex
getAccountInfo getTransactionByHash getTransactionBySenderAndNonce getTransactionCount getTransactionReceipt
getUncleByBlockHashAndIndex getUncleByBlockNumberAndIndex getUncleCountByBlockHash
getUncleCountByBlockNumber getWork hashrate maxPriorityFeePerGas mining newBlockFilter newFilter
newPendingTransactionFilter pendingTransactions protocolVersion resend sendBundle sendRawTransaction
sendRawTransactionConditional sendRawTransactionSync sendTransaction sign signTransaction
signTypedData signTypedData_v3 signTypedData_v4 simulateV1 submitHashrate submitWork subscribe
syncing uninstallFilter unsubscribe
"""
_DEBUG = """
accountRange backtraceAt blockProfile chaindbCompact chaindbProperty cpuProfile dbAncient dbAncients
dbGet dumpBlock executionWitness freeOSMemory gcStats getAccessibleState getBadBlocks
getModifiedAccountsByHash getModifiedAccountsByNumber getRawBlock getRawHeader getRawReceipts
getRawTransaction getTrieFlushInterval goTrace intermediateRoots memStats mutexProfile preimage
printBlock setBlockProfileRate setGCPercent setHead setMutexProfileFraction setTrieFlushInterval
stacks standardTraceBadBlockToFile standardTraceBlockToFile startCPUProfile startGoTrace
stopCPUProfile stopGoTrace storageRangeAt traceBadBlock traceBlock traceBlockByHash
traceBlockByNumber traceBlockFromFile traceCall traceCallMany traceChain traceTransaction verbosity
vmodule writeBlockProfile writeMemProfile writeMutexProfile
"""
_TRACE = "block call callMany filter get rawTransaction replayBlockTransactions replayTransaction transaction"
_TXPOOL = "content contentFrom inspect status"
_ADMIN = "addPeer addTrustedPeer datadir exportChain importChain nodeInfo peers removePeer removeTrustedPeer"
_OTS = """
getApiLevel getBlockDetails getBlockDetailsByHash getBlockTransactions getContractCreator
getInternalOperations getTransactionBySenderAndNonce getTransactionError hasCode
searchTransactionsAfter searchTransactionsBefore traceTransaction
"""
_ERIGON = """
blockNumber cacheCheck forks getBalanceChangesInBlock getBlockByTimestamp getBlockReceiptsByBlockHash
getHeaderByHash getHeaderByNumber getLatestLogs getLogsByHash nodeInfo
"""
_PARITY = "getBlockReceipts listStorageKeys nextNonce pendingTransactions"
_BOR = """
getAuthor getCurrentProposer getCurrentValidators getRootHash getSignersAtHash getSnapshot
getSnapshotProposer getSnapshotProposerSequence
"""
_ALCHEMY = """
getAssetTransfers getTokenAllowance getTokenBalances getTokenMetadata getTransactionReceipts
simulateAssetChanges simulateAssetChangesBundle simulateExecution simulateExecutionBundle
"""
_QN = """
broadcastRawTransaction fetchNFTCollectionDetails fetchNFTs fetchNFTsByCollection getBlockFromTimestamp
getBlocksWithReceipts getBlockWithReceipts getReceipts getTokenMetadataByContractAddress
getTokenMetadataBySymbol getTransactionsByAddress getTransfersByNFT getWalletTokenBalance
getWalletTokenTransactions resolveENS verifyNFTsOwner
"""
_ENGINE = """
exchangeCapabilities exchangeTransitionConfigurationV1 forkchoiceUpdatedV1 forkchoiceUpdatedV2
forkchoiceUpdatedV3 getBlobsV1 getBlobsV2 getClientVersionV1 getPayloadBodiesByHashV1
getPayloadBodiesByHashV2 getPayloadBodiesByRangeV1 getPayloadBodiesByRangeV2 getPayloadV1
getPayloadV2 getPayloadV3 getPayloadV4 getPayloadV5 newPayloadV1 newPayloadV2 newPayloadV3
newPayloadV4
"""
_SOLANA = """
getAccountInfo getBalance getBlock getBlockCommitment getBlockHeight getBlockProduction getBlockTime
getBlocks getBlocksWithLimit getClusterNodes getConfirmedBlock getConfirmedBlocks
getConfirmedBlocksWithLimit getConfirmedSignaturesForAddress2 getConfirmedTransaction getEpochInfo
getEpochSchedule getFeeCalculatorForBlockhash getFeeForMessage getFeeRateGovernor getFees
getFirstAvailableBlock getGenesisHash getHealth getHighestSnapshotSlot getIdentity
getInflationGovernor getInflationRate getInflationReward getLargestAccounts getLatestBlockhash
getLeaderSchedule getMaxRetransmitSlot getMaxShredInsertSlot getMinimumBalanceForRentExemption
getMultipleAccounts getProgramAccounts getRecentBlockhash getRecentPerformanceSamples
getRecentPrioritizationFees getSignatureStatuses getSignaturesForAddress getSlot getSlotLeader
getSlotLeaders getSnapshotSlot getStakeActivation getStakeMinimumDelegation getSupply
getTokenAccountBalance getTokenAccountsByDelegate getTokenAccountsByOwner getTokenLargestAccounts
getTokenSupply getTransaction getTransactionCount getVersion getVoteAccounts isBlockhashValid
minimumLedgerSlot requestAirdrop sendTransaction simulateTransaction
accountSubscribe accountUnsubscribe blockSubscribe blockUnsubscribe logsSubscribe logsUnsubscribe
programSubscribe programUnsubscribe rootSubscribe rootUnsubscribe signatureSubscribe
signatureUnsubscribe slotSubscribe slotUnsubscribe slotsUpdatesSubscribe slotsUpdatesUnsubscribe
voteSubscribe voteUnsubscribe
"""

KNOWN_METHODS: frozenset[str] = frozenset(
    {
        *(f"eth_{name}" for name in _ETH.split()),
        "net_version",
        "net_listening",
        "net_peerCount",
        "web3_clientVersion",
        "web3_sha3",
        *(f"debug_{name}" for name in _DEBUG.split()),
        *(f"trace_{name}" for name in _TRACE.split()),
        *(f"arbtrace_{name}" for name in _TRACE.split()),  # Arbitrum's trace_ for its pre-Nitro blocks
        *(f"txpool_{name}" for name in _TXPOOL.split()),
        *(f"engine_{name}" for name in _ENGINE.split()),
        *(f"admin_{name}" for name in _ADMIN.split()),
        *(f"ots_{name}" for name in _OTS.split()),
        *(f"erigon_{name}" for name in _ERIGON.split()),
        *(f"parity_{name}" for name in _PARITY.split()),
        *(f"bor_{name}" for name in _BOR.split()),
        "eth_getTransactionReceiptsByBlock",  # Polygon's (Bor) eth_ additions
        "eth_getRootHash",
        *(f"alchemy_{name}" for name in _ALCHEMY.split()),
        *(f"qn_{name}" for name in _QN.split()),
        *_SOLANA.split(),
    }
)


def near_miss(method: str, known: Collection[str]) -> str | None:
    """The known name `method` looks like a typo of, or None (pure). Only a name of its own kind: an
    EVM-style `ns_method` suggests a name of its namespace (`ots_` and `eth_` are both real, so one is
    no typo of the other), or any EVM name when the namespace is itself unknown (`eht_call`); a
    Solana-style camelCase name suggests only Solana names."""
    if method in known:
        return None
    namespace, underscore, _ = method.partition("_")
    if not underscore:
        candidates = [name for name in known if "_" not in name]
    elif any(name.startswith(f"{namespace}_") for name in known):
        candidates = [name for name in known if name.startswith(f"{namespace}_")]
    else:
        candidates = [name for name in known if "_" in name]
    near = difflib.get_close_matches(method, candidates, 1, 0.85)
    return near[0] if near else None
