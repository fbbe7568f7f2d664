"""JSON-RPC 2.0 envelope: codes, the one error type, parsing and encoding. No I/O.

orjson is used here and nowhere else for the envelope; results travel as encoded bytes so a
cached answer is spliced into the response with the caller's id, never decoded again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

# jsonrpc.org section 5.1
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
# Server-defined codes (EIP-1474 where one fits); README documents each.
INVALID_API_KEY = -32001
UPSTREAM_UNAVAILABLE = -32002
LIMIT_EXCEEDED = -32005
EXECUTION_REVERTED = 3

Id = str | int | float | None

# A method name is an ASCII identifier of bounded length, checked in the envelope, before anything
# (a route memo, a policy lookup) is keyed by it: a client cannot make the proxy keep megabytes of
# name, and look-alikes (" admin_x", Cyrillic letters) are refused rather than matched loosely.
METHOD_NAME_MAX = 128
METHOD_NAME = re.compile(rf"[A-Za-z][A-Za-z0-9_]{{0,{METHOD_NAME_MAX - 1}}}")
METHOD_NAME_PROBLEM = (
    f"invalid request: method must be ASCII letters, digits and '_', starting with a letter, "
    f"at most {METHOD_NAME_MAX} characters"
)


class JsonRpcError(Exception):
    """The one error type: a JSON-RPC error object plus the HTTP status it implies alone."""

    def __init__(
        self,
        code: int,
        message: str,
        data: Any = None,
        *,
        http_status: int = 200,
        headers: dict[str, str] | None = None,
        reached: bool = False,
        local: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.http_status = http_status
        self.headers = headers or {}
        # An upstream failure after a node got the call (a timeout, a garbled reply): the node may
        # have done the work, so the call is charged (charging.py).
        self.reached = reached
        # The proxy's own refusal, no node asked (a filter id unknown to the key): given back (charging.py).
        self.local = local

    def encode(self) -> bytes:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            body["data"] = self.data
        return orjson.dumps(body)

    def __repr__(self) -> str:
        return f"JsonRpcError({self.code}, {self.message!r})"


def invalid_params(name: str, problem: str) -> JsonRpcError:
    return JsonRpcError(INVALID_PARAMS, f"invalid params: {name}: {problem}")


@dataclass(slots=True)  # not frozen: built per call, and frozen init costs 3x
class Call:
    """One well-formed request object."""

    method: str
    params: list[Any] | dict[str, Any]
    id: Id = None
    notification: bool = False


@dataclass(slots=True)  # not frozen: built per call, and frozen init costs 3x
class Invalid:
    """A batch element (or single request) that is not a valid request object."""

    error: JsonRpcError
    id: Id = None
    notification: bool = field(default=False)


Entry = Call | Invalid


@dataclass(slots=True)  # not frozen: built per call, and frozen init costs 3x
class Body:
    entries: list[Entry]
    batch: bool


MAX_PARAMS_DEPTH = 64


def _too_deep(value: list[Any] | dict[str, Any], limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels (the params themselves are level 1)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (list, dict)):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


FLOAT_ID_LIMIT = float(2**53)  # a number id that is a float is echoed exactly only below it


def _entry(obj: Any) -> Entry:
    if not isinstance(obj, dict):
        return Invalid(JsonRpcError(INVALID_REQUEST, "invalid request: expected a JSON object"))
    raw_id = obj.get("id")
    has_id = "id" in obj
    # jsonrpc.org 4: id is a string, a number or null.
    if has_id and (isinstance(raw_id, bool) or not isinstance(raw_id, (str, int, float, type(None)))):
        return Invalid(JsonRpcError(INVALID_REQUEST, "invalid request: id must be a string, number or null"))
    if type(raw_id) is float and not -FLOAT_ID_LIMIT < raw_id < FLOAT_ID_LIMIT:
        # An integer past 64 bits, which orjson reads as a float (past 2^53 a float holds no integer
        # exactly): it would come back changed. Anvil refuses it too.
        return Invalid(
            JsonRpcError(
                INVALID_REQUEST,
                "invalid request: id is a number too large to echo exactly (an integer id must fit in 64 bits)",
            )
        )
    rid: Id = raw_id if has_id else None
    if obj.get("jsonrpc") != "2.0":
        return Invalid(JsonRpcError(INVALID_REQUEST, 'invalid request: jsonrpc must be "2.0"'), rid)
    method = obj.get("method")
    if not isinstance(method, str) or not method:
        return Invalid(JsonRpcError(INVALID_REQUEST, "invalid request: method must be a non-empty string"), rid)
    if not METHOD_NAME.fullmatch(method):
        return Invalid(JsonRpcError(INVALID_REQUEST, METHOD_NAME_PROBLEM), rid)
    params = obj.get("params", [])
    if not isinstance(params, (list, dict)):
        return Invalid(JsonRpcError(INVALID_REQUEST, "invalid request: params must be an array or object"), rid)
    if _too_deep(params, MAX_PARAMS_DEPTH):
        # orjson encodes at most 255 levels: deeper params could be neither keyed nor forwarded.
        return Invalid(invalid_params("params", f"nested deeper than {MAX_PARAMS_DEPTH} levels"), rid)
    return Call(method=method, params=params, id=rid, notification=not has_id)


# Bodies at least this long that open with `[` are counted element by element before the full parse.
BATCH_SCAN_FROM = 64 * 1024
_STDLIB = json.JSONDecoder()


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def _longer_than(body: bytes | str, limit: int) -> bool:
    """Whether a body is a JSON array of more than `limit` elements, found by decoding at most
    limit + 1 of them (the stdlib decoder resumes at any offset; orjson decodes whole documents).
    False when it cannot tell (not an array, malformed): the full parse then judges the body."""
    try:
        text = body.decode() if isinstance(body, bytes) else body
        at = _skip_space(text, 0)
        if text[at] != "[":
            return False
        at += 1
        for count in range(1, limit + 2):
            _, at = _STDLIB.raw_decode(text, _skip_space(text, at))
            if count > limit:
                return True
            at = _skip_space(text, at)
            if text[at] != ",":
                return False
            at += 1
    except (UnicodeDecodeError, ValueError, RecursionError, IndexError):
        pass
    return False


MAX_CONTAINERS = 100_000  # objects and arrays in one body; a full batch of real calls has a few thousand


def _containers(body: bytes | str) -> int:
    """An upper bound on the objects and arrays in a body (braces inside strings count too): C-speed."""
    if isinstance(body, str):
        return body.count("{") + body.count("[")
    return body.count(b"{") + body.count(b"[")


# JSON the parser does not read (RFC 8259 section 9 lets a parser limit nesting and numbers' range):
# orjson's message opens with the limit, and the whole body is refused, as one that is no JSON.
_PARSER_LIMITS = {
    "depth limit exceeded": "parse error: JSON nested deeper than 1024 levels is not read",
    "number is infinity": "parse error: a number past a 64-bit float's range is not read",
}


def _unread(reason: str) -> str:
    """A -32700 message: the parser's limit that the body passed, else that it is not JSON."""
    return next(
        (m for start, m in _PARSER_LIMITS.items() if reason.startswith(start)), "parse error: body is not valid JSON"
    )


def parse_body(body: bytes | str, *, max_batch: int) -> Body:
    """Parse a request body; raise JsonRpcError for a body that cannot be answered element-wise."""
    if len(body) >= BATCH_SCAN_FROM and _longer_than(body, max_batch):
        # A 5 MB `[{},{},...]` is 1.7 million objects: refused before they are built.
        raise JsonRpcError(
            INVALID_REQUEST,
            f"invalid request: batch exceeds the limit of {max_batch}",
            http_status=400,
        )
    if len(body) >= BATCH_SCAN_FROM and _containers(body) > MAX_CONTAINERS:
        # 5 MB of `{}` inside one call's params is 1.7 million objects (hundreds of MB) once parsed.
        raise JsonRpcError(
            INVALID_REQUEST,
            f"invalid request: more than {MAX_CONTAINERS} JSON objects and arrays in one body",
            http_status=400,
        )
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise JsonRpcError(PARSE_ERROR, _unread(str(error)), http_status=400) from None
    if isinstance(data, list):
        if not data:
            # jsonrpc.org 6: an empty array gets a single Invalid Request.
            raise JsonRpcError(INVALID_REQUEST, "invalid request: empty batch", http_status=400)
        if len(data) > max_batch:
            raise JsonRpcError(
                INVALID_REQUEST,
                f"invalid request: batch of {len(data)} exceeds the limit of {max_batch}",
                http_status=400,
            )
        return Body([_entry(item) for item in data], batch=True)
    entry = _entry(data)
    if isinstance(entry, Invalid) and entry.error.code != INVALID_PARAMS:
        # spec: the response id is the request's: an invalid request whose id is valid is answered
        # with it, as a batch element is (an invalid id is None here); the status stays 400.
        entry = Invalid(JsonRpcError(entry.error.code, entry.error.message, http_status=400), entry.id)
    return Body([entry], batch=False)


PLAIN_MAX_BYTES = 1024


def plain_body(body: bytes | str, plain: tuple[int | str, str, list[Any]]) -> Body | None:
    """The Body `parse_body` makes of `body`, whose `plain_call` is `plain` (parsed already, by the
    cache-hit path); None when only `parse_body` can judge it (a method name it refuses, params it
    would measure for depth). A body with fewer brackets than the depth limit cannot nest past it."""
    rid, method, params = plain
    if not METHOD_NAME.fullmatch(method) or _containers(body) > MAX_PARAMS_DEPTH:
        return None
    return Body([Call(method=method, params=params, id=rid)], batch=False)


def plain_call(body: bytes | str) -> tuple[int | str, str, list[Any]] | None:
    """A single request that is plainly valid (a dict, "2.0", an int or string id, a string method,
    an array of params), or None for anything else, valid or not, which `parse_body` then judges.

    The strict subset the cache-hit path accepts without building a `Body`; it loosens nothing.
    Long bodies are never plain calls (memoized params are short), so they are parsed once, by
    `parse_body`; a short batch is parsed here too, which costs less than looking for one first.
    """
    if len(body) > PLAIN_MAX_BYTES:
        return None
    try:
        obj = orjson.loads(body)
        # Subscripts rather than .get(): a body that is not an object (orjson's only mapping is a
        # dict) fails here with TypeError, and a plain call pays no method calls.
        if obj["jsonrpc"] != "2.0":
            return None
        rid, method, params = obj["id"], obj["method"], obj["params"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    if type(method) is not str or type(params) is not list:
        return None
    if type(rid) is not int and type(rid) is not str:  # a bool id is not an int here
        return None
    return rid, method, params


ID_HEAD = b'{"jsonrpc":"2.0","id":'
# What follows the id, by whether the answer is an error: b"".join((ID_HEAD, orjson.dumps(rid),
# RESULT_KEYS[is_error], payload, b"}")) is a memory hit's answer, written out on the hot path.
RESULT_KEYS = (b',"result":', b',"error":')


def encode_result(rid: Id, result: bytes) -> bytes:
    # One join: the (possibly large) result is copied once, not once per concatenation.
    return b"".join((ID_HEAD, orjson.dumps(rid), b',"result":', result, b"}"))


def encode_error(rid: Id, error: JsonRpcError) -> bytes:
    return encode_error_object(rid, error.encode())


def encode_error_object(rid: Id, error_object: bytes) -> bytes:
    return b"".join((ID_HEAD, orjson.dumps(rid), b',"error":', error_object, b"}"))


def encode_notification(method: str, subscription: str | int, result: bytes, *, error: bool = False) -> bytes:
    """A subscription notification: {"method": ..., "params": {"subscription": id, "result"|"error": ...}}.

    `result` is already encoded, so one block's header or log is encoded once for every subscriber.
    """
    return b"".join(
        (
            b'{"jsonrpc":"2.0","method":',
            orjson.dumps(method),
            b',"params":{"subscription":',
            orjson.dumps(subscription),
            b',"error":' if error else b',"result":',
            result,
            b"}}",
        )
    )


def encode_batch(parts: list[bytes]) -> bytes:
    # One join of the brackets, the answers and the commas between them: each answer is copied once
    # ("[" + a join + "]" copied them three times).
    if not parts:
        return b"[]"
    framed = [b","] * (2 * len(parts) + 1)
    framed[1::2] = parts
    framed[0], framed[-1] = b"[", b"]"
    return b"".join(framed)


# orjson's own function, not a wrapper: the cache-hit path calls it twice per request.
dumps: Callable[[Any], bytes] = orjson.dumps


LONG_TEXT = 64 * 1024


def dumps_result(value: Any) -> bytes:
    """As dumps; a long text with nothing to escape (a hex result) is quoted as it is: orjson 3.13
    reserves about 8 times a long text's size for its output, and the bytes it returns keep it."""
    if (
        type(value) is str
        and len(value) >= LONG_TEXT
        and value.isascii()
        and value.isprintable()
        and '"' not in value
        and "\\" not in value
    ):
        # Joined, not %-formatted: bytes formatting reserves a quarter more while it writes.
        return b"".join((b'"', value.encode("ascii"), b'"'))
    return orjson.dumps(value)


def dumps_canonical(value: Any) -> bytes:
    """Encoding used for cache keys: object keys sorted, so their order does not matter."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def loads(data: bytes | bytearray | str) -> Any:
    return orjson.loads(data)


JSONDecodeError = orjson.JSONDecodeError
# What `dumps` raises for a value it cannot encode (a TypeError): a node's JSON nested past 255 levels.
JSONEncodeError = orjson.JSONEncodeError
