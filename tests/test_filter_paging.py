"""A log filter's changes past GETLOGS_MAX_RESULTS are paged, never lost (filter_backlog.py): a poll
answers the first `limit` logs in chain order and the next polls the rest, read back with eth_getLogs
from a cursor in the filter's table entry, before newer changes. The pure part, a node faked for two
workers and a reorg, then real Anvil: one process, and WORKERS=2 with polls alternating workers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.gateway.filter_backlog import Backlog, after, behind, first_page, loaded, merged
from proxy.gateway.filters import Filters
from proxy.rpc.jsonrpc import Call
from proxy.values import Answer
from tests.support import Anvil, Proxy, ProxyFactory, selector, settings_for, word
from tests.test_workers import Running, _connections_by_process, _ready, _start, _stop

LIMIT = 20


def _log(block: int, index: int, removed: bool = False, data: str = "0x") -> dict[str, Any]:
    return {"blockNumber": hex(block), "logIndex": hex(index), "removed": removed, "data": data}


def _at(logs: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(int(log["blockNumber"], 16), int(log["logIndex"], 16)) for log in logs]


class TestBacklog:
    def test_a_first_page_is_the_limit_in_chain_order_and_the_rest_a_cursor(self) -> None:
        changes = [_log(2, 1), _log(1, 0), _log(2, 0), _log(1, 1), _log(3, 0)]
        page = first_page(changes, 3)
        assert _at(page.logs) == [(1, 0), (1, 1), (2, 0)] and page.backlog == Backlog((2, 0), 3)

    def test_removed_logs_come_first_and_take_places(self) -> None:
        page = first_page([_log(1, 0), _log(1, 1), _log(9, 4, removed=True)], 2)
        assert page.logs[0]["removed"] and _at(page.logs[1:]) == [(1, 0)] and page.backlog == Backlog((1, 0), 1)
        page = first_page([_log(1, 0), _log(9, 4, removed=True), _log(9, 5, removed=True)], 2)
        assert _at(page.logs) == [(9, 4), (9, 5)] and page.backlog == Backlog((1, -1), 1)  # none of block 1 yet

    def test_a_page_of_a_read_drops_what_was_delivered(self) -> None:
        read = [_log(5, 3), _log(5, 1), _log(5, 2), _log(6, 0)]
        assert after(read, (5, 1), 2) == ([_log(5, 2), _log(5, 3)], (5, 3))
        assert after(read, (5, 1), 3) == ([_log(5, 2), _log(5, 3), _log(6, 0)], None)
        assert after(read, (6, 0), 3) == ([], None)

    def test_changes_behind_a_backlog_move_its_end_or_take_it_back_to_a_replaced_block(self) -> None:
        # A removed log goes now; a reorg's new log at or before the cursor (a block the client read,
        # replaced) takes the backlog back before that block, read and paged again: never past the limit.
        changes = [_log(7, 0), _log(4, 0, data="0x01"), _log(4, 9, removed=True), _log(5, 2)]
        now, backlog = behind(changes, Backlog((4, 3), 6))
        assert now == [_log(4, 9, removed=True)] and backlog == Backlog((4, -1), 7)
        now, backlog = behind([_log(7, 0)], Backlog((4, 3), 6))
        assert now == [] and backlog == Backlog((4, 3), 7)

    def test_two_polls_of_one_backlog_merge_forward(self) -> None:
        assert merged(Backlog((3, 4), 9), Backlog((5, 0), 8)) == Backlog((5, 0), 9)
        assert merged(None, Backlog((5, 0), 8)) == Backlog((5, 0), 8)
        assert merged(Backlog((3, 4), 9), None) == Backlog((3, 4), 9)  # kept: a page may come twice, none lost

    def test_an_entry_without_a_backlog_or_a_garbled_one_loads_as_none(self) -> None:
        assert loaded([4, 3, 6]) == Backlog((4, 3), 6)
        assert loaded(None) is None and loaded([1, 2]) is None and loaded("x") is None


class _Node:
    """A node with one log filter: its changes as queued, eth_getLogs over `chain`. `lag`: a load
    balancer whose every other read reaches a member that many blocks behind (it answers a range
    clipped to its head, as geth does, and null for a block past it)."""

    def __init__(self, chain: list[dict[str, Any]], lag: int | None = None) -> None:
        self.chain = chain
        self.queued: list[list[dict[str, Any]]] = [list(chain)]
        self.lag = lag
        self.reads = 0

    def _head(self) -> float:
        self.reads += 1
        if self.lag is None or self.reads % 2 == 0:
            return float("inf")
        return max(int(log["blockNumber"], 16) for log in self.chain) - self.lag

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer:
        result: Any = "0x1"
        if method == "eth_getFilterChanges":
            result = self.queued.pop(0) if self.queued else []
        elif method == "eth_getLogs":
            result = self._logs(params[0], self._head())
        return Answer(orjson.dumps(result), result)

    def _logs(self, query: dict[str, Any], head: float) -> list[dict[str, Any]]:
        start, end = int(query["fromBlock"], 16), min(int(query["toBlock"], 16), head)
        return [log for log in self.chain if start <= int(log["blockNumber"], 16) <= end]

    async def together(self, calls: list[tuple[str, Any]]) -> list[Answer]:
        (_, [query]), (_, [block, _]) = calls
        head = self._head()
        logs, shown = self._logs(query, head), {"number": block} if int(block, 16) <= head else None
        return [Answer(orjson.dumps(logs), logs), Answer(orjson.dumps(shown), shown)]


async def _unused(*_args: Any) -> Any:
    raise AssertionError("not asked in these tests")


def _workers(tmp_path: Path, node: _Node, limit: int) -> tuple[list[Filters], Any]:
    settings = settings_for(EVM_UPSTREAM="http://127.0.0.1:1", GETLOGS_MAX_RESULTS=str(limit))
    workers = [Filters(settings, _unused, _unused, run_dir=str(tmp_path)) for _ in range(2)]
    return workers, SimpleNamespace(name="evm", upstream=node, tracker=None)  # no head to tell of blocks shown


async def _ask(worker: Filters, network: Any, method: str, params: list[Any]) -> Any:
    prepared: Any = SimpleNamespace(call=Call(method, params, 1), network=network, params=params)
    outcome = await worker.execute(prepared, "k1")
    return orjson.loads(outcome.payload)


async def test_a_backlog_left_by_one_worker_is_read_by_the_other(tmp_path: Path) -> None:
    chain = [_log(b, i) for b in (1, 2, 3) for i in range(4)]
    workers, network = _workers(tmp_path, _Node(chain), 5)
    own_id = await _ask(workers[0], network, "eth_newFilter", [{}])
    pages = [await _ask(workers[n % 2], network, "eth_getFilterChanges", [own_id]) for n in range(4)]
    assert [len(p) for p in pages] == [5, 5, 2, 0]
    assert _at([log for p in pages for log in p]) == _at(chain)


async def test_a_reorg_of_the_backlogs_blocks_delivers_no_log_twice_in_a_poll(tmp_path: Path) -> None:
    node = _Node([_log(b, i) for b in (1, 2) for i in range(5)])
    workers, network = _workers(tmp_path, node, 4)
    own_id = await _ask(workers[0], network, "eth_newFilter", [{}])
    assert _at(await _ask(workers[0], network, "eth_getFilterChanges", [own_id])) == [(1, 0), (1, 1), (1, 2), (1, 3)]
    # Block 2 is replaced before its logs are read: the node reports its old logs removed, and the new.
    replaced = [_log(2, i, data="0x02") for i in range(3)]
    node.queued.append([_log(2, i, removed=True) for i in range(5)] + replaced)
    node.chain = node.chain[:5] + replaced
    polls = [await _ask(workers[1], network, "eth_getFilterChanges", [own_id]) for _ in range(3)]
    assert all(log["removed"] for log in polls[0]) and len(polls[0]) == 5  # what cannot be read again: at once
    assert polls[1] == [_log(1, 4), *replaced] and polls[2] == []


async def test_a_backlog_is_read_only_from_a_node_that_shows_its_ranges_last_block(tmp_path: Path) -> None:
    # Behind a load balancer whose lagging member answers every other read short of the blocks it
    # lacks: each range is taken only beside its last block, so no log is lost (was: 86 of 164).
    chain = [_log(b, i) for b in range(1, 9) for i in range(4)]
    workers, network = _workers(tmp_path, _Node(chain, lag=3), 5)
    own_id = await _ask(workers[0], network, "eth_newFilter", [{}])
    pages = [await _ask(workers[0], network, "eth_getFilterChanges", [own_id]) for _ in range(8)]
    assert _at([log for p in pages for log in p]) == _at(chain) and pages[-1] == []


async def test_a_table_entry_written_before_backlogs_still_pages(tmp_path: Path) -> None:
    # An entry of six fields (as every entry was before backlogs and sizes): a restarted worker reads it.
    chain = [_log(1, i) for i in range(7)]
    workers, network = _workers(tmp_path, _Node(chain), 5)
    own_id = await _ask(workers[0], network, "eth_newFilter", [{}])
    table = orjson.loads((tmp_path / "filters.json").read_bytes())
    assert len(table[own_id]) == 8
    table[own_id] = table[own_id][:6]
    (tmp_path / "filters.json").write_bytes(orjson.dumps(table))
    settings = settings_for(EVM_UPSTREAM="http://127.0.0.1:1", GETLOGS_MAX_RESULTS="5")
    again = Filters(settings, _unused, _unused, run_dir=str(tmp_path))
    pages = [await _ask(again, network, "eth_getFilterChanges", [own_id]) for _ in range(3)]
    assert [len(p) for p in pages] == [5, 2, 0]


# --- real Anvil ---------------------------------------------------------------------------


@pytest.fixture
async def proxy(anvil: Anvil, make_proxy: ProxyFactory) -> Proxy:
    return await make_proxy(EVM_UPSTREAM=anvil.url, GETLOGS_MAX_RESULTS=str(LIMIT))


def _key(log: dict[str, Any]) -> tuple[str, str, str, str]:
    return log["blockNumber"], log["logIndex"], log["transactionHash"], log["topics"][1]


async def _drain(poll: Any) -> list[list[dict[str, Any]]]:
    """Polls until an empty answer; every answer."""
    pages: list[list[dict[str, Any]]] = []
    while not pages or pages[-1]:
        pages.append(await poll())
        assert len(pages) < 20, pages
    return pages


async def test_changes_past_the_limit_come_in_pages_each_once_in_order_then_newer_ones(
    anvil: Anvil, proxy: Proxy
) -> None:
    # Was: -32005 for the 60, which the node had moved past: the next polls gave only newer logs.
    store = anvil.deploy_store()
    own_id = await proxy.result("eth_newFilter", [{"address": store}])
    first = anvil.send(store, selector("emitMany(uint256)") + word(15))["blockNumber"]
    for _ in range(3):
        anvil.send(store, selector("emitMany(uint256)") + word(15))
    pages = [await proxy.result("eth_getFilterChanges", [own_id])]
    newer = anvil.send(store, selector("emitMany(uint256)") + word(3))["blockNumber"]
    pages += await _drain(lambda: proxy.result("eth_getFilterChanges", [own_id]))
    assert [len(p) for p in pages] == [20, 20, 20, 3, 0]
    expected = anvil.rpc("eth_getLogs", {"address": store, "fromBlock": first, "toBlock": newer})
    assert [_key(log) for page in pages for log in page] == [_key(log) for log in expected] and len(expected) == 63


async def test_one_block_with_more_logs_than_the_limit_is_paged_by_log_index(anvil: Anvil, proxy: Proxy) -> None:
    store = anvil.deploy_store()
    own_id = await proxy.result("eth_newFilter", [{"address": store}])
    anvil.send(store, selector("emitMany(uint256)") + word(50))
    pages = await _drain(lambda: proxy.result("eth_getFilterChanges", [own_id]))
    assert [len(p) for p in pages] == [20, 20, 10, 0]
    logs = [log for page in pages for log in page]
    assert len({log["blockNumber"] for log in logs}) == 1 and [int(log["logIndex"], 16) for log in logs] == list(
        range(50)
    )


@pytest.fixture
async def workers(anvil: Anvil) -> AsyncIterator[tuple[Running, list[aiohttp.ClientSession]]]:
    """WORKERS=2 and one keep-alive session held by each worker (found from /proc)."""
    running = _start(anvil.url, 2, GETLOGS_MAX_RESULTS="10")
    held: dict[int, aiohttp.ClientSession] = {}
    spare: list[aiohttp.ClientSession] = []
    try:
        async with aiohttp.ClientSession() as session:
            await _ready(session, running, 2)
        while len(held) < 2 and len(spare) < 40:
            pids = running.workers()
            before = _connections_by_process(running.port, pids)
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            async with session.post(running.url, json={"jsonrpc": "2.0", "id": 1, "method": "eth_chainId"}) as r:
                await r.read()
            now = _connections_by_process(running.port, pids)
            pid = next((p for p in pids if now[p] > before.get(p, 0)), None)
            if pid is not None and pid not in held:
                held[pid] = session
            else:
                spare.append(session)
        assert len(held) == 2, "no connection reached the second worker"
        yield running, list(held.values())
    finally:
        for session in [*held.values(), *spare]:
            await session.close()
        await _stop(running)


async def test_two_workers_polling_one_filter_in_turn_page_it_each_log_once(
    anvil: Anvil, workers: tuple[Running, list[aiohttp.ClientSession]]
) -> None:
    running, sessions = workers
    store = anvil.deploy_store()
    turn = [0]

    async def call(method: str, params: list[Any]) -> Any:
        session = sessions[turn[0] % 2]
        turn[0] += 1
        async with session.post(running.url, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params}) as r:
            reply = await r.json()
        assert "result" in reply, reply
        return reply["result"]

    own_id = await call("eth_newFilter", [{"address": store}])
    anvil.send(store, selector("emitMany(uint256)") + word(35))
    pages = await _drain(lambda: call("eth_getFilterChanges", [own_id]))
    assert [len(p) for p in pages] == [10, 10, 10, 5, 0]
    assert [int(log["logIndex"], 16) for page in pages for log in page] == list(range(35))


async def test_a_reorg_under_a_backlog_pages_the_new_chains_logs_within_the_limit(anvil: Anvil, proxy: Proxy) -> None:
    # The chain under a filter's backlog is replaced (evm_revert, then other blocks): the new chain's
    # logs at or before the cursor were one answer past the limit (51 with limit 20); now each is
    # read and paged, and every one comes exactly once.
    store = anvil.deploy_store()
    own_id = await proxy.result("eth_newFilter", [{"address": store}])
    snapshot = anvil.rpc("evm_snapshot")
    for count in (45, 30, 30):
        anvil.send(store, selector("emitMany(uint256)") + word(count))
    assert [len(await proxy.result("eth_getFilterChanges", [own_id])) for _ in range(3)] == [20, 20, 20]
    assert anvil.rpc("evm_revert", snapshot) is True
    first = anvil.send(store, selector("emitMany(uint256)") + word(50))["blockNumber"]
    last = anvil.send(store, selector("emitMany(uint256)") + word(1))["blockNumber"]
    pages = await _drain(lambda: proxy.result("eth_getFilterChanges", [own_id]))
    kept = [[log for log in page if not log.get("removed")] for page in pages]
    assert all(len(page) <= LIMIT for page in kept), [len(page) for page in pages]
    expected = anvil.rpc("eth_getLogs", {"address": store, "fromBlock": first, "toBlock": last})
    assert sorted(_key(log) for page in kept for log in page) == sorted(_key(log) for log in expected)
    assert len(expected) == 51
