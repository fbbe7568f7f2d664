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
from proxy.rpc.result_shapes import Shape
from proxy.upstream.posting import Failed
from proxy.upstream.replies import SHAPES, block_unknown, is_response, shape_problem, single_problem
from proxy.values import Answer, new_record

UNCLE = "eth_getUncleByBlockHashAndIndex"
NO_BLOCK_CODES = (-32001, -32000)  # EIP-1474's "Resource not found"; geth's and most nodes' server error

UNENCODABLE = "malformed reply: nested too deep to encode again"


class BatchReply(NamedTuple):
    items: list[Any]  # the reply's items in the order of the calls asked (proof headers read as they are)
    answers: list[Answer]  # the answers of the first calls asked (those the caller takes as answers)


def single_answer(sent: int, method: str, reply: Any, seconds: float, index: int) -> Answer:
    """The answer in a reply to the single call of `method` with id `sent`, or Failed."""
    problem = single_problem(reply, sent) or _error_problem(reply)
    if problem is None:
        try:
            answer = Answer.from_response(reply, seconds, index)
        except JSONEncodeError:
            raise Failed("mismatch", UNENCODABLE) from None
        shape = SHAPES.get(method)
        if shape is None or _shaped(shape, answer):
            return errored(method, answer) if answer.error is not None else answer
        problem = shape_problem(method, shape, answer.result)
    raise Failed("mismatch", problem)


def _shaped(shape: Shape, answer: Answer) -> bool:
    """Whether an answer is of its method's shape: an error is (judged by _error_problem), a null is
    where the shape takes one (judged as nodes mean it: asking.py)."""
    result = answer.result  # None for an error, and for a null
    return shape.fits(result) if result is not None else answer.error is not None or shape.null


def _error_problem(item: dict[str, Any]) -> str | None:
    """Why an answer's error member is not a JSON-RPC 2.0 error object (section 5.1: an integer code
    and a string message), or None; an error that is not one is a malformed reply, not the node's answer."""
    error = item.get("error")
    if error is None:
        return None
    if type(error) is not dict or type(error.get("code")) is not int or type(error.get("message")) is not str:
        return "malformed reply: an error that is not an object with an integer code and a message"
    return None


def errored(method: str, answer: Answer) -> Answer:
    """A node's error answer as the caller takes it. The interface: an uncle is "a block object, or
    null when no block is found"; a node's "no such block" error (EIP-1474's -32001 "Resource not
    found" on Anvil, which is also this proxy's code for a refused key, or -32000 "header not found")
    is that null; another error (a missing method, an internal or a quota error) stays one."""
    if method == UNCLE and answer.error_code in NO_BLOCK_CODES and block_unknown(answer.error):
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
            problem = _error_problem(items[i])
            if problem is not None:
                raise Failed("mismatch", problem)
            answer = Answer.from_response(items[i], seconds, index)
            if answer.error is not None:
                answer = errored(methods[i], answer)
            shape = SHAPES.get(methods[i])
            if shape is not None and not _shaped(shape, answer):
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
