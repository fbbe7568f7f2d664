"""A network's upstream WebSocket: subscriptions the proxy relays to the node (newPendingTransactions,
Solana pubsub) and the node's pushed heads.

One connection per network, opened when first needed and shared by every relayed subscription;
each notification is routed by the node's subscription id to its subscribers (a node may give one
id to identical subscriptions on a connection, as Agave does: each is sent every notification, and the
node's is cancelled when the last leaves). When the connection
drops, the subscriptions it carried are opened again on the next upstream WebSocket (the one after
the lost one first), each still delivered under its subscriber's id; a subscriber is told its
subscription ended only when no upstream takes it back within the upstream timeout. aiohttp's
exceptions are mapped to JsonRpcError here; URLs may carry a provider's secret, so errors name an
upstream by its index only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from proxy import via
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import UPSTREAM_UNAVAILABLE, JsonRpcError
from proxy.rpc.large_replies import crowded
from proxy.rpc.methods import SOLANA_PUBSUB, ends_signature
from proxy.upstream.replies import is_response
from proxy.upstream.scrubbing import scrub_reply, secrets_of
from proxy.upstream.standing import ChainIdentity
from proxy.upstream.ws_identity import EVM_IDENTITY_CALLS, identity_problem

log = logging.getLogger("proxy.upstream_ws")
SIGNATURE_NOTE = "signatureNotification"  # a signatureSubscribe's last one ends it (Agave), ends_signature


@dataclass(slots=True, eq=False)  # one subscriber's: compared by identity
class Route:
    on_ok: Callable[[], None]
    on_notify: Callable[[str, Any], None]
    on_lost: Callable[[], None]
    unsubscribe: str
    method: str = ""
    params: Any = None
    upstream_id: Any = None
    confirmed: bool = False  # its subscriber was answered (once: a re-opening is not answered again)
    marked: bool = False  # its subscriber's socket came with rpc-proxy marks (via.py)
    cancelled: bool = False
    waiter: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class RelayedSubscription:
    def __init__(self, socket: UpstreamSocket, route: Route) -> None:
        self._socket = socket
        self._route = route

    async def cancel(self) -> None:
        await self._socket.forget(self._route)


def unavailable(network: str, detail: str) -> JsonRpcError:
    return JsonRpcError(
        UPSTREAM_UNAVAILABLE, f"upstream unavailable: network '{network}' WebSocket ({detail})", http_status=502
    )


def _reply_problem(data: dict[str, Any]) -> str:
    """What makes a node's reply to a subscribe no answer ("" when it is one): a result and an error
    both or neither (JSON-RPC 2.0, replies.py), or a subscription id that is no string or integer (null
    names nothing to unsubscribe, an object is no key its notifications could be routed by)."""
    if not is_response(data):
        return "both a result and an error" if "result" in data else "neither a result nor an error"
    result = data.get("result")
    if "result" in data and (isinstance(result, bool) or not isinstance(result, str | int)):
        return "a subscription id that is no string or integer"
    return ""


class UpstreamSocket:
    def __init__(
        self,
        network: str,
        urls: Sequence[str],
        *,
        timeout: float,
        max_message: int,
        headers: Sequence[tuple[tuple[str, str], ...]] = (),
    ) -> None:
        self.network = network
        # The largest message read from a node (MAX_RESPONSE_BYTES): aiohttp fails a larger one at its
        # frame header and closes the socket (its subscriptions move to the next upstream).
        self._max_message = max_message
        self._urls = tuple(urls)
        self._headers = tuple(headers)  # per URL: NETWORKS_FILE `headers`, sent with the handshake
        # ... and what of them and of its URL an error the node sends back may echo (scrubbed from it).
        self._secrets = [
            secrets_of(url, self._headers[i] if i < len(self._headers) else ()) for i, url in enumerate(urls)
        ]
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()
        self._next_id = 0
        self._pending: dict[int, Route] = {}  # request id -> route waiting for its subscription id
        # Request id -> the route of a subscribe whose caller stopped waiting (timed out, left): granted
        # later, it is cancelled on the node, never held there for nobody.
        self._unanswered: dict[int, Route] = {}
        self._sends: set[asyncio.Task[None]] = set()
        self._proxied = False  # the connection's upstream is an rpc-proxy (its handshake's Server: via.py)
        self._routes = RouteTable()
        self._current = -1  # the index of the upstream the connection is to
        self._resubscribing: asyncio.Task[None] | None = None
        self._closed = False
        self.resubscribed = 0  # subscriptions opened again after a drop (for tests and logs)
        self.identity: Callable[[], ChainIdentity | None] | None = None  # held to each new connection's

    async def subscribe(
        self,
        method: str,
        params: Any,
        *,
        on_ok: Callable[[], None],
        on_notify: Callable[[str, Any], None],
        on_lost: Callable[[], None],
        marked: bool = False,
    ) -> RelayedSubscription:
        """Open a subscription on the node; its errors come back as they are, as JsonRpcError. `marked`:
        its subscriber's socket came through other rpc-proxies (via.py)."""
        ws = await self._connected()
        route = Route(on_ok, on_notify, on_lost, SOLANA_PUBSUB.get(method, "eth_unsubscribe"), method, params)
        route.marked = marked
        try:
            await self._open(ws, route)
        except BaseException:  # its caller left (a closed socket) once the node had granted it, maybe
            route.cancelled = True
            if self._routes.release(route, self._pending.values()):
                self._cancel_later(route.unsubscribe, route.upstream_id)
            raise
        return RelayedSubscription(self, route)

    async def _open(self, ws: aiohttp.ClientWebSocketResponse, route: Route) -> None:
        """Ask the node for the route's subscription and wait for its id."""
        if route.marked and self._proxied:  # a chain of more than two rpc-proxies: a loop, maybe (via.py)
            raise unavailable(
                self.network,
                "the subscription came through another rpc-proxy and this upstream WebSocket is an rpc-proxy "
                "too: a relayed subscription passes at most two rpc-proxies",
            )
        if self._sends:  # unsubscribes decided before it go out first: the node may give it their id
            await asyncio.wait(list(self._sends), timeout=self._timeout)  # (a cancel here does not cancel them)
        rid = self._send_id()
        self._pending[rid] = route
        try:
            await ws.send_str(
                jsonrpc.dumps({"jsonrpc": "2.0", "id": rid, "method": route.method, "params": route.params}).decode()
            )
            async with asyncio.timeout(self._timeout):
                await route.waiter
        except TimeoutError:
            raise JsonRpcError(
                UPSTREAM_UNAVAILABLE,
                f"upstream timeout: network '{self.network}' WebSocket did not answer the subscription",
                http_status=504,
            ) from None
        except (aiohttp.ClientError, ConnectionError):
            raise unavailable(self.network, "send failed") from None
        finally:
            if self._pending.pop(rid, None) is not None:  # no answer yet, and none awaited: cancelled if one comes
                self._unanswered[rid] = route
                self._settle(route)  # an id parked for it is nobody's now

    async def forget(self, route: Route) -> None:
        """Stop routing a subscription and cancel it on the node (its answer is not awaited)."""
        route.cancelled = True  # not opened again, should its connection drop now
        if self._routes.release(route, self._pending.values()):
            await self._unsubscribe(route.unsubscribe, route.upstream_id)

    def _cancel_later(self, method: str, upstream_id: Any) -> None:
        """Cancel a node's subscription soon, on the connection it is on: never on a later one, where
        its id may name another subscription (another node's ids)."""
        send = asyncio.create_task(self._unsubscribe(method, upstream_id, self._ws))
        self._sends.add(send)
        send.add_done_callback(self._sends.discard)

    async def _unsubscribe(
        self, method: str, upstream_id: Any, on: aiohttp.ClientWebSocketResponse | None = None
    ) -> None:
        ws = on or self._ws
        if ws is not None and ws is self._ws and not ws.closed:
            call = {"jsonrpc": "2.0", "id": self._send_id(), "method": method, "params": [upstream_id]}
            with contextlib.suppress(Exception):
                await ws.send_str(jsonrpc.dumps(call).decode())

    async def close(self) -> None:
        """Close for good: the subscriptions it carries are told lost, never opened again."""
        self._closed = True
        if self._resubscribing is not None:
            self._resubscribing.cancel()
        ws = self._ws
        if ws is not None:
            await ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        if self._session is not None:
            await self._session.close()

    # --- the connection ---------------------------------------------------------------------

    def _send_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def _connected(self) -> aiohttp.ClientWebSocketResponse:
        async with self._connecting:
            if self._ws is not None and not self._ws.closed:
                return self._ws
            if self._closed:
                raise unavailable(self.network, "closed: its network was reloaded")
            if self._session is None:
                self._session = aiohttp.ClientSession(trust_env=False)
            failures = []
            count = len(self._urls)
            # After a drop, the next upstream first: the lost one may be down.
            for index in ((self._current + 1 + i) % count for i in range(count)):
                headers = self._headers[index] if index < len(self._headers) else ()
                try:
                    ws = await _dial(self._session, self._urls[index], headers, self._timeout, self._max_message)
                    expected = self.identity() if self.identity is not None else None
                    problem = await identity_problem(ws, expected, self._next_id + 1, self._timeout)
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    log.warning("upstream WebSocket %s#%d failed: %s", self.network, index, type(exc).__name__)
                    failures.append(f"#{index}: {type(exc).__name__}")
                    continue
                if problem is not None:  # another chain's (a devnet's in a mainnet network): never used
                    log.error("upstream WebSocket %s#%d %s: not used", self.network, index, problem)
                    failures.append(f"#{index}: {problem}")
                    await ws.close()
                    continue
                self._next_id += len(EVM_IDENTITY_CALLS)  # ids the probe may have used
                self._ws = ws
                self._current = index
                # aiohttp keeps the handshake's answer private: its Server names an rpc-proxy (via.py).
                self._proxied = ws._response.headers.get(aiohttp.hdrs.SERVER) == via.SERVER
                self._reader = asyncio.create_task(self._read(ws), name=f"upstream-ws-{self.network}")
                return ws
            raise unavailable(self.network, "; ".join(failures) or "no upstream")

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        try:
            async for message in ws:
                if message.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY) or crowded(message.data):
                    continue  # a crowded message is dropped unparsed, as one that is not JSON (large_replies.py)
                try:
                    data = jsonrpc.loads(message.data)
                except jsonrpc.JSONDecodeError:
                    continue
                if isinstance(data, dict):
                    self._dispatch(data)
        finally:
            self._lost()

    def _dispatch(self, data: dict[str, Any]) -> None:
        rid = data.get("id")
        route = self._pending.pop(rid, None) if isinstance(rid, int) else None
        if route is None and isinstance(rid, int) and rid in self._unanswered:
            self._nobodys(data, self._unanswered.pop(rid))
            return
        if route is not None:
            self._answered(route, data)
            self._settle(route)
            return
        params = data.get("params")
        if isinstance(params, dict) and "subscription" in params:
            method = str(data.get("method"))
            # Agave ends a signature subscription with its result: not opened again after a drop.
            by_id = self._routes.by_id
            final = method == SIGNATURE_NOTE and ends_signature(params.get("result"))
            shared = by_id.pop(params["subscription"], None) if final else None
            shared = shared or by_id.get(params["subscription"])
            for target in list(shared or ()):
                target.on_notify(method, params.get("result"))

    def _settle(self, route: Route) -> None:
        for unsubscribe, upstream_id in self._routes.settle(route, self._pending.values()):
            self._cancel_later(unsubscribe, upstream_id)

    def _nobodys(self, data: dict[str, Any], route: Route) -> None:
        """A subscribe granted once its caller had stopped waiting: cancelled on the node (unless a
        subscriber holds the same id, or may be given it: a node that gives identical subscribes one id)."""
        granted = data.get("result")
        if isinstance(granted, str | int) and not isinstance(granted, bool) and granted not in self._routes.by_id:
            route.upstream_id = granted
            if self._routes.orphaned(route, self._pending.values()):
                self._cancel_later(route.unsubscribe, granted)

    def _answered(self, route: Route, data: dict[str, Any]) -> None:
        """A subscribe's answer: its route routed by the node's id, or its caller told the error."""
        if route.waiter.done() or route.cancelled:  # its caller left as the answer came, or while re-opened
            self._nobodys(data, route)
            if not route.waiter.done():
                route.waiter.set_exception(unavailable(self.network, "its subscriber left"))
            return
        problem = _reply_problem(data)
        if problem:  # no answer: the call fails at once, the socket's other subscriptions go on
            route.waiter.set_exception(unavailable(self.network, f"malformed reply: {problem}"))
            return
        error = data.get("error")
        if error is not None:
            scrub_reply(data, self._secrets[self._current])  # a key it echoes reaches no client
            error = data["error"]
            error = error if isinstance(error, dict) else {"code": -32603, "message": str(error)}
            route.waiter.set_exception(
                JsonRpcError(int(error.get("code", -32603)), str(error.get("message", "")), error.get("data"))
            )
            return
        route.upstream_id = data.get("result")
        self._routes.add(route)
        if not route.confirmed:
            route.confirmed = True
            route.on_ok()  # before any notification of it is routed: the reply goes out first
        route.waiter.set_result(route.upstream_id)

    def _lost(self) -> None:
        """The node's socket closed: subscriptions being opened fail; those it carried are opened
        again on the next upstream WebSocket."""
        self._ws = None
        for route in list(self._pending.values()):
            if not route.waiter.done():
                route.waiter.set_exception(unavailable(self.network, "connection closed"))
        self._pending.clear()
        self._unanswered.clear()  # the node drops what the connection held
        routes = self._routes.clear()
        if self._closed:  # closed for good (a reload retired it): each subscriber is told
            for route in routes:
                if not route.cancelled:
                    route.on_lost()
        elif routes:
            log.warning(
                "upstream WebSocket %s#%d closed: opening %d subscription(s) again",
                self.network,
                self._current,
                len(routes),
            )
            self._resubscribing = asyncio.create_task(
                self._resubscribe(routes), name=f"upstream-ws-resubscribe-{self.network}"
            )

    async def _resubscribe(self, routes: list[Route]) -> None:
        """Each route on a new connection, under its subscriber's id; told lost if none takes it in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        left = routes
        while left and loop.time() < deadline:
            try:
                ws = await self._connected()
            except JsonRpcError:
                await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))
                continue
            failed = []
            for route in (r for r in left if not r.cancelled):
                route.waiter = loop.create_future()
                try:
                    await self._open(ws, route)
                    self.resubscribed += 1
                except JsonRpcError:
                    failed.append(route)
            left = failed
        for route in left:
            if not route.cancelled:
                route.on_lost()


async def _dial(
    session: aiohttp.ClientSession, url: str, headers: tuple[tuple[str, str], ...], timeout: float, max_message: int
) -> aiohttp.ClientWebSocketResponse:
    """A WebSocket to an upstream: `headers` (NETWORKS_FILE) and Via with the handshake."""
    return await session.ws_connect(
        url,
        heartbeat=30.0,
        timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=timeout),
        max_msg_size=max_message,
        compress=0,  # no permessage-deflate: a message's size is its bytes on the wire
        # Via: a WebSocket upstream that is this proxy refuses the handshake (via.py).
        headers={**dict(headers), "Via": via.field()},
    )


class RouteTable:
    """The routes of the node's subscription ids. A node may give identical subscribes on a connection
    one id (Agave does): each of its routes is sent every notification, and the node's subscription is
    cancelled when the last leaves, but not while an identical subscribe waits for its answer (the
    node may give it that id again: it is parked until the answer names another)."""

    def __init__(self) -> None:
        self.by_id: dict[Any, list[Route]] = {}
        self._parked: dict[Any, Route] = {}

    def add(self, route: Route) -> None:
        self._parked.pop(route.upstream_id, None)  # the node gave it the id a route left: its own now
        self.by_id.setdefault(route.upstream_id, []).append(route)

    def release(self, route: Route, waiting: Iterable[Route]) -> bool:
        """Take the route off its id; True when the node's subscription is nobody's and can be cancelled."""
        shared = self.by_id.get(route.upstream_id)
        if shared is None or route not in shared:
            return False
        shared.remove(route)
        if shared:
            return False
        del self.by_id[route.upstream_id]
        return self.orphaned(route, waiting)

    def orphaned(self, route: Route, waiting: Iterable[Route]) -> bool:
        """The node's subscription of a route no other holds: True when it can be cancelled now."""
        if any(_alike(other, route) for other in waiting):
            self._parked[route.upstream_id] = route
            return False
        return True

    def settle(self, answered: Route, waiting: Iterable[Route]) -> list[tuple[str, Any]]:
        """An identical subscribe was answered: (unsubscribe method, id) of the parked ids it did not
        take, to cancel on the node once no other identical one waits."""
        if not self._parked or any(_alike(other, answered) for other in waiting):
            return []
        done = [(upstream_id, r) for upstream_id, r in self._parked.items() if _alike(r, answered)]
        for upstream_id, _ in done:
            del self._parked[upstream_id]
        return [(r.unsubscribe, upstream_id) for upstream_id, r in done]

    def clear(self) -> list[Route]:
        """Every route (the node's socket closed: it dropped them all)."""
        routes = [route for shared in self.by_id.values() for route in shared]
        self.by_id, self._parked = {}, {}
        return routes


def _alike(one: Route, other: Route) -> bool:
    """Two subscribes a node may answer with one id: of one method (Agave compares params as it
    parsed them, defaults filled in: `["Q"]` and `["Q", {"commitment": "finalized"}]` are one)."""
    return one.method == other.method
