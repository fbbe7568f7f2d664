"""The pure parts of tenant isolation: per-key cache admission, the response size budget and the
per-key upstream slots, without a server."""

from __future__ import annotations

import asyncio

from proxy.cache.admission import Admission
from proxy.cache.policy import Ttls, decide
from proxy.gateway.response_size import ResponseBudget
from proxy.key_context import CALLER
from proxy.rpc.methods import CacheClass
from proxy.upstream.key_budget import KeySlots
from proxy.values import HIT, Outcome

TTLS = Ttls(unfinalized=12, negative=2, largest_accounts=3600, token_balance=0.4, identity=30)


class TestAdmission:
    def test_a_key_stores_up_to_its_bytes_per_window_then_nothing_until_the_next(self) -> None:
        now = [0.0]
        admission = Admission(100, lambda: now[0])
        assert admission.admit("a", 60) and admission.admit("a", 40)
        assert not admission.admit("a", 1)
        assert admission.admit("b", 100)  # another key has its own share
        now[0] = 60.0
        assert admission.admit("a", 100)

    def test_the_proxys_own_stores_and_a_zero_setting_are_not_bounded(self) -> None:
        assert Admission(1, lambda: 0.0).admit(None, 10**9)
        assert Admission(0, lambda: 0.0).admit("a", 10**9)


class TestResponseBudget:
    def test_answers_past_the_limit_become_the_size_error_naming_the_setting(self) -> None:
        budget = ResponseBudget(10)
        first = budget.take(Outcome(b"12345678", False, HIT))
        second = budget.take(Outcome(b"123", False, HIT))
        assert first.payload == b"12345678"
        assert second.is_error and second.error is not None and second.error.code == -32005
        assert "MAX_RESPONSE_BYTES" in second.error.message
        assert budget.take(Outcome(b"12", False, HIT)).payload == b"12"  # what still fits is answered


class TestClientState:
    def test_an_answer_computed_from_overrides_is_never_cached(self) -> None:
        assert not decide(CacheClass.BLOCK, [], None, TTLS, client_state=True).cacheable


class TestKeySlots:
    async def test_a_key_holds_at_most_its_slots_and_another_key_never_waits_behind_it(self) -> None:
        slots = KeySlots(2)
        release = asyncio.Event()
        peak = {"a": 0}

        async def hold(key: str) -> None:
            CALLER.set(key)
            async with slots.held():
                peak[key] = max(peak.get(key, 0), slots.in_use(key))
                if key == "a":
                    await release.wait()

        attackers = [asyncio.create_task(hold("a")) for _ in range(10)]
        await asyncio.sleep(0)
        await asyncio.wait_for(hold("b"), 1.0)  # not queued behind "a"'s ten
        release.set()
        await asyncio.gather(*attackers)
        assert peak["a"] == 2 and slots.in_use("a") == 0


class TestSplice:
    def test_pieces_are_merged_by_bytes_as_the_parsed_merge_would_be(self) -> None:
        import orjson

        from proxy.cache.log_chunks import merge, splice

        parts = [[{"a": 1}], [], [{"b": 2}, {"c": [3]}], []]
        assert orjson.loads(splice([orjson.dumps(p) for p in parts])) == merge(parts)
        assert splice([b"[]", b"[]"]) == b"[]"
