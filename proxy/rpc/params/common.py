"""What both families' validators share: `Rules`, `BlockRef`, hex scalars, block parameters, arity."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from proxy.rpc.jsonrpc import invalid_params

TAGS = ("latest", "earliest", "pending", "safe", "finalized")
# Used with fullmatch only: `$` would also accept a trailing newline ("0x...\n").
_HEX = re.compile(r"0x[0-9a-fA-F]*")
_UPPER = re.compile(r"[A-F]")
LONG_HEX = 4096  # digits past which a lower-case hex string is kept as it is (hex_bytes)
_DECIMAL = re.compile(r"[0-9]{1,20}")  # 2**64 has 20 digits; longer is never a block number
UINT256_MAX = 2**256 - 1


@dataclass(frozen=True, slots=True)
class Rules:
    """The settings validation depends on."""

    eth_call_require_from: bool = False
    getlogs_max_params: int = 5_000


@dataclass(slots=True, eq=False)  # not frozen: made per block parameter validated; never changed
class BlockRef:
    """A block parameter as the caller gave it: exactly one of tag, number, hash is set.

    Compared by identity: two equal-looking refs in one request (fromBlock/toBlock) stay distinct.
    """

    tag: str | None = None
    number: int | None = None
    hash: str | None = None
    object_form: bool = False  # EIP-1898 object ({"blockHash": ...} / {"blockNumber": ...})
    require_canonical: bool = False  # EIP-1898: the hash must name a block of the canonical chain
    # How this position takes a block hash in place of a number: "object" (EIP-1898), "plain" (the
    # hash itself), None (it cannot). Unfinalized reads are sent pinned to the hash this way.
    hash_form: str | None = None

    def encode_hash(self, block_hash: str) -> Any:
        """The JSON value that names block `block_hash` here, or None where no hash is accepted."""
        if self.hash_form == "object":
            return {"blockHash": block_hash}
        return block_hash if self.hash_form == "plain" else None

    def encode(self, number: int | None = None) -> Any:
        """The JSON value sent upstream; `number` replaces a resolved tag."""
        if self.hash is not None:
            if self.require_canonical:
                return {"blockHash": self.hash, "requireCanonical": True}
            return {"blockHash": self.hash} if self.object_form else self.hash
        n = number if number is not None else self.number
        if n is None:
            return self.tag
        return {"blockNumber": hex(n)} if self.object_form else hex(n)


# --- scalar validators ------------------------------------------------------------------


def hex_bytes(name: str, value: Any, size: int | None = None) -> str:
    """A 0x-prefixed hex byte string, lower-cased; `size` in bytes when fixed."""
    if not isinstance(value, str) or not _HEX.fullmatch(value):
        raise invalid_params(name, "expected a 0x-prefixed hex string")
    digits = len(value) - 2
    if size is not None and digits != size * 2:
        raise invalid_params(name, f"expected {size} bytes (0x followed by {size * 2} hex digits)")
    if digits % 2:
        raise invalid_params(name, "hex string has an odd number of digits")
    if digits > LONG_HEX and not _UPPER.search(value):
        return value  # calldata of megabytes: not copied again while its call is made
    return value.lower()


def address(name: str, value: Any) -> str:
    return hex_bytes(name, value, 20)


def hash32(name: str, value: Any) -> str:
    return hex_bytes(name, value, 32)


def _uint256(name: str, value: Any, expected: str, too_big: str) -> int:
    if not isinstance(value, str) or not _HEX.fullmatch(value) or len(value) < 3:
        raise invalid_params(name, expected)
    number = int(value, 16)
    if number > UINT256_MAX:
        raise invalid_params(name, too_big)
    return number


def quantity_int(name: str, value: Any) -> int:
    return _uint256(name, value, "expected a hex quantity such as 0x1", "quantity exceeds 256 bits")


def quantity(name: str, value: Any) -> str:
    """A hex quantity, normalised: 0x0 == 0x00 == 0x000."""
    return hex(quantity_int(name, value))


_SLOT = re.compile(r"0[xX][0-9a-fA-F]+")


def storage_word(name: str, value: Any) -> str:
    """A storage position as a 32-byte word, so 0x0 and 0x00...00 are one position; 0X as 0x, as geth
    and Anvil read it. Digits without either are refused: geth reads "10" as hex, Anvil as decimal,
    so no answer could be the node's whichever the network runs."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and int(value, 10) == int(value, 16):
        value = "0x" + value  # one digit (leading zeros aside): the same slot read either way
    if not isinstance(value, str) or not _SLOT.fullmatch(value):
        if isinstance(value, str) and value.isalnum() and value.isascii():
            raise invalid_params(name, "write the position with 0x: geth reads bare digits as hex, Anvil as decimal")
        raise invalid_params(name, "expected a hex storage position such as 0x0")
    number = int(value, 16)  # int() takes the 0x or 0X itself
    if number > UINT256_MAX:
        raise invalid_params(name, "storage position exceeds 32 bytes")
    return "0x" + format(number, "064x")


def block_param(
    name: str, value: Any, *, allow_hash: bool = False, allow_decimal: bool = False, allow_object: bool = True
) -> BlockRef:
    """spec: a hex block number, or one of latest/earliest/pending/safe/finalized."""
    if isinstance(value, str):
        if value in TAGS:
            return BlockRef(tag=value)
        if allow_hash and len(value) == 66 and _HEX.fullmatch(value):
            return BlockRef(hash=value.lower())
        if allow_decimal and value.isascii() and value.isdigit():
            if not _DECIMAL.fullmatch(value) or int(value) >= 2**64:
                raise invalid_params(name, "block number exceeds 64 bits")
            return BlockRef(number=int(value))
        if _HEX.fullmatch(value) and len(value) > 2:
            number = quantity_int(name, value)
            if number >= 2**64:
                raise invalid_params(name, "block number exceeds 64 bits")
            return BlockRef(number=number)
    elif allow_decimal and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        if value >= 2**64:
            raise invalid_params(name, "block number exceeds 64 bits")
        return BlockRef(number=value)
    elif allow_object and isinstance(value, dict):
        # EIP-1898: {"blockHash": h, "requireCanonical"?: bool} or {"blockNumber": n}.
        keys = set(value) - {"requireCanonical"}
        if keys == {"blockHash"}:
            canonical = value.get("requireCanonical", False)
            if not isinstance(canonical, bool):
                raise invalid_params(f"{name}.requireCanonical", "expected true or false")
            return BlockRef(
                hash=hash32(f"{name}.blockHash", value["blockHash"]), object_form=True, require_canonical=canonical
            )
        if keys == {"blockNumber"}:  # requireCanonical means nothing for a number (geth ignores it too)
            inner = block_param(f"{name}.blockNumber", value["blockNumber"], allow_object=False)
            return BlockRef(tag=inner.tag, number=inner.number, object_form=True)
        raise invalid_params(name, "expected an EIP-1898 object with blockHash or blockNumber")
    expected = "a hex block number"
    if allow_decimal:
        expected += ", a decimal block number"
    if allow_hash:
        expected += ", a 32-byte block hash"
    raise invalid_params(name, f"expected {expected} or one of {', '.join(TAGS)}")


def _hash_form(ref: BlockRef, form: str) -> BlockRef:
    # Field by field, not dataclasses.replace: every block parameter a miss validates comes here.
    return BlockRef(ref.tag, ref.number, ref.hash, ref.object_form, ref.require_canonical, form)


def _arity(params: list[Any], names: tuple[str, ...], required: int) -> None:
    if len(params) < required:
        missing = names[len(params)]
        raise invalid_params(missing, "missing required parameter")
    if len(params) > len(names):
        raise invalid_params("params", f"expected at most {len(names)} parameters, got {len(params)}")


def _object(name: str, value: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid_params(name, "expected an object")
    for key in value:
        if key not in allowed:
            raise invalid_params(f"{name}.{key}", "unknown field")
    return value


def block_refs(value: Any, found: list[BlockRef] | None = None) -> list[BlockRef]:
    """Every BlockRef inside canonical params, in order (a loop, not a call per scalar: per miss)."""
    if found is None:
        found = []
    kind = type(value)
    if kind is BlockRef:
        found.append(value)
        return found
    if kind is dict:
        value = value.values()
    elif kind is not list:
        return found
    for item in value:
        kind = type(item)
        if kind is BlockRef:
            found.append(item)
        elif kind is list or kind is dict:
            block_refs(item, found)
    return found


def substitute(value: Any, replace: dict[int, Any]) -> Any:
    """Copy of canonical params with each BlockRef replaced by replace[id(ref)] (scalars copied
    without a call each: this runs several times per miss)."""
    kind = type(value)
    if kind is BlockRef:
        return replace[id(value)]
    if kind is list:
        copied = []
        for item in value:
            kind = type(item)
            if kind is BlockRef:
                copied.append(replace[id(item)])
            elif kind is list or kind is dict:
                copied.append(substitute(item, replace))
            else:
                copied.append(item)
        return copied
    if kind is dict:
        return {k: substitute(v, replace) for k, v in value.items()}
    return value


def no_params(params: list[Any], rules: Rules) -> list[Any]:
    """eth_chainId, eth_blockNumber, fee reads, getGenesisHash...: nothing to validate; extra params are refused."""
    _arity(params, (), 0)
    return []
