"""Parameter validation and canonical forms for the first-class methods. Pure: no I/O.

Each validator takes the raw positional params and returns canonical params: lower-case hex,
normalised quantities, 32-byte storage words, defaults filled in, and block parameters as
`BlockRef` values that the service resolves to numbers. Two requests that mean the same thing
get equal canonical params; the forwarded request is built from them too.

By family: common.py (what both share), evm.py, solana.py. Every public name of the three is
importable from here, as `from proxy.rpc import params as p; p.eth_call`.
"""

from __future__ import annotations

from proxy.rpc.params.common import (
    TAGS,
    UINT256_MAX,
    BlockRef,
    Rules,
    address,
    block_param,
    block_refs,
    hash32,
    hex_bytes,
    no_params,
    quantity,
    quantity_int,
    storage_word,
    substitute,
)
from proxy.rpc.params.evm import (
    PROOF_MAX_KEYS,
    address_at_block,
    block_by_number_only,
    block_hash_and_index,
    block_hash_only,
    block_number_and_index,
    call_object,
    eth_call,
    eth_estimate_gas,
    eth_fee_history,
    eth_get_block_by_hash,
    eth_get_block_by_number,
    eth_get_block_receipts,
    eth_get_logs,
    eth_get_proof,
    eth_get_storage_at,
    eth_get_uncle_by_block_hash_and_index,
    filter_id,
    log_filter,
    transaction_hash,
)
from proxy.rpc.params.solana import (
    COMMITMENTS,
    LARGEST_ACCOUNTS_FILTERS,
    base58_pubkey,
    get_block,
    get_largest_accounts,
    get_multiple_accounts,
    get_token_account_balance,
    get_transaction,
    solana_account,
    solana_balance,
    solana_commitment_only,
)

__all__ = [
    "COMMITMENTS", "LARGEST_ACCOUNTS_FILTERS", "PROOF_MAX_KEYS", "TAGS", "UINT256_MAX", "BlockRef", "Rules", "address",
    "address_at_block", "base58_pubkey", "block_by_number_only", "block_hash_and_index", "block_hash_only",
    "block_number_and_index", "block_param", "block_refs", "call_object", "eth_call", "eth_estimate_gas",
    "eth_fee_history", "eth_get_block_by_hash", "eth_get_block_by_number", "eth_get_block_receipts", "eth_get_logs",
    "eth_get_proof", "eth_get_storage_at", "eth_get_uncle_by_block_hash_and_index", "filter_id", "get_block",
    "get_largest_accounts", "get_multiple_accounts", "get_token_account_balance", "get_transaction", "hash32",
    "hex_bytes", "log_filter", "no_params", "quantity", "quantity_int", "solana_account", "solana_balance",
    "solana_commitment_only", "storage_word", "substitute", "transaction_hash",
]
