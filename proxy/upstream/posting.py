"""The HTTP side of one network's upstream pool: a pool of kept-alive connections per upstream (and
the reconnects it makes), one post and its reply read as JSON under its byte bound, or a Failed
saying why. The HTTP client's exceptions are mapped here and nowhere else; upstreams are named by
index, never by URL (a URL may hold a key)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from proxy import via
from proxy.forwarded import Abandoned
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import INVALID_REQUEST
from proxy.rpc.large_replies import BYTES_PER_CONTAINER, crowded, loads_reply
from proxy.upstream.budget import Slot
from proxy.upstream.http_client import ClientFault, HostPool, TooLarge, Unreadable
from proxy.upstream.replies import REQUEST_FAULT_STATUSES, retry_after
from proxy.upstream.scrubbing import scrub_reply, secrets_of
from proxy.upstream.standing import UpstreamStates

log = logging.getLogger("proxy.upstream")

POOL_LIMIT = 128  # connections open to one upstream; more callers wait for one
POOL_IDLE_TIMEOUT = 30.0  # seconds an idle connection is kept for reuse


class Failed(Exception):
    def __init__(self, kind: str, detail: str, *, unsent: bool = False, wait: float | None = None) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.unsent = unsent  # the connection was refused: the node never got the call
        self.wait = wait  # Retry-After of a rate limit


class _Late:
    """A post cancelled once sent (a hedge's loser, a poll or a query past its time limit): the node
    still works on it, so its budget places are held until its answer is read, or its deadline
    passes (then held as unanswered), not freed at the cancel."""

    __slots__ = ("slot", "waits")

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.waits = False

    def __call__(self, answered: bool) -> None:
        self.slot.budget.release(self.slot, answered=answered)


class UpstreamLinks:
    def __init__(
        self,
        network: str,
        urls: Sequence[str],
        states: UpstreamStates,
        headers: Sequence[tuple[tuple[str, str], ...]],
    ) -> None:
        self.network = network
        self._urls = urls
        self.states = states
        self._headers = headers  # per upstream: NETWORKS_FILE `headers` (secrets: never logged)
        # ... and what of them and of its URL an error it sends back may echo (scrubbed from it).
        self._secrets = [secrets_of(url, headers[i] if i < len(headers) else ()) for i, url in enumerate(urls)]
        self._unreachable = [False] * len(urls)  # its last attempt could not reach it (INFO when back)
        self._inflight = [0] * len(urls)  # calls being posted, per upstream
        self._pools: list[HostPool] | None = None
        self._closed = False  # closed for good: a reload retired it, or the proxy is stopping

    @property
    def posting(self) -> int:
        """Posts in flight to any upstream."""
        return sum(self._inflight)

    def _pool(self, index: int) -> HostPool:
        if self._closed:  # a call that outlived its pool's grace (a reload): never a new connection
            raise Failed("connect", "the pool was closed (its network was reloaded)", unsent=True)
        if self._pools is None:
            headers = self._headers
            self._pools = [
                HostPool(
                    url,
                    limit=POOL_LIMIT,
                    idle_timeout=POOL_IDLE_TIMEOUT,
                    on_connect=lambda alone, i=index: self._connected(i, alone),  # type: ignore[misc]
                    headers=headers[index] if index < len(headers) else (),
                )
                for index, url in enumerate(self._urls)
            ]
        return self._pools[index]

    def _connected(self, index: int, alone: bool) -> None:
        """Connection loss is identity loss: a new connection (a silent keep-alive reconnect included)
        may reach a restarted node, so its identity is checked again (state.py)."""
        if alone:
            # Nothing else was in flight to it when it began to connect, so the pool held an idle
            # connection unless it was closed: this is a reconnect, not the pool growing under load.
            # (Judged after the connect instead, a post that ended meanwhile made a growing pool look
            # like a reconnect, and its answers went unkept until the identity was checked again.)
            self.states.reconnected(index)

    async def close(self) -> None:
        self._closed = True
        if self._pools is not None:
            for pool in self._pools:
                pool.close()
            self._pools = None

    async def post(self, slot: Slot, index: int, body: bytes, timeout: float, max_reply: int) -> Any:
        """The node's reply to `body` (its JSON), within `timeout`, in the budget place `slot`, released
        when it ends: held one window longer if no answer came (timed out, cancelled), as the node may
        still get the request after that; a post cancelled once sent keeps its place until the node's
        answer is read or `timeout` passes (_Late); one never written (Abandoned) gives it back at once.
        Its failures are Failed, and only here is a client fault one."""
        answered = False
        late: _Late | None = _Late(slot)
        self._inflight[index] += 1
        try:
            try:
                pools = self._pools  # built on the first post (_pool), dropped at close
                pool = pools[index] if pools is not None and not self._closed else self._pool(index)
                response = await pool.post(body, timeout, max_reply, late)
            except Abandoned:
                late = None  # never written: its places go back at once, the provider never saw it
                raise
            except TimeoutError:
                raise Failed("timeout", "timed out") from None
            except TooLarge as exc:
                answered = True
                raise Failed(
                    "too_large",
                    f"a reply of {exc.size} bytes" if exc.declared else f"a reply of over {max_reply} bytes",
                ) from None
            except Unreadable as exc:
                answered = True  # refused at its headers: the node sent what it was never asked for
                raise Failed("invalid", str(exc)) from None
            except ClientFault as exc:
                answered = True  # it failed at once: nothing is left on its way to the node
                self._unreachable[index] = True
                # A refused connection proves the node never got the call (a write may go elsewhere).
                raise Failed("connect", str(exc), unsent=exc.unsent) from None
            answered = True
            status = response.status
            if status in REQUEST_FAULT_STATUSES:
                if body[:1] == b"[":
                    # A node that takes no batches may say so with an HTTP error (400, 413): the batch
                    # is refused as by one error object (judging.batch_answers), and its calls go alone.
                    return {
                        "jsonrpc": "2.0",
                        "id": None,
                        "error": {"code": INVALID_REQUEST, "message": f"batch refused: HTTP {status}"},
                    }
                raise Failed("refused", f"HTTP {status}")
            if status == 429:
                raise Failed("rate_limited", "HTTP 429", wait=retry_after(response.headers.get("retry-after")))
            if status == 508:  # Loop Detected (RFC 5842 7.2): the request's Via, not the node's health (via.py)
                raise Failed("loop", via.LOOP_DETECTED)
            if status != 200:
                raise Failed("http", f"HTTP {status}")
            if self._unreachable[index]:
                self._unreachable[index] = False
                log.info("upstream %s#%d is reachable again", self.network, index)  # by index: a URL may hold a key
            data = response.take_body()  # freed once read: the response lives to the end of this step
            if crowded(data):  # refused before orjson builds its objects (large_replies.py)
                raise Failed(
                    "invalid",
                    f"a reply of {len(data)} bytes with over one JSON object or array per {BYTES_PER_CONTAINER}",
                )
            try:
                reply = loads_reply(data)
            except jsonrpc.JSONDecodeError:
                raise Failed("invalid", "reply is not JSON") from None
            if self._secrets[index]:  # an error echoing a key reaches no client, log line or check
                scrub_reply(reply, self._secrets[index])
            return reply
        finally:
            self._inflight[index] -= 1
            if late is None:
                slot.budget.give_back(slot)
            elif not late.waits:  # else released once the node's answer to a cancelled post is read
                late(answered)
