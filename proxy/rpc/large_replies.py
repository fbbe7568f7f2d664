"""A node's reply read with few copies when it carries a long hex result (eth_call, eth_getCode, a raw
transaction): such a result is taken from the reply's bytes, and only the rest is parsed.

orjson 3.13's parse of one long string peaks at about 13 times its size (its document's value pool
is sized from the input's length; measured with tracemalloc, `bench/memory_answers.py` shows what
that did to a process under large answers), and encoding it back reserves about 8 times. A hex
string has nothing to unescape or escape, so its bytes are its text: read that way, a reply of S
bytes costs about 2 S while it is read (its bytes and the result's text) and its encoded result S."""

from __future__ import annotations

import re
import secrets
from itertools import count
from typing import Any

from proxy.rpc import jsonrpc

LONG = 64 * 1024  # a result shorter than this is parsed with the rest (a scan would cost more than it saves)
# A long hex string that is the value of a "result" member: its text, without the quotes.
_LONG_RESULT = re.compile(rb'"result"\s*:\s*"(0x[0-9a-fA-F]{%d,})"' % LONG)
# A placeholder no node can send: the process's random prefix, a NUL, and a serial (per reply).
_PREFIX = "\x00" + secrets.token_hex(8) + ":"
_serials = count()

# A reply's objects and arrays are bounded before it is parsed: orjson builds each one (about 90 bytes
# for `{}`), so 30 MB of `[{},{},...]` held ~900 MB and parsed for a second with the event loop
# stopped. Real replies are sparse (a 32 MB eth_getLogs answer: ~1 container per 280 bytes; a geth
# structLogs trace: ~1 per 22), but their strings may be dense in braces (a revert reason, a Solana log
# message): only containers outside strings count, so a node's true answer is never refused.
CROWDED_FROM = 64 * 1024  # a shorter reply is parsed whatever it holds
BYTES_PER_CONTAINER = 16
# A JSON string token with its escapes (possessive: no backtracking on a hostile reply), or a string
# that never closes, to the reply's end: one pass over any reply. (Were an unclosed string no match,
# each later `"` would start a scan to the end again: 120 KB of `\"{` took 18 s with the loop stopped.)
STRING_TOKEN = re.compile(rb'(?s)"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)')
TEXT_STRING_TOKEN = re.compile(STRING_TOKEN.pattern.decode())


def crowded(data: bytes | bytearray | str) -> bool:
    """More than one object or array outside strings per BYTES_PER_CONTAINER bytes in a reply past
    CROWDED_FROM. The `{` and `[` bytes are counted first (C-speed); only a reply that many flag has its
    strings skipped and its containers counted again (30 MB: 0.07 s for `[{},...]` or one string of `{`,
    up to ~1.8 s for hostile strings packed between containers, still far below what parsing it costs)."""
    if len(data) < CROWDED_FROM:
        return False
    bound = len(data) // BYTES_PER_CONTAINER
    if _containers(data) <= bound:
        return False
    outside = TEXT_STRING_TOKEN.sub("", data) if isinstance(data, str) else STRING_TOKEN.sub(b"", data)
    return _containers(outside) > bound


def _containers(data: bytes | bytearray | str) -> int:
    """The `{` and `[` characters in `data`, inside strings or not."""
    return data.count("{") + data.count("[") if isinstance(data, str) else data.count(b"{") + data.count(b"[")


def loads_reply(data: bytes | bytearray) -> Any:
    """`data` parsed as JSON (one reply, or a batch's list of replies), as jsonrpc.loads would,
    each long hex "result" of a reply read from its bytes. Anything else (a long result nested
    deeper than a reply's own member, a placeholder not found where it was put) is parsed whole."""
    if len(data) < LONG:
        return jsonrpc.loads(data)
    spans = [match.span(1) for match in _LONG_RESULT.finditer(data)]
    if not spans:
        return jsonrpc.loads(data)
    mark = f"{_PREFIX}{next(_serials)}:"
    parts: list[bytes | bytearray] = []
    at = 0
    for index, (start, end) in enumerate(spans):
        parts += (data[at:start], b"\\u0000", mark[1:].encode(), b"%d" % index)
        at = end
    parts.append(data[at:])
    rest = jsonrpc.loads(b"".join(parts))
    replies = rest if type(rest) is list else [rest]
    found = 0
    view = memoryview(data)
    for reply in replies:
        result = reply.get("result") if type(reply) is dict else None
        if type(result) is str and result.startswith(mark):
            start, end = spans[int(result[len(mark) :])]
            reply["result"] = str(view[start:end], "ascii")  # one copy: its text, no bytes between
            found += 1
    return rest if found == len(spans) else jsonrpc.loads(data)
