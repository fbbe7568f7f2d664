"""gzip for large answers (RFC 1952 around RFC 1951 deflate), compressed once per result.

A single-call answer is `{"jsonrpc":"2.0","id":<id>,"result":<payload>}` and only the id changes
between clients. So the payload is deflated once (a sync flush leaves it byte-aligned and not final)
and kept by content, and each answer is spliced: the gzip header, the prefix as a stored block, the
kept deflate of the payload, the closing `}` as the final stored block, then CRC-32 and length. A hit
then costs a CRC-32 and a copy of the body, not a compression. Batches and errors are compressed
whole. Only gzip: Python 3.11 has no zstd or brotli of its own, and neither is a dependency here;
for the same reason a request body is decoded from gzip and deflate only (any other coding: 415).
"""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections import OrderedDict

GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no mtime, unknown OS
LEVEL = 6  # zlib's default: most of level 9's ratio on JSON at a fraction of its CPU
_RESULT = b',"result":'
_HEAD = b'{"jsonrpc":"2.0","id":'
STORED_MAX = 0xFFFF
# An answer at least this large is compressed in a worker thread (zlib lets go of the GIL while it
# works): the event loop serves other clients meanwhile (a 30 MB batch answer held it about 1 s).
APART_BYTES = 1 << 20


def accepts_gzip(accepted: str | None) -> bool:
    """An Accept-Encoding value accepts gzip (RFC 9110 12.5.3): listed, and not with q=0."""
    if accepted is None:
        return False
    for item in accepted.lower().split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip() in ("gzip", "x-gzip", "*"):  # x-gzip is gzip (RFC 9110 8.4.1.3)
            return params.replace(" ", "") not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False


def _stored(data: bytes, final: bool) -> bytes:
    """One stored deflate block (RFC 1951 3.2.4), starting byte-aligned."""
    return (b"\x01" if final else b"\x00") + struct.pack("<HH", len(data), len(data) ^ 0xFFFF) + data


def gzip_whole(body: bytes) -> bytes:
    compressor = zlib.compressobj(LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return compressor.compress(body) + compressor.flush()


class Compressor:
    """Decides whether an answer is compressed and keeps the deflate of large payloads, by content."""

    def __init__(self, min_bytes: int, cache_bytes: int) -> None:
        self.min_bytes = min_bytes  # 0: off
        self._cache_bytes = cache_bytes
        self._held = 0
        self._deflated: OrderedDict[bytes, bytes] = OrderedDict()

    def gzip(self, body: bytes) -> bytes:
        """The gzip member whose content is `body`."""
        cut = _result_at(body)
        if cut < 0:
            return gzip_whole(body)  # a batch, an error, or an id too long for one stored block
        payload = body[cut:-1]
        deflated = self._kept(payload)
        if deflated is None:
            deflated = self._keep(payload, _deflated(payload))
        return _spliced(body, cut, deflated, zlib.crc32(body))

    async def gzip_apart(self, body: bytes) -> bytes:
        """As `gzip`, its compression and CRC-32 in a worker thread (APART_BYTES)."""
        loop = asyncio.get_running_loop()
        cut = _result_at(body)
        if cut < 0:
            return await loop.run_in_executor(None, gzip_whole, body)
        payload = body[cut:-1]
        deflated = self._kept(payload)
        if deflated is None:
            deflated = self._keep(payload, await loop.run_in_executor(None, _deflated, payload))
        return _spliced(body, cut, deflated, await loop.run_in_executor(None, zlib.crc32, body))

    def _kept(self, payload: bytes) -> bytes | None:
        """The payload's deflate, if kept (one never kept is not looked for: hashing it costs)."""
        if len(payload) > self._cache_bytes // 4:
            return None
        found = self._deflated.get(payload)
        if found is not None:
            self._deflated.move_to_end(payload)
        return found

    def _keep(self, payload: bytes, deflated: bytes) -> bytes:
        """The payload's deflate kept (bounded, oldest out), and returned."""
        size = len(payload) + len(deflated)
        if size <= self._cache_bytes // 4 and payload not in self._deflated:  # one never takes most of the room
            self._deflated[payload] = deflated
            self._held += size
            while self._held > self._cache_bytes:
                old, old_deflated = self._deflated.popitem(last=False)
                self._held -= len(old) + len(old_deflated)
        return deflated


def _result_at(body: bytes) -> int:
    """Where a single call's result begins in its answer, or -1 (a batch, an error, an id too long)."""
    start = body.find(_RESULT, len(_HEAD)) if body.startswith(_HEAD) else -1
    if start < 0 or start + len(_RESULT) > STORED_MAX or not body.endswith(b"}"):
        return -1
    return start + len(_RESULT)


def _deflated(payload: bytes) -> bytes:
    """The payload as non-final deflate blocks ending byte-aligned."""
    compressor = zlib.compressobj(LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS)
    return compressor.compress(payload) + compressor.flush(zlib.Z_SYNC_FLUSH)


def _spliced(body: bytes, cut: int, deflated: bytes, crc: int) -> bytes:
    trailer = struct.pack("<II", crc, len(body) & 0xFFFFFFFF)
    return b"".join((GZIP_HEADER, _stored(body[:cut], False), deflated, _stored(b"}", True), trailer))


class UnsupportedCoding(Exception):
    """A request body in a content coding the proxy does not decode: RFC 9110 section 15.5.16, 415."""

    def __init__(self, coding: str) -> None:
        super().__init__(coding)
        self.coding = coding


DECODED_CODINGS = "gzip, deflate"  # the request codings decoded (x-gzip is gzip): a 415's Accept-Encoding
MAX_CODINGS = 5  # codings stacked on one body: each layer is inflated up to the limit (urllib3's bound too)
# Members of one gzip body (RFC 1952 2.2: `gzip -c a b` writes two; a client's encoder writes one).
# Each is decoded apart, the rest of the body copied after it: 262,000 empty ones in 5 MB were 15 s of
# the event loop's time.
MAX_GZIP_MEMBERS = 16


def codings_of(encoding: str | None) -> list[str]:
    """A Content-Encoding value's codings in the order they were applied (RFC 9110 section 8.4), with
    identity (no coding) and empty list elements (section 5.6.1) left out."""
    codings = [item.strip().lower() for item in (encoding or "").split(",")]
    return [coding for coding in codings if coding and coding != "identity"]


def decoded_body(body: bytes, encoding: str | None, limit: int) -> bytes | None:
    """A request body decoded from its Content-Encoding, every layer of it, the last applied first;
    None when a layer decodes to more than `limit` bytes, which is never held. UnsupportedCoding: a
    coding other than gzip or deflate, or more than MAX_CODINGS (nothing is inflated then);
    zlib.error: not decodable."""
    codings = codings_of(encoding)
    if len(codings) > MAX_CODINGS:
        raise UnsupportedCoding(f"{len(codings)} codings stacked (at most {MAX_CODINGS})")
    for coding in codings:
        if coding not in ("gzip", "x-gzip", "deflate"):
            raise UnsupportedCoding(coding)
    for coding in reversed(codings):
        inflated = _inflated(body, coding, limit)
        if inflated is None:
            return None
        body = inflated
    return body


def _inflated(body: bytes, coding: str, limit: int) -> bytes | None:
    """One layer: gzip (a series of members, RFC 1952 section 2.2, decoded one after another) or
    deflate; None past `limit` bytes, the members' together."""
    wbits = 16 + zlib.MAX_WBITS  # gzip
    if coding == "deflate":  # zlib-wrapped, or raw as some clients send it
        wbits = zlib.MAX_WBITS if body[:1] == b"\x78" else -zlib.MAX_WBITS
    parts: list[bytes] = []
    size = 0
    rest = body
    while True:
        if len(parts) == MAX_GZIP_MEMBERS:
            raise zlib.error(f"the encoded body has over {MAX_GZIP_MEMBERS} gzip members")
        inflater = zlib.decompressobj(wbits)
        part = inflater.decompress(rest, limit + 1 - size)  # at least 1: size never passes limit here
        size += len(part)
        if size > limit:
            return None
        parts.append(part)
        if not inflater.eof:  # cut short: not the body sent
            raise zlib.error("the encoded body is truncated")
        rest = inflater.unused_data
        if not rest:
            return b"".join(parts)
        if wbits != 16 + zlib.MAX_WBITS or rest[:2] != GZIP_HEADER[:2]:  # bytes after its end: not the body sent
            raise zlib.error("the encoded body has data after its end")
