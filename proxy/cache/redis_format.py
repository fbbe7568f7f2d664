"""An answer as the Redis tier holds it: one kind byte (`r` result, `e` error object) followed by its
JSON, after `f<height>:` for a hash-addressed answer its writer tagged with its finalized height
(sharing.py), after `p` for an answer its writer proved (verifying.py): a replica with
VERIFY_ANSWERS=required takes an entry with no expiry only when it is so marked, since an `auto`
replica keeps some answers forever unproven under the same key.

Redis is shared: what it holds may have been written by something other than this proxy (another
program, an older format, a hand, a truncated write). Its bytes are spliced into responses as they
are, so a value is taken only when it is exactly what `encode_value` writes: a known prefix, and a
payload that is one JSON value (RFC 8259 section 2: `"0x01","id":9` is not one, and spliced it would
forge the envelope's fields), an error payload an object with an integer `code` and a string
`message` (JSON-RPC 2.0 section 5.1). Anything else decodes to None: a miss. Checked only on a value
read from Redis (never on a memory hit), at the cost of one parse of the payload.
"""

from __future__ import annotations

from typing import NamedTuple

from proxy.rpc.jsonrpc import JSONDecodeError, loads

Stored = tuple[bytes, bool]  # an answer as the cache holds it: (payload JSON, is an error object)
MAX_HEIGHT_DIGITS = 20  # a block height's; bounds the search for the tag's end and int()'s work


class Entry(NamedTuple):
    """A Redis value as this proxy wrote it."""

    stored: Stored
    final_at: int | None  # its writer's finalized height, for a hash-addressed answer (sharing.py)
    proven: bool = False  # its writer proved it against its block's header (verifying.py)


def encode_value(stored: Stored, final_at: int | None = None, proven: bool = False) -> bytes:
    kind = b"e" if stored[1] else b"r"
    tagged = kind if final_at is None else b"f%d:%s" % (final_at, kind)
    return (b"p" + tagged if proven else tagged) + stored[0]


def decode_value(value: bytes) -> Entry | None:
    """What `encode_value` wrote, else None (a value this proxy did not write). Never raises."""
    proven = value[:1] == b"p"
    height, start = None, 1 if proven else 0
    if value[start : start + 1] == b"f":
        end = value.find(b":", start + 1, start + MAX_HEIGHT_DIGITS + 2)
        digits = value[start + 1 : end]
        if end < 0 or not digits.isdigit() or b"%d" % int(digits) != digits:  # as %d writes it: no sign, no 0-padding
            return None
        height, start = int(digits), end + 1
    kind, payload = value[start : start + 1], value[start + 1 :]
    if kind not in (b"r", b"e"):
        return None
    try:
        parsed = loads(payload)  # exactly one JSON value, nothing after it
    except JSONDecodeError:
        return None
    if kind == b"e" and not (
        isinstance(parsed, dict) and type(parsed.get("code")) is int and isinstance(parsed.get("message"), str)
    ):
        return None  # the proxy keeps a node's error object (a revert), never a bare value
    return Entry((payload, kind == b"e"), height, proven)
