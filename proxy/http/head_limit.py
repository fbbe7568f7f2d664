"""What a request head must be on the fast front (front.py) before anything reads it: within
MAX_HEAD_BYTES, held also when the head arrives over many reads or whole in one, and with the one Host
field RFC 9112 section 3.2 asks for."""

from __future__ import annotations

from proxy.host_names import is_host_field
from proxy.http.wire import MAX_HEADERS, MAX_LINE, refusal
from proxy.rpc.jsonrpc import INVALID_REQUEST

MAX_HEAD_BYTES = 64 * 1024  # a request head in all


def host_fault_of(host: str | None, repeated: bool, http10: bool) -> str:
    """Why a head's Host refuses it (RFC 9112 section 3.2: 400), or "" when it is as the rule asks: a
    request with more than one Host field line or an invalid Host value, and an HTTP/1.1 request with
    none, MUST be answered 400. An HTTP/1.0 request may lack it."""
    if host is None:
        return "" if http10 else "bad request: no Host header field (RFC 9112 section 3.2)"
    if repeated:
        return "bad request: more than one Host header field (RFC 9112 section 3.2)"
    if not is_host_field(host.strip(" \t")):  # whitespace around a field value is not part of it
        return "bad request: the Host header field is not one host and port (RFC 9112 section 3.2)"
    return ""


class HeadLimit:
    """The bytes of the head being read, counted against MAX_HEAD_BYTES (one per connection)."""

    __slots__ = ("body_read", "field_bytes", "head_bytes", "heads_read")

    def __init__(self) -> None:
        self.head_bytes = 0  # of the head being read, counted in the reads before (over)
        self.body_read = 0  # body bytes in the read being fed (of every request: none of it is a head's)
        # At most the bytes of the heads completed in the read being fed: each adds, as it is whole (the
        # front), its target's bytes and 13 more (the request line's least: `GET  HTTP/1.1`, a line
        # end, the empty line's end), each field's name and value and 2 more (`:` and a line end),
        # less what earlier reads counted of it (head_bytes: never less than what they held).
        self.heads_read = 0
        self.field_bytes = 0  # the header fields' bytes of the request being read

    def begin(self) -> None:
        self.head_bytes = self.field_bytes = 0

    def field(self, name: bytes, value: bytes, fields: int) -> None:
        """A header field, after `fields` others: refused (431) when it or the head is too large."""
        # The fields' own bytes hold the head to its limit also when it arrives whole in one read.
        self.field_bytes += len(name) + len(value)
        if len(value) > MAX_LINE or len(name) > MAX_LINE or fields >= MAX_HEADERS or self.field_bytes > MAX_HEAD_BYTES:
            raise refusal(INVALID_REQUEST, "request header fields too large", 431)

    def over(self, data: bytes, begun_here: bool) -> bool:
        """A read that leaves a head still arriving: whether the head is now over MAX_HEAD_BYTES."""
        if not begun_here:  # begun in an earlier read: all of this one is head
            self.head_bytes += len(data)
        else:
            # Begun in this read, after the requests it completed: after the read's last empty line
            # (a head holds none) and after every body and head byte of the read (each counted at
            # most: a start never past the head's own).
            last_empty = data.rfind(b"\r\n\r\n")
            start = max(last_empty + 4 if last_empty >= 0 else 0, self.body_read + self.heads_read)
            self.head_bytes += len(data) - start  # never less than the head's bytes in it
        return self.head_bytes > MAX_HEAD_BYTES
