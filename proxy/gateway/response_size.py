"""The response size limit: bytes of answers one request body may return, its calls together.

Like providers' "response size exceeded": a call whose answer would take the body past
MAX_RESPONSE_BYTES gets -32005 naming the setting instead of its answer, which is dropped at once,
so a batch of large answers never holds (or sends) more than the limit. A batch is counted whole,
in the order its calls finish; the calls that fit are answered.
"""

from __future__ import annotations

from proxy.rpc.jsonrpc import LIMIT_EXCEEDED, JsonRpcError
from proxy.values import Outcome


def too_large(limit: int) -> JsonRpcError:
    return JsonRpcError(
        LIMIT_EXCEEDED,
        f"response size exceeded: the answer would pass MAX_RESPONSE_BYTES "
        f"({limit} bytes); ask for less (a narrower block range, fewer calls per batch)",
    )


class ResponseBudget:
    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, outcome: Outcome) -> Outcome:
        """The outcome if its answer still fits the body, else the size error (charged as served)."""
        size = len(outcome.payload)
        if self.used + size > self.limit:
            return Outcome.failed(too_large(self.limit), outcome.cache)
        self.used += size
        return outcome
