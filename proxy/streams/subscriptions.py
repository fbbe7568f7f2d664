"""WebSocket subscriptions: one connection's registry of subscriptions and its outgoing queue.

A `Session` belongs to one WebSocket connection. It answers eth_subscribe/eth_unsubscribe and the
Solana pubsub methods before the gateway sees them, hands each subscription to its source (the
network's shared head feed, `head_feed.py`, or the upstream WebSocket relay, `upstream_ws.py`),
and sends what they deliver through one bounded queue (its `Outbox`, outbox.py): a consumer that
falls behind by more than WS_SEND_BUFFER_BYTES, or by more than WS_MAX_LAG seconds, is disconnected
(1008) rather than allowed to grow the proxy's memory. Every notification is charged before it is
sent; a key that cannot pay gets an error on each of its subscriptions, which are then closed. A
block's logs arrive as one shared batch, expanded by this connection's writer (fanout.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSCloseCode, web

from proxy import via
from proxy.config import Settings
from proxy.credits.accounts import OPEN_ACCOUNT
from proxy.held_bytes import HeldBytes
from proxy.metrics import Metrics
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import INVALID_PARAMS, LIMIT_EXCEEDED, METHOD_NOT_FOUND, Call, JsonRpcError, invalid_params
from proxy.rpc.methods import SOLANA_PUBSUB, SOLANA_PUBSUB_METHODS, ends_signature
from proxy.streams.fanout import LogBatch
from proxy.streams.outbox import Outbox, Outgoing
from proxy.streams.subscription import (
    EVM_NOTIFICATION,
    Charger,
    HeadSource,
    Relay,
    Subscription,
    new_subscription,
    spawn,
    unrelayable,
)

log = logging.getLogger("proxy.subscriptions")

HEAD_KINDS = frozenset({"newHeads", "logs"})  # served from the network's own head feed
ROOM_POLL = 0.01  # seconds between looks at a full socket buffer while a call's answer waits for room
CLOSE_TIMEOUT = 2.0  # seconds a slow consumer's close frame may take before the socket is dropped


def unsubscribed(call: Call) -> Any:
    """The one subscription id an unsubscribe names. A boolean is none: `True == 1` in Python, but
    Agave reads the id as a u64 and geth as a string, so `[true]` is invalid params, not id 1."""
    params = call.params if isinstance(call.params, list) else [call.params]
    if len(params) != 1:
        raise invalid_params("subscription", "expected one subscription id")
    if type(params[0]) is bool:
        raise invalid_params("subscription", "expected a subscription id, not a boolean")
    return params[0]


def _join_feed(sub: Subscription, feed: HeadSource) -> None:
    """A head subscription served from its network's own head feed, active at once."""
    sub.active = True
    sub.source = feed
    feed.add(sub)

    async def leave_feed() -> None:
        if sub.source is not None:
            sub.source.discard(sub)

    sub.detach = leave_feed


def _routed(gateway: Charger, account: str, call: Call, params: list[Any], network: Any) -> Any:
    """The network a subscribe call of `account` goes to, its allow-lists and family checked."""
    refusal = gateway.call_refusal(account, call.method, params)
    if refusal is not None:
        raise refusal
    runtime = gateway.route_method(call.method, network)
    family = runtime.config.family
    if (family == "solana") != (call.method in SOLANA_PUBSUB):
        raise JsonRpcError(
            METHOD_NOT_FOUND, f"method not found: {call.method} is not available on {family} network '{runtime.name}'"
        )
    return runtime


def _too_many_bytes(limit: int) -> JsonRpcError:
    return JsonRpcError(
        LIMIT_EXCEEDED,
        f"subscriptions hold too many bytes: at most {limit} (WS_MAX_SUBSCRIPTION_BYTES), a key's a quarter; "
        "unsubscribe some, or ask for fewer addresses",
    )


@dataclass(eq=False)
class Session:
    """One WebSocket connection's subscriptions and outgoing queue."""

    ws: web.WebSocketResponse
    transport: Any  # asyncio transport of the connection: its write buffer counts toward the bound
    account: str  # the key's account name (never the secret key)
    network: Any  # the network the connection named (path or Host), else None
    gateway: Charger
    feeds: Mapping[str, HeadSource]
    relays: Mapping[str, Relay]
    settings: Settings
    metrics: Metrics
    held: HeldBytes  # bytes the process's subscriptions hold (WS_MAX_SUBSCRIPTION_BYTES)
    subs: dict[str | int, Subscription] = field(default_factory=dict)
    outbox: Outbox = field(init=False)  # what is owed to the client, in order, and its writer
    making: int = 0  # bytes reckoned for calls' answers being made (http/ws.py): a call waits for room
    _next_solana_id: int = 0
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    closed: bool = False
    _held: JsonRpcError | None = None  # the refusal (per-second limit, ledger down) the writer waits out

    def __post_init__(self) -> None:
        credits, lag = self.settings.subscription_credits, self.settings.ws_max_lag
        self.outbox = Outbox(self.ws, self.transport, credits, self._paid, lag, self._check_behind)

    def start(self) -> None:
        self.outbox.start()

    # --- requests ---------------------------------------------------------------------

    async def handle(self, call: Call) -> None:
        """Answer one subscription call; the reply goes through the queue, ahead of its notifications."""
        try:
            if call.method == "eth_unsubscribe" or (
                call.method in SOLANA_PUBSUB_METHODS and call.method not in SOLANA_PUBSUB
            ):
                result = await self._unsubscribe(call)
                self._reply(call, jsonrpc.dumps(result))
            elif not call.notification:  # a notification's subscription has an id no one learns: none made
                await self._subscribe(call)
        except JsonRpcError as error:
            if not call.notification:
                self._queue(Outgoing(jsonrpc.encode_error(call.id, error)))

    def _reply(self, call: Call, result: bytes) -> None:
        if not call.notification:
            self._queue(Outgoing(jsonrpc.encode_result(call.id, result)))

    async def _subscribe(self, call: Call) -> None:
        params = call.params if isinstance(call.params, list) else [call.params]
        if len(self.subs) >= self.settings.ws_max_subscriptions:
            raise JsonRpcError(
                LIMIT_EXCEEDED,
                f"too many subscriptions: at most {self.settings.ws_max_subscriptions} "
                "per connection (WS_MAX_SUBSCRIPTIONS)",
            )
        runtime = _routed(self.gateway, self.account, call, params, self.network)
        family, solana = runtime.config.family, call.method in SOLANA_PUBSUB
        credits = self.settings.subscription_credits
        sub = new_subscription(call, params, self, credits, self._solana_id() if solana else None)
        kind = sub.kind
        relay = self.relays.get(runtime.name)
        feed = self.feeds.get(runtime.name) if kind in HEAD_KINDS else None
        if feed is None and relay is None:
            raise unrelayable(call.method, kind, family)

        if not self.held.take(self.account, sub.size, whole=self.account == OPEN_ACCOUNT):
            raise _too_many_bytes(self.settings.ws_max_subscription_bytes)
        # Only an accepted subscription costs its credits: a node's (a relay's) is counted once it
        # accepts, and given back if it refuses or the socket went meanwhile.
        cost, charged_at, registered = credits.get("subscribe", 0), self.gateway.now(), False
        try:
            refusal = await self.gateway.charge_stream(self.account, call.method, cost, charged_at, counted=bool(feed))
            if refusal is not None:
                raise refusal
            if self.closed:  # the socket went while this was charged: nothing to attach
                if feed is None:
                    await self.gateway.refund_stream(self.account, cost, charged_at)
                return
            self._register(sub)
            registered = True
        finally:
            if not registered:  # else _forget gives its bytes back
                self.held.give(self.account, sub.size)
        if feed is not None:  # sent the blocks after the node's head (asked once it is accepted)
            sub.after = await feed.node_head()
            if self.closed:  # the socket went meanwhile: its close forgot the subscription
                return
            self._reply(call, jsonrpc.dumps(sub.id))
            _join_feed(sub, feed)
            return
        assert relay is not None

        def on_ok() -> None:  # called by the relay's reader before any notification of it
            self._reply(call, jsonrpc.dumps(sub.id))
            sub.active = True
            self.gateway.count_stream(self.account, call.method, cost)

        def on_notify(_method: str, result: Any) -> None:
            sub.notify(jsonrpc.dumps(result))
            if sub.once and ends_signature(result):
                self._forget(sub)

        def on_lost() -> None:
            ended = f"upstream WebSocket of network '{runtime.name}' closed: subscription ended; subscribe again"
            self.end(sub, JsonRpcError(-32002, ended))

        try:
            sent = params if solana else call.params
            marked = via.RECEIVED.get() is not None  # the client's socket came through other rpc-proxies (via.py)
            relayed = await relay.subscribe(
                call.method, sent, on_ok=on_ok, on_notify=on_notify, on_lost=on_lost, marked=marked
            )
        except BaseException as error:
            self._forget(sub)
            if isinstance(error, JsonRpcError) and not sub.active:
                await self.gateway.refund_stream(self.account, cost, charged_at)  # never accepted: free
            raise
        sub.detach = relayed.cancel
        if self.closed or sub.id not in self.subs:
            await relayed.cancel()

    async def _unsubscribe(self, call: Call) -> bool:
        target = unsubscribed(call)
        sub = self.subs.get(target) if isinstance(target, (str, int)) else None
        solana = call.method != "eth_unsubscribe"
        if sub is None or (sub.method == EVM_NOTIFICATION) == solana:
            if solana:  # Solana's answer to an unknown id
                raise JsonRpcError(INVALID_PARAMS, "Invalid subscription id.")
            return False  # geth's answer to an unknown id
        await self._drop(sub)
        return True

    def _solana_id(self) -> int:
        self._next_solana_id += 1
        return self._next_solana_id

    # --- delivery ---------------------------------------------------------------------

    def push(self, sub: Subscription, result: bytes) -> None:
        if not sub.active or self.closed:
            return
        cost = self.settings.subscription_credits.get(sub.label, 0)
        self._queue(Outgoing(jsonrpc.encode_notification(sub.method, sub.id, result), sub, cost))

    def push_logs(self, subs: tuple[Subscription, ...], batch: LogBatch) -> None:
        """Queue a block's logs for this connection's `subs`: matched and sent by the writer. A block
        without logs queues nothing but still finds a consumer that fell too far behind."""
        if self.closed:
            return
        if batch.entries:
            self._queue(Outgoing(b"", logs=batch, subs=subs))
        else:
            self._check_behind(time.monotonic())

    def _queue(self, item: Outgoing) -> None:
        if self.closed:
            return
        now = time.monotonic()
        self.outbox.put(item, now)
        self._check_behind(now)

    async def room(self, more: int | None = None) -> bool:
        """Whether a call's answer may be sent (or, `more`: its estimate, made, with `making`): once it
        fits in WS_SEND_BUFFER_BYTES with what waits for the client (the queue and the socket's buffer),
        or nothing waits, within WS_MAX_LAG: a client that reads none of its answers for as long is
        closed (1008) as a slow consumer; one that reads, however large its answers, is served."""
        limit = self.settings.ws_send_buffer_bytes
        self.outbox.watch()  # a send that blocks for WS_MAX_LAG closes it too (_check_behind)

        def short() -> bool:
            held = self.outbox.owed() + (0 if more is None else self.making)
            return held > limit if more is None else held > 0 and held + more > limit

        if not short() and not self.closed:
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.ws_max_lag
        behind = self.outbox.owed()
        while not self.closed and short():
            now_behind = self.outbox.owed()
            if more is not None and (now_behind < behind or not now_behind):  # it takes bytes: not lag
                deadline = loop.time() + self.settings.ws_max_lag
            behind = now_behind
            if loop.time() >= deadline:
                self._overflow(f"fell behind by more than {limit} bytes for {self.settings.ws_max_lag:g}s")
                return False
            await asyncio.sleep(ROOM_POLL)
        return not self.closed

    def _check_behind(self, now: float, stalled: bool = False) -> None:
        """Also the outbox's timer's, only `stalled`: its socket took no byte for WS_MAX_LAG (Outbox.watch)."""
        settings = self.settings
        over_bytes = self.outbox.owed() > settings.ws_send_buffer_bytes and not stalled
        if self.closed or not (stalled or over_bytes or now - self.outbox.oldest > settings.ws_max_lag):
            return
        bound = f"{settings.ws_send_buffer_bytes} bytes" if over_bytes else f"{settings.ws_max_lag:g}s (WS_MAX_LAG)"
        if stalled or self._held is None:
            self._overflow(f"took nothing for {bound}" if stalled else f"fell behind by more than {bound}")
        elif self.subs:  # held back by the key's own limit, not by its client: its subscriptions end
            error = JsonRpcError(
                self._held.code, f"{self._held.message}: notifications held past {bound}; subscription ended"
            )
            log.warning("ending %d subscriptions of a WebSocket: %s", len(self.subs), error.message)
            for sub in list(self.subs.values()):
                self.end(sub, error)  # the connection stays

    def _overflow(self, why: str) -> None:
        self.closed = True
        spawn(self._tasks, self._evict(why))

    async def _evict(self, why: str) -> None:
        """A consumer that does not read: drop what waits for it and close (1008)."""
        log.warning("closing a WebSocket whose consumer %s", why)
        self.metrics.slow_consumers.inc()
        self.outbox.clear()
        await self.close()
        message = f"slow consumer: {why}".encode()[:120]
        closing = asyncio.ensure_future(self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=message))
        closing.add_done_callback(lambda done: done.cancelled() or done.exception())
        await asyncio.wait({closing}, timeout=CLOSE_TIMEOUT)  # not cancelled: aiohttp closes, not aborts
        if self.transport is not None and any(self.outbox.outstanding()):
            # Bytes still owed (its buffer, the kernel's): closed, not aborted, they wait for a reader.
            self.transport.abort()

    async def _paid(self, sub: Subscription, cost: int) -> bool:
        """Charge one notification; a key out of credits ends every subscription of this connection."""
        try:
            while True:
                if not sub.active and not sub.once:
                    return False  # unsubscribed (or ended) while its notification waited
                refusal = await self.gateway.charge_stream(self.account, sub.label, cost)
                if refusal is None:
                    return True
                if refusal.http_status not in (429, 503):
                    break
                self._held = refusal  # deliver later, within the send bounds (past them: _check_behind)
                await asyncio.sleep(float(refusal.headers.get("Retry-After", "1")))
        finally:
            self._held = None
        for other in list(self.subs.values()):
            self.end(other, refusal)
        return False

    def end(self, sub: Subscription, error: JsonRpcError) -> None:
        """Tell the client a subscription is over, with why, and let go of it."""
        if not self._forget(sub):
            return
        self.outbox.discard(sub)
        if not self.closed:  # no reckoning of the lag: _check_behind ends several at once
            self.outbox.put(
                Outgoing(jsonrpc.encode_notification(sub.method, sub.id, error.encode(), error=True)), time.monotonic()
            )
        if sub.detach is not None:
            spawn(self._tasks, sub.detach())

    def recheck(self) -> None:
        """After a reload: each subscription the key's new allow-lists refuse is ended, with why."""
        for sub in list(self.subs.values()):
            refusal = self.gateway.call_refusal(self.account, sub.call_method, sub.params)
            if refusal is not None:
                self.end(sub, refusal)

    async def revoke(self, error: JsonRpcError) -> None:
        """The key is gone (a reload removed it or changed its secret): every subscription ends with
        `error`, and those notices are written (within CLOSE_TIMEOUT) before the socket closes."""
        for sub in list(self.subs.values()):
            self.end(sub, error)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_TIMEOUT
        while self.outbox.busy and not self.ws.closed and loop.time() < deadline:
            await asyncio.sleep(ROOM_POLL)
        await self.close()

    def _register(self, sub: Subscription) -> None:
        self.subs[sub.id] = sub
        self.metrics.child(self.metrics.subscriptions, sub.label).inc()

    def _forget(self, sub: Subscription) -> bool:
        """Stop counting and delivering a subscription; False if it was already gone."""
        if self.subs.pop(sub.id, None) is None:
            return False
        self.held.give(self.account, sub.size)
        sub.active = False
        self.metrics.child(self.metrics.subscriptions, sub.label).dec()
        return True

    async def _drop(self, sub: Subscription) -> None:
        self._forget(sub)
        if sub.detach is not None:
            await sub.detach()

    async def close(self) -> None:
        """The socket is gone (or going): end its subscriptions and stop writing."""
        self.closed = True
        for sub in list(self.subs.values()):
            with contextlib.suppress(Exception):
                await self._drop(sub)
        await self.outbox.stop()
