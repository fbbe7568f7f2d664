"""One request body for one API key, whatever the transport: routing, credits, batches, headers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

from proxy.config import Settings
from proxy.config_files import KeyConfig
from proxy.credits.accounts import OPEN_ACCOUNT, Accounts
from proxy.credits.allow_lists import AllowLists, call_refusal
from proxy.credits.charging import free
from proxy.credits.ledger import Ledger
from proxy.gateway.accounting import REFUSED_STATUSES, CallAccounting
from proxy.gateway.cashier import Cashier
from proxy.gateway.filters import FILTER_METHODS, Filters
from proxy.gateway.hits import Hits, Lookup, MemoryHit
from proxy.gateway.key_work import KeyWork
from proxy.gateway.network_routing import Router
from proxy.gateway.response_size import ResponseBudget
from proxy.gateway.running import AnswerRoom, BodyRun
from proxy.key_context import CALLER
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.prepared import Prepared
from proxy.redis_link import RedisLink
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import INVALID_API_KEY, Body, Call, Invalid, JsonRpcError
from proxy.service import Service
from proxy.values import BYPASS, HIT, Outcome, PaidHit, Reply
from proxy.verifying import NOT_APPLICABLE

PREPARE_SLICE = 64  # calls of a batch validated in one go


def invalid_key_error() -> JsonRpcError:
    return JsonRpcError(
        INVALID_API_KEY,
        "invalid API key: the key (in the path, Authorization: Bearer or X-Api-Key) is missing or unknown",
        http_status=401,
    )


class Gateway:
    def __init__(
        self,
        settings: Settings,
        service: Service,
        ledger: Ledger,
        metrics: Metrics,
        wall_clock: Callable[[], float],
        run_dir: str | None = None,
        link: RedisLink | None = None,
    ) -> None:
        self._settings = settings
        self._service = service
        self._ledger = ledger
        self._metrics = metrics
        self._now = wall_clock
        self.open_mode = settings.open_mode
        self._access_log = settings.access_log
        self._accounts: Accounts | None = None
        self.key_lists: dict[str, AllowLists] = {}  # accounts with an allow-list (allow_lists.py)
        self._restricted: frozenset[str] = frozenset()  # ...whose lists restrict calls: no hot path
        self.forget_keys: list[Callable[[], None]] = []  # what else holds secrets in memory (front.Front.request_heads)
        self.reloaded: list[Callable[[], None]] = []  # told after a reload: open WebSockets check their key (ws.py)
        self._calls = CallAccounting(settings, metrics)
        self.work = KeyWork(settings.max_calls_in_flight_per_key)
        self.router = Router(settings, service.networks)
        self.cashier = Cashier(settings, ledger, metrics, wall_clock)
        self._terms = self.cashier.terms
        self.hits = Hits(
            service,
            ledger,
            self._calls,
            self._terms,
            self.router.default_routes,
            wall_clock,
            open_mode=self.open_mode,
            access_log=self._access_log,
        )
        self.tabs = self.hits.tabs  # secret -> Tab: the endpoint reads it
        self.load_keys(settings.api_keys)
        self.open_hit_headers: Mapping[str, str] = self._reply(None, 200, 0, None, HIT).headers
        # With workers, the filters are a table in the run directory they share; with Redis, counted there too.
        self.filters = Filters(settings, service.prepare, service.execute, run_dir=run_dir, link=link)

    # --- auth ---------------------------------------------------------------------------

    def account(self, api_key: str) -> str | None:
        """The account name an API key opens (None: refused). Everything after this takes the name,
        never the secret: metric labels, log lines, the ledger's keys, headers."""
        known = self.accepted.get(api_key)  # Accounts' memo, read here: a call fewer per request
        if known is not None:
            return known
        if self._accounts is None:
            return OPEN_ACCOUNT
        return self._accounts.account(api_key)

    def load_keys(self, keys: Mapping[str, KeyConfig] | None) -> None:
        """The keys and their allow-lists (at start, and again on SIGHUP: reload.py). Accounts whose
        credit terms are not known yet get them from the cashier on first use."""
        self._accounts = None if keys is None else Accounts({name: k.sha256 for name, k in keys.items()})
        self.accepted: dict[str, str] = {} if self._accounts is None else self._accounts.accepted
        self.key_lists = {name: k.lists for name, k in (keys or {}).items() if k.lists.any}
        self._restricted = frozenset(name for name, lists in self.key_lists.items() if lists.restricts_calls)
        self.hits.keys_changed(self.key_lists, self._restricted)
        for forget in self.forget_keys:
            forget()

    def reload(self, settings: Settings) -> None:
        """Keys, allow-lists and credit terms from new settings (SIGHUP); then each open WebSocket
        checks its key against them (a removed or changed key's sockets are closed)."""
        self._settings = settings
        self.load_keys(settings.api_keys)
        self.cashier.reload(settings)
        for tell in self.reloaded:
            tell()

    # --- what subscriptions ask of the gateway (subscriptions.Charger) ----------------------

    def call_refusal(self, account: str, method: str, params: object) -> JsonRpcError | None:
        """The refusal of the key's allowed_methods or allowed_addresses list for one call, if any."""
        lists = self.key_lists.get(account)
        return None if lists is None else call_refusal(lists, method, params)

    def route_method(self, method: str, network: NetworkRuntime | None) -> NetworkRuntime:
        return self.router.route_method(method, network)

    async def charge_stream(
        self, account: str, label: str, cost: int, now: float | None = None, *, counted: bool = True
    ) -> JsonRpcError | None:
        return await self.cashier.charge_stream(account, label, cost, now, counted=counted)

    def count_stream(self, account: str, label: str, cost: int) -> None:
        self.cashier.count_stream(account, label, cost)

    async def refund_stream(self, account: str, cost: int, charged_at: float) -> None:
        await self.cashier.refund_stream(account, cost, charged_at)

    def now(self) -> float:
        return self.cashier.now()

    # --- one body -----------------------------------------------------------------------

    async def handle(
        self,
        body: bytes | str,
        account: str,
        network: NetworkRuntime | None,
        lookup: Lookup,
        room: AnswerRoom | None = None,
    ) -> Reply:
        """One body the hot path did not answer (`lookup`: what it made of the body, Hits; `room`: its
        connection's count of answers not yet taken, which a batch's calls wait for room in)."""
        started = time.perf_counter()
        request_id = self._calls.request_id()
        if lookup.unpaid is not None:
            return await self._paid_hit(lookup.unpaid, account, request_id, started)
        lists = self.key_lists.get(account) if account in self._restricted else None
        try:
            parsed = lookup.parsed or jsonrpc.parse_body(body, max_batch=self._settings.max_batch_size)
        except JsonRpcError as error:
            self._metrics.child(self._metrics.requests, "none", "invalid", "invalid").inc()
            balance = None if self.open_mode else await self.cashier.remaining(account)
            return self._reply(jsonrpc.encode_error(None, error), error.http_status, 0, balance, None)

        # Its calls wait their turn among the key's own in the making (key_work.py), then are made.
        async with self.work.held(None if self.open_mode else account, len(parsed.entries)):
            return await self._made(parsed, account, network, lists, room, request_id)

    async def _made(
        self,
        parsed: Body,
        account: str,
        network: NetworkRuntime | None,
        lists: AllowLists | None,
        room: AnswerRoom | None,
        request_id: int,
    ) -> Reply:
        slots = await self._prepare(parsed.entries, network, lists)
        prepared = [s for s in slots if isinstance(s, Prepared)]
        cost = 0 if self.open_mode else sum(p.credits for p in prepared)
        remaining: int | None = None
        credit_refusal: Outcome | None = None
        charged_at = self._now()  # a refund goes back to the day of its charge, whatever the clock says then
        charging = bool(cost)
        if cost:
            refusal, remaining = await self.cashier.charge(account, cost, charged_at)
            if refusal is not None:
                # A batch that cannot be paid in full is refused in full, and nothing is forwarded.
                credit_refusal = Outcome.failed(refusal)
                prepared, cost = [], 0

        budget = ResponseBudget(self._settings.max_response_bytes)
        run = BodyRun(self._execute, prepared, account, budget, bool(cost), room)
        # Everything below runs as this key: its upstream slots, its cache admission (caller.py).
        caller = CALLER.set(None if self.open_mode else account)
        try:
            results = await run.outcomes(slots, credit_refusal)
        except asyncio.CancelledError:
            await self._left(account, run, charged_at)
            raise
        finally:
            CALLER.reset(caller)

        refund = cost and run.cut_given_back + sum(
            s.credits for s, o in zip(slots, results, strict=True) if isinstance(s, Prepared) and free(o)
        )
        if refund:
            # No node could be reached: the caller is not charged for our failure (charging.py).
            await self._ledger.refund(account, refund, now=charged_at)
            cost -= refund
            remaining = None if remaining is None else remaining + refund
        keyed = not self.open_mode and cost > 0
        self._calls.count(parsed.entries, slots, results, keyed, request_id)
        if keyed:
            self._terms[account].charged.value += cost
        if remaining is None and not self.open_mode and not charging:
            remaining = await self.cashier.remaining(account)  # a charge's own None: the ledger knows none

        return self._answer(parsed, results, cost, remaining)

    async def _prepare(
        self,
        entries: list[Call | Invalid],
        network: NetworkRuntime | None,
        lists: AllowLists | None,
    ) -> list[Prepared | Outcome]:
        """Each call routed, validated and priced, or the error that answers it; a batch's in slices
        of PREPARE_SLICE, the loop given to others between them (a thousand calls are tens of ms)."""
        slots: list[Prepared | Outcome] = []
        for index, entry in enumerate(entries):
            if index and not index % PREPARE_SLICE:
                await asyncio.sleep(0)
            if isinstance(entry, Invalid):
                slots.append(Outcome.failed(entry.error))
                continue
            try:
                prepared_call = self._service.prepare(entry, self.router.route(entry, network))
                refusal = call_refusal(lists, entry.method, prepared_call.params) if lists is not None else None
                slots.append(prepared_call if refusal is None else Outcome.failed(refusal))
            except JsonRpcError as error:
                slots.append(Outcome.failed(error))
        return slots

    def _answer(self, parsed: Body, results: list[Outcome], cost: int, remaining: int | None) -> Reply:
        """The body's reply: its answers (a batch, one call, or nothing for notifications) and headers."""
        parts = [
            jsonrpc.encode_error_object(e.id, o.payload) if o.is_error else jsonrpc.encode_result(e.id, o.payload)
            for e, o in zip(parsed.entries, results, strict=True)
            if not e.notification
        ]
        if not parts:
            return self._reply(None, 204, cost, remaining, None)
        if parsed.batch:
            refused = [o.error for o in results if o.error is not None and o.error.http_status in REFUSED_STATUSES]
            status = refused[0].http_status if refused and len(refused) == len(results) else 200
            extra = refused[0].headers if refused else {}
            reply = self._reply(jsonrpc.encode_batch(parts), status, cost, remaining, None, extra)
            reply.upstream_seconds = max((o.upstream_seconds or 0.0 for o in results), default=0.0) or None
            return reply
        outcome = results[0]
        status = outcome.error.http_status if outcome.error is not None else 200
        extra = outcome.error.headers if outcome.error is not None else {}
        # Every single answer says it; nothing of the proxy's own (a refusal, an invalid call) is proven.
        extra = {**extra, "X-Verified": outcome.verified or NOT_APPLICABLE}
        reply = self._reply(parts[0], status, cost, remaining, outcome.cache, extra)
        reply.upstream_seconds = outcome.upstream_seconds
        return reply

    async def _left(self, account: str, run: BodyRun, charged_at: float) -> None:
        """The body's task cancelled before its answers were made (its client gone: a WebSocket that
        closed): what its calls sent to no node cost is given back (running.py, charging.py)."""
        left = run.left()
        if left.given_back:
            await self._ledger.refund(account, left.given_back, now=charged_at)
        if left.kept:
            self._terms[account].charged.value += left.kept

    def _execute(self, prepared: Prepared, account: str) -> Awaitable[Outcome]:
        """A node-side filter belongs to the key that made it (filters.py); every other call is the service's."""
        if prepared.call.method in FILTER_METHODS:
            return self.filters.execute(prepared, account)
        return self._service.execute(prepared)

    async def _paid_hit(self, hit: MemoryHit, account: str, request_id: int, started: float) -> Reply:
        credits = hit.found[0].credits
        charge = self.cashier.charge_now(account, credits)
        if charge is None:
            charge = await self.cashier.charge(account, credits)
        return self._paid_reply(hit, account, charge, request_id, started)

    def _paid_reply(
        self,
        hit: MemoryHit,
        account: str,
        charge: tuple[JsonRpcError | None, int | None],
        request_id: int,
        started: float,
    ) -> Reply:
        (rid, method, _), (plan, runtime, _, is_error) = hit
        credits = plan.credits
        refusal, remaining = charge
        if refusal is not None:  # nothing was debited, nothing is served
            self._calls.call(runtime.name, method, Outcome.failed(refusal), 0, request_id)
            return self._reply(
                jsonrpc.encode_error(rid, refusal), refusal.http_status, 0, remaining, BYPASS, refusal.headers
            )
        self._terms[account].charged.value += credits
        plan.hit_cells[is_error].charged.value += credits
        answer = self.hits.answer_of(hit.call, hit.found, request_id, started)
        return self._reply(answer, 200, credits, remaining, HIT, {"X-Verified": plan.verified_as.decode()})

    @staticmethod
    def paid_hit_headers(hit: PaidHit) -> dict[str, str]:
        """A paid memory hit's headers but X-Verified (as _reply writes them; the fast server pre-builds
        the same bytes, with a place for X-Verified after them)."""
        charged, remaining, _, _, _ = hit
        return {"X-Credits-Charged": str(charged), "X-Credits-Remaining": str(remaining), "X-Cache": HIT}

    def _reply(
        self,
        body: bytes | None,
        status: int,
        charged: int,
        remaining: int | None,
        cache: str | None,
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
