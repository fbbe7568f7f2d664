"""One request body for one API key, whatever the transport: routing, credits, batches, headers."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from proxy.calls import BYPASS, HIT, Outcome, Prepared
from proxy.config import Settings
from proxy.credits.accounts import OPEN_ACCOUNT, Accounts
from proxy.credits.charging import refunded
from proxy.credits.ledger import Debit, Ledger, Verdict
from proxy.memo import Memo
from proxy.metrics import HitCells, Metrics
from proxy.network import NetworkRuntime
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import (
    INVALID_API_KEY,
    INVALID_REQUEST,
    LIMIT_EXCEEDED,
    METHOD_NOT_FOUND,
    UPSTREAM_UNAVAILABLE,
    Call,
    Invalid,
    JsonRpcError,
)
from proxy.rpc.methods import family_of, metric_label, refusal
from proxy.service import Service

log = logging.getLogger("proxy.access")
REFUSED_STATUSES = (402, 429, 503)  # refused for credits: exhausted, per-second limit, ledger unreachable

# A memory hit found on the hot path: id, method, network, payload, is_error, credits, metric cells.
_Hit = tuple[int | str, str, NetworkRuntime, bytes, bool, int, HitCells]


_OK = Verdict.OK  # an enum member read through its class costs a hit more than the comparison
PaidHit = tuple[bytes, dict[str, str]]  # a paid memory hit's body and headers


class _KeyTerms(NamedTuple):
    daily: int
    per_second: int | None
    charged: Any  # the key's rpc_proxy_key_credits_charged cell


@dataclass(slots=True)
class Reply:
    body: bytes | None  # None: nothing to send (notifications only)
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


def invalid_key_error() -> JsonRpcError:
    return JsonRpcError(INVALID_API_KEY, "invalid API key: the key in the path is missing or unknown",
                        http_status=401)


class Gateway:
    def __init__(
        self,
        settings: Settings,
        service: Service,
        ledger: Ledger,
        metrics: Metrics,
        wall_clock: Callable[[], float],
    ) -> None:
        self._settings = settings
        self._service = service
        self._ledger = ledger
        self._metrics = metrics
        self._now = wall_clock
        self.open_mode = settings.open_mode
        keys = settings.api_keys
        self._accounts = None if keys is None else Accounts({name: k.sha256 for name, k in keys.items()})
        self._access_log = settings.access_log
        self._by_host = {h: rt for rt in service.networks.values() for h in rt.config.hosts}
        # Host header -> network, and method -> default network, remembered: a deployment sees a
        # handful of each. Bounded, since both are the client's to choose.
        self._host_routes: Memo[str, NetworkRuntime | None] = Memo(1024, self._route_host)
        self._default_routes: Memo[str, NetworkRuntime | None] = Memo(1024, self._default_for)
        self._id_prefix = uuid.uuid4().hex[:8] + "-"  # unique per process; a counter within it
        self._ids = itertools.count(1)
        self.open_hit_headers: Mapping[str, str] = self._reply(None, 200, 0, None, HIT).headers
        # Each configured key's balance, limit and metric cell, found once (keys are authorized first).
        self._terms: Memo[str, _KeyTerms] = Memo(65_536, self._key_terms)

    # --- routing and auth ---------------------------------------------------------------

    def account(self, api_key: str) -> str | None:
        """The account name an API key opens (None: refused). Everything after this takes the name,
        never the secret: metric labels, log lines, the ledger's keys, headers."""
        if self._accounts is None:
            return OPEN_ACCOUNT
        return self._accounts.account(api_key)

    def network_for(self, host: str | None, path_network: str | None) -> NetworkRuntime | None:
        """spec order: the Host header's first label, then a path prefix; None: route by method family."""
        networks = self._service.networks
        if host:
            by_host = self._host_routes[host]
            if by_host is not None:
                return by_host
        if path_network is not None:
            chosen = networks.get(path_network)
            if chosen is None:
                raise JsonRpcError(INVALID_REQUEST, f"unknown network '{path_network}'", http_status=404)
            return chosen
        return None

    def _route_host(self, host: str) -> NetworkRuntime | None:
        """The network a Host header names, if any: a declared host name, or a first label."""
        hostname = host.rsplit(":", 1)[0].lower() if not host.startswith("[") else host
        declared = self._by_host.get(hostname)
        if declared is not None:
            return declared
        first, dot, _ = hostname.partition(".")
        return self._service.networks.get(first) if dot else None

    def _request_id(self) -> int:
        """An id for this request's log lines; 0 when there are none (ACCESS_LOG off, the default),
        decided without asking the logging module, which a cache hit would feel."""
        return next(self._ids) if self._access_log and log.isEnabledFor(logging.INFO) else 0

    def _default_for(self, method: str) -> NetworkRuntime | None:
        name = self._settings.default_network.get(family_of(method))
        return self._service.networks[name] if name is not None else None

    def _route(self, call: Call, network: NetworkRuntime | None) -> NetworkRuntime:
        # The envelope checked the name's form; the allow-list comes before the route memo, so the
        # memo only ever holds names this deployment serves.
        refused = refusal(call.method, self._settings.allowed_methods, self._settings.allowed_namespaces)
        if refused is not None:
            raise JsonRpcError(METHOD_NOT_FOUND, refused)
        runtime = network or self._default_routes[call.method]
        if runtime is None:
            raise JsonRpcError(METHOD_NOT_FOUND, f"method not found: no {family_of(call.method)} network is configured")
        return runtime

    def route_method(self, method: str, network: NetworkRuntime | None) -> NetworkRuntime:
        """The network a method goes to: the one the connection named, else its family's default."""
        return self._route(Call(method, []), network)

    # --- subscription streams (subscriptions.py) ---------------------------------------

    async def charge_stream(self, account: str, label: str, cost: int) -> JsonRpcError | None:
        """Charge one subscription event (a subscribe, a notification) through the ledger; the
        refusal if the key cannot pay. Open mode and free kinds charge nothing."""
        if self.open_mode or cost <= 0:
            return None
        refusal, _remaining = await self._charge(account, cost)
        if refusal is None:
            metrics = self._metrics
            metrics.child(metrics.key_credits_charged, account).inc(cost)
            metrics.child(metrics.credits_charged, label).inc(cost)
        return refusal

    # --- one body -----------------------------------------------------------------------

    def open_hit(self, body: bytes | str, network: NetworkRuntime | None) -> bytes | None:
        """In open mode, the response body for a memory hit, made without awaiting anything (there is
        nothing to charge); its headers are always `open_hit_headers`. None for everything else, which
        `handle(..., memory_checked=True)` then serves."""
        if not self.open_mode:
            return None
        started = time.perf_counter()
        hit = self._cached_single(body, network)
        if hit is None:
            return None
        return self._hit_body(hit, self._request_id(), started)

    def keyed_hit(self, body: bytes | str, account: str, network: NetworkRuntime | None) -> PaidHit | Reply | bool:
        """With API keys, a memory hit the key's lease pays for, made without awaiting anything: its
        body and headers (or the Reply refusing it). Otherwise whether memory was checked (True: no
        hit, so `handle(..., memory_checked=True)`; False: a hit whose debit must ask the ledger)."""
        started = time.perf_counter()
        hit = self._cached_single(body, network)
        if hit is None:
            return True
        terms = self._terms[account]
        credits = hit[5]
        debit = self._ledger.try_debit(account, credits, daily=terms.daily, per_second=terms.per_second,
                                       now=self._now())
        if debit is None:
            return False
        if debit[0] is not _OK:
            charge = self._verdict(debit, credits, terms.per_second)
            return self._paid_reply(hit, account, charge, self._request_id(), started)
        # What _paid_reply does for a paid hit, written out: this is the path every keyed hit takes.
        terms.charged.value += credits
        hit[6].charged.value += credits
        remaining = debit[1]
        return self._hit_body(hit, self._request_id(), started), {
            "X-Credits-Charged": str(credits), "X-Credits-Remaining": str(remaining if remaining > 0 else 0),
            "X-Cache": HIT,
        }

    async def handle(
        self, body: bytes | str, account: str, network: NetworkRuntime | None, *, memory_checked: bool = False,
    ) -> Reply:
        started = time.perf_counter()
        request_id = self._request_id()
        hit = None if memory_checked else self._cached_single(body, network)
        if hit is not None:
            if self.open_mode:  # nothing to charge, so nothing to await
                return self._serve_hit(hit, 0, None, request_id, started)
            return await self._paid_hit(hit, account, request_id, started)
        try:
            parsed = jsonrpc.parse_body(body, max_batch=self._settings.max_batch_size)
        except JsonRpcError as error:
            self._metrics.child(self._metrics.requests, "none", "invalid", "invalid").inc()
            balance = None if self.open_mode else await self.remaining(account)
            return self._reply(jsonrpc.encode_error(None, error), error.http_status, 0, balance, None)

        slots: list[Prepared | Outcome] = []
        for entry in parsed.entries:
            if isinstance(entry, Invalid):
                slots.append(Outcome.failed(entry.error))
                continue
            try:
                slots.append(self._service.prepare(entry, self._route(entry, network)))
            except JsonRpcError as error:
                slots.append(Outcome.failed(error))

        prepared = [s for s in slots if isinstance(s, Prepared)]
        cost = 0 if self.open_mode else sum(p.credits for p in prepared)
        remaining: int | None = None
        credit_refusal: Outcome | None = None
        if cost:
            refusal, remaining = await self._charge(account, cost)
            if refusal is not None:
                # A batch that cannot be paid in full is refused in full, and nothing is forwarded.
                credit_refusal = Outcome.failed(refusal)
                prepared, cost = [], 0

        if len(prepared) == 1:  # the common case: no task per call
            outcomes = iter([await self._service.execute(prepared[0])])
        else:
            outcomes = iter(await asyncio.gather(*(self._service.execute(p) for p in prepared)))
        results: list[Outcome] = [
            s if not isinstance(s, Prepared) else credit_refusal if credit_refusal is not None else next(outcomes)
            for s in slots
        ]

        refund = cost and sum(
            s.credits for s, o in zip(slots, results, strict=True) if isinstance(s, Prepared) and refunded(o.error)
        )
        if refund:
            # No node could be reached: the caller is not charged for our failure (charging.py).
            await self._ledger.refund(account, refund, now=self._now())
            cost -= refund
            remaining = None if remaining is None else remaining + refund
        self._account(account, parsed.entries, slots, results, cost, request_id)
        if remaining is None and not self.open_mode:
            remaining = await self.remaining(account)

        parts = [
            jsonrpc.encode_error_object(e.id, o.payload) if o.is_error else jsonrpc.encode_result(e.id, o.payload)
            for e, o in zip(parsed.entries, results, strict=True) if not e.notification
        ]
        if not parts:
            return self._reply(None, 204, cost, remaining, None)
        if parsed.batch:
            refused = [o.error for o in results if o.error is not None and o.error.http_status in REFUSED_STATUSES]
            status = refused[0].http_status if refused and len(refused) == len(results) else 200
            extra = refused[0].headers if refused else {}
            return self._reply(jsonrpc.encode_batch(parts), status, cost, remaining, None, extra)
        outcome = results[0]
        status = outcome.error.http_status if outcome.error is not None else 200
        extra = outcome.error.headers if outcome.error is not None else {}
        return self._reply(parts[0], status, cost, remaining, outcome.cache, extra)

    def _cached_single(self, body: bytes | str, network: NetworkRuntime | None) -> _Hit | None:
        """The hot path: a plain single call already answered from memory for this head, straight from
        the raw body. None: take the general path, which judges everything this path passes over.

        Only params that passed validation on this network before have a memoized plan, so nothing
        is skipped that could change the answer; credits, metrics and logs are the same.
        """
        plain = jsonrpc.plain_call(body)
        if plain is None:
            return None
        rid, method, params = plain
        # .get, not [..]: a name not routed before (so not yet judged) is not remembered from here.
        runtime = network or self._default_routes.get(method)
        if runtime is None:
            return None
        hit = self._service.memory_hit(method, params, runtime)
        if hit is None:
            return None
        return rid, method, runtime, *hit

    async def _paid_hit(self, hit: _Hit, account: str, request_id: int, started: float) -> Reply:
        charge = self._charge_now(account, hit[5])
        if charge is None:
            charge = await self._charge(account, hit[5])
        return self._paid_reply(hit, account, charge, request_id, started)

    def _paid_reply(
        self, hit: _Hit, account: str, charge: tuple[JsonRpcError | None, int], request_id: int, started: float,
    ) -> Reply:
        rid, method, runtime, _payload, _is_error, credits, _cells = hit
        refusal, remaining = charge
        if refusal is not None:  # nothing was debited, nothing is served
            self._account_call(runtime.name, method, Outcome.failed(refusal), 0, request_id)
            return self._reply(jsonrpc.encode_error(rid, refusal), refusal.http_status, 0, remaining, BYPASS,
                               refusal.headers)
        self._terms[account].charged.value += credits
        hit[6].charged.value += credits
        return self._serve_hit(hit, credits, remaining, request_id, started)

    def _serve_hit(self, hit: _Hit, cost: int, remaining: int | None, request_id: int, started: float) -> Reply:
        return self._reply(self._hit_body(hit, request_id, started), 200, cost, remaining, HIT)

    def _hit_body(self, hit: _Hit, request_id: int, started: float) -> bytes:
        rid, method, runtime, payload, is_error, credits, cells = hit
        # The counts execute() and _account_call() make for a hit, through cells found once.
        cells.record(credits, time.perf_counter() - started)
        if request_id:
            self._log_call(request_id, runtime.name, method, "error" if is_error else "ok", HIT, None)
        return jsonrpc.encode_error_object(rid, payload) if is_error else jsonrpc.encode_result(rid, payload)

    def _key_terms(self, account: str) -> _KeyTerms:
        settings = self._settings
        return _KeyTerms(settings.daily_credits_for(account), settings.credits_per_second_for(account),
                         self._metrics.key_credits_charged.labels(account))

    def _charge_now(self, account: str, cost: int) -> tuple[JsonRpcError | None, int] | None:
        """A charge the ledger decides without a round trip (a lease covers it), or None."""
        terms = self._terms[account]
        debit = self._ledger.try_debit(account, cost, daily=terms.daily, per_second=terms.per_second,
                                       now=self._now())
        return None if debit is None else self._verdict(debit, cost, terms.per_second)

    async def _charge(self, account: str, cost: int) -> tuple[JsonRpcError | None, int]:
        charge = self._charge_now(account, cost)
        if charge is not None:
            return charge
        terms = self._terms[account]
        debit = await self._ledger.debit(account, cost, daily=terms.daily, per_second=terms.per_second,
                                         now=self._now())
        return self._verdict(debit, cost, terms.per_second)

    def _verdict(self, debit: Debit, cost: int, per_second: int | None) -> tuple[JsonRpcError | None, int]:
        if debit.verdict is Verdict.OK:
            return None, debit.remaining
        if debit.verdict is Verdict.UNAVAILABLE:
            self._metrics.credit_rejections.labels("unavailable").inc()
            return JsonRpcError(
                LIMIT_EXCEEDED, "credits unavailable: the credit ledger cannot be reached; retry shortly",
                http_status=503, headers={"Retry-After": "5"},
            ), debit.remaining
        if debit.verdict is Verdict.EXHAUSTED:
            self._metrics.credit_rejections.labels("exhausted").inc()
            return JsonRpcError(
                LIMIT_EXCEEDED, f"daily credit limit reached: {cost} credits needed, {max(debit.remaining, 0)} left "
                "today; balances reset at 00:00 UTC", http_status=402,
            ), debit.remaining
        if debit.verdict is Verdict.RATE_LIMITED:
            self._metrics.credit_rejections.labels("rate").inc()
            return JsonRpcError(
                LIMIT_EXCEEDED, f"rate limit exceeded: more than {per_second} credits per second",
                http_status=429, headers={"Retry-After": "1"},
            ), debit.remaining
        return None, debit.remaining

    def _account(
        self, account: str, entries: list[Call | Invalid], slots: list[Prepared | Outcome],
        results: list[Outcome], cost: int, request_id: int,
    ) -> None:
        keyed = not self.open_mode and cost > 0
        for entry, slot, outcome in zip(entries, slots, results, strict=True):
            if isinstance(slot, Prepared):
                self._account_call(slot.network.name, slot.call.method, outcome, slot.credits if keyed else 0,
                                   request_id)
            else:
                method = entry.method if isinstance(entry, Call) else "invalid"
                self._account_call("none", method, outcome, 0, request_id)
        if keyed:
            self._terms[account].charged.value += cost

    def _account_call(self, network: str, method: str, outcome: Outcome, credits: int, request_id: int) -> None:
        """Count and log one call; `network` "none" marks a call refused before routing."""
        metrics = self._metrics
        label = metric_label(method) if method != "invalid" else method
        if network == "none":
            result = "invalid"
        elif outcome.error is None:
            result = "error" if outcome.is_error else "ok"
        elif outcome.error.http_status in REFUSED_STATUSES:
            result = "refused"
        elif outcome.error.code == UPSTREAM_UNAVAILABLE:
            result = "upstream_error"
        else:
            result = "error"
        if credits and result != "refused" and not refunded(outcome.error):
            metrics.child(metrics.credits_charged, label).inc(credits)
        metrics.child(metrics.requests, network, label, result).inc()
        if request_id:
            cache = outcome.cache if network != "none" else None
            self._log_call(request_id, network, label, result, cache, outcome.upstream_seconds)

    def _log_call(
        self, request_id: int, network: str, label: str, result: str, cache: str | None, upstream: float | None
    ) -> None:
        log.info(
            "call", extra={
                "request_id": f"{self._id_prefix}{request_id:x}", "network": network, "method": label,
                "outcome": result, "cache": cache,
                "upstream_ms": None if upstream is None else round(upstream * 1000, 2),
            },
        )

    def _reply(
        self, body: bytes | None, status: int, charged: int, remaining: int | None, cache: str | None,
        extra: dict[str, str] | None = None,
    ) -> Reply:
        headers = {
            "X-Credits-Charged": str(charged),
            "X-Credits-Remaining": "unlimited" if self.open_mode else str(max(remaining or 0, 0)),
        }
        if remaining is None and not self.open_mode:
            headers["X-Credits-Remaining"] = "unknown"
        if cache is not None:
            headers["X-Cache"] = cache
        if extra:
            headers.update(extra)
        return Reply(body, status, headers)

    async def remaining(self, account: str) -> int | None:
        """Today's remaining balance, for responses that charged nothing."""
        if self.open_mode:
            return None
        daily = self._settings.daily_credits_for(account)
        try:
            used = await self._ledger.used(account, now=self._now())
        except Exception:
            return None
        return daily - used
