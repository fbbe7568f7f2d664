"""Which calls are charged: the one place the rule lives.

A call is charged when it was forwarded to a node or served from cache. It is free when it was
refused before forwarding (invalid, unknown method, refused for credits: those are never debited)
or when no node could be reached at all. A call that reached a node and then failed (a timeout, a
garbled reply) is charged: the node may have done the work, as a slow eth_estimateGas does. A
call a node left out of its batch reply was never answered by any node, so it is free like any
other -32002 of a node that could not be reached.

A call that made several upstream calls (a chunked eth_getLogs) is charged once any of them was
answered, even when a later one fails (an HTTP 429 on a few chunks): the work done upstream is not
given away, so failing part-way is no free amplification (chunked_logs.py marks such an error
`reached`). A call cut by the response size limit (MAX_RESPONSE_BYTES), or answered by a node with
an `id: null` error (it could not read the call), was served: charged. One that every node refused
with HTTP 400/413/414/431 was run by none: free, like any other -32002 of unreachable nodes.
"""

from __future__ import annotations

from proxy.rpc.jsonrpc import UPSTREAM_UNAVAILABLE, JsonRpcError


def refunded(error: JsonRpcError | None) -> bool:
    """True when a debited call must be given back: no node was reached."""
    return error is not None and error.code == UPSTREAM_UNAVAILABLE and not error.reached
