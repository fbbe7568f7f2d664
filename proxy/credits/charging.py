"""Which calls are charged: the one place the rule lives.

A call is charged when it was forwarded to a node or served from cache. It is free when it was
refused before forwarding (invalid, unknown method, refused for credits: most are never debited;
one found only once its block tags are resolved, a reversed eth_getLogs range, is given back) or
when no node could be reached at all. A call that reached a node and then failed (a timeout, a
garbled reply) is charged: the node may have done the work, as a slow eth_estimateGas does. A
call a node left out of its batch reply was never answered by any node, so it is free like any
other -32002 of a node that could not be reached.

A call that made several upstream calls (a chunked eth_getLogs) is charged once any of them was
answered, even when a later one fails (an HTTP 429 on a few chunks): the work done upstream is not
given away, so failing part-way is no free amplification (chunked_logs.py marks such an error
`reached`). A call cut by the response size limit (MAX_RESPONSE_BYTES), or answered by a node with
an `id: null` error (it could not read the call), was served: charged. One that every node refused
with HTTP 400/413/414/431 was run by none: free, like any other -32002 of unreachable nodes.

A call whose caller left before its answer was made (a WebSocket closed while the call waited: the
body's task is cancelled) is charged only if a request made for it was sent to a node: the node
does the work whether or not anyone reads its answer. One still waiting, for the key's upstream slot
(UPSTREAM_KEY_CONCURRENCY), a connection, or another caller's identical request (coalesced, in the
process or across replicas), is given back: nothing was forwarded for it and nothing served to it;
the node's work on a shared request is charged to the call that sent it. Over HTTP a client that
disconnects does not cancel its calls: they are forwarded, answered and charged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.rpc.jsonrpc import INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, UPSTREAM_UNAVAILABLE, JsonRpcError

if TYPE_CHECKING:
    from proxy.values import Outcome

# The proxy's own refusals of the call itself: a node's error is its answer, relayed as its payload
# (values.Outcome.error is the proxy's own), never one of these.
REFUSALS = frozenset({INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS})


def refunded(error: JsonRpcError | None) -> bool:
    """True when a debited call must be given back: no node was reached, or the proxy refused it
    before forwarding once it was debited (an eth_getLogs range found reversed only once its tags
    are resolved against the head: `{"fromBlock": "latest", "toBlock": "0x5"}`)."""
    if error is None or error.reached:
        return False
    return error.code == UPSTREAM_UNAVAILABLE or error.code in REFUSALS or error.local


def free(outcome: Outcome) -> bool:
    """True when a debited call that has its outcome must be given back: `refunded`, or answered by
    the proxy itself with no node asked (an `eth_uninstallFilter` of an id the key does not hold)."""
    return outcome.local or refunded(outcome.error)


def refunded_unanswered(sent: bool) -> bool:
    """True when a debited call whose caller left before its answer (cancelled) must be given back:
    no request made for it was sent to a node (`sent`: forwarded.py's mark)."""
    return not sent
