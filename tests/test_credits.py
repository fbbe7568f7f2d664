"""Credits: fixed costs from daily balances, shared by replicas through Redis, never overdrawn."""

from __future__ import annotations

import asyncio
import calendar
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from proxy.credits.accounts import derived_name
from proxy.credits.ledger import MemoryLedger, Verdict
from proxy.credits.rate_window import NO_WINDOW, window_after, window_held
from proxy.http.app_keys import GATEWAY, SETTINGS
from proxy.reload import reload_keys
from tests.support import (
    ROOT,
    Anvil,
    FakeClock,
    Proxy,
    ProxyFactory,
    eventually,
    free_port,
    settings_for,
    start_proxy,
)


def keys_file(tmp_path: Path, **keys: dict[str, int]) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(
        "".join(
            f"[keys.{name}]\n" + "".join(f"{k} = {v}\n" for k, v in fields.items()) for name, fields in keys.items()
        )
    )
    return str(path)


def storage(rid: Any = 1, position: str = "0x0") -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": "eth_getStorageAt", "params": ["0x" + "11" * 20, position, "latest"]}


@pytest.fixture
async def keyed(anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory) -> Proxy:
    path = keys_file(tmp_path, alice={"daily_credits": 1000}, bob={})
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=path, DAILY_CREDITS="500")
    await proxy.head_at(0)
    return proxy


class TestMemoryLedger:
    async def test_debits_stop_at_the_daily_balance(self) -> None:
        ledger = MemoryLedger()
        assert (await ledger.debit("k", 60, daily=100, per_second=None, now=0)).verdict is Verdict.OK
        refused = await ledger.debit("k", 60, daily=100, per_second=None, now=0)
        assert refused.verdict is Verdict.EXHAUSTED and refused.remaining == 40

    async def test_a_new_utc_day_starts_a_new_balance(self) -> None:
        ledger = MemoryLedger()
        midnight = calendar.timegm((2026, 11, 22, 0, 0, 0))
        await ledger.debit("k", 100, daily=100, per_second=None, now=midnight - 1)
        assert (await ledger.debit("k", 1, daily=100, per_second=None, now=midnight - 0.5)).verdict is Verdict.EXHAUSTED
        assert (await ledger.debit("k", 1, daily=100, per_second=None, now=midnight)).verdict is Verdict.OK

    async def test_its_lease_is_its_one_count_whoever_spends_from_it(self) -> None:
        ledger = MemoryLedger()
        assert ledger.purse("k", 5.0) is None  # no lease before the key's first debit
        assert ledger.spend("k", 60, 1000, 5.0) == 940
        lease = ledger.purse("k", 5.0)
        assert lease is not None and lease.spend(100, 1000, 6.0) == 840  # the hot path (hits.Tab)
        assert await ledger.used("k", now=7.0) == 160 and ledger.spend("k", 40, 1000, 7.0) == 800
        await ledger.refund("k", 100, now=7.0)
        assert lease.spend(0, 1000, 8.0) == 900 and await ledger.used("k", now=8.0) == 100
        await ledger.refund("k", 10**6, now=8.0)  # never below nothing spent
        assert await ledger.used("k", now=8.0) == 0 and lease.spend(1000, 1000, 8.0) == 0
        assert lease.spend(1, 1000, 8.0) is None  # the whole balance spent: the ledger refuses
        assert (await ledger.debit("k", 1, daily=1000, per_second=None, now=8.0)).verdict is Verdict.EXHAUSTED

    async def test_a_new_balance_applies_to_its_lease_against_what_was_spent(self) -> None:
        ledger = MemoryLedger()
        ledger.spend("k", 300, 1000, 5.0)
        lease = ledger.purse("k", 5.0)
        assert lease is not None and lease.spend(10, 400, 5.0) is None  # a reload lowered it: the ledger decides
        assert ledger.spend("k", 100, 400, 5.0) == 0 and ledger.spend("k", 1, 400, 5.0) is None
        assert lease.spend(1, 400, 5.0) is None and ledger.spend("k", 600, 1000, 5.0) == 0  # raised again

    async def test_it_keeps_the_leases_of_the_latest_day_and_the_one_before_only(self) -> None:
        ledger = MemoryLedger()
        for day in range(5):
            ledger.spend("k", 10, 1000, day * 86400.0 + 5)
        assert [await ledger.used("k", now=day * 86400.0 + 5) for day in range(5)] == [0, 0, 0, 10, 10]
        await ledger.refund("k", 10, now=3 * 86400.0 + 5)  # yesterday's charge: back to yesterday
        assert await ledger.used("k", now=3 * 86400.0 + 6) == 0 and await ledger.used("k", now=4 * 86400.0) == 10


async def test_each_call_costs_its_spec_credits_and_headers_say_so(keyed: Proxy) -> None:
    status, _, headers = await keyed.post(storage(), key="alice")
    assert status == 200
    assert (headers["X-Credits-Charged"], headers["X-Credits-Remaining"]) == ("80", "920")
    _, _, headers = await keyed.post({"jsonrpc": "2.0", "id": 1, "method": "eth_chainId"}, key="alice")
    assert (headers["X-Credits-Charged"], headers["X-Credits-Remaining"]) == ("5", "915")  # prices.py's table
    _, _, headers = await keyed.post({"jsonrpc": "2.0", "id": 1, "method": "net_peerCount"}, key="alice")
    assert (headers["X-Credits-Charged"], headers["X-Credits-Remaining"]) == ("20", "895")  # DEFAULT_CREDITS


async def test_a_cache_hit_costs_the_same_as_a_miss(keyed: Proxy) -> None:
    for expected_cache in ("MISS", "HIT"):
        _, _, headers = await keyed.post(storage(), key="alice")
        assert headers["X-Cache"] == expected_cache and headers["X-Credits-Charged"] == "80"
    assert keyed.metric("rpc_proxy_upstream_credits_saved_total", network="evm", method="eth_getStorageAt") == 80


async def test_a_paid_hit_carries_the_same_headers_whether_its_head_is_pre_built_or_not(keyed: Proxy) -> None:
    await keyed.post(storage(), key="alice")  # a miss: the next ones are memory hits
    _, plain_body, plain = await keyed.post(storage(), key="alice")  # the fast server's pre-built head
    _, page_body, page = await keyed.post(storage(), key="alice", headers={"Origin": "https://app.example"})
    names = ("X-Credits-Charged", "X-Credits-Remaining", "X-Cache", "Content-Type")
    assert [plain[n] for n in names] == ["80", "840", "HIT", "application/json"]
    assert [page[n] for n in names] == ["80", "760", "HIT", "application/json"] and plain_body == page_body
    assert page["Access-Control-Allow-Origin"] == "*" and "Access-Control-Allow-Origin" not in plain


async def test_exhausted_balance_is_402_and_nothing_is_forwarded(keyed: Proxy) -> None:
    for i in range(12):  # 12 x 80 = 960 of alice's 1000
        assert (await keyed.post(storage(i, hex(i)), key="alice"))[0] == 200
    calls_before = keyed.upstreams["evm"].calls["eth_getStorageAt"]
    status, reply, headers = await keyed.post(storage(99, "0x99"), key="alice")
    assert status == 402 and reply["id"] == 99
    assert reply["error"]["code"] == -32005 and "daily credit limit reached" in reply["error"]["message"]
    assert (headers["X-Credits-Charged"], headers["X-Credits-Remaining"]) == ("0", "40")
    assert keyed.upstreams["evm"].calls["eth_getStorageAt"] == calls_before
    assert keyed.metric("rpc_proxy_credit_rejections_total", reason="exhausted") == 1
    # Counted as refused on its network (an outside tester saw network "none", outcome "invalid").
    assert keyed.metric("rpc_proxy_requests_total", network="evm", method="eth_getStorageAt", outcome="refused") == 1
    assert keyed.metric("rpc_proxy_requests_total", network="none", method="eth_getStorageAt", outcome="invalid") == 0


async def test_every_call_in_a_batch_is_charged(keyed: Proxy) -> None:
    batch = [storage(1), {"jsonrpc": "2.0", "id": 2, "method": "eth_getLogs", "params": [{}]}]
    status, body, headers = await keyed.post(batch, key="alice")
    assert status == 200 and [b["id"] for b in body] == [1, 2]
    assert headers["X-Credits-Charged"] == str(80 + 255)
    # The older-form table [keys.alice] makes "alice" the secret: the label is its derived name.
    assert keyed.metric("rpc_proxy_key_credits_charged_total", key=derived_name("alice")) == 335
    assert keyed.metric("rpc_proxy_credits_charged_total", method="eth_getLogs") == 255


async def test_a_batch_that_cannot_be_paid_in_full_is_refused_in_full(keyed: Proxy) -> None:
    batch = [{"jsonrpc": "2.0", "id": i, "method": "eth_getBlockReceipts", "params": ["latest"]} for i in range(2)]
    status, body, headers = await keyed.post(batch, key="alice")  # 2000 > 1000
    assert status == 402 and all(item["error"]["code"] == -32005 for item in body)
    assert headers["X-Credits-Charged"] == "0"
    assert keyed.upstreams["evm"].calls["eth_getBlockReceipts"] == 0
    status, _, headers = await keyed.post(batch[:1], key="alice")  # one alone fits
    assert status == 200 and headers["X-Credits-Charged"] == "1000"


async def test_invalid_calls_cost_nothing(keyed: Proxy) -> None:
    _, reply, headers = await keyed.post(storage() | {"params": ["0x12", "0x0", "latest"]}, key="alice")
    assert reply["error"]["code"] == -32602 and headers["X-Credits-Charged"] == "0"


async def test_default_daily_credits_apply_to_keys_without_their_own(keyed: Proxy) -> None:
    for i in range(6):  # 6 x 80 = 480 of DAILY_CREDITS=500
        assert (await keyed.post(storage(i, hex(i)), key="bob"))[0] == 200
    assert (await keyed.post(storage(), key="bob"))[0] == 402


async def test_websocket_messages_refused_for_credits_each_get_an_error(keyed: Proxy) -> None:
    async with keyed.session.ws_connect(keyed.ws_url("alice")) as ws:
        for i in range(14):
            await ws.send_str(json.dumps(storage(i, hex(i))))
        replies = [json.loads((await ws.receive(timeout=5)).data) for _ in range(14)]
    refused = [r for r in replies if "error" in r]
    assert len(refused) == 2 and all("daily credit limit" in r["error"]["message"] for r in refused)


async def test_open_mode_charges_nothing(evm_proxy: Proxy) -> None:
    _, _, headers = await evm_proxy.post(storage())
    assert (headers["X-Credits-Charged"], headers["X-Credits-Remaining"]) == ("0", "unlimited")


async def test_credits_per_second_limit_is_429_with_retry_after(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    path = keys_file(tmp_path, carol={"credits_per_second": 100})
    clock = FakeClock()
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=path, clock=clock)
    assert (await proxy.post(storage(1), key="carol"))[0] == 200
    status, reply, headers = await proxy.post(storage(2), key="carol")
    assert status == 429 and headers["Retry-After"] == "1" and "rate limit" in reply["error"]["message"]
    clock.advance(1)
    assert (await proxy.post(storage(3), key="carol"))[0] == 200


@pytest.mark.parametrize("shared", [False, True], ids=["in-process", "redis"])
async def test_a_batch_dearer_than_the_per_second_limit_fills_the_seconds_after_it_and_each_key_has_its_own_window(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory, request: pytest.FixtureRequest, shared: bool
) -> None:
    # The per-second limit holds on average: one call of any size is admitted in an empty window,
    # and what it passes the limit by is refused in the seconds after it, not forgotten.
    path = keys_file(tmp_path, carol={"credits_per_second": 100}, dave={"credits_per_second": 100})
    clock = FakeClock()
    extra = {"REDIS_URL": request.getfixturevalue("redis_url")} if shared else {}
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=path, clock=clock, **extra)
    assert (await proxy.post(storage(1), key="carol"))[0] == 200
    assert (await proxy.post(storage(2), key="dave"))[0] == 200  # dave's spending leaves carol's window as it is
    assert (await proxy.post(storage(3), key="carol"))[0] == 429
    clock.advance(1)
    status, replies, headers = await proxy.post([storage(i, hex(i)) for i in range(5)], key="carol")
    assert status == 200 and len(replies) == 5 and headers["X-Credits-Charged"] == "400"  # 4 seconds' worth
    for _ in range(4):  # this second and the three after it are spent
        status, reply, headers = await proxy.post(storage(9), key="carol")
        assert status == 429 and headers["Retry-After"] == "1", reply
        clock.advance(1)
    assert (await proxy.post(storage(9), key="carol"))[0] == 200


def test_a_per_second_window_carries_a_dearer_calls_excess_into_the_seconds_after_it() -> None:
    assert window_after(NO_WINDOW, 10, 80, 100) == (10, 10, 80)
    assert window_after((10, 10, 80), 10, 20, 100) == (10, 10, 100)  # the second filled exactly
    assert window_after(NO_WINDOW, 10, 400, 100) == (10, 13, 100)  # seconds 10 to 13
    assert window_after(NO_WINDOW, 10, 450, 100) == (10, 14, 50)
    assert [window_held((10, 14, 50), second, 100) for second in (9, 10, 13, 14, 15)] == [100, 100, 100, 50, 0]
    assert window_after((10, 13, 100), 11, 0, 100) == (10, 13, 100)  # a free call keeps what a dearer one carried
    # A call judged late (another replica's, out of order) counts in the newest second, never as full.
    assert window_held((11, 11, 30), 10, 100) == 30 and window_after((11, 11, 30), 10, 50, 100) == (11, 11, 80)


async def test_balances_reset_at_midnight_utc(anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory) -> None:
    path = keys_file(tmp_path, alice={"daily_credits": 100})
    clock = FakeClock(calendar.timegm((2026, 11, 21, 23, 59, 59)))
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=path, clock=clock)
    assert (await proxy.post(storage(1), key="alice"))[0] == 200
    assert (await proxy.post(storage(2), key="alice"))[0] == 402
    clock.advance(1.5)  # 00:00:00.5 UTC
    status, _, headers = await proxy.post(storage(3), key="alice")
    assert status == 200 and headers["X-Credits-Remaining"] == "20"


async def test_upstream_failures_are_not_charged(tmp_path: Path, make_proxy: ProxyFactory) -> None:
    path = keys_file(tmp_path, alice={"daily_credits": 1000})
    proxy = await make_proxy(EVM_UPSTREAM=f"http://127.0.0.1:{free_port()}", API_KEYS_FILE=path)
    status, reply, headers = await proxy.post(storage(), key="alice")
    assert status == 502 and reply["error"]["code"] == -32002
    assert (headers["X-Credits-Charged"], headers["X-Credits-Remaining"]) == ("0", "1000")


# --- shared by replicas through Redis --------------------------------------------------------


async def two_replicas(
    anvil: Anvil, redis_url: str, tmp_path: Path, make_proxy: ProxyFactory, *, reads: int
) -> tuple[Proxy, Proxy]:
    """Two replicas on one Redis, and a key `alice` whose balance pays exactly `reads` storage reads."""
    path = keys_file(tmp_path, alice={"daily_credits": 80 * reads})
    settings = settings_for(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=path, REDIS_URL=redis_url)
    return await make_proxy(settings), await make_proxy(settings)


async def test_concurrent_debits_on_two_replicas_never_overdraw(
    anvil: Anvil, redis_url: str, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    first, second = await two_replicas(anvil, redis_url, tmp_path, make_proxy, reads=40)
    requests = [(first if i % 2 else second).post(storage(i, hex(i)), key="alice") for i in range(100)]
    statuses = [status for status, _, _ in await asyncio.gather(*requests)]
    assert statuses.count(200) == 40 and statuses.count(402) == 60
    _, _, headers = await first.post(storage(), key="alice")
    assert headers["X-Credits-Remaining"] == "0"


async def test_a_replica_whose_lease_cannot_pay_is_served_from_credit_another_replica_holds(
    anvil: Anvil, redis_url: str, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    # "replicas share the balance exactly": a call is refused 402 only when the key's balance cannot
    # pay it, never because another replica (a worker, a host) holds the rest in its lease.
    first, second = await two_replicas(anvil, redis_url, tmp_path, make_proxy, reads=4)
    await first.head_at(0)
    await second.head_at(0)
    # The first replica's lease holds a second call's credit; the second replica spends the rest.
    order = [first, second, second, second]
    statuses = [(await proxy.post(storage(i, hex(i)), key="alice"))[0] for i, proxy in enumerate(order)]
    assert statuses == [200, 200, 200, 200]
    status, reply, _ = await first.post(storage(9, hex(9)), key="alice")
    assert status == 402 and "0 left today" in reply["error"]["message"], reply


async def test_a_call_waiting_for_credit_another_replica_holds_is_judged_under_a_reload_that_lands_meanwhile(
    anvil: Anvil, redis_url: str, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    # "a call still in flight for it when the reload lands is refused (402)": asking again for credit
    # held elsewhere asks under the key's terms then in force, not those the call came with.
    first, second = await two_replicas(anvil, redis_url, tmp_path, make_proxy, reads=4)
    for i, proxy in enumerate([first, second, second]):
        assert (await proxy.post(storage(i, hex(i)), key="alice"))[0] == 200
    waiting = asyncio.create_task(second.post(storage(9, hex(9)), key="alice"))  # the first replica holds it
    ledger = redis.Redis.from_url(redis_url)

    async def wanted() -> bool:
        return any(ledger.hexists(name, "w") for name in ledger.scan_iter("rcp:credits:*"))

    await eventually(wanted, timeout=5, what="the second replica to find the credit held elsewhere")
    Path(tmp_path / "keys.toml").write_text("[keys.bob]\n")  # alice removed
    for proxy in (first, second):
        reload_keys(proxy.app[SETTINGS], proxy.app[GATEWAY])
    status, reply, _ = await waiting
    assert status == 402 and reply["error"]["code"] == -32005, reply


def test_operator_cli_shows_a_keys_usage_from_redis(anvil: Anvil, redis_url: str, tmp_path: Path) -> None:
    path = keys_file(tmp_path, alice={"daily_credits": 1000})

    async def spend() -> None:
        # Inline, not make_proxy: this sync test runs the proxy in an event loop of its own
        # (asyncio.run), and closes it before the CLI reads the usage it spent.
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=path, REDIS_URL=redis_url))
        try:
            await proxy.post(storage(), key="alice")
            await proxy.post({"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [{}]}, key="alice")
        finally:
            await proxy.close()

    asyncio.run(spend())
    env = {"PATH": "/usr/bin:/bin", "REDIS_URL": redis_url, "API_KEYS_FILE": path}
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "keys", "usage", "alice"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert f"key {derived_name('alice')}: 335 credits used, 665 left of 1000" in result.stdout
    unknown = subprocess.run(
        [sys.executable, "-m", "proxy", "keys", "usage", "mallory"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert unknown.returncode == 2 and "not configured" in unknown.stderr


async def test_a_hit_refused_for_credits_is_neither_served_nor_counted(keyed: Proxy) -> None:
    for _ in range(12):  # one miss, then eleven hits: 960 of alice's 1000
        assert (await keyed.post(storage(), key="alice"))[0] == 200
    hits = keyed.metric("rpc_proxy_cache_lookups_total", tier="memory", result="hit")
    saved = keyed.metric("rpc_proxy_upstream_credits_saved_total", network="evm", method="eth_getStorageAt")
    assert (hits, saved) == (11, 11 * 80)
    status, reply, headers = await keyed.post(storage(), key="alice")
    assert status == 402 and "result" not in reply and headers["X-Credits-Charged"] == "0"
    assert headers["X-Cache"] == "BYPASS" and reply["error"]["code"] == -32005
    assert keyed.metric("rpc_proxy_cache_lookups_total", tier="memory", result="hit") == hits
    assert keyed.metric("rpc_proxy_upstream_credits_saved_total", network="evm", method="eth_getStorageAt") == saved
