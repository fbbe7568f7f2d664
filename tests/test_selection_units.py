"""Pure parts of upstream selection: policies, scores, budgets, rate-limit answers, NETWORKS_FILE."""

from __future__ import annotations

import asyncio
import random
import subprocess
import tracemalloc
from collections import Counter
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import pytest

from proxy.config import ConfigError, build_settings
from proxy.upstream.budget import Budget, BudgetBook, UnitRate
from proxy.upstream.replies import RETRY_AFTER_MAX, rate_limited, retry_after
from proxy.upstream.selection import SCORE_HALF_LIFE, Scores, Selector
from proxy.upstream.shared_window import SharedWindow
from proxy.upstream.window import WINDOW_MARGIN


class TestPolicies:
    def test_priority_keeps_the_declared_order(self) -> None:
        assert Selector("priority", [1, 5, 9]).order([0, 1, 2], [-1, -1, -1], 0.0) == [0, 1, 2]

    def test_weighted_puts_each_upstream_first_in_proportion_to_its_weight(self) -> None:
        rng = random.Random(7)
        selector = Selector("weighted", [3.0, 1.0, 1.0], draw=rng.random)
        firsts = Counter(selector.order([0, 1, 2], [-1] * 3, 0.0)[0] for _ in range(10_000))
        assert 0.57 < firsts[0] / 10_000 < 0.63  # 3 / 5
        assert 0.17 < firsts[1] / 10_000 < 0.23  # 1 / 5

    def test_weighted_orders_only_the_candidates_given(self) -> None:
        selector = Selector("weighted", [1.0, 1.0, 1.0], draw=random.Random(1).random)
        assert sorted(selector.order([0, 2], [-1] * 3, 0.0)) == [0, 2]

    def test_fastest_prefers_the_lowest_recent_latency(self) -> None:
        selector = Selector("fastest", [1.0, 1.0])
        for _ in range(5):
            selector.scores.observe(0, 0.200, 0.0)
            selector.scores.observe(1, 0.010, 0.0)
        assert selector.order([0, 1], [10, 10], 0.0) == [1, 0]

    def test_fastest_counts_errors_against_an_upstream(self) -> None:
        selector = Selector("fastest", [1.0, 1.0])
        selector.scores.observe(0, 0.010, 0.0)
        selector.scores.observe(1, 0.015, 0.0)
        for _ in range(5):
            selector.scores.observe(0, None, 0.0)
        assert selector.order([0, 1], [10, 10], 0.0) == [1, 0]

    def test_fastest_counts_head_lag_against_an_upstream(self) -> None:
        selector = Selector("fastest", [1.0, 1.0])
        selector.scores.observe(0, 0.010, 0.0)
        selector.scores.observe(1, 0.020, 0.0)
        assert selector.order([0, 1], [90, 100], 0.0) == [1, 0]

    def test_an_old_slowness_decays_so_a_recovered_upstream_is_chosen_again(self) -> None:
        scores = Scores(1)
        scores.observe(0, 1.0, 0.0)
        scores.observe(0, 0.01, 10 * SCORE_HALF_LIFE)
        assert scores.score(0, 0, 10 * SCORE_HALF_LIFE) < 0.02

    def test_an_upstream_not_heard_from_for_long_is_tried_again(self) -> None:
        selector = Selector("fastest", [1.0, 1.0])
        selector.scores.observe(0, 2.0, 0.0)  # once very slow, then never asked again
        for t in range(0, 300, 10):
            selector.scores.observe(1, 0.05, float(t))
        assert selector.order([0, 1], [1, 1], 10.0) == [1, 0]
        assert selector.order([0, 1], [1, 1], 300.0) == [0, 1]  # its old slowness is no longer known

    def test_an_unknown_policy_is_refused(self) -> None:
        with pytest.raises(ValueError):
            Selector("random", [1.0])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TestBudget:
    def test_a_request_in_flight_holds_its_place_until_a_window_after_its_answer(self) -> None:
        clock = Clock()
        budget = Budget(1, None, clock=clock)
        slot = budget.try_take()
        assert slot is not None
        clock.now += 5.0  # still unanswered: the provider may see it arrive any time now
        assert budget.try_take() is None
        budget.release(slot)
        clock.now += 0.9
        assert budget.try_take() is None
        clock.now += 0.2
        assert budget.try_take() is not None

    def test_no_window_of_one_second_holds_more_than_max_rps(self) -> None:
        clock = Clock()
        budget = Budget(10, None, clock=clock)
        taken = []
        for step in range(400):  # 4 s in 10 ms steps, taking whenever there is room
            clock.now = 100.0 + step * 0.01
            slot = budget.try_take()
            if slot is not None:
                budget.release(slot)
                taken.append(clock.now)
        for start in taken:
            assert sum(1 for t in taken if start <= t < start + 1.0 + WINDOW_MARGIN) <= 10
        assert len(taken) >= 30  # and the budget is used: about 10 per window

    @pytest.mark.parametrize("shared", [False, True])
    def test_a_window_holds_a_call_in_memory_independent_of_its_cost(self, shared: bool, tmp_path: Path) -> None:
        """Rule: a window keeps one entry a request, not one a compute unit: a call of ten million units
        takes no more memory than a call of one, and still fills the second's budget until it leaves."""
        clock = Clock()
        windows = (SharedWindow(str(tmp_path / "w")), SharedWindow(str(tmp_path / "u"))) if shared else (None, None)
        units = UnitRate(10_000_000, {}, default=10_000_000)
        budget = Budget(None, None, window=windows[0], units=units, units_window=windows[1], clock=clock)
        tracemalloc.start()
        try:
            slot = budget.try_take(("eth_call",))
            assert slot is not None
            budget.release(slot)
            assert budget.try_take(("eth_call",)) is None  # the second's budget is spent
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 100_000, peak
        clock.now += 1.0 + WINDOW_MARGIN + 0.001
        assert budget.try_take(("eth_call",)) is not None

    @pytest.mark.parametrize("shared", [False, True])
    def test_a_call_dearer_than_a_seconds_units_goes_alone_once_the_window_is_empty(
        self, shared: bool, tmp_path: Path
    ) -> None:
        """Rule: a call costing more units than the budget allows in a second (a provider's dear method
        on a small plan) is not refused for ever: it is sent once nothing else is counted, alone."""
        clock = Clock()
        windows = (SharedWindow(str(tmp_path / "w")), SharedWindow(str(tmp_path / "u"))) if shared else (None, None)
        units = UnitRate(10, {"eth_getLogs": 75}, default=1)
        budget = Budget(None, None, window=windows[0], units=units, units_window=windows[1], clock=clock)
        cheap = budget.try_take(("eth_call",))
        assert cheap is not None
        assert budget.try_take(("eth_getLogs",)) is None  # not while a cheap call is counted
        budget.release(cheap)
        clock.now += 2 * (1.0 + WINDOW_MARGIN)
        dear = budget.try_take(("eth_getLogs",))
        assert dear is not None  # the window is empty: it goes, alone
        assert budget.try_take(("eth_call",)) is None
        budget.release(dear)

    @pytest.mark.parametrize("shared", [False, True])
    def test_each_call_of_a_batch_is_a_place_as_the_provider_meters_it(self, shared: bool, tmp_path: Path) -> None:
        clock = Clock()
        window = SharedWindow(str(tmp_path / "budget.window")) if shared else None
        budget = Budget(10, None, window=window, clock=clock)
        taken: list[tuple[float, int]] = []
        sizes = [1, 3, 7, 2, 5]
        for step in range(400):  # 4 s in 10 ms steps: requests of several calls, whenever there is room
            clock.now = 100.0 + step * 0.01
            calls = sizes[len(taken) % len(sizes)]
            slot = budget.try_take(("eth_call",) * calls)
            if slot is not None:
                budget.release(slot)
                taken.append((clock.now, calls))
        for start, _ in taken:
            assert sum(n for t, n in taken if start <= t < start + 1.0 + WINDOW_MARGIN) <= 10
        assert sum(n for _, n in taken) >= 30

    def test_max_concurrency_counts_calls_in_flight(self) -> None:
        budget = Budget(None, 4, clock=Clock())
        batch = budget.try_take(("eth_call",) * 3)
        assert batch is not None and budget.in_flight == 3
        assert budget.try_take(("eth_call",) * 2) is None and budget.try_take() is not None
        budget.release(batch)
        assert budget.try_take(("eth_call",) * 3) is not None

    def test_a_request_larger_than_the_budget_goes_only_once_nothing_else_is_counted(self) -> None:
        clock = Clock()
        budget = Budget(5, None, clock=clock)
        small = budget.try_take()
        assert small is not None and budget.try_take(("eth_call",) * 8) is None
        budget.release(small)
        clock.now += 1.0 + WINDOW_MARGIN + 0.001
        large = budget.try_take(("eth_call",) * 8)
        assert large is not None and budget.limits.room == 5  # auto-batches are cut to 5 (batching.py)

    @pytest.mark.parametrize("shared", [False, True])
    def test_a_unit_rate_weighs_each_call_by_its_method_cost(self, shared: bool, tmp_path: Path) -> None:
        clock = Clock()
        units = UnitRate(100, {"eth_getLogs": 75, "eth_call": 26}, default=10)
        window, units_window = (
            (SharedWindow(str(tmp_path / "w")), SharedWindow(str(tmp_path / "u"))) if shared else (None, None)
        )
        budget = Budget(50, None, clock=clock, units=units, window=window, units_window=units_window)
        logs = budget.try_take(("eth_getLogs",))
        assert logs is not None and logs.units == 75
        assert budget.try_take(("eth_call",)) is None  # 75 + 26 > 100 units, though 2 calls < 50
        assert budget.in_flight == 1  # the refused request's call place went back
        assert budget.try_take(("eth_chainId", "eth_blockNumber")) is not None  # 10 + 10 units
        budget.release(logs)
        clock.now += 1.0 + WINDOW_MARGIN + 0.001
        assert budget.try_take(("eth_call",) * 3) is not None  # 78 units, the window moved on

    def test_upstream_tables_carry_a_unit_rate_and_refuse_costs_without_one(self, tmp_path: Path) -> None:
        path = tmp_path / "networks.toml"
        path.write_text(
            '[networks.main]\nfamily = "evm"\nupstreams = [{url = "http://127.0.0.1:1", '
            "max_units_per_second = 330, method_costs = {eth_getLogs = 75}, default_cost = 20}]\n"
        )
        (network,) = build_settings({"NETWORKS_FILE": str(path)}).networks
        options = network.options_of(0)
        assert (options.max_units_per_second, options.method_costs, options.default_cost) == (
            330,
            (("eth_getLogs", 75),),
            20,
        )
        path.write_text(
            '[networks.main]\nfamily = "evm"\nupstreams = [{url = "http://127.0.0.1:1", '
            "method_costs = {eth_getLogs = 75}}]\n"
        )
        with pytest.raises(ConfigError, match="need max_units_per_second"):
            build_settings({"NETWORKS_FILE": str(path)})

    def test_workers_count_in_one_shared_window_so_together_they_stay_within_it(self, tmp_path: Path) -> None:
        clock = Clock()
        path = str(tmp_path / "budget.window")
        first, second = (Budget(1, 1, window=SharedWindow(path), clock=clock) for _ in range(2))  # two workers
        slot = first.try_take()
        assert slot is not None and second.try_take() is None and second.in_flight == 1
        first.release(slot)
        clock.now += 0.5
        assert second.try_take() is None  # the answered request is still in the provider's second
        clock.now += 0.6
        assert second.try_take() is not None  # and either worker may use the whole budget

    def test_the_whole_rate_is_usable_by_workers_sharing_it(self, tmp_path: Path) -> None:
        clock = Clock()
        path = str(tmp_path / "budget.window")
        workers = [Budget(5, None, window=SharedWindow(path), clock=clock) for _ in range(2)]
        taken = [slot for _ in range(4) for budget in workers if (slot := budget.try_take()) is not None]
        assert len(taken) == 5

    def test_a_worker_that_died_with_requests_in_flight_leaves_them_held_one_window(self, tmp_path: Path) -> None:
        clock = Clock()
        path = str(tmp_path / "budget.window")
        dead = SharedWindow(path)
        dead._pid = int(subprocess.check_output(["sh", "-c", "echo $$"]))  # a process that has exited
        assert Budget(None, 1, window=dead, clock=clock).try_take() is not None
        survivor = Budget(1, 1, window=SharedWindow(path), clock=clock)
        assert survivor.try_take() is None  # its request may yet reach the node: held one window
        clock.now += 1.1
        assert survivor.try_take() is not None

    def test_a_reload_retunes_the_budget_in_force_with_its_window_and_calls_in_flight(self) -> None:
        book = BudgetBook()
        budget = book.budget("evm", "http://node", 2, 2)
        slots = [budget.try_take(), budget.try_take()]
        assert all(slots) and budget.try_take() is None
        assert book.budget("evm", "http://node", 3, 3) is budget  # a reload: the same window, new limits
        assert budget.try_take() is not None and budget.try_take() is None

    def test_max_concurrency_bounds_calls_in_flight(self) -> None:
        budget = Budget(None, 2)
        first, second = budget.try_take(), budget.try_take()
        assert first is not None and second is not None
        assert budget.try_take() is None
        budget.release(first)
        assert budget.try_take() is not None

    # A rate under one per second spaces single requests; a request given up without an answer (timed
    # out) holds its place one window longer: the node may still get it later.
    @pytest.mark.parametrize(("max_rps", "answered"), [(0.5, True), (1, False)])
    def test_a_place_is_held_two_seconds_under_half_a_request_per_second_or_without_an_answer(
        self,
        max_rps: float,
        answered: bool,
    ) -> None:
        clock = Clock()
        budget = Budget(max_rps, None, clock=clock)
        slot = budget.try_take()
        assert slot is not None
        budget.release(slot, answered=answered)
        clock.now += 1.5
        assert budget.try_take() is None
        clock.now += 0.6
        assert budget.try_take() is not None

    async def test_a_waiting_call_gets_the_slot_a_finished_call_releases(self) -> None:
        budget = Budget(None, 1)
        slot = budget.try_take()
        assert slot is not None
        loop = asyncio.get_running_loop()
        waiter = asyncio.create_task(budget.take(loop.time() + 5))
        await asyncio.sleep(0)
        budget.release(slot)
        assert await waiter is not None

    async def test_a_call_stops_waiting_for_budget_at_its_deadline(self) -> None:
        budget = Budget(None, 1)
        assert budget.try_take() is not None
        assert await budget.take(asyncio.get_running_loop().time() + 0.05) is None


class TestRateLimits:
    def test_a_provider_rate_limit_error_is_recognised(self) -> None:
        assert rate_limited({"error": {"code": 429, "message": "Too many requests"}})
        infura = "daily request count exceeded, request rate limited"
        assert rate_limited({"error": {"code": -32005, "message": infura}})
        assert rate_limited({"error": {"code": -32007, "message": "300/second request limit reached"}})

    def test_other_errors_and_answers_are_not_rate_limits(self) -> None:
        assert rate_limited({"result": "0x1"}) is None
        assert rate_limited({"error": {"code": -32005, "message": "query returned more than 10000 results"}}) is None
        assert rate_limited({"error": {"code": 3, "message": "execution reverted: rate limit", "data": "0x"}}) is None
        assert rate_limited({"error": {"code": -32000, "message": "execution reverted: too many requests"}}) is None

    def test_retry_after_takes_seconds_or_an_http_date_and_is_bounded(self) -> None:
        assert retry_after("7") == 7.0
        assert retry_after("999999") == RETRY_AFTER_MAX
        assert retry_after("soon") is None and retry_after(None) is None
        # No wait named (zero, negative, a date gone by): the usual cooldown, never none at all.
        assert retry_after("0") is None and retry_after("-5") is None
        assert retry_after(format_datetime(datetime.now(UTC) - timedelta(seconds=30), usegmt=True)) is None
        later = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
        parsed = retry_after(later)
        assert parsed is not None and 25 < parsed <= 30


class TestNetworksFile:
    def _write(self, tmp_path: Path, body: str) -> str:
        path = tmp_path / "networks.toml"
        path.write_text(body)
        return str(path)

    def test_upstream_tables_carry_weight_and_budgets(self, tmp_path: Path) -> None:
        path = self._write(
            tmp_path,
            """
[networks.main]
family = "evm"
selection = "weighted"
hedge_after_ms = 250
upstreams = ["http://a.example/", {url = "http://b.example/k", weight = 3, max_rps = 20, max_concurrency = 4},
             "ws://a.example/"]
""",
        )
        [net] = build_settings({"NETWORKS_FILE": path}).networks
        assert net.upstreams == ("http://a.example/", "http://b.example/k")
        assert net.ws_upstreams == ("ws://a.example/",)
        assert net.selection == "weighted" and net.hedge_after == 0.25
        assert net.options_of(0).weight == 1.0 and net.options_of(1).max_rps == 20
        assert net.options_of(1).max_concurrency == 4 and net.options_of(1).weight == 3.0

    @pytest.mark.parametrize(
        "fragment, error",
        [
            ('selection = "random"\nupstreams = ["http://a/"]', "selection must be one of"),
            ('hedge_after_ms = -1\nupstreams = ["http://a/"]', "hedge_after_ms must be a positive number"),
            ('upstreams = [{url = "http://a/SECRET", weight = 0}]', "weight must be a positive number"),
            (
                'upstreams = [{url = "http://a/SECRET", max_concurrency = 1.5}]',
                "max_concurrency must be a positive whole",
            ),
            ('upstreams = [{url = "http://a/SECRET", rps = 3}]', "unknown field 'rps'"),
            ('upstreams = [{url = "ftp://a/SECRET"}]', r"is not an http\(s\) URL"),
        ],
    )
    def test_a_bad_upstream_entry_is_a_configuration_error_that_never_echoes_the_url(
        self,
        tmp_path: Path,
        fragment: str,
        error: str,
    ) -> None:
        path = self._write(tmp_path, f'[networks.main]\nfamily = "evm"\n{fragment}\n')
        with pytest.raises(ConfigError, match=error) as raised:
            build_settings({"NETWORKS_FILE": path})
        assert "SECRET" not in str(raised.value)
