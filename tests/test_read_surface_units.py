"""Pure decisions of the common read surface: cache classes, transactions tied to their block,
answers the trackers hold, credits, params."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.cache import policy as cp
from proxy.chain import from_trackers, slots
from proxy.chain.head_polls import Head, Resolved, TrackerError
from proxy.chain.heads import EvmHeadTracker
from proxy.chain.slots import SLOT_HOLD, SolanaSlotTracker
from proxy.credits.prices import METHOD_CREDITS, SPEC_CREDITS, credits_of
from proxy.metrics import Metrics
from proxy.rpc import params as p
from proxy.rpc.jsonrpc import JsonRpcError
from proxy.rpc.methods import POLICIES, CacheClass
from proxy.upstream.standing import ChainIdentity
from proxy.values import Answer
from tests.support import FakeClock

TTLS = cp.Ttls(unfinalized=12, negative=2, identity=30)
H5, H6, OLD = "0x" + "55" * 32, "0x" + "66" * 32, "0x" + "99" * 32


def head(stale: bool = False) -> Head:
    return Head(
        latest=6,
        safe=4,
        finalized=4,
        latest_hash=H6,
        gas_limit=30_000_000,
        timestamp=0,
        hashes={5: H5, 6: H6},
        numbers={H5: 5, H6: 6},
        stale=stale,
        space="evm@1",
    )


def receipt(number: int, block_hash: str) -> dict[str, Any]:
    return {"blockNumber": hex(number), "blockHash": block_hash, "status": "0x1"}


class TestTransactionsAreTiedToTheirBlock:
    def test_a_final_block_keeps_the_answer_forever(self) -> None:
        assert cp.transaction_ttl(receipt(3, OLD), head(), {}, TTLS) == math.inf

    def test_a_canonical_unfinalized_block_keeps_it_for_the_unfinalized_ttl(self) -> None:
        assert cp.transaction_ttl(receipt(5, H5), head(), {}, TTLS) == 12

    def test_a_block_the_tracker_does_not_hold_is_not_kept(self) -> None:
        assert cp.transaction_ttl(receipt(5, OLD), head(), {}, TTLS) is None  # another fork's block
        assert cp.transaction_ttl(receipt(7, OLD), head(), {}, TTLS) is None  # beyond the head

    def test_not_yet_mined_is_kept_for_the_unmined_ttl_only(self) -> None:
        assert cp.transaction_ttl(None, head(), {}, TTLS) == TTLS.unmined == 0.25
        pending = {"hash": OLD, "blockHash": None, "blockNumber": None}
        assert cp.transaction_ttl(pending, head(), {}, TTLS) == TTLS.unmined

    def test_a_reorged_out_block_is_never_served(self) -> None:
        assert cp.transaction_servable(receipt(5, H5), head(), {})
        assert not cp.transaction_servable(receipt(5, H5), head(), {H5: None})
        assert not cp.transaction_servable(receipt(3, OLD), head(), {OLD: None})
        replaced = replace(head(), hashes={5: OLD, 6: H6}, numbers={OLD: 5, H6: 6})  # height 5, another hash
        assert not cp.transaction_servable(receipt(5, H5), replaced, {})

    def test_a_stale_head_vouches_for_final_blocks_only(self) -> None:
        assert cp.transaction_servable(receipt(3, OLD), head(stale=True), {})
        assert not cp.transaction_servable(receipt(5, H5), head(stale=True), {})


class TestDecisions:
    def test_fees_are_keyed_by_the_head_and_need_a_fresh_one(self) -> None:
        assert cp.decide(CacheClass.HEAD, [], head(), TTLS) == cp.Decision(cp.Mode.TTL, 12, per_head=True)
        assert cp.decide(CacheClass.HEAD, [], head(stale=True), TTLS) is cp.BYPASS
        assert cp.decide(CacheClass.HEAD, [], None, TTLS) is cp.BYPASS

    def test_fee_history_is_immutable_when_final_else_per_head(self) -> None:
        assert cp.decide(CacheClass.FEE_HISTORY, [Resolved(4, None)], head(), TTLS).mode is cp.Mode.IMMUTABLE
        unfinal = cp.decide(CacheClass.FEE_HISTORY, [Resolved(6, H6)], head(), TTLS)
        assert unfinal.per_head and not unfinal.pin_hashes
        assert cp.decide(CacheClass.FEE_HISTORY, [Resolved(7, None)], head(), TTLS) is cp.BYPASS

    def test_solana_blocks_are_immutable_at_finalized_only(self) -> None:
        final = cp.decide(CacheClass.SOLANA_FINAL, [], None, TTLS, [1, {"commitment": "finalized"}])
        assert final.mode is cp.Mode.IMMUTABLE
        assert cp.decide(CacheClass.SOLANA_FINAL, [], None, TTLS, [1, {"commitment": "confirmed"}]) is cp.BYPASS

    def test_min_context_slot_is_never_cached(self) -> None:
        params = ["addr", {"commitment": "finalized", "minContextSlot": 5}]
        assert cp.decide(CacheClass.TOKEN_BALANCE, [], None, TTLS, params) is cp.BYPASS

    def test_identity_data_lives_for_the_identity_ttl(self) -> None:
        assert cp.decide(CacheClass.IDENTITY, [], None, TTLS) == cp.Decision(cp.Mode.TTL, 30)


def evm_tracker() -> EvmHeadTracker:
    return EvmHeadTracker(
        "evm",
        None,
        interval=1,
        finality_depth=64,  # type: ignore[arg-type]
        metrics=Metrics(CollectorRegistry()),
    )


class TestAnswersTheTrackersHold:
    def test_block_number_is_the_head_unless_stale_or_behind_a_shown_block(self) -> None:
        tracker = evm_tracker()
        assert from_trackers.held("eth_blockNumber", [], tracker, 0, 1) is None  # no head yet
        tracker.head = head()
        assert from_trackers.held("eth_blockNumber", [], tracker, 0, 1) == "0x6"
        tracker.head = head(stale=True)
        assert from_trackers.held("eth_blockNumber", [], tracker, 0, 1) is None
        tracker.head = head()
        tracker.shown = 9  # a client has seen block 9: the head must not be shown
        assert from_trackers.held("eth_blockNumber", [], tracker, 0, 1) is None

    def test_chain_id_is_the_network_identity_once_known(self) -> None:
        tracker = evm_tracker()
        assert from_trackers.held("eth_chainId", [], tracker, 0, 1) is None
        tracker.set_identity(ChainIdentity(31337, H5))
        assert from_trackers.held("eth_chainId", [], tracker, 0, 1) == "0x7a69"

    def test_slots_are_held_for_the_max_age_and_never_go_back(self) -> None:
        tracker = SolanaSlotTracker(
            "sol",
            None,
            interval=1,  # type: ignore[arg-type]
            metrics=Metrics(CollectorRegistry()),
        )
        config = [{"commitment": "confirmed"}]
        assert from_trackers.held("getSlot", config, tracker, 100.0, 0.4) is None
        answer = from_trackers.learned("getSlot", config, tracker, Answer.from_response({"result": 50}, 0.0, 0), 100.0)
        assert answer.result == 50
        assert from_trackers.held("getSlot", config, tracker, 100.3, 0.4) == 50
        assert from_trackers.held("getSlot", config, tracker, 100.5, 0.4) is None  # older than the max age
        lagging = Answer.from_response({"result": 40}, 0.0, 0)
        assert from_trackers.learned("getSlot", config, tracker, lagging, 101.0).result == 50
        with_min = [{"commitment": "confirmed", "minContextSlot": 1}]
        assert from_trackers.held("getSlot", with_min, tracker, 100.1, 0.4) is None

    def test_a_slot_shown_in_error_holds_the_slots_up_only_while_seen_again_within_the_hold(self) -> None:
        """Rule: one node's absurd slot (a devnet's in a mainnet pool) never goes back within SLOT_HOLD,
        then is let go: else every later honest answer would be below it, and refused, for ever."""
        tracker = SolanaSlotTracker("sol", None, interval=1, metrics=Metrics(CollectorRegistry()))  # type: ignore[arg-type]
        config = [{"commitment": "finalized"}]
        bogus = Answer.from_response({"result": 4_000_000_000}, 0.0, 0)
        assert from_trackers.learned("getSlot", config, tracker, bogus, 100.0).result == 4_000_000_000
        honest = Answer.from_response({"result": 5_000}, 0.0, 1)
        assert from_trackers.learned("getSlot", config, tracker, honest, 100.0 + SLOT_HOLD - 1).result == 4_000_000_000
        assert tracker.shown("finalized") == 4_000_000_000
        assert from_trackers.learned("getSlot", config, tracker, honest, 100.0 + SLOT_HOLD).result == 5_000
        assert tracker.shown("finalized") == 5_000
        # A value seen again keeps holding: each sight dates it anew.
        at = 200.0
        for step in range(3):
            seen = Answer.from_response({"result": 6_000}, 0.0, 0)
            from_trackers.learned("getSlot", config, tracker, seen, at + step * (SLOT_HOLD - 1))
        lagging = Answer.from_response({"result": 5_990}, 0.0, 1)
        assert from_trackers.learned("getSlot", config, tracker, lagging, at + 3 * (SLOT_HOLD - 1)).result == 6_000


async def test_letting_a_held_slot_go_keeps_a_value_a_forwarded_answer_showed_within_the_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule (docs/caching.md, Solana slots): a poll's slot not reached again within SLOT_HOLD is let go,
    but a value a forwarded answer showed within it still holds: getSlot never steps back from it."""
    clock = FakeClock()
    monkeypatch.setattr(slots, "time", clock)
    tracker = SolanaSlotTracker("sol", None, interval=1, metrics=Metrics(CollectorRegistry()))  # type: ignore[arg-type]
    answering: dict[str, int] = {}

    async def ask(calls: list[Any]) -> list[Answer]:  # one getSlot per commitment
        return [Answer.from_response({"result": answering[params[0]["commitment"]]}, 0.0, 0) for _, params in calls]

    async def checked() -> None:
        return None

    tracker._asker.ask = ask  # type: ignore[method-assign]
    tracker.check_identity = checked  # type: ignore[method-assign]
    answering.update(processed=10_000, confirmed=9_990, finalized=9_960)  # the node in step
    await tracker.poll()
    clock.advance(1)
    answering.update(processed=9_900, confirmed=9_890, finalized=9_860)  # polls reach a node 100 behind now
    with pytest.raises(TrackerError):
        await tracker.poll()
    clock.advance(SLOT_HOLD - 0.5)
    seen = Answer.from_response({"result": 9_990}, 0.0, 1)  # a forwarded getSlot of the node in step
    assert from_trackers.learned("getSlot", [{"commitment": "finalized"}], tracker, seen, clock.now).result == 9_990
    clock.advance(0.6)  # past the poll's hold, within the forwarded sight's
    await tracker.poll()
    assert tracker.slots["finalized"] == 9_860  # the poll's slot let go...
    assert tracker.shown("finalized") == 9_990  # ...but not what a client was shown since
    assert from_trackers.held("getSlot", [{"commitment": "finalized"}], tracker, clock.now, 1.0) == 9_990


class TestCredits:
    def test_the_spec_seven_are_fixed_and_others_come_from_the_table_or_the_default(self) -> None:
        assert credits_of("eth_call", {"eth_call": 1}, 20) == 80
        assert credits_of("eth_getBalance", METHOD_CREDITS, 20) == 80
        assert credits_of("net_peerCount", METHOD_CREDITS, 20) == 20
        for name, cost in SPEC_CREDITS.items():
            assert POLICIES[name].credits == cost

    def test_every_cached_method_has_a_price(self) -> None:
        unpriced = [m for m, policy in POLICIES.items() if policy.credits is None and m not in METHOD_CREDITS]
        assert unpriced == []


class TestParams:
    RULES = p.Rules()

    def test_block_by_number_defaults_full_transactions_to_false(self) -> None:
        ref, full = p.eth_get_block_by_number(["latest"], self.RULES)
        assert isinstance(ref, p.BlockRef) and ref.tag == "latest" and full is False

    def test_fee_history_takes_a_json_number_count_and_canonical_percentiles(self) -> None:
        assert p.eth_fee_history([4, "0x10", [25, 75]], self.RULES)[0::2] == ["0x4", [25.0, 75.0]]
        assert p.eth_fee_history(["0x4", "0x10"], self.RULES)[0] == "0x4"

    def test_proof_keys_are_storage_words_in_order(self) -> None:
        out = p.eth_get_proof(["0x" + "11" * 20, ["0x1", "0x0"], "latest"], self.RULES)
        assert out[1] == ["0x" + "0" * 63 + "1", "0x" + "0" * 64]

    @pytest.mark.parametrize("value", ["0x" + "1" * 40, 12, None])
    def test_a_signature_must_be_64_bytes_of_base58(self, value: Any) -> None:
        with pytest.raises(JsonRpcError):
            p.get_transaction([value], self.RULES)
