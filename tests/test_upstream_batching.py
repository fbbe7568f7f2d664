"""Auto-batching: cache-miss reads that arrive together share one upstream HTTP request."""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.forwarded import FORWARDED, Forwarded, forwarding
from proxy.logs import Throttled
from proxy.metrics import Metrics
from proxy.upstream import pool
from proxy.upstream.batching import AutoBatcher
from proxy.upstream.pool import HttpUpstream
from proxy.values import Answer
from tests.fault_relay import FaultRelay
from tests.support import (
    Anvil,
    Proxy,
    ProxyFactory,
    balancer,
    selector,
    serving,
    settings_for,
    start_proxy,
    word,
)
from tests.test_check_command import check

STORE_FINAL = 66  # blocks mined after deploying, so the deploy block is final


@dataclass
class Relay:
    """An HTTP relay in front of a node that records each request's batch size (and body length)."""

    url: str = ""
    sizes: list[int] = field(default_factory=list)
    bodies: list[int] = field(default_factory=list)
    refused: int = 0  # batches refused


@asynccontextmanager
async def relay(
    target: str,
    *,
    refuse_batches: tuple[str, ...] = (),
    refuse_batches_over: int | None = None,
    max_body: int | None = None,
    slow_alone: float = 0.0,
    refusal_status: int = 200,
) -> AsyncIterator[Relay]:
    """`refuse_batches`: batches holding these methods are refused with one error object, and so are
    batches of more than `refuse_batches_over` calls (with HTTP status `refusal_status`); such a
    method's call sent alone is answered `slow_alone` seconds late; `max_body`: bodies longer than
    this are answered 413, as providers do."""
    record = Relay()
    session = aiohttp.ClientSession()

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        payload = json.loads(body)
        is_batch = isinstance(payload, list)
        # Clients' reads: not the tracker's polls, identity probes, nor the header asked beside a read
        # to show the node's chain (proofs.py).
        reads = [
            p
            for p in (payload if is_batch else [payload])
            if isinstance(p, dict)
            and p.get("method") not in ("eth_getBlockByNumber", "eth_blockNumber", "eth_chainId", "eth_syncing")
        ]
        if reads:
            record.bodies.append(len(body))
        if max_body is not None and len(body) > max_body:
            return web.Response(status=413, text="request entity too large")
        if is_batch and (
            any(p["method"] in refuse_batches for p in payload)
            or (refuse_batches_over is not None and len(payload) > refuse_batches_over)
        ):
            record.sizes.append(-len(reads))
            record.refused += 1
            return web.json_response(
                {
                    "jsonrpc": "2.0",
                    "id": None,
                    "error": {"code": -32600, "message": "batch requests are not supported"},
                },
                status=refusal_status,
            )
        if reads:
            record.sizes.append(len(reads))
        if not is_batch and payload.get("method") in refuse_batches:
            await asyncio.sleep(slow_alone)  # meanwhile the node takes other batches (the tracker's polls)
        async with session.post(target, data=body, headers={"Content-Type": "application/json"}) as resp:
            return web.Response(body=await resp.read(), content_type="application/json")

    try:
        async with serving(handle) as record.url:
            yield record
    finally:
        await session.close()


async def concurrent_storage_reads(anvil: Anvil, proxy: Proxy, count: int) -> list[dict[str, object]]:
    store = anvil.deploy_store()
    block = anvil.block_number()
    await proxy.head_at(anvil.mine(STORE_FINAL))
    requests = [proxy.call("eth_getStorageAt", [store, hex(slot), hex(block)], rid=slot) for slot in range(count)]
    return await asyncio.gather(*requests)


async def test_concurrent_misses_share_upstream_requests(anvil: Anvil) -> None:
    async with relay(anvil.url) as seen:
        # Inline, not make_proxy: closed inside the relay's `async with`, before what the relay saw is checked.
        # Verification off: its eth_getProof per final read is a call of its own (docs/caching.md).
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=seen.url, VERIFY_ANSWERS="off"))
        try:
            replies = await concurrent_storage_reads(anvil, proxy, 40)
        finally:
            await proxy.close()
    assert [r["id"] for r in replies] == list(range(40))
    assert replies[0]["result"] == "0x" + word(7) and all(r["result"] == "0x" + word(0) for r in replies[1:])
    assert sum(seen.sizes) == 40  # every call reached the node once
    assert len(seen.sizes) < 40 and max(seen.sizes) > 1  # but in fewer HTTP requests


async def test_upstream_batch_max_counts_the_header_beside_the_reads(anvil: Anvil) -> None:
    """Rule: UPSTREAM_BATCH_MAX is a provider's cap on a batch, the header asked beside the reads
    included: with a cap of 3, batches of 3 reads and their header were sent, refused, and the reads
    asked alone were never cached (an outside attack)."""
    async with relay(anvil.url, refuse_batches_over=3) as seen:
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=seen.url, UPSTREAM_BATCH_MAX="3", VERIFY_ANSWERS="off"))
        try:
            replies = await concurrent_storage_reads(anvil, proxy, 24)
            assert all("result" in r for r in replies)
            # No batch of reads refused (the tracker's polls, 4 tags, are: it then polls call by call).
            assert all(size >= 0 for size in seen.sizes) and max(seen.sizes) > 1, seen.sizes
        finally:
            await proxy.close()


async def test_batching_can_be_turned_off(anvil: Anvil) -> None:
    async with relay(anvil.url) as seen:
        # Inline, not make_proxy: closed inside the relay's `async with`, before what the relay saw is checked.
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=seen.url, UPSTREAM_BATCH_MAX="1", VERIFY_ANSWERS="off"))
        try:
            await concurrent_storage_reads(anvil, proxy, 10)
        finally:
            await proxy.close()
    assert seen.sizes == [1] * 10


async def test_a_node_that_refuses_batches_gets_each_call_alone(anvil: Anvil) -> None:
    async with relay(anvil.url, refuse_batches=("eth_getStorageAt",)) as seen:
        # Inline, not make_proxy: closed inside the relay's `async with`, before what the relay saw is checked.
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=seen.url))
        try:
            replies = await concurrent_storage_reads(anvil, proxy, 10)
        finally:
            await proxy.close()
    assert all("result" in r for r in replies)
    assert any(size < 0 for size in seen.sizes)  # a batch was refused ...
    assert sum(size for size in seen.sizes if size > 0) == 10  # ... and every call went alone


async def test_a_node_that_refuses_batches_is_said_to_be_served_uncached_by_serve_and_check(
    anvil: Anvil, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule: an upstream that refuses batches is never cached from (an answer is kept only beside its
    block's header, in one batch), and the operator is told so: `serve` logs a WARNING, and `check`
    says so rather than advising UPSTREAM_BATCH_MAX=1, which changed nothing (an outside attack: every
    call BYPASS, /readyz ready, no warning, and `check` failing the same whatever was set)."""
    monkeypatch.setattr(pool, "throttled", Throttled(pool.log))  # an earlier test's line does not hold this one back
    async with relay(anvil.url, refuse_batches=("eth_getStorageAt", "eth_chainId", "eth_getBlockByNumber")) as seen:
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=seen.url))
        try:
            await concurrent_storage_reads(anvil, proxy, 2)
        finally:
            await proxy.close()
        result = await asyncio.to_thread(check, tmp_path, EVM_UPSTREAM=seen.url, UPSTREAM_BATCH_MAX="1")
    warned = [r.getMessage() for r in caplog.records if "refused a JSON-RPC batch" in r.getMessage()]
    assert warned and "never cached" in warned[0]
    assert result.returncode == 1 and "served but never cached" in result.stdout, result.stdout
    assert "set UPSTREAM_BATCH_MAX=1" not in result.stdout


async def test_a_failed_batch_reaches_every_caller_as_a_json_rpc_error(anvil: Anvil) -> None:
    async with relay(anvil.url) as seen:
        # Inline, not make_proxy: closed inside the relay's `async with`, before what the relay saw is checked.
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=seen.url, UPSTREAM_TIMEOUT="2"))
        try:
            store = anvil.deploy_store()
            await proxy.head_at(anvil.mine(STORE_FINAL))
            anvil.stop()  # the node goes away behind the relay
            replies = await asyncio.gather(
                *(proxy.call("eth_getStorageAt", [store, hex(i), "0x1"], rid=i) for i in range(5))
            )
        finally:
            await proxy.close()
    assert [r["id"] for r in replies] == list(range(5))
    assert all(r["error"]["code"] == -32002 for r in replies)


def slow_params(method: str, store: str) -> list[Any]:
    return {
        "eth_call": [{"to": store, "data": "0x"}, "latest"],
        "eth_getBlockReceipts": ["latest"],
        "eth_getProof": [store, ["0x" + word(0)], "latest"],
    }[method]


@pytest.mark.parametrize("method", ["eth_call", "eth_getBlockReceipts", "eth_getProof"])
async def test_a_slow_call_never_fails_the_reads_that_arrived_with_it(
    anvil: Anvil, make_proxy: ProxyFactory, method: str
) -> None:
    """The rule: only a call that fails by itself fails. A call whose cost its params do not bound
    (code run by eth_call, a block's receipts, a client's proof of many slots) may take any time, so
    it never shares a batch: a node holding it past UPSTREAM_TIMEOUT fails that call alone, not the
    cheap reads of other clients that missed the cache in the same turn."""
    store = anvil.deploy_store()
    relay = await FaultRelay(anvil.url).start()
    try:
        proxy = await make_proxy(EVM_UPSTREAM=relay.url, UPSTREAM_TIMEOUT="1", VERIFY_ANSWERS="off")
        await proxy.head_at(anvil.block_number())
        relay.inject("slow", method=method, delay=2.0, times=None)  # held past UPSTREAM_TIMEOUT
        slow = {"jsonrpc": "2.0", "id": 0, "method": method, "params": slow_params(method, store)}
        reads = [
            {"jsonrpc": "2.0", "id": i, "method": "eth_getStorageAt", "params": [store, hex(i - 1), "latest"]}
            for i in range(1, 6)
        ]
        # One client batch: its calls miss the cache in the same turn, as concurrent clients' may.
        _, replies, _ = await proxy.post([slow, *reads])
        together = [methods for _, methods in relay.timeline if {method, "eth_getStorageAt"} <= set(methods)]
    finally:
        await relay.close()
    by_id = {reply["id"]: reply for reply in replies}
    assert by_id[0]["error"]["code"] == -32002  # the slow call fails by itself ...
    assert [by_id[i].get("result") for i in range(1, 6)] == ["0x" + word(7)] + ["0x" + word(0)] * 4  # ... alone
    assert together == []  # they never shared an HTTP request


class FaultyBatches(HttpUpstream):
    """An upstream whose batch path fails with a plain exception (a bug, not a node error)."""

    async def _batch_items(
        self, calls: Any, *, auto: bool, timeout: float | None, observed: int, bound: int
    ) -> tuple[list[Any] | None, float, int]:
        raise RuntimeError("broken batch path")


async def test_a_fault_in_a_batch_reaches_every_caller_and_none_waits_forever() -> None:
    upstream = FaultyBatches(
        "evm", ["http://127.0.0.1:9"], timeout=1, metrics=Metrics(CollectorRegistry()), batch_max=10
    )
    try:
        results = await asyncio.wait_for(
            asyncio.gather(
                *(upstream.request("eth_getStorageAt", ["0x" + "11" * 20, hex(i), "0x1"]) for i in range(3)),
                return_exceptions=True,
            ),
            timeout=5,
        )
    finally:
        await upstream.close()
    assert all(isinstance(r, RuntimeError) for r in results)


class Recorder:
    """AutoBatcher's three ways out, recording which took each call (and from which task)."""

    def __init__(self) -> None:
        self.alone: list[tuple[str, Any, asyncio.Task[Any] | None]] = []
        self.together: list[list[Any]] = []

    async def single(self, method: str, params: Any, timeout: float | None) -> Answer:
        return Answer.from_response({"result": ["single", params]}, 0.0, 0)

    async def by_itself(self, method: str, params: Any, block: str | None) -> Answer:
        self.alone.append((method, params, asyncio.current_task()))
        return Answer.from_response({"result": ["alone", params, block]}, 0.0, 0)

    async def with_others(self, calls: Any) -> list[Answer]:
        self.together.append([p for _, p, _ in calls])
        return [Answer.from_response({"result": ["together", p, b]}, 0.0, 0) for _, p, b in calls]

    def batcher(self) -> AutoBatcher:
        return AutoBatcher("evm", self.single, self.by_itself, self.with_others, batch_max=10, batch_max_bytes=1 << 20)


async def test_a_lone_call_is_sent_alone_from_its_own_task() -> None:
    recorder = Recorder()
    batcher = recorder.batcher()
    caller = asyncio.create_task(batcher.enqueue("eth_getStorageAt", [1], "0x5"))
    answer = await caller
    assert answer.result == ["alone", [1], "0x5"]
    assert recorder.alone == [("eth_getStorageAt", [1], caller)]  # no task of its own, no batch
    assert recorder.together == [] and not batcher._deliveries


async def test_calls_made_in_the_same_turn_go_together_and_a_later_one_alone() -> None:
    recorder = Recorder()
    batcher = recorder.batcher()
    first = [asyncio.create_task(batcher.enqueue("eth_getStorageAt", [i])) for i in range(3)]
    answers = await asyncio.gather(*first)
    assert [a.result for a in answers] == [["together", [i], None] for i in range(3)]
    assert recorder.together == [[[0], [1], [2]]]
    later = await batcher.enqueue("eth_getStorageAt", [9])
    assert later.result == ["alone", [9], None]


async def test_a_leader_cancelled_in_its_turn_leaves_the_others_to_go() -> None:
    """The rule: a call's leader going away never strands the calls that joined it."""
    for joined in (1, 2):
        recorder = Recorder()
        batcher = recorder.batcher()
        leader = asyncio.create_task(batcher.enqueue("eth_getStorageAt", ["leader"]))
        others = [asyncio.create_task(batcher.enqueue("eth_getStorageAt", [i])) for i in range(joined)]
        await asyncio.sleep(0)  # the leader has queued itself and yielded its turn, and the others joined it
        assert len(batcher._turn.queue) == 1 + joined
        leader.cancel()
        answers = await asyncio.wait_for(asyncio.gather(*others), timeout=5)
        assert leader.cancelled()
        if joined == 1:
            assert answers[0].result == ["alone", [0], None]
        else:
            assert [a.result for a in answers] == [["together", [i], None] for i in range(joined)]
        assert all("leader" not in c for c in recorder.together)
        later = await batcher.enqueue("eth_getStorageAt", ["next"])  # the batcher is not stuck leading
        assert later.result == ["alone", ["next"], None]


class Holding(Recorder):
    """A Recorder whose batches wait (for a budget, a connection) until `go` is set, then are written
    as HostPool.post writes a request: forwarding() first."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()
        self.go = asyncio.Event()

    async def with_others(self, calls: Any) -> list[Answer]:
        self.waiting.set()
        await self.go.wait()
        forwarding()
        return await super().with_others(calls)


async def test_a_call_whose_caller_left_while_its_batch_waited_is_never_written() -> None:
    """The rule (docs/keys-and-credits.md): a caller that left before a request made for it was
    written is given its credits back, so its call is never written afterwards; the others in its
    batch go without it, and a batch whose callers all left sends nothing."""
    for leaving in ({1}, {0, 1, 2}):
        recorder = Holding()
        batcher = recorder.batcher()
        marks = [Forwarded() for _ in range(3)]
        calls = []
        for i, mark in enumerate(marks):
            context = contextvars.copy_context()
            context.run(FORWARDED.set, mark)
            calls.append(asyncio.create_task(batcher.enqueue("eth_getStorageAt", [i]), context=context))
        await asyncio.wait_for(recorder.waiting.wait(), 5)  # the three in one batch, waiting
        for i in leaving:
            calls[i].cancel()
        outcomes = await asyncio.gather(*(calls[i] for i in leaving), return_exceptions=True)
        assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
        recorder.go.set()
        staying = [i for i in range(3) if i not in leaving]
        answers = await asyncio.wait_for(asyncio.gather(*(calls[i] for i in staying)), 5)
        await asyncio.wait_for(asyncio.gather(*batcher._deliveries), 5)
        assert [a.result for a in answers] == [["together", [i], None] for i in staying]
        assert recorder.together == ([[[i] for i in staying]] if staying else [])
        assert [mark.sent for mark in marks] == [i not in leaving for i in range(3)]


async def test_a_leader_left_alone_by_callers_that_left_while_its_batch_waited_is_sent_alone() -> None:
    """The rule: the others go without the callers that left, also when only the batch's first caller
    (its leader) stays: its call is sent alone and answered (it failed with an internal error)."""
    recorder = Holding()
    batcher = recorder.batcher()
    calls = [asyncio.create_task(batcher.enqueue("eth_getStorageAt", [i])) for i in range(3)]
    await asyncio.wait_for(recorder.waiting.wait(), 5)
    for call in calls[1:]:
        call.cancel()
    await asyncio.gather(*calls[1:], return_exceptions=True)
    recorder.go.set()
    answer = await asyncio.wait_for(calls[0], 5)
    assert answer.result == ["alone", [0], None]
    assert recorder.together == [] and [params for _, params, _ in recorder.alone] == [[0]]


async def asked_twice_behind_a_balancer(
    node: Anvil,
    member: Anvil,
    method: str,
    params: list[Any],
    **settings: str,
) -> tuple[dict[str, Any], dict[str, Any], Relay]:
    """`method` asked through a load balancer that refuses its batches: first while the balancer sends
    it to `member` (everything else reaches `node`), then again while it sends it to `node`."""
    reads_to = [member.url]

    def route(calls: list[dict[str, Any]]) -> str:
        return reads_to[0] if any(c.get("method") == method for c in calls) else node.url

    async with balancer(route) as members, relay(members, refuse_batches=(method,)) as seen:
        # Inline, not make_proxy: closed inside the relay's `async with`, before what the relay saw is checked.
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=seen.url, **settings))
        try:
            await proxy.head_at(node.block_number())
            served = await proxy.call(method, params)
            reads_to[0] = node.url
            return served, await proxy.call(method, params), seen
        finally:
            await proxy.close()


async def test_a_call_sent_alone_is_never_kept_on_a_header_another_member_may_have_given() -> None:
    """The rule: a node that refuses batches shows nothing of its chain beside a call. Asked alone, the
    call and the header of its block may reach different members of a load balancer, so the header
    proves nothing of the call: its answer is served, never kept."""
    node = Anvil()
    store = node.deploy_store()
    fork_at = node.block_number()
    diverged = Anvil("--fork-url", node.url, "--fork-block-number", str(fork_at))
    try:
        diverged.mine()  # its own block after the fork: x is still 7 there
        node.send(store, selector("setX(uint256)") + word(9))  # the chain's block: x = 9
        node.mine(STORE_FINAL)
        served, again, seen = await asked_twice_behind_a_balancer(
            node, diverged, "eth_getStorageAt", [store, "0x0", hex(fork_at + 1)]
        )
    finally:
        diverged.stop()
        node.stop()
    assert any(size < 0 for size in seen.sizes)  # the batch of the call and its header was refused
    assert served["result"] == "0x" + word(7)  # the other member's answer, served as the balancer gave it ...
    assert again["result"] == "0x" + word(9)  # ... but never kept: the chain's own answer when asked again


async def test_logs_sent_alone_are_never_kept_on_a_range_end_another_member_may_have_given() -> None:
    """The same rule for an unfinalized log range, whose last block is asked beside it: a lagging
    member's partial logs, asked alone, are served and never kept."""
    node = Anvil()
    store = node.deploy_store()
    first = node.block_number() + 1
    for _ in range(3):  # one log in each of three blocks
        node.send(store, selector("emitMany(uint256)") + word(1))
    lagging = Anvil("--fork-url", node.url, "--fork-block-number", str(first + 1))  # without the third
    try:
        node.mine(2)
        served, again, seen = await asked_twice_behind_a_balancer(
            node, lagging, "eth_getLogs", [{"address": store, "fromBlock": hex(first), "toBlock": hex(first + 2)}]
        )
    finally:
        lagging.stop()
        node.stop()
    assert any(size < 0 for size in seen.sizes)
    assert len(served.get("result", [])) < 3  # the lagging member's logs (or its range error), served ...
    assert len(again["result"]) == 3  # ... but never kept


async def test_a_final_range_in_pieces_is_never_kept_merged_when_a_piece_could_not_be_kept() -> None:
    """The rule for a chunked final range: its merge is kept only if every piece was (found by an
    outside attack: pieces asked alone were never kept, but their merge was, forever)."""
    node = Anvil()
    store = node.deploy_store()
    fork_at = node.block_number()
    diverged = Anvil("--fork-url", node.url, "--fork-block-number", str(fork_at))
    try:
        for _ in range(3):  # the chain's blocks: a log in each
            node.send(store, selector("emitMany(uint256)") + word(1))
        node.mine(100)
        diverged.mine(103)  # its own blocks at those heights: no logs
        log_filter = {"address": store, "fromBlock": hex(fork_at + 1), "toBlock": hex(fork_at + 25)}
        served, again, seen = await asked_twice_behind_a_balancer(
            node, diverged, "eth_getLogs", [log_filter], GETLOGS_CHUNK_BLOCKS="10"
        )
    finally:
        diverged.stop()
        node.stop()
    assert seen.refused
    assert served["result"] == []  # the other member's, served once ...
    assert len(again["result"]) == 3  # ... and never kept, neither piece by piece nor merged


@pytest.mark.parametrize("status", [200, 400, 413])
async def test_a_node_that_refuses_batches_still_gets_its_nulls_and_tags_served(anvil: Anvil, status: int) -> None:
    """The rule: an answer that cannot be shown beside its block (the node takes no batches), a null or
    a tag's, is served as the node gave it, never kept; it is not refused as a lagging member's (-32002).
    A node may refuse with one error object or with an HTTP error (400, 413: found by an outside attack)."""
    uncles = ("eth_getUncleByBlockHashAndIndex", "eth_getUncleByBlockNumberAndIndex", "eth_getLogs")
    store = anvil.deploy_store()
    anvil.send(store, selector("emitMany(uint256)") + word(2))
    logged = anvil.block_number()
    # Its calls alone come late, while the node takes other batches (the tracker's): a node that
    # refuses some batches, not all, is judged by the answer asked alone, not by the node's last batch.
    async with relay(anvil.url, refuse_batches=uncles, slow_alone=0.2, refusal_status=status) as seen:
        # Inline, not make_proxy: closed inside the relay's `async with`, before what the relay saw is checked.
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=seen.url))
        try:
            logs = [
                await proxy.call("eth_getLogs", [{"address": store, "fromBlock": hex(logged), "toBlock": tag}])
                for tag in (hex(logged), "latest")
            ]
            latest = anvil.mine(3)
            await proxy.head_at(latest)
            block = anvil.rpc("eth_getBlockByNumber", hex(latest - 1), False)["hash"]
            replies = [await proxy.call("eth_getUncleByBlockHashAndIndex", [block, "0x0"]) for _ in range(2)]
            # A null at a tag is asked again as the tag, beside the node's latest block (asking.py).
            tagged = [
                await proxy.call("eth_getUncleByBlockNumberAndIndex", [tag, "0x0"])
                for tag in ("latest", "safe", "latest")
            ]
        finally:
            await proxy.close()
    assert seen.refused
    assert [len(reply["result"]) for reply in logs] == [2, 2]
    assert replies == [{"jsonrpc": "2.0", "id": 1, "result": None}] * 2
    assert tagged == replies[:1] * 3
