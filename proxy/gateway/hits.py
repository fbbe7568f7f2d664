"""The hot path: a plain single call answered from the memory tier, and paid for, without awaiting
anything, in open mode, for a key's first hit and through a key's tab. What it cannot answer goes to
the general path (Gateway.handle) as its Lookup, so that no body is looked up or parsed twice."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import Any, NamedTuple

from orjson import dumps

from proxy.credits.allow_lists import AllowLists
from proxy.credits.key_lease import KeyLease
from proxy.credits.ledger import Ledger
from proxy.gateway.accounting import CallAccounting
from proxy.memo import Memo
from proxy.network import NetworkRuntime
from proxy.rpc.jsonrpc import ID_HEAD, RESULT_KEYS, Body, plain_body, plain_call
from proxy.service import MemoryFind, Service
from proxy.values import HIT, PaidHit, new_record


class MemoryHit(NamedTuple):
    """A memory hit whose charge awaits the ledger (Lookup.unpaid): its call and what memory held."""

    call: tuple[int | str, str, Any]  # (id, method, params), as jsonrpc.plain_call made it
    found: MemoryFind


class Lookup(NamedTuple):
    """What the hot path made of one body for one key that it did not answer (a hit answered and paid
    for is its PaidHit, sent as it is); at most one field is set. Made with new_record (values.py),
    in field order."""

    unpaid: MemoryHit | None = None  # a hit whose charge awaits the ledger (no lease, a per-second limit)
    parsed: Body | None = None  # a plain single call the memory tier does not hold, as parsed here


# Not looked up: a body that is no plain single call (parse_body judges it), or a key whose lists
# restrict its calls (each call is checked against them on the general path).
NOT_LOOKED = Lookup()


@dataclass(slots=True)
class Tab:
    """What a keyed memory hit needs of its key, found once per secret (Hits.tabs): an accepted key
    with no allow-list and no per-second limit, its daily balance and metric cell, and the lease of
    its credits it spends from directly (KeyLease.spend). Forgotten with every reload of keys and terms."""

    account: str
    daily: int
    charged: Any  # the key's rpc_proxy_key_credits_charged cell
    lease: KeyLease


NO_LEASE = KeyLease("", "")  # a tab's lease until the ledger has one: it spends nothing (no day is its own)


class Hits:
    def __init__(
        self,
        service: Service,
        ledger: Ledger,
        calls: CallAccounting,
        terms: Mapping[str, Any],
        default_routes: Mapping[str, NetworkRuntime | None],
        wall_clock: Callable[[], float],
        *,
        open_mode: bool,
        access_log: bool,
    ) -> None:
        self._service = service
        self._ledger = ledger
        self._calls = calls
        self._terms = terms  # the cashier's, read on the hot path
        self._default_routes = default_routes
        self._now = wall_clock
        self._open_mode = open_mode
        self._access_log = access_log
        self.tabs: Memo[str, Tab] = Memo(65_536)  # secret -> Tab (never replaced: the endpoint reads it)
        self.key_lists: Mapping[str, AllowLists] = {}
        self.restricted: frozenset[str] = frozenset()  # accounts whose lists restrict calls: no hot path

    def keys_changed(self, key_lists: Mapping[str, AllowLists], restricted: frozenset[str]) -> None:
        self.key_lists, self.restricted = key_lists, restricted
        self.tabs.clear()  # a tab holds what these keys and their terms were

    def open(self, body: bytes | str, network: NetworkRuntime | None) -> PaidHit | Lookup:
        """Open mode: nothing to charge, so a hit is always answered here (0 credits, 0 remaining)."""
        started = perf_counter()
        plain = plain_call(body)  # the lookup of _found, written out: a call fewer on every hit
        if plain is None:
            return NOT_LOOKED
        found = self._service.memory_hit(plain, network, self._default_routes)
        if found is None:
            return new_record(Lookup, (None, plain_body(body, plain)))
        plan, _, payload, is_error = found
        if self._access_log:
            answer = self.answer_of(plain, found, self._calls.request_id(), started)
        else:  # answer_of with no log line, written out: a call fewer on every hit
            plan.hit_cells[is_error].record(plan.credits, perf_counter() - started)
            answer = b"".join((ID_HEAD, dumps(plain[0]), RESULT_KEYS[is_error], payload, b"}"))
        return 0, 0, plan.verified_as, len(answer), answer

    def keyed(
        self, body: bytes | str, account: str, network: NetworkRuntime | None, secret: str | None = None
    ) -> PaidHit | Lookup:
        """A key's hit, paid from its lease where it can be. `secret`: the key the account was found
        by; it keeps the tab made here unless the account has allow-lists."""
        if account in self.restricted:
            return NOT_LOOKED  # its calls are checked against its lists on the general path
        terms = self._terms[account]
        if terms.per_second is not None:
            return self._found(body, network)  # every debit of such a key asks the ledger's per-second window
        tab = Tab(account, terms.daily, terms.charged, self._ledger.purse(account, self._now()) or NO_LEASE)
        if secret is not None and account not in self.key_lists:
            self.tabs[secret] = tab
        return self.by_tab(body, tab, network)

    def by_tab(self, body: bytes | str, tab: Tab, network: NetworkRuntime | None) -> PaidHit | Lookup:
        """keyed() with the key's checks made (its tab): the lease spent from directly down to its
        low-water mark; past it (a top-up due, another day, no lease) the ledger decides."""
        started = perf_counter()
        plain = plain_call(body)  # the lookup of _found, written out: a call fewer on every keyed hit
        if plain is None:
            return NOT_LOOKED
        found = self._service.memory_hit(plain, network, self._default_routes)
        if found is None:
            return new_record(Lookup, (None, plain_body(body, plain)))
        plan, _, payload, is_error = found
        credits, now = plan.credits, self._now()
        remaining = tab.lease.spend(credits, tab.daily, now)
        if remaining is None:  # the ledger decides at the same instant
            remaining = self._ledger.spend(tab.account, credits, tab.daily, now)
            if remaining is None:
                return new_record(Lookup, (new_record(MemoryHit, (plain, found)), None))
            tab.lease = self._ledger.purse(tab.account, now) or NO_LEASE  # today's, once the ledger has it
        # What Gateway's paid reply does for a paid hit, written out: this is the path every keyed hit takes.
        tab.charged.value += credits
        cells = plan.hit_cells[is_error]
        cells.charged.value += credits
        if self._access_log:
            answer = self.answer_of(plain, found, self._calls.request_id(), started)
        else:  # answer_of with no log line, written out: a call fewer on every keyed hit
            cells.record(credits, perf_counter() - started)
            answer = b"".join((ID_HEAD, dumps(plain[0]), RESULT_KEYS[is_error], payload, b"}"))
        return credits, remaining if remaining > 0 else 0, plan.verified_as, len(answer), answer

    def _found(self, body: bytes | str, network: NetworkRuntime | None) -> Lookup:
        """The memory tier's hit, not yet paid for (`unpaid`), or the parsed miss, or NOT_LOOKED."""
        plain = plain_call(body)
        if plain is None:
            return NOT_LOOKED
        found = self._service.memory_hit(plain, network, self._default_routes)
        if found is None:
            return new_record(Lookup, (None, plain_body(body, plain)))
        return new_record(Lookup, (new_record(MemoryHit, (plain, found)), None))

    def answer_of(self, call: tuple[int | str, str, Any], found: MemoryFind, request_id: int, started: float) -> bytes:
        """A hit's encoded answer, counted (the counts execute() and the accounting make for a call)."""
        rid, method, _ = call
        plan, runtime, payload, is_error = found
        plan.hit_cells[is_error].record(plan.credits, perf_counter() - started)
        if request_id:
            self._calls.log_call(request_id, runtime.name, method, "error" if is_error else "ok", HIT, None)
        return b"".join((ID_HEAD, dumps(rid), RESULT_KEYS[is_error], payload, b"}"))
