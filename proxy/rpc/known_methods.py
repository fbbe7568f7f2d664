"""Method names nodes serve beyond the method-policy table (methods.py): the Ethereum execution API's
eth_, net_ and web3_ names with the debug_, trace_, txpool_ and engine_ names clients commonly call,
and Solana's JSON-RPC methods, HTTP and WebSocket. Only for telling a typo from a real name
(config.doubts): a name here is never warned about, a near miss of one is."""

from __future__ import annotations

_ETH = """
accounts blobBaseFee blockNumber call callBundle callMany chainId coinbase config createAccessList
estimateGas feeHistory fillTransaction gasPrice getAccount getBalance getBlockByHash getBlockByNumber
getBlockReceipts getBlockTransactionCountByHash getBlockTransactionCountByNumber getCode
getFilterChanges getFilterLogs getHeaderByHash getHeaderByNumber getLogs getProof
getRawTransactionByBlockHashAndIndex getRawTransactionByBlockNumberAndIndex getRawTransactionByHash
getStorageAt getTransactionByBlockHashAndIndex getTransactionByBlockNumberAndIndex
getTransactionByHash getTransactionBySenderAndNonce getTransactionCount getTransactionReceipt
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
        *(f"txpool_{name}" for name in _TXPOOL.split()),
        *(f"engine_{name}" for name in _ENGINE.split()),
        *_SOLANA.split(),
    }
)
