"""eth_call/eth_estimateGas state and block overrides, in the form the node reads them.

The cache keys params with object keys sorted, but a node decodes an override object in order and
the last of two spellings of one key wins: `0xAbC...` and `0xabc...` are one account to it, and
`0x1` and `0x0...01` one slot. So keys that name the same thing are merged here as the node merges
them (last wins), and the merged object is what is both keyed and forwarded: the node never reads
an override differently from how it was keyed (issue 19, item 8). Field names the node matches
without regard to case (geth's encoding/json) are refused when two of them collide.
"""

from __future__ import annotations

from typing import Any

from proxy.rpc.jsonrpc import invalid_params
from proxy.rpc.params.common import _object, address, storage_word

# geth's OverrideAccount (internal/ethapi/override); Anvil's AccountOverride has the same names.
ACCOUNT_FIELDS = ("balance", "nonce", "code", "state", "stateDiff", "movePrecompileToAddress")
_SLOT_MAPS = ("state", "stateDiff")


def state_overrides(name: str, value: Any) -> dict[str, Any]:
    """{address: account}: addresses in any case merged, last wins; each account's slots likewise."""
    if not isinstance(value, dict):
        raise invalid_params(name, "expected an object")
    merged: dict[str, Any] = {}
    for key, account in value.items():
        where = f"{name}.{key}"
        merged[address(where, key)] = _account(where, account)  # spec: the node keeps the last spelling
    return merged


def _account(name: str, value: Any) -> dict[str, Any]:
    account = dict(_object(name, value, ACCOUNT_FIELDS))
    for field_name in _SLOT_MAPS:
        slots = account.get(field_name)
        if slots is None:
            continue
        if not isinstance(slots, dict):
            raise invalid_params(f"{name}.{field_name}", "expected an object of slot: value")
        account[field_name] = {storage_word(f"{name}.{field_name}", k): v for k, v in slots.items()}
    return account


def block_overrides(name: str, value: Any) -> dict[str, Any]:
    """Block overrides as sent; two field names equal but for case would be one field to geth."""
    if not isinstance(value, dict):
        raise invalid_params(name, "expected an object")
    seen: dict[str, str] = {}
    for key in value:
        folded = str(key).lower()
        if folded in seen:
            raise invalid_params(
                f"{name}.{key}", f"duplicates {seen[folded]!r} (field names are not case-sensitive to the node)"
            )
        seen[folded] = key
    return value
