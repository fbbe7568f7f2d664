"""One subscription: its record and its log filter, the call that makes one, its label for credits,
and what feeds it (the network's head feed, an upstream WebSocket relay) and charges it (the gateway).
A connection's subscriptions are subscriptions.py's (Session), their outgoing queue outbox.py's."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.held_bytes import HeldBytes, deep_size
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import METHOD_NOT_FOUND, Call, JsonRpcError, invalid_params
from proxy.rpc.methods import SUBSCRIPTION_METHODS
from proxy.rpc.params import BlockRef, Rules, log_filter
from proxy.streams.fanout import LogBatch

EVM_NOTIFICATION = "eth_subscription"


class Session(Protocol):
    """What a subscription asks of the connection it belongs to (subscriptions.Session)."""

    def push(self, sub: Subscription, result: bytes) -> None: ...

    def end(self, sub: Subscription, error: JsonRpcError) -> None: ...

    def push_logs(self, subs: tuple[Subscription, ...], batch: LogBatch) -> None: ...


@dataclass(frozen=True, slots=True)
class LogFilter:
    """A logs subscription's filter: an address set, topic positions (None matches anything) and
    block bounds (None: latest, no bound)."""

    addresses: frozenset[str] | None = None
    topics: tuple[frozenset[str] | None, ...] = ()
    from_block: int | None = None
    to_block: int | None = None

    @classmethod
    def parse(cls, value: Any, rules: Rules) -> LogFilter:
        """geth's logs criteria (eth/filters SubscribeLogs): address, topics and block bounds."""
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise invalid_params("filter", "expected an object")
        checked = log_filter(value, rules)
        if "blockHash" in checked:
            raise invalid_params("filter.blockHash", "not allowed in a logs subscription")
        addresses = checked.get("address")
        topics = tuple(None if t is None else frozenset(t) for t in checked.get("topics", []))
        first, last = _bounds(checked["fromBlock"], checked["toBlock"])
        return cls(frozenset(addresses) if addresses else None, topics, first, last)

    def matches(self, entry: Mapping[str, Any]) -> bool:
        if self.addresses is not None and str(entry.get("address", "")).lower() not in self.addresses:
            return False
        topics = entry.get("topics") or []
        for position, wanted in enumerate(self.topics):
            if wanted is None:
                continue
            if position >= len(topics) or str(topics[position]).lower() not in wanted:
                return False
        if self.from_block is None and self.to_block is None:
            return True
        return self._within(entry.get("blockNumber"))

    def _within(self, raw: Any) -> bool:
        """geth's filterLogs: fromBlock <= the log's block <= toBlock, for the bounds that are numbers."""
        try:
            number = int(raw, 16)
        except (TypeError, ValueError):
            return False
        return (self.from_block is None or self.from_block <= number) and (
            self.to_block is None or number <= self.to_block
        )


def _bounds(start: BlockRef, end: BlockRef) -> tuple[int | None, int | None]:
    """A stream's block bounds (None: latest, no bound) as geth's SubscribeLogs takes them: latest to
    latest, a number to latest, or numbers with to >= from; pending is refused, and so is the rest."""
    if start.tag == "pending" or end.tag == "pending":
        raise invalid_params("filter", "pending logs are not supported")
    first, last = start.number, end.number  # None for a tag
    if start.tag == "latest" and end.tag == "latest":
        return None, None
    if first is not None and end.tag == "latest":
        return first, None
    if first is not None and last is not None and last >= first:
        return first, last
    raise invalid_params("filter", "invalid from and to block combination")


def subscription_call(data: str | bytes) -> Call | None:
    """The frame as a subscription call if it is one (a single request), else None: the gateway
    serves it. A cheap substring test first, so ordinary calls are not parsed twice; a frame with a
    JSON escape is parsed too (`"slotS\\u0075bscribe"` names slotSubscribe)."""
    if isinstance(data, bytes):
        if b"ubscribe" not in data and b"\\u" not in data:
            return None
    elif "ubscribe" not in data and "\\u" not in data:
        return None
    try:
        body = jsonrpc.parse_body(data, max_batch=1)
    except JsonRpcError:
        return None
    call = body.entries[0] if not body.batch else None
    if isinstance(call, Call) and call.method in SUBSCRIPTION_METHODS:
        return call
    return None


def spawn(tasks: set[asyncio.Task[None]], work: Awaitable[None]) -> None:
    """Run `work` in the background, holding its task until it ends (the loop keeps weak references)."""

    async def run() -> None:
        await work

    task = asyncio.create_task(run())
    tasks.add(task)
    task.add_done_callback(tasks.discard)


def notification_label(kind: str, credits: Mapping[str, int]) -> str:
    """The credits-table row (and metric label) of a notification kind; unknown kinds are `other`."""
    return kind if kind in credits else "other"


# --- the sources a subscription is attached to ---------------------------------------------


class HeadSource(Protocol):
    """A network's shared newHeads/logs feed (head_feed.EvmFeed)."""

    def add(self, sub: Subscription) -> None: ...

    def discard(self, sub: Subscription) -> None: ...

    async def node_head(self) -> int: ...


class Relayed(Protocol):
    """A subscription held open on the network's upstream WebSocket."""

    async def cancel(self) -> None: ...


class Relay(Protocol):
    """The network's upstream WebSocket (upstream_ws.UpstreamSocket)."""

    async def subscribe(
        self,
        method: str,
        params: Any,
        *,
        on_ok: Callable[[], None],
        on_notify: Callable[[str, Any], None],
        on_lost: Callable[[], None],
        marked: bool = False,
    ) -> Relayed: ...


class Charger(Protocol):
    """The gateway's stream charging (Gateway.charge_stream), routing (Gateway.route_method) and the
    key's allow-lists (Gateway.call_refusal)."""

    async def charge_stream(
        self, account: str, label: str, cost: int, now: float | None = None, *, counted: bool = True
    ) -> JsonRpcError | None: ...

    def count_stream(self, account: str, label: str, cost: int) -> None: ...

    async def refund_stream(self, account: str, cost: int, charged_at: float) -> None: ...

    def now(self) -> float: ...

    def call_refusal(self, account: str, method: str, params: Any) -> JsonRpcError | None: ...

    def route_method(self, method: str, network: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class Streams:
    """What subscriptions attach to, per network name: head feeds (EVM) and upstream WebSockets."""

    feeds: Mapping[str, HeadSource]
    relays: Mapping[str, Relay]
    held: HeldBytes  # what this process's subscriptions hold (WS_MAX_SUBSCRIPTION_BYTES)


@dataclass(eq=False, slots=True)
class Subscription:
    id: str | int
    kind: str  # newHeads, logs, newPendingTransactions, ... or a Solana subscribe method
    method: str  # the notification method: eth_subscription, accountNotification, ...
    session: Session
    label: str  # its credits-table row
    match: LogFilter | None = None
    active: bool = False  # set once its subscribe reply is queued: nothing is sent before it
    once: bool = False  # signatureSubscribe: ends with its first notification
    detach: Callable[[], Awaitable[None]] | None = None
    source: HeadSource | None = None  # the feed it is in (a reload may hand it to the network's next feed)
    params: Any = None  # its subscribe call's params: a reload's allow-lists are checked against them
    size: int = 0  # bytes it holds (the call's params, its filter), taken from WS_MAX_SUBSCRIPTION_BYTES
    after: int = -1  # a head subscription: blocks to this one the node had before it are not sent (-1: none)

    @property
    def call_method(self) -> str:
        """The method that made it: eth_subscribe, or the Solana subscribe method (its kind)."""
        return "eth_subscribe" if self.method == EVM_NOTIFICATION else self.kind

    def notify(self, result: bytes) -> None:
        """Queue one notification; `result` is the encoded result, shared by every subscriber."""
        self.session.push(self, result)

    def wants(self, entry: Mapping[str, Any]) -> bool:
        return self.match is None or self.match.matches(entry)


def unrelayable(method: str, kind: str, family: str) -> JsonRpcError:
    setting = "SOLANA_UPSTREAM_WS" if family == "solana" else "EVM_UPSTREAM_WS"
    if family == "evm" and kind not in ("newPendingTransactions", "syncing"):
        return invalid_params(
            "subscription",
            f"unsupported subscription kind {kind!r}: the proxy serves newHeads "
            "and logs itself; other kinds need an upstream WebSocket",
        )
    what = method if family == "solana" else f"eth_subscribe {kind}"
    return JsonRpcError(
        METHOD_NOT_FOUND,
        f"method not found: {what} is relayed to the node's WebSocket, and none is "
        f"configured for this network (set {setting} or a ws:// upstream in NETWORKS_FILE)",
    )


def new_subscription(
    call: Call, params: list[Any], session: Session, credits: Mapping[str, int], solana_id: int | None
) -> Subscription:
    """The subscription a call asks for (`solana_id`: its id, for a Solana pubsub call); its params
    checked: a kind for eth_subscribe, at most a filter for logs, none for newHeads."""
    if solana_id is not None:
        kind = call.method
        sub = Subscription(
            solana_id,
            kind,
            call.method.replace("Subscribe", "Notification"),
            session,
            notification_label(kind, credits),
            once=kind == "signatureSubscribe",
            params=params,
        )
        sub.size = deep_size(sub, params)
        return sub
    if not params or not isinstance(params[0], str):
        raise invalid_params("subscription", "expected a subscription kind such as newHeads or logs")
    kind = params[0]
    sub = Subscription(
        "0x" + secrets.token_hex(16), kind, EVM_NOTIFICATION, session, notification_label(kind, credits), params=params
    )
    if kind == "logs":
        if len(params) > 2:
            raise invalid_params("params", f"expected at most 2 parameters, got {len(params)}")
        sub.match = LogFilter.parse(params[1] if len(params) > 1 else None, Rules())
    elif kind == "newHeads" and len(params) > 1:
        raise invalid_params("params", "newHeads takes no filter")
    sub.size = deep_size(
        sub, params, sub.match, *(() if sub.match is None else (sub.match.addresses, sub.match.topics))
    )
    return sub
