"""The workload benchmark's workloads (bench/workloads) get the node's answers through the proxy.

Each workload runs small through the proxy, and every request is sent to Anvil too at the same moment
(the chain holds still meanwhile): every answer must equal the node's, call by call. The caching outcomes
asserted here are only those of methods cached by their spec rule (eth_getLogs, eth_getBlockReceipts and
eth_call at final blocks), which do not depend on timing; the savings on the other reads are the
benchmark's to measure (`python -m bench.workloads`, figures in docs/benchmarks.md "Workloads").
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import aiohttp
import pytest

from bench.workloads import dapp, indexer, wallet
from bench.workloads.chain import Chain, ChainSpec, Miner, build_chain
from bench.workloads.rpc import Target
from tests.support import Anvil, Proxy, ProxyFactory

SMALL = ChainSpec(blocks=200, event_every=3, txs_per_block=2, transfers_per_tx=4, holders=40)


class Recorder:
    """The proxy's upstream calls (method, params) sent during each phase of a workload."""

    def __init__(self, proxy: Proxy) -> None:
        self.upstream = proxy.upstreams["evm"]
        self.marks: list[int] = []

    async def mark(self, _phase: str) -> None:
        self.marks.append(len(self.upstream.params))

    def phase(self, index: int) -> list[tuple[str, Any]]:
        return self.upstream.params[self.marks[index] : self.marks[index + 1]]

    def methods(self, index: int) -> Counter[str]:
        return Counter(method for method, _ in self.phase(index))


@pytest.fixture
async def chain(anvil: Anvil) -> Chain:
    return build_chain(anvil.url, SMALL)


@pytest.fixture
async def proxy(anvil: Anvil, redis_url: str, chain: Chain, make_proxy: ProxyFactory) -> Proxy:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, REDIS_URL=redis_url)
    await proxy.head_at(chain.head)
    return proxy


def mismatches(target: Target) -> list[Any]:
    assert target.pairs, "the workload sent nothing"
    assert all("error" not in pair.node for pair in target.pairs), "the workload itself is wrong"
    return [(p.method, p.params, p.proxy, p.node) for p in target.pairs if p.proxy != p.node]


class TestWindows:
    def test_windows_cover_the_range_each_overlapping_the_previous_by_half(self) -> None:
        assert indexer.windows(0, 2499, 1000) == [(0, 999), (500, 1499), (1000, 1999), (1500, 2499)]

    def test_the_last_window_stops_at_the_last_block(self) -> None:
        assert indexer.windows(0, 1100, 1000) == [(0, 999), (500, 1100)]


async def test_indexer_answers_equal_the_nodes_and_its_second_pass_gets_logs_and_receipts_from_cache(
    anvil: Anvil,
    chain: Chain,
    proxy: Proxy,
) -> None:
    recorder = Recorder(proxy)
    async with aiohttp.ClientSession() as session:
        target = Target(session, proxy.url(), mirror=anvil.url, on_phase=recorder.mark)
        await indexer.run(target, chain, window=40)
    assert mismatches(target) == []
    first, second = (phase.calls for phase in target.phases)
    assert first == second and first["eth_getBlockReceipts"] > 10
    # spec: final eth_getLogs ranges and eth_getBlockReceipts are immutable: the same windows again are free.
    assert recorder.methods(1)["eth_getLogs"] == 0
    assert recorder.methods(1)["eth_getBlockReceipts"] == 0


async def test_wallet_answers_equal_the_nodes_and_repeated_views_make_no_final_eth_call_upstream(
    anvil: Anvil,
    chain: Chain,
    proxy: Proxy,
) -> None:
    recorder = Recorder(proxy)
    finalized = anvil.rpc("eth_getBlockByNumber", "finalized", False)["number"]
    async with aiohttp.ClientSession() as session:
        target = Target(session, proxy.url(), mirror=anvil.url, on_phase=recorder.mark)
        await wallet.run(target, chain, addresses=30, views=3, batch=25)
    assert mismatches(target) == []
    assert [phase.name for phase in target.phases] == ["wallet first view", "wallet repeated views"]

    # spec: eth_call at a final block is immutable (the proxy asks the node by the block's number).
    def final_calls(phase: int) -> int:
        return sum(method == "eth_call" and params[1] == finalized for method, params in recorder.phase(phase))

    assert final_calls(0) == 30
    assert final_calls(1) == 0


async def test_dapp_pages_answers_equal_the_nodes_block_after_block(anvil: Anvil, chain: Chain, proxy: Proxy) -> None:
    async def settle(head: int) -> None:
        await proxy.head_at(head)

    async with aiohttp.ClientSession() as session:
        target = Target(session, proxy.url(), mirror=anvil.url, settle=settle)
        await dapp.run_lockstep(target, chain, Miner(session, chain), clients=8, blocks=3)
    assert mismatches(target) == []
    calls = target.phases[0].calls
    assert calls["eth_blockNumber"] == 8 * 3 and calls["eth_getTransactionReceipt"] == 8 * 3 * 2
