"""spec: the gas field of eth_call and eth_estimateGas is capped at 10 times the current block gas limit."""

from __future__ import annotations

from typing import Any

from proxy.rpc.jsonrpc import JsonRpcError
from proxy.rpc.params import quantity_int

FALLBACK_BLOCK_GAS_LIMIT = 30_000_000


def cap_gas(params: Any, gas_limit: int | None, multiplier: int) -> Any:
    """params with the call's gas capped at `multiplier` times the block gas limit."""
    if not isinstance(params, list) or not params:
        return params
    # Before the first head poll the block gas limit is unknown: a common one stands in, so
    # the cap holds from the first call.
    gas_limit = gas_limit or FALLBACK_BLOCK_GAS_LIMIT
    tx = params[0]
    if not isinstance(tx, dict) or "gas" not in tx:
        return params
    try:
        gas = quantity_int("gas", tx["gas"])
    except JsonRpcError:
        return params  # a forwarded method's malformed gas: the node answers for it
    cap = gas_limit * multiplier
    if gas <= cap:
        return params
    return [{**tx, "gas": hex(cap)}, *params[1:]]
