"""The JSON-RPC forms of a node's values (quantities, data) read strictly, and keccak-256: what every
proof check reads its input with. Pure.

Strict because what is proven is kept as the node wrote it: "0x01", "0x 1" or "0x1_0" would read as
numbers Python accepts, and a cached answer must be the one canonical form (spec: a quantity is 0x and
hex digits without leading zeros, data is 0x and two hex digits a byte).
"""

from __future__ import annotations

import re
from typing import Any

from sha3 import keccak_256  # type: ignore[import-untyped]  # no stubs: one function used, typed below

_HEX = re.compile(r"0x[0-9a-fA-F]*")


class FieldError(ValueError):
    """A value that is not in its JSON-RPC form."""


def keccak256(value: bytes) -> bytes:
    # safe-pysha3's C object: a 32-byte hash in about 1 µs, where pycryptodome's ctypes calls took
    # four to six times that (bench.verify_primitives); every proof node and logsBloom bit is one.
    digest: bytes = keccak_256(value).digest()
    return digest


def quantity(value: Any, name: str = "quantity") -> int:
    """A JSON-RPC quantity: 0x and hex digits without leading zeros ("0x0" for zero)."""
    if not isinstance(value, str) or len(value) < 3 or not _HEX.fullmatch(value):
        raise FieldError(f"{name} is not a quantity")
    if len(value) > 3 and value[2] == "0":
        raise FieldError(f"{name} has a leading zero")
    return int(value, 16)


def data(value: Any, name: str = "data", size: int | None = None) -> bytes:
    """JSON-RPC data: 0x and an even number of hex digits; exactly `size` bytes when given."""
    # bytes.fromhex reads the digits without a pattern's pass over them first (proof nodes, logs' data
    # are long); it takes only ASCII hex digits in pairs and whitespace between pairs, and two digits a
    # byte leaves no room for whitespace.
    if not isinstance(value, str) or not value.startswith("0x"):
        raise FieldError(f"{name} is not hex data")
    try:
        raw = bytes.fromhex(value[2:])
    except ValueError:
        raise FieldError(f"{name} is not hex data") from None
    if 2 * len(raw) != len(value) - 2:
        raise FieldError(f"{name} is not hex data")
    if size is not None and len(raw) != size:
        raise FieldError(f"{name} is not {size} bytes")
    return raw


def block_time(value: Any) -> int:
    """A blockTimestamp beside a transaction, receipt or log: a quantity, or a JSON number as Anvil
    writes a receipt's."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return quantity(value, "blockTimestamp")
