"""JSON-RPC 2.0 envelope: codes, the one error type, parsing and encoding. No I/O.

orjson is used here and nowhere else for the envelope; results travel as encoded bytes so a
cached answer is spliced into the response with the caller's id, never decoded again.
"""

from __future__ import annotations

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


def _entry(obj: Any) -> Entry:
    if not isinstance(obj, dict):
        return Invalid(JsonRpcError(INVALID_REQUEST, "invalid request: expected a JSON object"))
    raw_id = obj.get("id")
    has_id = "id" in obj
    # jsonrpc.org 4: id is a string, a number or null.
    if has_id and (isinstance(raw_id, bool) or not isinstance(raw_id, (str, int, float, type(None)))):
        return Invalid(JsonRpcError(INVALID_REQUEST, "invalid request: id must be a string, number or null"))
    rid: Id = raw_id if has_id else None
    if obj.get("jsonrpc") != "2.0":
        return Invalid(JsonRpcError(INVALID_REQUEST, 'invalid request: jsonrpc must be "2.0"'), rid)
    method = obj.get("method")
    if not isinstance(method, str) or not method:
        return Invalid(JsonRpcError(INVALID_REQUEST, "invalid request: method must be a non-empty string"), rid)
    params = obj.get("params", [])
    if not isinstance(params, (list, dict)):
        return Invalid(JsonRpcError(INVALID_REQUEST, "invalid request: params must be an array or object"), rid)
    return Call(method=method, params=params, id=rid, notification=not has_id)


def parse_body(body: bytes | str, *, max_batch: int) -> Body:
    """Parse a request body; raise JsonRpcError for a body that cannot be answered element-wise."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise JsonRpcError(PARSE_ERROR, "parse error: body is not valid JSON", http_status=400) from None
    if isinstance(data, list):
        if not data:
            # jsonrpc.org 6: an empty array gets a single Invalid Request.
            raise JsonRpcError(INVALID_REQUEST, "invalid request: empty batch", http_status=400)
        if len(data) > max_batch:
            raise JsonRpcError(
                INVALID_REQUEST, f"invalid request: batch of {len(data)} exceeds the limit of {max_batch}",
                http_status=400,
            )
        return Body([_entry(item) for item in data], batch=True)
    entry = _entry(data)
    if isinstance(entry, Invalid):
        raise JsonRpcError(entry.error.code, entry.error.message, http_status=400)
    return Body([entry], batch=False)


PLAIN_MAX_BYTES = 1024


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
        # Subscripts rather than .get(): a body that is not such an object fails here, and a
        # plain call pays no method calls.
        if obj["jsonrpc"] != "2.0":
            return None
        rid, method, params = obj["id"], obj["method"], obj["params"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    if type(obj) is not dict or type(method) is not str or type(params) is not list:
        return None
    if type(rid) is not int and type(rid) is not str:  # a bool id is not an int here
        return None
    return rid, method, params


_HEAD = b'{"jsonrpc":"2.0","id":'


def encode_result(rid: Id, result: bytes) -> bytes:
    # One join: the (possibly large) result is copied once, not once per concatenation.
    return b"".join((_HEAD, orjson.dumps(rid), b',"result":', result, b"}"))


def encode_error(rid: Id, error: JsonRpcError) -> bytes:
    return encode_error_object(rid, error.encode())


def encode_error_object(rid: Id, error_object: bytes) -> bytes:
    return b"".join((_HEAD, orjson.dumps(rid), b',"error":', error_object, b"}"))


def encode_batch(parts: list[bytes]) -> bytes:
    return b"[" + b",".join(parts) + b"]"


# orjson's own function, not a wrapper: the cache-hit path calls it twice per request.
dumps: Callable[[Any], bytes] = orjson.dumps


def dumps_canonical(value: Any) -> bytes:
    """Encoding used for cache keys: object keys sorted, so their order does not matter."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


JSONDecodeError = orjson.JSONDecodeError
