"""A node's JSON-RPC answer as the proxy carries it: the encoded result or error, and who produced it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.rpc import jsonrpc


@dataclass(slots=True)  # not frozen: two per miss, and frozen init costs 3x
class Answer:
    """A node's JSON-RPC answer: `payload` is the encoded result, or the encoded error object."""

    payload: bytes
    result: Any = None
    error: dict[str, Any] | None = None
    seconds: float = 0.0
    upstream: int = -1  # the index of the upstream that produced it; -1: not known (a stored answer)
    # The hash the same node gave, in the same batch, for the proof block the call was asked with
    # ("" when it had no such block; None when no proof was asked): see pool.HttpUpstream.proven().
    proof: str | None = None
    # Asked alone because its node refused the batch its proof was in: no block can come beside it
    # (asking.py serves it as the node gave it, and never keeps it).
    unbatched: bool = False

    @property
    def is_error(self) -> bool:
        return self.error is not None

    @property
    def error_code(self) -> int | None:
        code = self.error.get("code") if self.error else None
        return code if isinstance(code, int) else None

    def with_proof(self, proof: str | None) -> Answer:
        """This answer with the hash its node gave for the proof block (not dataclasses.replace: per miss)."""
        return Answer(self.payload, self.result, self.error, self.seconds, self.upstream, proof, self.unbatched)

    @classmethod
    def stored(cls, payload: bytes, is_error: bool) -> Answer:
        """An answer another replica fetched and stored: only its encoded bytes are at hand."""
        return cls(payload, None, {"stored": True} if is_error else None)

    @classmethod
    def from_response(cls, obj: dict[str, Any], seconds: float = 0.0, upstream: int = -1) -> Answer:
        if "error" in obj and obj["error"] is not None:
            error = obj["error"] if isinstance(obj["error"], dict) else {"code": -32603, "message": str(obj["error"])}
            return cls(jsonrpc.dumps(error), None, error, seconds, upstream)
        result = obj.get("result")
        return cls(jsonrpc.dumps(result), result, None, seconds, upstream)
