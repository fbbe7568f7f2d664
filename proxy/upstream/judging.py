"""A node's reply made into the answers its caller takes, in the try that read it (sending.py), so a
reply that cannot be one fails as that upstream's fault and the next upstream is asked: ids that do
not answer the request, a result of the wrong shape for its method (replies.py), or a reply the
proxy cannot encode again (orjson writes at most 255 levels of nesting; a node's valid JSON may nest
deeper). Each answer is encoded once, here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from proxy.rpc.jsonrpc import JSONEncodeError
from proxy.upstream.posting import Failed
from proxy.upstream.replies import batch_problem, single_problem
from proxy.values import Answer, new_record

UNENCODABLE = "malformed reply: nested too deep to encode again"


class BatchReply(NamedTuple):
    items: list[Any]  # the reply's items in the order of the calls asked (proof headers read as they are)
    answers: list[Answer]  # the answers of the first calls asked (those the caller takes as answers)


def single_answer(reply: Any, sent: int, method: str, seconds: float, index: int) -> Answer:
    """The answer in a reply to the single call of `method` with id `sent`, or Failed."""
    problem = single_problem(reply, sent, method)
    if problem is None:
        try:
            return Answer.from_response(reply, seconds, index)
        except JSONEncodeError:
            problem = UNENCODABLE
    raise Failed("mismatch", problem)


def batch_answers(
    reply: Any, ids: range, methods: Sequence[str], answered: int, seconds: float, index: int
) -> BatchReply | None:
    """A reply to the batch `ids` of `methods`: its items in order and the answers of the first
    `answered` calls; None when the node refused the batch (one error object), or Failed."""
    problem = batch_problem(reply, ids, methods)
    if problem is not None:
        raise Failed("mismatch", problem)
    if not isinstance(reply, list):
        return None
    items = _in_order(reply, ids)
    answers: list[Answer] = []
    try:
        for item in items[:answered]:  # a loop, not a comprehension: every auto-batch passes here
            answers.append(Answer.from_response(item, seconds, index))
    except JSONEncodeError:
        raise Failed("mismatch", UNENCODABLE) from None
    return new_record(BatchReply, (items, answers))  # not BatchReply(...): its __new__ is Python's, per miss


def _in_order(reply: list[Any], ids: range) -> list[Any]:
    """A batch reply's items in the order of the ids asked (batch_problem checked each is there once)."""
    for item, i in zip(reply, ids, strict=True):  # a loop, not a generator: every auto-batch passes here
        if item["id"] != i:
            break
    else:
        return reply
    by_id = {item["id"]: item for item in reply}
    return [by_id[i] for i in ids]
