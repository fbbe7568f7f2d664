"""Per-key allow-lists (API_KEYS_FILE: allowed_origins, allowed_methods, allowed_addresses), as hosted
providers offer them for a key that ships inside a browser bundle. Pure decisions: each takes what the
request carries and returns the refusal naming the list that refused, or None."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.rpc.jsonrpc import INVALID_API_KEY, JsonRpcError

# Methods whose target is an address, and where it sits in their (validated) params.
_FIRST_PARAM = frozenset(
    {"eth_getStorageAt", "eth_getBalance", "eth_getCode", "eth_getTransactionCount", "eth_getProof"}
)
_CALL_TO = frozenset({"eth_call", "eth_estimateGas", "eth_createAccessList"})
_FILTER = frozenset({"eth_getLogs", "eth_newFilter"})


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
    if origin.rstrip("/").lower() not in lists.origins:
        return refused(f"origin {origin[:100]!r} is not in the key's allowed_origins")
    return None


def targets(method: str, params: Any) -> list[str] | None:
    """The addresses a call reads from; None: the method names no address (not restricted by it)."""
    if not isinstance(params, list) or not params:
        return None if method not in _FILTER | _CALL_TO | _FIRST_PARAM else []
    first = params[0]
    if method in _FIRST_PARAM:
        return [first] if isinstance(first, str) else []
    if method in _CALL_TO:
        to = first.get("to") if isinstance(first, dict) else None
        return [to] if isinstance(to, str) else []  # a contract creation targets no allowed address
    if method in _FILTER or (method == "eth_subscribe" and first == "logs"):
        spec = first if method in _FILTER else (params[1] if len(params) > 1 else {})
        address = spec.get("address") if isinstance(spec, dict) else None
        if isinstance(address, str):
            return [address]
        return [a for a in address if isinstance(a, str)] if isinstance(address, list) else []
    return None


def call_refusal(lists: AllowLists, method: str, params: Any) -> JsonRpcError | None:
    if lists.methods and method not in lists.methods:
        return refused(f"method {method} is not in the key's allowed_methods")
    if lists.addresses:
        found = targets(method, params)
        if found is None:
            return None
        if not found:
            return refused(f"{method} names no address, and the key has an allowed_addresses list")
        for address in found:
            if address.lower() not in lists.addresses:
                return refused(f"address {address[:42]} is not in the key's allowed_addresses")
    return None
