"""An answer as the Redis tier holds it: one kind byte (`r` result, `e` error object) followed by its
JSON, after `f<height>:` for a hash-addressed answer its writer tagged with its finalized height
(sharing.py)."""

from __future__ import annotations

Stored = tuple[bytes, bool]  # an answer as the cache holds it: (payload JSON, is an error object)


def encode_value(stored: Stored, final_at: int | None = None) -> bytes:
    kind = b"e" if stored[1] else b"r"
    return (kind if final_at is None else b"f%d:%s" % (final_at, kind)) + stored[0]


def decode_value(value: bytes) -> Stored:
    if value[:1] == b"f":
        value = value[value.index(b":") + 1 :]
    return value[1:], value[:1] == b"e"


def final_at(value: bytes) -> int | None:
    """The writer's finalized height a value is tagged with (sharing.py), None when it has none."""
    return int(value[1 : value.index(b":")]) if value[:1] == b"f" else None
