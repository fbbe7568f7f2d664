"""A node's reply made into the answers its caller takes, in the try that read it (sending.py), so a
reply that cannot be one fails as that upstream's fault and the next upstream is asked: ids that do
not answer the request, a result of the wrong shape for its method (replies.py), or a reply the
proxy cannot encode again (orjson writes at most 255 levels of nesting; a node's valid JSON may nest
deeper). Each answer is encoded once, here. Called as functools.partial(judge, <the request>): no
closure and no frame of its own per try."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from proxy.rpc.jsonrpc import JSONEncodeError
from proxy.upstream.posting import Failed
from proxy.upstream.replies import SHAPES, block_unknown, is_response, shape_problem, single_problem
from proxy.values import Answer, new_record

UNCLE = "eth_getUncleByBlockHashAndIndex"

UNENCODABLE = "malformed reply: nested too deep to encode again"


class BatchReply(NamedTuple):
    items: list[Any]  # the reply's items in the order of the calls asked (proof headers read as they are)
    answers: list[Answer]  # the answers of the first calls asked (those the caller takes as answers)


def single_answer(sent: int, method: str, reply: Any, seconds: float, index: int) -> Answer:
    """The answer in a reply to the single call of `method` with id `sent`, or Failed."""
    problem = single_problem(reply, sent)
    if problem is None:
        try:
            answer = Answer.from_response(reply, seconds, index)
        except JSONEncodeError:
            raise Failed("mismatch", UNENCODABLE) from None
        shape = SHAPES.get(method)
        result = answer.result  # None for an error, and for a null (judged as before)
        if shape is None or result is None or shape.fits(result):
            return errored(method, answer) if answer.error is not None else answer
        problem = shape_problem(method, shape, result)
    raise Failed("mismatch", problem)


def errored(method: str, answer: Answer) -> Answer:
    """A node's error answer as the caller takes it, or Failed: an error object's code is an integer
    (JSON-RPC 2.0 section 5.1; a string code is a malformed reply). The interface: an uncle is "a block
    object, or null when no block is found"; a node's "no such block" error (Anvil's -32001, which is
    also this proxy's code for a refused key) is that null."""
    if type(answer.error_code) is not int:
        raise Failed("mismatch", "malformed reply: an error object without an integer code")
    if method == UNCLE and block_unknown(answer.error):
        return Answer(b"null", None, None, answer.seconds, answer.upstream)
    return answer


def batch_answers(
    ids: range, methods: Sequence[str], answered: int, reply: Any, seconds: float, index: int
) -> BatchReply | None:
    """A reply to the batch `ids` of `methods` (each id exactly once, nothing else): its items in order
    and the answers of the first `answered` calls (each result of its method's shape); None when the
    node refused the batch (one error object instead of a list: not a fault here), or Failed. The
    ids are checked here, not in a function of their own: every auto-batch and proof passes here."""
    if isinstance(reply, dict):
        if "error" in reply:
            return None
        raise Failed("mismatch", "malformed batch reply")
    if not isinstance(reply, list):
        raise Failed("mismatch", "malformed batch reply")
    seen = set()
    for item in reply:  # a loop, not generators
        if not is_response(item):
            raise Failed("mismatch", "malformed batch reply")
        rid = item.get("id")
        if isinstance(rid, bool) or rid not in ids or rid in seen:
            raise Failed("mismatch", "batch reply ids differ from the request ids")
        seen.add(rid)
    if len(seen) != len(ids):
        raise Failed("mismatch", "batch reply ids differ from the request ids")
    items = _in_order(reply, ids)
    answers: list[Answer] = []
    try:
        for i in range(answered):  # a loop, not a comprehension: every auto-batch passes here
            answer = Answer.from_response(items[i], seconds, index)
            if answer.error is not None:
                answer = errored(methods[i], answer)
            shape = SHAPES.get(methods[i])
            if shape is not None and answer.result is not None and not shape.fits(answer.result):
                raise Failed("mismatch", shape_problem(methods[i], shape, answer.result))
            answers.append(answer)
    except JSONEncodeError:
        raise Failed("mismatch", UNENCODABLE) from None
    return new_record(BatchReply, (items, answers))  # not BatchReply(...): its __new__ is Python's, per miss


def _in_order(reply: list[Any], ids: range) -> list[Any]:
    """A batch reply's items in the order of the ids asked (batch_answers checked each is there once)."""
    for item, i in zip(reply, ids, strict=True):  # a loop, not a generator: every auto-batch passes here
        if item["id"] != i:
            break
    else:
        return reply
    by_id = {item["id"]: item for item in reply}
    return [by_id[i] for i in ids]
