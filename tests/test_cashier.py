"""The cashier's wait for credit other replicas' leases hold (Verdict.HELD): it is each call's own,
so a key whose credit is held elsewhere never delays another key's calls."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from prometheus_client import CollectorRegistry

from proxy.config import build_settings
from proxy.credits.ledger import Debit, Verdict
from proxy.gateway import cashier as cashier_module
from proxy.gateway.cashier import Cashier
from proxy.metrics import Metrics
from tests.support import eventually


class HeldLedger:
    """Key "held"'s credit is held by other replicas' leases until `given_back`; every other key's is free."""

    def __init__(self) -> None:
        self.given_back = False
        self.asked: Counter[str] = Counter()

    def try_debit(self, api_key: str, amount: int, daily: int, per_second: int | None, now: float) -> Debit | None:
        return None  # no lease here: every debit is asked of the ledger

    async def debit(self, api_key: str, amount: int, *, daily: int, per_second: int | None, now: float) -> Debit:
        self.asked[api_key] += 1
        await asyncio.sleep(0)  # a round trip's turn of the loop
        if api_key == "held" and not self.given_back:
            return Debit(Verdict.HELD, 500)
        return Debit(Verdict.OK, 900)


def _cashier(ledger: HeldLedger) -> Cashier:
    settings = build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", "API_KEYS": "held,free", "DAILY_CREDITS": "1000"})
    return Cashier(settings, ledger, Metrics(CollectorRegistry()), time.time)  # type: ignore[arg-type]


async def test_a_key_whose_credit_is_held_elsewhere_waits_alone_while_other_keys_calls_are_charged() -> None:
    ledger = HeldLedger()
    cashier = _cashier(ledger)
    waiting = asyncio.create_task(cashier.charge("held", 10))

    async def asked_again() -> bool:
        return ledger.asked["held"] >= 2

    await eventually(asked_again, what="the held key's debit to be asked again")
    for _ in range(50):  # each charged at once: no lock is shared with the held key's wait
        assert await cashier.charge("free", 10) == (None, 900)
    assert not waiting.done()  # still waiting (for up to HELD_WAIT): the free key's calls did not queue behind it
    ledger.given_back = True  # the holders gave it back at their exchange
    assert await asyncio.wait_for(waiting, 10) == (None, 900)


async def test_credit_held_elsewhere_past_the_wait_is_the_balances_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cashier_module, "HELD_WAIT", 0.3)
    ledger = HeldLedger()
    refusal, remaining = await asyncio.wait_for(_cashier(ledger).charge("held", 10), 10)
    assert refusal is not None and refusal.http_status == 402 and "daily credit limit reached" in refusal.message
    assert remaining == 500 and ledger.asked["held"] >= 2  # asked again, every HELD_RETRY, until the wait ran out
    # The message never says a balance that could pay was simply "left": it says who holds it.
    assert "500 left today, held by other replicas" in refusal.message


class BrokenLedger(HeldLedger):
    async def debit(self, api_key: str, amount: int, *, daily: int, per_second: int | None, now: float) -> Debit:
        raise RuntimeError("a fault of the ledger's own")


async def test_a_ledger_that_fails_is_a_503_whose_balance_is_not_known() -> None:
    """Rule: a debit the ledger fails to decide is refused with 503 and shows no balance (unknown), never 0."""
    refusal, remaining = await _cashier(BrokenLedger()).charge("held", 10)
    assert refusal is not None and refusal.http_status == 503 and remaining is None
