"""The admin listener's POST /reload applies every change of NETWORKS_FILE without a restart: an
upstream or a network added, a network removed, upstreams replaced (by those of another chain
too: never served the old chain's entries), and a file that does not check refused whole."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from proxy.http.app_keys import SERVICE
from tests.fault_relay import FaultRelay
from tests.support import DEV_ACCOUNT, Anvil, Proxy, ProxyFactory, eventually, free_port
from tests.test_upstream_selection import (
    TOKEN,
    Meter,
    _admin,
    _asked,
    _balance_call,
    _most_in_one_second,
    _networks_file,
    _pool,
)
from tests.test_workers import _answers, _ready, _start, _stop
from tests.ws_client import connect

CHAIN_ID = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}


def _write(tmp_path: Path, networks: dict[str, list[str]]) -> str:
    """A NETWORKS_FILE of EVM networks, each with its upstream URLs."""
    lines = []
    for name, urls in networks.items():
        lines += [f"[networks.{name}]", 'family = "evm"', f"upstreams = {json.dumps(urls)}"]
    path = tmp_path / "networks.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


async def _admin_proxy(make_proxy: ProxyFactory, tmp_path: Path, networks: dict[str, list[str]]) -> tuple[Proxy, int]:
    port = free_port()
    proxy = await make_proxy(NETWORKS_FILE=_write(tmp_path, networks), ADMIN_PORT=str(port), ADMIN_TOKEN=TOKEN)
    for name in networks:
        await proxy.head_at(0, name)
    return proxy, port


async def _reload(proxy: Proxy, port: int) -> tuple[int, Any]:
    return await _admin(proxy.session, port, "/reload", method="POST")


async def test_an_upstream_added_by_a_reload_receives_calls(
    relays: list[FaultRelay], tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    proxy, port = await _admin_proxy(make_proxy, tmp_path, {"evm": [relays[0].url]})
    _write(tmp_path, {"evm": [relays[1].url, relays[0].url]})  # the new one first: priority asks it
    status, body = await _reload(proxy, port)
    assert status == 200 and body["replaced"] == ["evm"], body
    for _ in range(5):
        status, answer, _ = await proxy.post(_balance_call())
        assert status == 200 and answer["result"] == "0x0", answer
    assert _asked(relays[1], "eth_getBalance") == 5
    assert _pool(proxy).urls == (relays[1].url, relays[0].url)


async def test_a_network_added_by_a_reload_answers(
    relays: list[FaultRelay], tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    proxy, port = await _admin_proxy(make_proxy, tmp_path, {"evm": [relays[0].url]})
    status, body, _ = await proxy.post(CHAIN_ID, network="side")
    assert status == 404 and "unknown network 'side'" in body["error"]["message"]
    _write(tmp_path, {"evm": [relays[0].url], "side": [relays[1].url]})
    status, body = await _reload(proxy, port)
    assert status == 200 and body["added"] == ["side"] and body["replaced"] == [], body
    status, body, _ = await proxy.post(_balance_call(), network="side")
    assert status == 200 and body["result"] == "0x0", body
    assert _asked(relays[1], "eth_getBalance") == 1
    listing = (await _admin(proxy.session, port, "/upstreams"))[1]
    assert sorted(listing) == ["evm", "side"]


async def test_a_network_removed_by_a_reload_is_refused_and_its_polls_stop(
    anvil: Anvil,
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    proxy, port = await _admin_proxy(make_proxy, tmp_path, {"evm": [relays[0].url], "side": [relays[1].url]})
    polled = "rpc_proxy_head_last_poll_timestamp_seconds"
    assert proxy.registry.get_sample_value(polled, {"network": "side"}) is not None
    assert proxy.registry.get_sample_value("rpc_proxy_upstream_up", {"network": "side", "upstream": "0"}) == 1
    client = await connect(proxy)
    heads = await client.subscribe("newHeads")  # on evm, the default: not touched by the reload
    side = aiohttp.ClientSession()
    side_ws = await side.ws_connect(f"{proxy.base}/side/ws/v3/test-key")
    _write(tmp_path, {"evm": [relays[0].url]})
    status, body = await _reload(proxy, port)
    assert status == 200 and body["removed"] == ["side"], body
    status, body, _ = await proxy.post(CHAIN_ID, network="side")
    assert status == 404 and "unknown network 'side'" in body["error"]["message"]

    async def gauges_gone() -> bool:  # an alert on its head (or on its upstreams being up) would fire forever
        return all(
            proxy.registry.get_sample_value(name, labels) is None
            for name, labels in (
                (polled, {"network": "side"}),
                ("rpc_proxy_upstream_up", {"network": "side", "upstream": "0"}),
                ("rpc_proxy_network_unverifiable", {"network": "side"}),
            )
        )

    await eventually(gauges_gone, 10, "the removed network's gauges to go")
    assert proxy.registry.get_sample_value(polled, {"network": "evm"}) is not None
    # A connection opened on the network before the reload is refused the same way.
    await side_ws.send_str(json.dumps(CHAIN_ID))
    reply = json.loads((await side_ws.receive(timeout=10)).data)
    assert reply["id"] == 1 and "unknown network 'side'" in reply["error"]["message"], reply
    await side_ws.close()
    await side.close()

    start = anvil.block_number()
    for step in range(1, 4):  # each block seen by evm's tracker: its polls go on, side's have stopped
        anvil.mine(1)
        await client.notes_until(step)
        if step == 1:  # a poll interval or more after the swap: side's tasks were stopped by then
            asked = len(relays[1].calls)
    assert [int(h["number"], 16) for h in client.results(heads)] == [start + 1, start + 2, start + 3]
    assert len(relays[1].calls) == asked


async def test_a_replaced_upstream_on_another_chain_is_never_served_the_old_chains_entries(
    anvil: Anvil,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    other = Anvil("--chain-id", "4242")
    anvil.send(DEV_ACCOUNT, "0x")  # block 1 differs between the two chains (Anvil's genesis does not)
    anvil.mine(80)
    other.mine(81)
    proxy, port = await _admin_proxy(make_proxy, tmp_path, {"evm": [anvil.url]})
    block = {"jsonrpc": "2.0", "id": 1, "method": "eth_getBlockByNumber", "params": ["0x1", False]}
    try:
        client = await connect(proxy)
        heads = await client.subscribe("newHeads")
        old = (await proxy.post(block))[1]["result"]["hash"]
        assert (await proxy.post(block))[2]["X-Cache"] == "HIT"  # final: kept forever
        new = other.rpc("eth_getBlockByNumber", "0x1", False)["hash"]
        _write(tmp_path, {"evm": [other.url]})
        status, body = await _reload(proxy, port)
        assert status == 200 and body["replaced"] == ["evm"], body
        for _ in range(2):  # neither the old entry nor anything stored under it
            status, reply, _ = await proxy.post(block)
            assert status == 200 and reply["result"]["hash"] == new != old
        assert (await proxy.post(CHAIN_ID))[1]["result"] == hex(4242)
        # Its newHeads subscriber is told the subscription ended: blocks of another chain never follow.
        (note,) = await client.notes_until(1)
        assert note["params"]["subscription"] == heads and "another chain" in note["params"]["error"]["message"]
        assert client.results(heads) == []
    finally:
        other.stop()


async def test_subscribers_move_to_a_replaced_pool_on_the_same_chain_and_miss_no_block(
    anvil: Anvil,
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    proxy, port = await _admin_proxy(make_proxy, tmp_path, {"evm": [relays[0].url]})
    client = await connect(proxy)
    heads = await client.subscribe("newHeads")
    start = anvil.block_number()
    anvil.mine(1)
    await client.notes_until(1)
    _write(tmp_path, {"evm": [relays[1].url]})
    assert (await _reload(proxy, port))[0] == 200
    anvil.mine(2)
    await client.notes_until(3)
    assert [int(h["number"], 16) for h in client.results(heads)] == [start + 1, start + 2, start + 3]
    assert (await client.call("eth_unsubscribe", heads))["result"] is True


async def test_an_invalid_networks_file_is_400_and_nothing_is_applied(
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    proxy, port = await _admin_proxy(make_proxy, tmp_path, {"evm": [relays[0].url]})
    path = tmp_path / "networks.toml"
    before = proxy.app[SERVICE].networks["evm"]
    for text in (
        '[networks.evm]\nfamily = "evm"\nupstreams = [\n',  # not TOML
        f'[networks.evm]\nfamily = "evm"\nupstreams = ["{relays[1].url}"]\n'
        '[networks.Bad_Name]\nfamily = "evm"\nupstreams = ["http://127.0.0.1:1"]\n',
        f'[networks.evm]\nfamily = "evm"\nupstreams = ["{relays[1].url}"]\nhosts = ["a.example"]\n'
        '[networks.two]\nfamily = "evm"\nupstreams = ["http://127.0.0.1:1"]\nhosts = ["a.example"]\n',
    ):
        path.write_text(text)
        status, body = await _reload(proxy, port)
        assert status == 400 and "error" in body, body
        assert relays[1].url not in json.dumps(body)  # never a URL
        assert proxy.app[SERVICE].networks["evm"] is before and set(proxy.app[SERVICE].networks) == {"evm"}
    status, answer, _ = await proxy.post(_balance_call())
    assert answer["result"] == "0x0" and _asked(relays[1], "eth_getBalance") == 0


async def test_a_number_that_is_not_finite_is_400_naming_it_and_no_network_is_changed(
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    """Rule: inf, nan and 1e400 are refused before anything is applied, never half of a reload."""
    port = free_port()
    path = tmp_path / "networks.toml"
    table = '[networks.{}]\nfamily = "evm"\nupstreams = [{{url = "{}", max_rps = {}}}]\n'
    path.write_text(table.format("a", relays[0].url, 5) + table.format("b", relays[1].url, 5))
    proxy = await make_proxy(NETWORKS_FILE=str(path), ADMIN_PORT=str(port), ADMIN_TOKEN=TOKEN)
    for value in ("inf", "nan", "1e400"):
        path.write_text(table.format("a", relays[0].url, 7) + table.format("b", relays[1].url, value))
        status, body = await _reload(proxy, port)
        assert status == 400 and "networks.b.upstreams[0].max_rps must be a finite number" in body["error"], body
        status, listing = await _admin(proxy.session, port, "/upstreams")
        assert status == 200 and "Infinity" not in json.dumps(listing)
        assert [u["max_rps"] for n in ("a", "b") for u in listing[n]] == [5, 5], listing


async def test_a_number_out_of_its_range_is_400_naming_it_and_no_network_is_changed(
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    """Rule: a number past its documented range (one that would overflow when applied) is a 400 naming
    the field, never a 500 with a traceback, and nothing is applied."""
    port = free_port()
    path = tmp_path / "networks.toml"
    table = '[networks.{}]\nfamily = "evm"\nupstreams = [{{url = "{}", max_rps = 5{}}}]\n'
    path.write_text(table.format("a", relays[0].url, "") + table.format("b", relays[1].url, ""))
    proxy = await make_proxy(NETWORKS_FILE=str(path), ADMIN_PORT=str(port), ADMIN_TOKEN=TOKEN)
    huge = "1" + "0" * 400
    for extra, field in [
        (", max_units_per_second = 5e-324", "max_units_per_second"),
        (f", weight = {huge}", "weight"),
        (f", max_concurrency = {huge}", "max_concurrency"),
        (f", max_units_per_second = 10, default_cost = {huge}", "default_cost"),
    ]:
        path.write_text(table.format("a", relays[0].url, "") + table.format("b", relays[1].url, extra))
        status, body = await _reload(proxy, port)
        assert status == 400 and f"upstream #0: {field} " in body["error"], body
        status, listing = await _admin(proxy.session, port, "/upstreams")
        assert status == 200 and [u["max_rps"] for n in ("a", "b") for u in listing[n]] == [5, 5], listing


async def _queued_for_budget(
    make_proxy: ProxyFactory, relay: FaultRelay, tmp_path: Path, count: int
) -> tuple[Proxy, int, list[Any]]:
    """A proxy whose one upstream has max_rps 1, and `count` calls to it: one sent, the others waiting
    for its budget."""
    proxy, port = await _budgeted_proxy(make_proxy, tmp_path, [{"url": relay.url, "max_rps": 1}])
    calls = [asyncio.create_task(proxy.post(_balance_call())) for _ in range(count)]

    async def asked() -> bool:
        return _asked(relay, "eth_getBalance") >= 1

    await eventually(asked, 10, "the first call at the relay")
    return proxy, port, calls


async def _answered(calls: list[Any]) -> None:
    for status, answer, _ in await asyncio.gather(*calls):
        assert status == 200 and answer["result"] == "0x0", answer


async def _budgeted_proxy(make_proxy: ProxyFactory, tmp_path: Path, upstreams: list[Any]) -> tuple[Proxy, int]:
    """Network evm on `upstreams` (tables with budgets), polls rare so calls have the budget."""
    port = free_port()
    proxy = await make_proxy(
        NETWORKS_FILE=_networks_file(tmp_path, upstreams),
        ADMIN_PORT=str(port),
        ADMIN_TOKEN=TOKEN,
        HEAD_POLL_INTERVAL="5",
        UPSTREAM_BATCH_MAX="1",
    )
    await proxy.head_at(0)
    return proxy, port


async def test_calls_waiting_for_a_replaced_pools_budget_are_answered(
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    proxy, port, calls = await _queued_for_budget(make_proxy, relays[0], tmp_path, 4)
    _networks_file(tmp_path, [relays[1].url])  # three calls wait for the budget of the pool replaced
    status, body = await _reload(proxy, port)
    assert status == 200 and body["replaced"] == ["evm"], body
    await _answered(calls)


async def test_calls_waiting_for_a_budget_a_reload_raises_go_on_under_the_new_one(
    relays: list[FaultRelay],
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    proxy, port, calls = await _queued_for_budget(make_proxy, relays[0], tmp_path, 8)
    _networks_file(tmp_path, [{"url": relays[0].url, "max_rps": 100}])  # seven wait: 7 s under max_rps 1
    status, body = await _reload(proxy, port)
    assert status == 200 and body["replaced"] == [], body
    raised = time.monotonic()
    await _answered(calls)
    assert time.monotonic() - raised < 3.0


async def test_a_budget_a_reload_changes_goes_on_counting_the_window_it_had(
    anvil: Anvil,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    meter = Meter(anvil, tmp_path)
    try:
        proxy, port = await _budgeted_proxy(make_proxy, tmp_path, [{"url": meter.url, "max_rps": 2}])
        calls = [asyncio.create_task(proxy.post(_balance_call())) for _ in range(8)]

        async def answered() -> bool:
            return len(meter.spans()) >= 2

        await eventually(answered, 10, "calls at the meter")
        _networks_file(tmp_path, [{"url": meter.url, "max_rps": 3}])
        status, body = await _reload(proxy, port)
        assert status == 200 and body["replaced"] == [], body
        calls += [asyncio.create_task(proxy.post(_balance_call())) for _ in range(6)]
        await _answered(calls)
        assert _most_in_one_second(meter.arrivals()) <= 3
    finally:
        meter.stop()


async def test_a_reload_reaches_every_worker(relays: list[FaultRelay], tmp_path: Path) -> None:
    port = free_port()
    path = _write(tmp_path, {"main": [relays[0].url]})
    running = _start(relays[0].url, 2, NETWORKS_FILE=path, ADMIN_PORT=str(port), ADMIN_TOKEN=TOKEN)
    url = f"http://127.0.0.1:{running.port}/side/v3/any-key"
    try:
        async with aiohttp.ClientSession() as session:
            await _ready(session, running, 2)
            _write(tmp_path, {"main": [relays[0].url], "side": [relays[1].url]})
            status, body = await _admin(session, port, "/reload", method="POST")
            assert status == 200 and body["added"] == ["side"], body
            # The sibling took it before the answer: connections spread over both workers all find it.
            sessions = [aiohttp.ClientSession() for _ in range(8)]
            try:
                answers = await asyncio.gather(*(_answers(sessions[i % 8], url, _balance_call()) for i in range(16)))
            finally:
                for one in sessions:
                    await one.close()
            assert all(a is not None and a.get("result") == "0x0" for a in answers), answers
    finally:
        code, log = await _stop(running)
        assert code == 0, log


async def test_a_reload_whose_network_no_upstream_serves_is_refused_whole(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    """Rule: a reload that would leave a network with no upstream of the chain it declares (chain_id)
    is refused (409), the networks in force kept: it answered 200 "replaced", and the network served
    nothing (an outside attack)."""
    proxy, port = await _admin_proxy(make_proxy, tmp_path, {"evm": [anvil.url]})
    path = Path(_write(tmp_path, {"evm": [anvil.url]}))
    path.write_text(path.read_text() + "chain_id = 4242\n")  # Anvil's is 31337
    status, body = await _reload(proxy, port)
    assert status == 409 and "network 'evm': no upstream serves its chain" in body["error"], body
    status, answer, _ = await proxy.post(CHAIN_ID)
    assert status == 200 and answer["result"] == hex(31337), answer
    # The refused pool's gauges are not left in place of those in force (a false alert on a healthy network).
    assert proxy.metric("rpc_proxy_upstream_up", network="evm", upstream="0") == 1
    assert proxy.metric("rpc_proxy_upstream_identity_mismatch", network="evm", upstream="0") == 0
    _write(tmp_path, {"evm": [anvil.url]})
    status, body = await _reload(proxy, port)
    assert status == 200 and body["replaced"] == [], body


def test_a_restarted_worker_reads_networks_file_as_it_is_and_keeps_the_environments(tmp_path: Path) -> None:
    """Rule (a restarted worker reads NETWORKS_FILE as it is): the supervisor's start-up networks came
    back with a restarted worker, undoing a reload on it (an outside attack). A file that no longer
    loads leaves the start-up networks."""
    from proxy.config import build_settings
    from proxy.reload import as_files_are

    path = Path(_write(tmp_path, {"main": ["http://127.0.0.1:1"]}))
    started = build_settings({"EVM_UPSTREAM": "http://127.0.0.1:2", "NETWORKS_FILE": str(path)})
    _write(tmp_path, {"main": ["http://127.0.0.1:3"], "side": ["http://127.0.0.1:4"]})
    now = as_files_are(started)
    assert {n.name: n.upstreams for n in now.networks} == {
        "evm": ("http://127.0.0.1:2",),
        "main": ("http://127.0.0.1:3",),
        "side": ("http://127.0.0.1:4",),
    }
    path.write_text("[networks.main\n")
    assert as_files_are(started).networks == started.networks
