"""The shape a method's result must have (spec "Conventions": binary values and quantities are strings
starting with `0x`), judged on every reply from a node (upstream/replies.py) before it is served or
kept. A few string operations and one match in C over the digits in place: nothing per character in Python."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple


class Shape(NamedTuple):
    name: str  # what the message says the result is not
    fits: Callable[[Any], bool]


# Each check below matches its hex digits in place, from position 2 (no slice, no decoded copy: an
# eth_call's result may be megabytes, and a copy of it would pass the bound a long reply is held to).
_HEX = re.compile(r"[0-9a-fA-F]*")


def is_data(value: Any) -> bool:
    """Hex data: `0x` and whole bytes, two hex digits each (`0x` alone: no bytes)."""
    return type(value) is str and value[:2] == "0x" and len(value) % 2 == 0 and _HEX.fullmatch(value, 2) is not None


# A 256-bit word: `0x` and 64 hex digits. geth, Erigon, Nethermind, Besu and Anvil pad eth_getStorageAt's
# value to 32 bytes.
WORD_LENGTH = 66


def is_word(value: Any) -> bool:
    """A 32-byte word: `0x` and 64 hex digits."""
    return (
        type(value) is str and len(value) == WORD_LENGTH and value[:2] == "0x" and _HEX.fullmatch(value, 2) is not None
    )


def is_quantity(value: Any) -> bool:
    """A quantity: `0x` and 1 to 64 hex digits (a 256-bit number at most)."""
    return (
        type(value) is str
        and 2 < len(value) <= WORD_LENGTH
        and value[:2] == "0x"
        and _HEX.fullmatch(value, 2) is not None
    )


DATA = Shape("hex data", is_data)
WORD = Shape("a 32-byte hex word", is_word)
QUANTITY = Shape("a hex quantity", is_quantity)
