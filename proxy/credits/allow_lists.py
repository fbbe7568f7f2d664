"""Per-key allow-lists (API_KEYS_FILE: allowed_origins, allowed_methods, allowed_addresses), as hosted
providers offer them for a key that ships inside a browser bundle. Pure decisions: each takes what the
request carries and returns the refusal naming the list that refused, or None."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.origins import origin_form
from proxy.rpc.jsonrpc import INVALID_API_KEY, JsonRpcError

# Methods whose target is an address, and where it sits in their (validated) params.
_FIRST_PARAM = frozenset(
    {"eth_getStorageAt", "eth_getBalance", "eth_getCode", "eth_getTransactionCount", "eth_getProof"}
)
_CALL_TO = frozenset({"eth_call", "eth_estimateGas", "eth_createAccessList", "debug_traceCall", "trace_call"})
_FILTER = frozenset({"eth_getLogs", "eth_newFilter"})
# Methods that execute calls in ways the address check cannot follow (bundles of signed or many
# calls, each with its own overrides): refused outright to a key with allowed_addresses, if an
# operator's ALLOW_METHODS offers them at all.
_UNCHECKABLE = frozenset(
    {
        "eth_callMany",
        "eth_callBundle",
        "trace_callMany",
        "debug_traceCallMany",
        "eth_sendBundle",
        "debug_executionWitness",
    }
)
# Solana methods that read accounts they name, or can name (a pubkey, a list of them, a program's or
# an owner's accounts, a logs subscription's `mentions`, a config's account keys): allowed_addresses
# holds EVM addresses only, so a key with the list is refused them, fail-closed as an EVM call that
# names no address is.
_SOLANA_ACCOUNTS = frozenset(
    {
        "getAccountInfo",
        "getBalance",
        "getMultipleAccounts",
        "getProgramAccounts",
        "getSignaturesForAddress",
        "getTokenAccountBalance",
        "getTokenAccountsByDelegate",
        "getTokenAccountsByOwner",
        "getTokenLargestAccounts",
        "getTokenSupply",
        "getInflationReward",
        # Calls that take account keys among their params or config: a transaction run on the node
        # (simulateTransaction's `accounts` returns their data), vote accounts, leaders, fees by account.
        "simulateTransaction",
        "getVoteAccounts",
        "getLeaderSchedule",
        "getBlockProduction",
        "getRecentPrioritizationFees",
        "getStakeActivation",
        "accountSubscribe",
        "programSubscribe",
        "logsSubscribe",
    }
)
# Where executing methods take client-supplied code or state: the param positions past the block
# (eth_call: stateOverrides, blockOverrides; eth_estimateGas: stateOverrides), and the keys of
# debug_traceCall's config and eth_simulateV1's blocks that carry them.
_OVERRIDE_FROM = {"eth_call": 2, "eth_estimateGas": 2, "eth_createAccessList": 2}
_OVERRIDE_KEYS = ("stateOverrides", "blockOverrides", "stateOverride", "blockOverride")


@dataclass(frozen=True, slots=True)
class AllowLists:
    """What one key may do; an empty tuple leaves that dimension open."""

    origins: frozenset[str] = frozenset()
    methods: frozenset[str] = frozenset()
    addresses: frozenset[str] = frozenset()

    @property
    def restricts_calls(self) -> bool:
        return bool(self.methods or self.addresses)

    @property
    def any(self) -> bool:
        return bool(self.origins or self.methods or self.addresses)


NO_LISTS = AllowLists()


def refused(what: str) -> JsonRpcError:
    return JsonRpcError(INVALID_API_KEY, f"not allowed for this key: {what}", http_status=403)


def origin_refusal(lists: AllowLists, origin: str | None) -> JsonRpcError | None:
    """A key with allowed_origins serves only pages of those origins; a request without an Origin
    (a server, a script) is refused too, since anyone who read the key from a bundle could send one."""
    if not lists.origins:
        return None
    if origin is None:
        return refused("the request has no Origin header and the key has an allowed_origins list")
    if origin_form(origin) not in lists.origins:
        return refused(f"origin {origin[:100]!r} is not in the key's allowed_origins")
    return None


def targets(method: str, params: Any) -> list[str] | None:
    """The addresses a call reads from; None: the method names no address (not restricted by it)."""
    if not isinstance(params, list) or not params:
        return None if method not in _FILTER | _CALL_TO | _FIRST_PARAM | {"eth_simulateV1"} else []
    first = params[0]
    if method in _FIRST_PARAM:
        return [first] if isinstance(first, str) else []
    if method in _CALL_TO:
        to = first.get("to") if isinstance(first, dict) else None
        return [to] if isinstance(to, str) else []  # a contract creation targets no allowed address
    if method == "eth_simulateV1":
        blocks = first.get("blockStateCalls") if isinstance(first, dict) else None
        calls = (
            [c for b in blocks if isinstance(b, dict) for c in (b.get("calls") or [])]
            if isinstance(blocks, list)
            else []
        )
        to = [c.get("to") if isinstance(c, dict) else None for c in calls]
        return [t for t in to if isinstance(t, str)] if to and all(isinstance(t, str) for t in to) else []
    if method in _FILTER or (method == "eth_subscribe" and first == "logs"):
        spec = first if method in _FILTER else (params[1] if len(params) > 1 else {})
        address = spec.get("address") if isinstance(spec, dict) else None
        if isinstance(address, str):
            return [address]
        return [a for a in address if isinstance(a, str)] if isinstance(address, list) else []
    return None


def overrides(method: str, params: Any) -> bool:
    """Whether an executing call brings its own code or state (state or block overrides): code that
    could call any contract from an allowed one, so the allowed address would not bound what is read."""
    if not isinstance(params, list):
        return False
    start = _OVERRIDE_FROM.get(method)
    if start is not None:
        return any(p not in (None, {}, []) for p in params[start:])
    if method == "debug_traceCall":
        config = params[2] if len(params) > 2 else None
        return isinstance(config, dict) and any(config.get(k) for k in _OVERRIDE_KEYS)
    if method == "eth_simulateV1":
        blocks = params[0].get("blockStateCalls") if params and isinstance(params[0], dict) else None
        return isinstance(blocks, list) and any(
            isinstance(b, dict) and any(b.get(k) for k in _OVERRIDE_KEYS) for b in blocks
        )
    return False


def call_refusal(lists: AllowLists, method: str, params: Any) -> JsonRpcError | None:
    if lists.methods and method not in lists.methods:
        return refused(f"method {method} is not in the key's allowed_methods")
    if lists.addresses:
        if method in _UNCHECKABLE:
            return refused(f"{method} runs calls the key's allowed_addresses list cannot check")
        if method in _SOLANA_ACCOUNTS:
            return refused(f"{method} reads Solana accounts, and the key's allowed_addresses lists EVM addresses only")
        if overrides(method, params):
            return refused(
                f"{method} with state or block overrides: they run code of the caller's choosing, "
                "which could read any contract, and the key has an allowed_addresses list"
            )
        found = targets(method, params)
        if found is None:
            return None
        if not found:
            return refused(f"{method} names no address, and the key has an allowed_addresses list")
        for address in found:
            if address.lower() not in lists.addresses:
                return refused(f"address {address[:42]} is not in the key's allowed_addresses")
    return None
