"""Upstreams as an operator runs them: selection policies, hedged reads, writes sent once, provider
budgets (max_rps, max_concurrency) and rate limits. One real Anvil behind fault relays, one relay per
upstream URL, so each upstream's share of the calls is counted where a provider would count it."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.config import ConfigError, build_settings
from proxy.http.admin import Cordons
from proxy.http.app_keys import SERVICE
from proxy.upstream.pool import HttpUpstream, http_pool
from tests.fault_relay import FaultRelay
from tests.support import Anvil, Proxy, ProxyFactory, eventually, free_port
from tests.test_workers import Running, _answers, _ready, _start, _stop

HUNG = 30.0  # seconds a hung node takes to answer


def _networks_file(tmp_path: Path, upstreams: list[Any], name: str = "evm", **fields: Any) -> str:
    lines = [f"[networks.{name}]", 'family = "evm"']
    lines += [f"{name} = {json.dumps(value)}" for name, value in fields.items()]
    entries = [json.dumps(u) if isinstance(u, str) else _inline_table(u) for u in upstreams]
    lines.append(f"upstreams = [{', '.join(entries)}]")
    path = tmp_path / "networks.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _inline_table(table: dict[str, Any]) -> str:
    return (
        "{"
        + ", ".join(f"{k} = {_inline_table(v) if isinstance(v, dict) else json.dumps(v)}" for k, v in table.items())
        + "}"
    )


async def _proxy(make_proxy: ProxyFactory, tmp_path: Path, upstreams: list[Any], **fields: Any) -> Proxy:
    proxy = await make_proxy(NETWORKS_FILE=_networks_file(tmp_path, upstreams, **fields))
    await proxy.head_at(0)
    return proxy


def _balance_call() -> dict[str, Any]:
    """A read no cache holds: the balance of a fresh address."""
    return {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": ["0x" + secrets.token_hex(20), "latest"]}


def _asked(relay: FaultRelay, method: str) -> int:
    return sum(1 for call in relay.calls if call.get("method") == method)


def _pool(proxy: Proxy) -> HttpUpstream:
    pool = http_pool(proxy.app[SERVICE].networks["evm"].upstream)
    assert pool is not None
    return pool


async def test_the_weighted_policy_asks_each_upstream_first_in_proportion_to_its_weight(
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    proxy = await _proxy(
        make_proxy, tmp_path, [{"url": relays[0].url, "weight": 3}, relays[1].url], selection="weighted"
    )
    for _ in range(120):
        status, body, _ = await proxy.post(_balance_call())
        assert status == 200 and body["result"] == "0x0", body
    first, second = _asked(relays[0], "eth_getBalance"), _asked(relays[1], "eth_getBalance")
    assert first + second >= 120
    assert 0.6 < first / (first + second) < 0.9, (first, second)  # 3:1 is 0.75


async def test_the_fastest_policy_moves_calls_off_a_slow_upstream(
    relays: list[FaultRelay], tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    proxy = await _proxy(make_proxy, tmp_path, [relays[0].url, relays[1].url], selection="fastest")
    relays[0].inject("slow", times=None, delay=0.15)  # every call to the declared primary is slow
    for _ in range(10):  # the scores learn
        await proxy.post(_balance_call())
    before = _asked(relays[0], "eth_getBalance")
    for _ in range(30):
        status, body, _ = await proxy.post(_balance_call())
        assert status == 200 and "result" in body
    assert _asked(relays[0], "eth_getBalance") - before <= 3  # the slow one is tried again only rarely


async def test_a_slow_read_is_hedged_to_the_next_upstream_and_the_first_answer_wins(
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    proxy = await _proxy(make_proxy, tmp_path, [relays[0].url, relays[1].url], hedge_after_ms=100)
    relays[0].inject("slow", method="eth_getBalance", times=None, delay=5.0)
    status, body, _ = await proxy.post(_balance_call())
    assert status == 200 and body["result"] == "0x0", body
    assert _asked(relays[1], "eth_getBalance") == 1
    assert proxy.metric("rpc_proxy_upstream_hedged_total", network="evm") == 1
    assert proxy.metric("rpc_proxy_upstream_hedge_wins_total", network="evm", upstream="1") == 1


async def test_a_write_goes_to_exactly_one_upstream_slow_or_failing(
    relays: list[FaultRelay], tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    proxy = await _proxy(make_proxy, tmp_path, [relays[0].url, relays[1].url], hedge_after_ms=50)
    send = {"jsonrpc": "2.0", "id": 1, "method": "eth_sendRawTransaction", "params": ["0x00"]}
    relays[0].inject("slow", method="eth_sendRawTransaction", delay=0.4)
    status, body, _ = await proxy.post(send)
    assert status == 200 and "error" in body  # Anvil's own refusal of the bytes, from the primary
    relays[0].inject("http500", method="eth_sendRawTransaction")  # it got the call, then failed
    status, body, _ = await proxy.post(send)
    assert body["error"]["code"] == -32002, body
    assert _asked(relays[0], "eth_sendRawTransaction") == 2
    assert _asked(relays[1], "eth_sendRawTransaction") == 0  # never hedged, never retried elsewhere


@pytest.mark.parametrize("method", ["eth_sendRawTransactionSync", "eth_sendTransactionSync", "anvil_mine"])
async def test_a_method_the_proxy_knows_no_read_of_goes_to_exactly_one_upstream_when_it_fails_after_sending(
    relays: list[FaultRelay], tmp_path: Path, make_proxy: ProxyFactory, method: str
) -> None:
    """Rule (docs/networks.md, Hedging): only the reads the proxy knows are asked of another upstream
    after one may have got them; a method ALLOW_METHODS opens (a write it does not name) is not."""
    networks = _networks_file(tmp_path, [relays[0].url, relays[1].url])
    proxy = await make_proxy(NETWORKS_FILE=networks, ALLOW_METHODS=method)
    await proxy.head_at(0)
    relays[0].inject("http500", method=method)  # it got the call, then failed
    status, body, _ = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": []})
    assert status == 502 and body["error"]["code"] == -32002, body
    assert (_asked(relays[0], method), _asked(relays[1], method)) == (1, 0)


@pytest.mark.parametrize("method", ["net_listening", "net_peerCount", "web3_clientVersion"])
async def test_a_read_served_by_default_is_asked_of_the_next_upstream_when_the_first_fails(
    relays: list[FaultRelay], tmp_path: Path, make_proxy: ProxyFactory, method: str
) -> None:
    proxy = await _proxy(make_proxy, tmp_path, [relays[0].url, relays[1].url])
    relays[0].inject("http500", method=method)
    status, body, _ = await proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": []})
    assert status == 200 and ("result" in body or body["error"]["code"] == -32601), body  # the node's answer
    assert (_asked(relays[0], method), _asked(relays[1], method)) == (1, 1)


async def test_a_write_has_the_whole_upstream_timeout_whatever_the_number_of_upstreams(
    relays: list[FaultRelay], tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    """Rule: a write is tried once, so its try is not given a share of UPSTREAM_TIMEOUT kept for the
    next upstream (with two upstreams it got half, and a transaction that ran was told it failed)."""
    networks = _networks_file(tmp_path, [relays[0].url, relays[1].url])
    proxy = await make_proxy(NETWORKS_FILE=networks, UPSTREAM_TIMEOUT="2")
    await proxy.head_at(0)
    relays[0].inject("slow", method="eth_sendRawTransaction", delay=1.3)
    status, body, _ = await proxy.post(
        {"jsonrpc": "2.0", "id": 1, "method": "eth_sendRawTransaction", "params": ["0x00"]}
    )
    assert status == 200 and body["error"]["code"] != -32002, body  # Anvil's own refusal of the bytes
    assert _asked(relays[1], "eth_sendRawTransaction") == 0


async def test_a_write_goes_to_the_next_upstream_only_when_the_first_refused_the_connection(
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    closed = f"http://127.0.0.1:{free_port()}/"  # nothing listens: the call provably never left
    proxy = await make_proxy(EVM_UPSTREAM=f"{closed},{relays[1].url}")
    await proxy.head_at(0)
    await proxy.post({"jsonrpc": "2.0", "id": 1, "method": "eth_sendRawTransaction", "params": ["0x00"]})
    assert _asked(relays[1], "eth_sendRawTransaction") == 1


async def test_a_429_cools_only_that_upstream_and_for_its_retry_after(
    relays: list[FaultRelay], tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    proxy = await _proxy(make_proxy, tmp_path, [relays[0].url, relays[1].url])
    relays[0].inject("http429", method="eth_getBalance", retry_after="60")
    status, body, _ = await proxy.post(_balance_call())
    assert status == 200 and body["result"] == "0x0", body  # answered by the other upstream
    for _ in range(5):
        await proxy.post(_balance_call())
    assert _asked(relays[0], "eth_getBalance") == 1 and _asked(relays[1], "eth_getBalance") == 6
    pool = _pool(proxy)
    assert pool.ordering.down_until[0] - time.monotonic() > 30  # Retry-After 60, not the 5 s cooldown
    assert pool.ordering.down_until[1] == 0.0
    assert proxy.metric("rpc_proxy_upstream_rate_limited_total", network="evm", upstream="0") == 1


async def test_a_429_rests_that_upstreams_head_polls_until_its_retry_after(
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    proxy = await _proxy(make_proxy, tmp_path, [relays[0].url, relays[1].url])
    relays[0].inject("http429", method="eth_getBalance", retry_after="60")
    status, body, _ = await proxy.post(_balance_call())
    assert status == 200 and body["result"] == "0x0", body

    async def polls_of_the_other(more: int) -> None:
        goal = _asked(relays[1], "eth_blockNumber") + more

        async def polled() -> bool:
            return _asked(relays[1], "eth_blockNumber") >= goal

        await eventually(polled, 10, f"{more} more head polls of upstream #1")

    await polls_of_the_other(2)  # a poll of #0 sent before the 429 has come back
    before = _asked(relays[0], "eth_blockNumber")
    await polls_of_the_other(5)
    assert _asked(relays[0], "eth_blockNumber") == before


async def test_a_request_given_up_without_an_answer_holds_its_budget_place_one_window_longer(
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    # The node may get a request the proxy gave up on later still: its place is held for two windows
    # after the timeout, so that late delivery and the next request never share one of the node's.
    networks = _networks_file(tmp_path, [{"url": relays[0].url, "max_rps": 1}])
    proxy = await make_proxy(
        NETWORKS_FILE=networks,
        # No head poll after the first: a poll's batch takes up to four of the one-a-second places, and
        # on a busy host one falling between the two calls kept the second waiting past its timeout.
        HEAD_POLL_INTERVAL="60",
        UPSTREAM_TIMEOUT="8",
        UPSTREAM_ATTEMPT_TIMEOUT="0.5",
        UPSTREAM_BATCH_MAX="1",
    )
    await proxy.head_at(0)
    relays[0].inject("slow", method="eth_getBalance", delay=3.0)
    status, _, _ = await proxy.post(_balance_call())
    gave_up = time.monotonic()
    assert status == 504
    status, body, _ = await proxy.post(_balance_call())  # waits for the budget
    assert status == 200 and body["result"] == "0x0", body
    slow = next(t for t, methods in relays[0].timeline if "eth_getBalance" in methods)
    assert min(t for t, _ in relays[0].timeline if t > slow) >= gave_up + 1.8


async def test_a_provider_rate_limit_error_in_a_200_reply_is_passed_over_not_served(
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    proxy = await _proxy(make_proxy, tmp_path, [relays[0].url, relays[1].url])
    relays[0].inject("ratelimit", method="eth_getBalance")
    status, body, _ = await proxy.post(_balance_call())
    assert status == 200 and body["result"] == "0x0", body
    assert _asked(relays[1], "eth_getBalance") == 1
    assert proxy.metric("rpc_proxy_upstream_rate_limited_total", network="evm", upstream="0") == 1


async def test_max_concurrency_bounds_the_calls_an_upstream_has_in_flight(
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    proxy = await _proxy(make_proxy, tmp_path, [{"url": relays[0].url, "max_concurrency": 2}])
    relays[0].inject("slow", method="eth_getBalance", times=None, delay=0.1)
    bodies = await asyncio.gather(*(proxy.post([_balance_call()]) for _ in range(12)))
    assert all(status == 200 and "result" in body[0] for status, body, _ in bodies)
    assert relays[0].most_in_flight <= 2


async def test_reads_go_to_an_upstream_with_room_while_a_hung_one_holds_its_max_concurrency_places(
    anvil: Anvil,
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    """A hung node keeps the places of the calls it has not answered (a hedge's loser included): reads
    go to an upstream that has room, or frees it first, and their proofs wait for no vote of the hung
    one, so every read is answered long before the hung node would answer; the healthy node gets the
    reads and their proofs, no storm of calls."""
    upstreams = [{"url": relay.url, "max_concurrency": 2} for relay in relays]
    networks = _networks_file(tmp_path, upstreams, hedge_after_ms=100)
    proxy = await make_proxy(NETWORKS_FILE=networks, HEAD_POLL_INTERVAL="1")
    anvil.mine(100)  # blocks 1 to 3 final: their answers are verified before they are kept
    await proxy.head_at(100)
    relays[0].inject("slow", method="eth_getBalance", times=None, delay=HUNG)
    before = len(relays[1].calls)
    blocks = ["latest", "0x1", "latest", "0x2", "latest", "0x3"]
    reads = [{**_balance_call(), "params": ["0x" + secrets.token_hex(20), block]} for block in blocks]
    async with asyncio.timeout(HUNG / 3):  # the hung node answers after HUNG seconds
        answers = await asyncio.gather(*(proxy.post(read) for read in reads))
    assert all(status == 200 and body.get("result") == "0x0" for status, body, _ in answers), answers
    assert relays[0].in_flight > 0  # the hung node still holds what it got
    assert len(relays[1].calls) - before <= 10 * len(reads), Counter(c.get("method") for c in relays[1].calls[before:])
    assert relays[1].most_in_flight <= 2  # its max_concurrency (a request holds a place per call)


def _most_in_one_second(arrivals: list[float]) -> int:
    ordered = sorted(arrivals)
    return max((sum(1 for t in ordered if start <= t < start + 1.0) for start in ordered), default=0)


def _most_calls_in_one_second(requests: list[tuple[float, float, int]]) -> int:
    """The most JSON-RPC calls arriving in any one second, as a provider meters them."""
    return max((sum(n for t, _, n in requests if start <= t < start + 1.0) for start, _, _ in requests), default=0)


def _most_calls_in_flight(requests: list[tuple[float, float, int]]) -> int:
    return max((sum(n for a, d, n in requests if a <= start < d) for start, _, _ in requests), default=0)


def _most_in_flight(spans: list[tuple[float, float]]) -> int:
    return max((sum(1 for a, d in spans if a <= start < d) for start, _ in spans), default=0)


class Meter:
    """The provider's meter in a process of its own (tests/arrivals_relay.py): the test's loop, busy
    sending a burst, would otherwise note arrivals late and bunch them up."""

    def __init__(self, anvil: Anvil, tmp_path: Path, delay: float = 0.0, slow: str | None = None) -> None:
        """`delay`: each request held that long; with `slow` (methods, comma separated) only those."""
        port, self._file = free_port(), tmp_path / f"arrivals-{free_port()}"
        self.url = f"http://127.0.0.1:{port}/"
        args = [anvil.url, str(port), str(self._file), str(delay), *([slow] if slow else [])]
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.arrivals_relay", *args], cwd=Path(__file__).resolve().parents[1]
        )

    def spans(self) -> list[tuple[float, float]]:
        """Each request answered so far: (arrival, departure)."""
        return [(a, d) for a, d, _ in self.requests()]

    def requests(self) -> list[tuple[float, float, int]]:
        """Each request answered so far: (arrival, departure, its JSON-RPC calls)."""
        return [(a, d, len(methods)) for a, d, methods in self.methods()]

    def methods(self) -> list[tuple[float, float, list[str]]]:
        """Each request answered so far: (arrival, departure, its calls' methods)."""
        text = self._file.read_text() if self._file.exists() else ""
        rows = (line.split() for line in text.splitlines())
        return [(float(a), float(d), m.split(",")) for a, d, _n, m, _port in rows]

    def busiest(self) -> str:
        """The requests in flight at the instant most calls were (arrival, departure, methods, sender's
        port), for a failure's message."""
        lines = [line.split() for line in self._file.read_text().splitlines()] if self._file.exists() else []
        spans = [(float(a), float(d), int(n), line) for line in lines for a, d, n in [line[:3]]]
        if not spans:
            return "no requests"
        _, start = max((sum(n for a, d, n, _ in spans if a <= s < d), s) for s, _, _, _ in spans)
        return "\n".join(" ".join(line) for a, d, _, line in spans if a <= start < d)

    def arrivals(self) -> list[float]:
        return [a for a, _ in self.spans()]

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(10)


@pytest.mark.parametrize(
    ("budget", "calls", "delay"),
    [
        ({"max_rps": 20}, 60, 0.0),
        ({"max_rps": 1}, 4, 0.0),  # below one per worker: no worker may take a whole one of its own
        ({"max_concurrency": 1}, 10, 0.1),
    ],
)
async def test_a_budget_is_never_exceeded_as_the_provider_sees_it_under_a_burst_from_two_workers(
    anvil: Anvil,
    relays: list[FaultRelay],
    tmp_path: Path,
    budget: dict[str, int],
    calls: int,
    delay: float,
) -> None:
    meter = Meter(anvil, tmp_path, delay)
    networks = _networks_file(tmp_path, [{"url": meter.url, **budget}], name="main")
    # The default network (EVM_UPSTREAM) is a relay's: every call the meter sees is network main's.
    # Polls are rare, so the calls have the budget to themselves.
    running: Running = _start(relays[1].url, 2, NETWORKS_FILE=networks, UPSTREAM_BATCH_MAX="1", HEAD_POLL_INTERVAL="5")
    url = f"http://127.0.0.1:{running.port}/main/v3/any-key"
    try:
        async with aiohttp.ClientSession() as session:
            await _ready(session, running, 2)
            sessions = [aiohttp.ClientSession() for _ in range(8)]  # connections spread over both workers
            try:
                answers = await asyncio.gather(*(_answers(sessions[i % 8], url, _balance_call()) for i in range(calls)))
            finally:
                for one in sessions:
                    await one.close()
        assert all(a is not None and a.get("result") == "0x0" for a in answers), answers[:3]
        spans = meter.spans()
        assert len(spans) >= calls
        assert _most_in_one_second([a for a, _ in spans]) <= budget.get("max_rps", len(spans))
        assert _most_in_flight(spans) <= budget.get("max_concurrency", len(spans))
    finally:
        code, log = await _stop(running)
        meter.stop()
        assert code == 0, log


@pytest.mark.parametrize(("budget", "delay"), [({"max_rps": 20}, 0.0), ({"max_concurrency": 6}, 0.1)])
async def test_a_budget_counts_calls_not_requests_under_a_batched_burst_from_two_workers(
    anvil: Anvil,
    relays: list[FaultRelay],
    tmp_path: Path,
    budget: dict[str, int],
    delay: float,
) -> None:
    """A provider meters JSON-RPC calls: each call of an auto-batch, each proof header and each head
    poll counts against max_rps and max_concurrency, however few HTTP requests carry them."""
    meter = Meter(anvil, tmp_path, delay)
    networks = _networks_file(tmp_path, [{"url": meter.url, **budget}], name="main")
    running: Running = _start(
        relays[1].url, 2, NETWORKS_FILE=networks, UPSTREAM_BATCH_MAX="50", HEAD_POLL_INTERVAL="1", UPSTREAM_TIMEOUT="30"
    )
    url = f"http://127.0.0.1:{running.port}/main/v3/any-key"
    try:
        async with aiohttp.ClientSession() as session:
            await _ready(session, running, 2)
            sessions = [aiohttp.ClientSession() for _ in range(8)]
            try:
                calls = [
                    {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": [f"0x{n + 1:040x}", "latest"]}
                    for n in range(100)
                ]
                answers = await asyncio.gather(*(_answers(sessions[i % 8], url, c) for i, c in enumerate(calls)))
            finally:
                for one in sessions:
                    await one.close()
        assert all(a is not None and a.get("result") == "0x0" for a in answers), answers[:3]
        requests = meter.requests()
        assert sum(n for _, _, n in requests) >= 100
        assert any(n > 1 for _, _, n in requests)  # batches went: the budget is in calls, not requests
        assert _most_calls_in_one_second(requests) <= budget.get("max_rps", 10**6)
        assert _most_calls_in_flight(requests) <= budget.get("max_concurrency", 10**6), meter.busiest()
    finally:
        code, log = await _stop(running)
        meter.stop()
        assert code == 0, log


async def test_a_call_given_up_once_sent_holds_its_max_concurrency_place_until_the_node_answers(
    anvil: Anvil,
    relays: list[FaultRelay],
    tmp_path: Path,
) -> None:
    """max_concurrency counts what the node works on: an eth_getLogs past GETLOGS_TIMEOUT is given up
    (-32005 to its client) while the node still works on it, so no other call reaches the node until
    the node has answered it; a cancel never frees the place early (two workers: the shared window)."""
    meter = Meter(anvil, tmp_path, delay=1.0, slow="eth_getLogs")  # the node slow on this query alone
    networks = _networks_file(tmp_path, [{"url": meter.url, "max_concurrency": 1}], name="main")
    running: Running = _start(
        relays[1].url, 2, NETWORKS_FILE=networks, GETLOGS_TIMEOUT="0.4", HEAD_POLL_INTERVAL="60", UPSTREAM_TIMEOUT="30"
    )
    url = f"http://127.0.0.1:{running.port}/main/v3/any-key"
    balance = {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": [f"0x{7:040x}", "0x0"]}
    logs = {"jsonrpc": "2.0", "id": 2, "method": "eth_getLogs", "params": [{"fromBlock": "0x0", "toBlock": "0x0"}]}
    try:
        async with aiohttp.ClientSession() as session:
            await _ready(session, running, 2)
            answer = await _answers(session, url, balance)
            assert answer is not None and answer.get("result") == "0x0", answer
            given_up = await _answers(session, url, logs)
            assert given_up is not None and given_up.get("error", {}).get("code") == -32005, given_up
            answer = await _answers(session, url, {**balance, "params": [f"0x{8:040x}", "0x0"]})
            assert answer is not None and answer.get("result") == "0x0", answer

        async def node_done() -> bool:
            return any("eth_getLogs" in methods for _, _, methods in meter.methods())

        await eventually(node_done, 10, "the node to answer the given-up query")
        spans = meter.methods()
        [(sent, answered, _)] = [s for s in spans if "eth_getLogs" in s[2]]
        overlapping = [s for s in spans if sent < s[0] < answered]
        assert overlapping == [], f"calls reached the node while it worked on the given-up one: {overlapping}"
    finally:
        code, log = await _stop(running)
        meter.stop()
        assert code == 0, log


async def test_a_unit_rate_holds_in_compute_units_as_the_provider_meters_them(
    anvil: Anvil,
    relays: list[FaultRelay],
    tmp_path: Path,
) -> None:
    """max_units_per_second with method_costs: each call weighs its method's cost (default_cost for the
    others: head polls, proof headers), and no second holds more units than the budget."""
    meter = Meter(anvil, tmp_path)
    budget = {"max_units_per_second": 100, "method_costs": {"eth_getBalance": 10}, "default_cost": 2}
    networks = _networks_file(tmp_path, [{"url": meter.url, **budget}], name="main")
    running: Running = _start(
        relays[1].url, 2, NETWORKS_FILE=networks, UPSTREAM_BATCH_MAX="50", HEAD_POLL_INTERVAL="1", UPSTREAM_TIMEOUT="30"
    )
    url = f"http://127.0.0.1:{running.port}/main/v3/any-key"
    try:
        async with aiohttp.ClientSession() as session:
            await _ready(session, running, 2)
            calls = [
                {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": [f"0x{n + 1:040x}", "latest"]}
                for n in range(30)
            ]
            answers = await asyncio.gather(*(_answers(session, url, c) for c in calls))
        assert all(a is not None and a.get("result") == "0x0" for a in answers), answers[:3]
        weighed = [
            (a, d, sum(10 if m == "eth_getBalance" else 2 for m in methods)) for a, d, methods in meter.methods()
        ]
        assert sum(m.count("eth_getBalance") for _, _, m in meter.methods()) >= 30
        assert _most_calls_in_one_second(weighed) <= 100
    finally:
        code, log = await _stop(running)
        meter.stop()
        assert code == 0, log


async def test_a_cordoned_upstream_is_not_asked(
    relays: list[FaultRelay], tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    proxy = await _proxy(make_proxy, tmp_path, [relays[0].url, relays[1].url])
    _pool(proxy).states.cordoned[0] = True
    for _ in range(5):
        await proxy.post(_balance_call())
    assert _asked(relays[0], "eth_getBalance") == 0

    async def asked_again() -> bool:
        _pool(proxy).states.cordoned[0] = False
        await proxy.post(_balance_call())
        return _asked(relays[0], "eth_getBalance") > 0

    await eventually(asked_again, 10, "the uncordoned upstream to be asked")


# --- the admin listener ----------------------------------------------------------------------

TOKEN = "s3cret-admin-token-0123456789"


async def _admin(
    session: aiohttp.ClientSession, port: int, path: str, token: str | None = TOKEN, method: str = "GET"
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with session.request(method, f"http://127.0.0.1:{port}{path}", headers=headers) as response:
        return response.status, await response.json()


async def test_an_admin_cordon_takes_an_upstream_out_within_one_call_and_needs_the_token(
    relays: list[FaultRelay],
    make_proxy: ProxyFactory,
) -> None:
    port = free_port()
    upstreams = f"{relays[0].url}?apikey=PROVIDERSECRET,{relays[1].url}"
    proxy = await make_proxy(EVM_UPSTREAM=upstreams, ADMIN_PORT=str(port), ADMIN_TOKEN=TOKEN)
    await proxy.head_at(0)
    async with aiohttp.ClientSession() as session:
        assert (await _admin(session, port, "/upstreams", token=None))[0] == 401
        assert (await _admin(session, port, "/upstreams/evm/0/cordon", token="wrong", method="POST"))[0] == 401
        # A header that is no UTF-8 is refused like any other, never an error.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /upstreams HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n"
        )
        assert (await reader.read()).startswith(b"HTTP/1.1 401")
        writer.close()
        status, listing = await _admin(session, port, "/upstreams")
        assert status == 200 and [u["index"] for u in listing["evm"]] == [0, 1]
        assert "PROVIDERSECRET" not in json.dumps(listing) and listing["evm"][0]["host"].startswith("http://")
        status, body = await _admin(session, port, "/upstreams/evm/0/cordon", method="POST")
        assert status == 200 and body["cordoned"] is True
        for _ in range(5):
            await proxy.post(_balance_call())
        assert _asked(relays[0], "eth_getBalance") == 0
        assert (await _admin(session, port, "/upstreams/evm/7/cordon", method="POST"))[0] == 404
        for written in (
            "+0",
            "%D9%A0",
            "0_0",
            "-0",
            "1" * 4400,
        ):  # ASCII digits, as listed (int() took +1; 4,400 digits: a 500)
            assert (await _admin(session, port, f"/upstreams/evm/{written}/cordon", method="POST"))[0] == 404
        await _admin(session, port, "/upstreams/evm/0/uncordon", method="POST")
        await proxy.post(_balance_call())
        assert _asked(relays[0], "eth_getBalance") == 1


@asynccontextmanager
async def _admin_workers(relays: list[FaultRelay], **env: str) -> AsyncIterator[tuple[Running, int]]:
    """Two workers over both relays with the admin listener, ready; stopped cleanly, the token in no
    log line."""
    port = free_port()
    running = _start(f"{relays[0].url},{relays[1].url}", 2, ADMIN_PORT=str(port), ADMIN_TOKEN=TOKEN, **env)
    try:
        async with aiohttp.ClientSession() as session:
            await _ready(session, running, 2)
        yield running, port
    finally:
        code, log = await _stop(running)
        assert code == 0, log
        assert TOKEN not in log


async def test_an_admin_cordon_reaches_every_worker(relays: list[FaultRelay]) -> None:
    async with _admin_workers(relays) as (running, port), aiohttp.ClientSession() as session:
        status, _ = await _admin(session, port, "/upstreams/evm/0/cordon", method="POST")
        assert status == 200
        before = _asked(relays[0], "eth_getBalance")
        sessions = [aiohttp.ClientSession() for _ in range(8)]  # connections spread over both workers
        try:
            answers = await asyncio.gather(
                *(_answers(sessions[i % 8], running.url, _balance_call()) for i in range(24))
            )
        finally:
            for one in sessions:
                await one.close()
        assert all(a is not None and "result" in a for a in answers)
        assert _asked(relays[0], "eth_getBalance") == before, running.log.read_text()


async def _fresh(port: int, path: str, method: str = "GET") -> Any:
    """An admin call on a new connection: with workers, either one may take it."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as one:
        return await _admin(one, port, path, method=method)


async def test_cordon_commands_crossing_on_two_workers_leave_both_with_the_last(relays: list[FaultRelay]) -> None:
    # Each worker applied its own command, then its sibling's: crossing commands left the two workers
    # disagreeing for good (an upstream cordoned by the operator still served by half of them).
    async with _admin_workers(relays) as (_, port):
        for _ in range(6):
            commands = ["cordon", "uncordon", "cordon", "uncordon"]
            replies = await asyncio.gather(*(_fresh(port, f"/upstreams/evm/0/{c}", "POST") for c in commands))
            assert all(status == 200 for status, _ in replies), replies
            views = await asyncio.gather(*(_fresh(port, "/upstreams") for _ in range(16)))
            states = {body["evm"][0]["cordoned"] for _, body in views}
            assert len(states) == 1, views  # every worker holds the host's one record


async def test_a_cordon_crossing_a_reload_on_the_other_worker_is_kept_by_both(
    relays: list[FaultRelay], tmp_path: Path
) -> None:
    # The reloading worker wrote its own view over the record after its reload, erasing a cordon its
    # sibling had just taken: the two workers disagreed for good, and the record had lost it.
    networks = tmp_path / "networks.toml"
    networks.write_text(f'[networks.side]\nfamily = "evm"\nupstreams = ["{relays[1].url}"]\n')
    async with _admin_workers(relays, NETWORKS_FILE=str(networks)) as (_, port):
        for index in (0, 1, 0, 1):
            replies = await asyncio.gather(
                _fresh(port, f"/upstreams/evm/{index}/cordon", "POST"), _fresh(port, "/reload", "POST")
            )
            assert [status for status, _ in replies] == [200, 200], replies
            views = await asyncio.gather(*(_fresh(port, "/upstreams") for _ in range(12)))
            assert all(body["evm"][index]["cordoned"] for _, body in views), views
            assert (await _fresh(port, f"/upstreams/evm/{index}/uncordon", "POST"))[0] == 200


def test_an_admin_port_needs_a_long_token() -> None:
    base = {"EVM_UPSTREAM": "http://127.0.0.1:1", "ADMIN_PORT": "9101"}
    with pytest.raises(ConfigError, match="ADMIN_TOKEN"):
        build_settings(base)
    with pytest.raises(ConfigError, match="ADMIN_TOKEN"):
        build_settings({**base, "ADMIN_TOKEN": "short"})
    assert TOKEN not in repr(build_settings({**base, "ADMIN_TOKEN": TOKEN}))


async def test_an_admin_reload_applies_new_routing_to_the_pool_in_force(
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    port = free_port()
    path = _networks_file(tmp_path, [relays[0].url, relays[1].url])
    proxy = await make_proxy(NETWORKS_FILE=path, ADMIN_PORT=str(port), ADMIN_TOKEN=TOKEN)
    await proxy.head_at(0)
    pool = _pool(proxy)
    async with aiohttp.ClientSession() as session:
        _networks_file(
            tmp_path,
            [{"url": relays[0].url, "weight": 1}, {"url": relays[1].url, "weight": 1000}],
            selection="weighted",
        )
        status, body = await _admin(session, port, "/reload", method="POST")
        assert status == 200 and body == {"reloaded": ["evm"], "added": [], "removed": [], "replaced": []}
        for _ in range(20):
            await proxy.post(_balance_call())
        assert _asked(relays[1], "eth_getBalance") >= 18
        assert _pool(proxy) is pool  # routing alone: the same pool, its cordons and scores kept
        assert (await _admin(session, port, "/reload", token=None, method="POST"))[0] == 401


async def test_readiness_with_every_upstream_cordoned_says_none_is_in_rotation_not_syncing(
    relays: list[FaultRelay], make_proxy: ProxyFactory
) -> None:
    # Every upstream out of rotation made "every upstream in rotation is syncing" true of none: /readyz
    # sent an operator whose node was down, or cordoned, to look at syncing.
    port = free_port()
    proxy = await make_proxy(EVM_UPSTREAM=f"{relays[0].url},{relays[1].url}", ADMIN_PORT=str(port), ADMIN_TOKEN=TOKEN)
    await proxy.head_at(0)
    async with aiohttp.ClientSession() as session:
        for index in (0, 1):
            assert (await _admin(session, port, f"/upstreams/evm/{index}/cordon", method="POST"))[0] == 200
        async with session.get(f"{proxy.base}/readyz") as response:
            status, body = response.status, await response.json()
    assert status == 503 and body["networks"]["evm"].startswith("degraded: no upstream in rotation"), body
    assert "cordoned" in body["networks"]["evm"]


@pytest.mark.parametrize(("status", "missed"), [(200, 0), (409, 1), (400, 1)])
async def test_a_sibling_that_did_not_take_a_command_is_counted(status: int, missed: int) -> None:
    # A reload answered 200 though a sibling refused it or had not finished (its answer was dropped).
    run_dir = tempfile.mkdtemp(dir="/tmp")  # a unix socket's path must be short
    app = web.Application()

    async def answer(_request: web.Request) -> web.Response:
        return web.json_response({}, status=status)

    app.router.add_post("/reload", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, os.path.join(run_dir, "admin-1.sock")).start()
    try:
        assert await Cordons({}, run_dir, 0).tell_siblings("/reload") == missed
    finally:
        await runner.cleanup()
        shutil.rmtree(run_dir)
