"""Charging a key for its calls: its daily balance and per-second limit, the ledger's verdict as the
error a client sees (402 exhausted, 429 rate limited, 503 ledger unreachable), and its remaining balance."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from proxy.config import Settings
from proxy.credits.ledger import HELD_RETRY, HELD_WAIT, Debit, Ledger, Verdict
from proxy.memo import Memo
from proxy.metrics import Metrics
from proxy.rpc.jsonrpc import LIMIT_EXCEEDED, JsonRpcError

log = logging.getLogger("proxy.credits")


class KeyTerms(NamedTuple):
    daily: int
    per_second: int | None
    charged: Any  # the key's rpc_proxy_key_credits_charged cell


class Cashier:
    def __init__(self, settings: Settings, ledger: Ledger, metrics: Metrics, wall_clock: Callable[[], float]) -> None:
        self._settings = settings
        self._ledger = ledger
        self._metrics = metrics
        self._now = wall_clock
        self.open_mode = settings.open_mode
        # Each configured key's balance, limit and metric cell, found once (keys are authorized first).
        self.terms: Memo[str, KeyTerms] = Memo(65_536, self._key_terms)

    def reload(self, settings: Settings) -> None:
        """New keys (SIGHUP): each key's terms are found again from them on first use (a lease
        granted under another balance is not spent: leases.LeasedLedger.debit)."""
        self._settings = settings
        self.terms.clear()

    async def charge_stream(
        self, account: str, label: str, cost: int, now: float | None = None, *, counted: bool = True
    ) -> JsonRpcError | None:
        """Charge one subscription event (a subscribe, a notification) through the ledger; the
        refusal if the key cannot pay. Open mode and free kinds charge nothing. `counted`: False for
        a subscribe the node has yet to accept (count_stream once it does, refund_stream if not)."""
        if self.open_mode or cost <= 0:
            return None
        refusal, _remaining = await self.charge(account, cost, now)
        if refusal is None and counted:
            self.count_stream(account, label, cost)
        return refusal

    def count_stream(self, account: str, label: str, cost: int) -> None:
        if self.open_mode or cost <= 0:
            return
        metrics = self._metrics
        metrics.child(metrics.key_credits_charged, account).inc(cost)
        metrics.child(metrics.credits_charged, label).inc(cost)

    async def refund_stream(self, account: str, cost: int, charged_at: float) -> None:
        """A subscribe charged (uncounted) that the node refused: given back, to the day of its charge."""
        if not self.open_mode and cost > 0:
            await self._ledger.refund(account, cost, now=charged_at)

    def now(self) -> float:
        return self._now()

    def _key_terms(self, account: str) -> KeyTerms:
        settings = self._settings
        return KeyTerms(
            settings.daily_credits_for(account),
            settings.credits_per_second_for(account),
            self._metrics.key_credits_charged.labels(account),
        )

    def charge_now(
        self, account: str, cost: int, now: float | None = None
    ) -> tuple[JsonRpcError | None, int | None] | None:
        """A charge the ledger decides without a round trip (a lease covers it), or None."""
        terms = self.terms[account]
        debit = self._ledger.try_debit(
            account, cost, daily=terms.daily, per_second=terms.per_second, now=self._now() if now is None else now
        )
        return None if debit is None else self.verdict(debit, cost, terms.per_second)

    async def charge(self, account: str, cost: int, now: float | None = None) -> tuple[JsonRpcError | None, int | None]:
        """`now`: the charge's time, which a refund of it must name too (its UTC day); the balance left
        is None when the replica does not know it (the ledger unreachable: leases.outage_shown)."""
        now = self._now() if now is None else now
        charge = self.charge_now(account, cost, now)
        if charge is not None:
            return charge
        held_until = None
        while True:
            terms = self.terms[account]  # asked again: a reload's terms meanwhile
            try:
                debit = await self._ledger.debit(account, cost, daily=terms.daily, per_second=terms.per_second, now=now)
            except Exception:  # no fault of the ledger becomes an HTTP 500: the call is refused, not charged
                log.exception("credits: the ledger failed to decide a debit; the call is refused with 503")
                debit = Debit(Verdict.UNAVAILABLE, None)  # the balance not known here either
            if debit.verdict is not Verdict.HELD:
                break
            # The balance can pay, other replicas' leases hold it: asked again while they give it back.
            held_until = held_until or time.monotonic() + HELD_WAIT
            if time.monotonic() >= held_until:
                debit = Debit(Verdict.EXHAUSTED, debit.remaining)  # they keep spending it: the balance's end
                break
            await asyncio.sleep(HELD_RETRY)
        return self.verdict(debit, cost, terms.per_second)

    def verdict(self, debit: Debit, cost: int, per_second: int | None) -> tuple[JsonRpcError | None, int | None]:
        if debit.verdict is Verdict.OK:
            return None, debit.remaining
        if debit.verdict is Verdict.UNAVAILABLE:
            self._metrics.credit_rejections.labels("unavailable").inc()
            return JsonRpcError(
                LIMIT_EXCEEDED,
                "credits unavailable: the credit ledger cannot be reached, or the key's entry in it is being "
                "rebuilt; retry shortly",
                http_status=503,
                headers={"Retry-After": "5"},
            ), debit.remaining
        if debit.verdict is Verdict.EXHAUSTED:
            self._metrics.credit_rejections.labels("exhausted").inc()
            if debit.remaining is None:
                left = "the balance left unknown while the credit ledger cannot be reached"
            elif debit.remaining >= cost:  # the balance could pay: other replicas' leases kept it (HELD_WAIT)
                left = f"{debit.remaining} left today, held by other replicas of the proxy"
            else:
                left = f"{max(debit.remaining, 0)} left today"
            return JsonRpcError(
                LIMIT_EXCEEDED,
                f"daily credit limit reached: {cost} credits needed, {left}; balances reset at 00:00 UTC",
                http_status=402,
            ), debit.remaining
        if debit.verdict is Verdict.RATE_LIMITED:
            self._metrics.credit_rejections.labels("rate").inc()
            return JsonRpcError(
                LIMIT_EXCEEDED,
                f"rate limit exceeded: more than {per_second} credits per second",
                http_status=429,
                headers={"Retry-After": "1"},
            ), debit.remaining
        return None, debit.remaining

    async def remaining(self, account: str) -> int | None:
        """Today's remaining balance, for responses that charged nothing; None: not known here."""
        if self.open_mode:
            return None
        daily = self._settings.daily_credits_for(account)
        try:
            used = await self._ledger.used(account, now=self._now())
        except Exception:
            return None
        return None if used is None else daily - used
