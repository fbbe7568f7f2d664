"""Keyed memory hits through a key's tab (hits.Tab): the key's checks are made once per secret and
its hits spend the key's lease directly, yet a reload of keys, lists and balances (lower ones too:
what was leased under the old balance is spent no more) and a new UTC day apply to the very next
hit, and the lease is still topped up and never overspent."""

from __future__ import annotations

import calendar
from pathlib import Path
from typing import Any

import pytest

from proxy.gateway.hits import NO_LEASE
from proxy.http.app_keys import GATEWAY, SETTINGS
from proxy.reload import reload_keys
from tests.support import Anvil, FakeClock, Proxy, ProxyFactory, settings_for

STORAGE = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": ["0x" + "11" * 20, "0x0", "latest"]}
COST = 80  # eth_getStorageAt's credits
ALICE = '[keys.alice]\nkey = "alice-secret"\n'


@pytest.fixture(params=["redis", "memory"])
def ledger_url(request: pytest.FixtureRequest) -> str:
    """Each rule holds for both ledgers: Redis's leases, and one process's own (no REDIS_URL), whose
    count is a lease of the whole balance the tab spends from just the same (ledger.MemoryLedger)."""
    return str(request.getfixturevalue("redis_url")) if request.param == "redis" else ""


async def keyed(
    make_proxy: ProxyFactory,
    anvil: Anvil,
    ledger_url: str,
    path: Path,
    text: str,
    clock: FakeClock | None = None,
    **extra: str,
) -> Proxy:
    """A proxy with the keys in `text` (written to `path`), and Redis and its leases when `ledger_url`."""
    path.write_text(text)
    redis = {"REDIS_URL": ledger_url} if ledger_url else {}
    settings = settings_for(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=str(path), **redis, **extra)
    proxy = await make_proxy(settings, clock=clock)
    await proxy.head_at(0)
    return proxy


def reload(proxy: Proxy, path: Path, text: str) -> None:
    """What SIGHUP does (app.py): the keys file, rewritten, read again into the gateway."""
    path.write_text(text)
    reload_keys(proxy.app[SETTINGS], proxy.app[GATEWAY])


async def hit(proxy: Proxy, key: str) -> tuple[int, Any, Any]:
    status, body, headers = await proxy.post(STORAGE, key=key)
    assert status != 200 or headers["X-Cache"] == "HIT", headers
    return status, body, headers


async def tabbed(proxy: Proxy, key: str, hits: int) -> list[int]:
    """`hits` memory hits for the key after a first call fills the cache; the balances they showed."""
    assert (await proxy.post(STORAGE, key=key))[0] == 200
    shown = []
    for _ in range(hits):
        status, _, headers = await hit(proxy, key)
        assert status == 200
        shown.append(int(headers["X-Credits-Remaining"]))
    tab = proxy.app[GATEWAY].tabs[key]  # the hits went through the key's tab...
    assert tab.lease is not NO_LEASE and tab.lease.consumed >= hits * COST  # ...and spent its lease directly
    return shown


async def test_a_key_a_reload_removes_is_refused_at_its_next_hit(
    anvil: Anvil, ledger_url: str, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    path = tmp_path / "keys.toml"
    proxy = await keyed(make_proxy, anvil, ledger_url, path, ALICE + '[keys.bob]\nkey = "bob-secret"\n')
    await tabbed(proxy, "alice-secret", 3)
    reload(proxy, path, '[keys.bob]\nkey = "bob-secret"\n')
    status, body, headers = await hit(proxy, "alice-secret")
    assert status == 401 and body["error"]["code"] == -32001 and headers["X-Credits-Charged"] == "0"
    assert (await hit(proxy, "bob-secret"))[0] == 200


async def test_a_list_a_reload_gives_a_key_applies_to_its_next_hit(
    anvil: Anvil,
    ledger_url: str,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    path = tmp_path / "keys.toml"
    proxy = await keyed(make_proxy, anvil, ledger_url, path, ALICE)
    await tabbed(proxy, "alice-secret", 3)
    reload(proxy, path, ALICE + 'allowed_methods = ["eth_chainId"]\n')
    status, body, headers = await proxy.post(STORAGE, key="alice-secret")
    assert status == 403 and "allowed_methods" in body["error"]["message"], body
    assert headers["X-Credits-Charged"] == "0"


async def test_a_balance_a_reload_raises_is_the_one_the_next_hit_shows(
    anvil: Anvil,
    ledger_url: str,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    path = tmp_path / "keys.toml"
    proxy = await keyed(make_proxy, anvil, ledger_url, path, ALICE + "daily_credits = 100000\n")
    assert await tabbed(proxy, "alice-secret", 3) == [100000 - COST * n for n in (2, 3, 4)]
    reload(proxy, path, ALICE + "daily_credits = 200000\n")
    assert (await hit(proxy, "alice-secret"))[2]["X-Credits-Remaining"] == str(200000 - COST * 5)


async def test_a_balance_a_reload_lowers_stops_the_key_there_though_its_lease_held_more(
    anvil: Anvil,
    ledger_url: str,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    path = tmp_path / "keys.toml"
    proxy = await keyed(make_proxy, anvil, ledger_url, path, ALICE + "daily_credits = 100000\n")
    await tabbed(proxy, "alice-secret", 3)  # 4 calls paid; the lease holds far more, granted under 100000
    reload(proxy, path, ALICE + f"daily_credits = {6 * COST}\n")
    shown = [(await hit(proxy, "alice-secret"))[:3:2] for _ in range(3)]
    assert [(status, headers["X-Credits-Remaining"]) for status, headers in shown] == [
        (200, str(COST)),
        (200, "0"),
        (402, "0"),
    ]


async def test_hits_after_midnight_utc_spend_the_new_days_balance_not_the_old_lease(
    anvil: Anvil,
    ledger_url: str,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    clock = FakeClock(calendar.timegm((2026, 11, 24, 23, 59, 59)))
    proxy = await keyed(make_proxy, anvil, ledger_url, tmp_path / "keys.toml", ALICE + "daily_credits = 1000\n", clock)
    assert await tabbed(proxy, "alice-secret", 2) == [1000 - 2 * COST, 1000 - 3 * COST]
    clock.advance(1.5)  # 00:00:00.5 UTC: the old day's lease still holds credits
    assert [int((await hit(proxy, "alice-secret"))[2]["X-Credits-Remaining"]) for _ in range(3)] == [
        1000 - COST,
        1000 - 2 * COST,
        1000 - 3 * COST,
    ]


async def test_hits_through_a_tab_top_up_the_lease_and_stop_exactly_at_the_balance(
    anvil: Anvil,
    ledger_url: str,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    # Leases of at most 4 hits: the tab's hits reach the low-water mark again and again.
    proxy = await keyed(
        make_proxy,
        anvil,
        ledger_url,
        tmp_path / "keys.toml",
        ALICE + "daily_credits = 2000\n",
        CREDITS_LEASE_MAX=str(4 * COST),
    )
    assert await tabbed(proxy, "alice-secret", 20) == [2000 - COST * n for n in range(2, 22)]  # each paid once
    for _ in range(4):
        assert (await hit(proxy, "alice-secret"))[0] == 200  # 25 calls x 80 = 2000: the whole balance
    status, body, headers = await hit(proxy, "alice-secret")
    assert status == 402 and headers["X-Credits-Remaining"] == "0", body
