"""The credit ledger from outside: two replicas sharing one Redis, a busy machine, Redis stopped,
restarted empty or full. Exact balances, nothing lost, nothing regained."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis

from proxy.config import Settings
from proxy.credits.accounts import derived_name
from proxy.credits.lease_exchange import ledger_key
from proxy.credits.leases import LeasedLedger
from proxy.http.app_keys import LEDGER
from tests.support import ROOT, Anvil, Proxy, RedisServer, eventually, settings_for, start_proxy
from tests.test_credits import keys_file, storage

# keys_file writes older-form tables ([keys.alice]: "alice" is the secret), named by a hash prefix.
ALICE = derived_name("alice")


@pytest.fixture
def busy_machine() -> Iterator[None]:
    """A CPU burner beside the test: the event loops and Redis answer late, as under real load."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    burner.kill()
    burner.wait()


@asynccontextmanager
async def two_replicas(settings: Settings) -> AsyncIterator[tuple[Proxy, Proxy]]:
    # Inline, not make_proxy: the replicas close at the end of the `async with`, before the tests read the ledger
    # (closing gives the leases back).
    first = await start_proxy(settings)
    try:
        second = await start_proxy(settings)
        try:
            await first.head_at(0)
            await second.head_at(0)
            yield first, second
        finally:
            await second.close()
    finally:
        await first.close()


def ledger_used(url: str, key: str) -> int:
    client = sync_redis.Redis.from_url(url)
    try:
        return int(client.hget(ledger_key(key, int(time.time()) // 86400), "used") or 0)
    finally:
        client.close()


async def warm(*replicas: Proxy) -> None:
    """Answer the calls once with a key of its own, so the measured calls are memory hits."""
    for replica in replicas:
        for position in ("0x0", "0x1"):
            assert (await replica.post(storage(1, position), key="warm"))[0] == 200


def keyed_settings(anvil: Anvil, redis_url: str, tmp_path: Path, daily: int, **extra: str) -> Settings:
    path = keys_file(tmp_path, alice={"daily_credits": daily}, warm={"daily_credits": 10**9})
    return settings_for(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=path, REDIS_URL=redis_url, **extra)


# --- exact under load --------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [False, True], ids=["calls", "batches"])
async def test_400_concurrent_requests_on_two_busy_replicas_spend_exactly_the_credit_for_10(
    anvil: Anvil,
    redis_url: str,
    tmp_path: Path,
    busy_machine: None,
    batch: bool,
) -> None:
    bodies: list[Any] = [[storage(1, "0x0"), storage(2, "0x1")]] if batch else [storage(i) for i in range(400)]
    price = 160 if batch else 80
    async with two_replicas(keyed_settings(anvil, redis_url, tmp_path, price * 10)) as (first, second):
        await warm(first, second)
        replies = await asyncio.gather(
            *((first, second)[i % 2].post(bodies[i % len(bodies)], key="alice") for i in range(400))
        )
        statuses = [status for status, _, _ in replies]
        assert (statuses.count(200), statuses.count(402)) == (10, 390)
        paid = [body for status, body, _ in replies if status == 200]
        assert all("result" in item for body in paid for item in (body if batch else [body]))
        assert sum(int(headers["X-Credits-Charged"]) for _, _, headers in replies) == price * 10
    assert ledger_used(redis_url, ALICE) == price * 10


async def test_400_concurrent_websocket_messages_on_two_busy_replicas_spend_exactly_the_credit_for_10(
    anvil: Anvil,
    redis_url: str,
    tmp_path: Path,
    busy_machine: None,
) -> None:
    async with two_replicas(keyed_settings(anvil, redis_url, tmp_path, 80 * 10)) as (first, second):
        await warm(first, second)

        async def connection(replica: Proxy, messages: int) -> list[dict[str, Any]]:
            async with replica.session.ws_connect(replica.ws_url("alice")) as ws:
                for i in range(messages):
                    await ws.send_str(json.dumps(storage(i)))
                return [json.loads((await ws.receive(timeout=60)).data) for _ in range(messages)]

        replies = [
            r
            for batch in await asyncio.gather(*(connection((first, second)[i % 2], 50) for i in range(8)))
            for r in batch
        ]
        assert len(replies) == 400
        assert sum("result" in r for r in replies) == 10
        assert all("daily credit limit" in r["error"]["message"] for r in replies if "error" in r)
    assert ledger_used(redis_url, ALICE) == 800


# --- Redis stopped mid-load --------------------------------------------------------------------


@dataclass
class Answered:
    replica: int
    started_in: int  # the phase when the request was sent: 0 before the outage, 1 during, 2 after
    finished_in: int
    status: int
    charged: int
    remaining: int | None


async def test_redis_stopped_mid_load_loses_no_usage_and_gives_no_credit_back(
    anvil: Anvil,
    redis_server: RedisServer,
    redis_url: str,
    tmp_path: Path,
) -> None:
    settings = keyed_settings(
        anvil,
        redis_url,
        tmp_path,
        3_000_000,
        REDIS_TIMEOUT="0.1",
        CREDITS_REDIS_TIMEOUT="0.3",
        CREDITS_REDIS_FAILURES="2",
        CREDITS_LEASE_MAX="4000",
        CREDITS_LEASE_SECONDS="60",
    )
    assert redis_server.proc is not None
    phase = 0
    answered: list[Answered] = []
    async with two_replicas(settings) as replicas:
        await warm(*replicas)

        async def worker(index: int) -> None:
            replica = replicas[index % 2]
            n = 0
            while phase < 3:
                n += 1
                started = phase
                status, _, headers = await replica.post(storage(n, ("0x0", "0x1")[n % 2]), key="alice")
                remaining = headers["X-Credits-Remaining"]
                answered.append(
                    Answered(
                        index % 2,
                        started,
                        phase,
                        status,
                        int(headers["X-Credits-Charged"]),
                        int(remaining) if remaining.isdigit() else None,
                    )
                )

        workers = [asyncio.create_task(worker(i)) for i in range(8)]
        try:
            await eventually(lambda: _at_least(answered, 200), 30, "load before the outage")
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            phase = 1
            await asyncio.sleep(5)  # the outage under test lasts 5 s
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        phase = 2
        ledgers = [r.app[LEDGER] for r in replicas]
        assert all(isinstance(ledger, LeasedLedger) for ledger in ledgers)

        async def settled() -> bool:
            return all(ledger.settled for ledger in ledgers if isinstance(ledger, LeasedLedger))

        await eventually(settled, 30, "journaled debits written back")
        phase = 3
        await asyncio.gather(*workers)

    during = [a for a in answered if a.started_in == 1]
    assert any(a.status == 200 for a in during), "calls during the outage were refused instead of charged"
    for replica in (0, 1):
        before = min(
            a.remaining for a in answered if a.replica == replica and a.finished_in == 0 and a.remaining is not None
        )
        later = [a.remaining for a in answered if a.replica == replica and a.started_in >= 1 and a.remaining]
        assert later and max(later) <= before
    # Both replicas gave their leases back on close: Redis holds exactly what was charged.
    assert ledger_used(redis_url, ALICE) == sum(a.charged for a in answered)


async def _at_least(items: list[Answered], count: int) -> bool:
    return len(items) >= count


# --- Redis restarted empty, or the entry deleted ----------------------------------------------


@pytest.mark.parametrize("loss", ["restart", "delete"])
async def test_a_ledger_entry_lost_while_replicas_hold_leases_gives_no_credit_back(
    anvil: Anvil,
    redis_server: RedisServer,
    redis_url: str,
    tmp_path: Path,
    loss: str,
) -> None:
    async with two_replicas(keyed_settings(anvil, redis_url, tmp_path, 80 * 40)) as replicas:
        await warm(*replicas)
        served = 0
        for i in range(10):
            served += (await replicas[i % 2].post(storage(i), key="alice"))[0] == 200
        if loss == "restart":
            redis_server.stop()
            redis_server.start()  # empty: no persistence
        else:
            client = sync_redis.Redis.from_url(redis_url)
            client.delete(ledger_key(ALICE, int(time.time()) // 86400))
            client.close()
        for i in range(100):
            served += (await replicas[i % 2].post(storage(i), key="alice"))[0] == 200
        assert served <= 40  # every replica came back, so the documented bound is exact here


# --- eviction --------------------------------------------------------------------------------


async def test_filling_the_cache_redis_to_its_limit_leaves_every_ledger_entry_intact(
    anvil: Anvil,
    tmp_path: Path,
) -> None:
    cache = RedisServer("--maxmemory", "30mb", "--maxmemory-policy", "allkeys-lru")
    ledger = RedisServer("--maxmemory-policy", "noeviction")
    try:
        path = keys_file(tmp_path, alice={"daily_credits": 240}, bob={"daily_credits": 10**6}, warm={})
        settings = settings_for(
            EVM_UPSTREAM=anvil.url, API_KEYS_FILE=path, REDIS_URL=cache.url, CREDITS_REDIS_URL=ledger.url
        )
        # Inline, not make_proxy: closed before the ledger entries are read, and before both Redis servers stop.
        proxy = await start_proxy(settings)
        try:
            await proxy.head_at(0)
            for i in range(4):
                await proxy.post(storage(i), key="alice")  # three paid, the fourth refused
            await proxy.post(storage(), key="bob")
            client = sync_redis.Redis.from_url(cache.url)
            filler = b"x" * 1024 * 1024
            for i in range(60):
                client.set(f"rcp:c:filler{i}", filler)
            assert int(client.info("stats")["evicted_keys"]) > 0
            client.close()
            status, _, headers = await proxy.post(storage(9, "0x9"), key="alice")
            assert status == 402 and headers["X-Credits-Remaining"] == "0"
        finally:
            await proxy.close()
        assert ledger_used(ledger.url, ALICE) == 240 and ledger_used(ledger.url, derived_name("bob")) == 80
    finally:
        cache.stop()
        ledger.stop()


async def test_an_evicting_ledger_redis_is_named_in_a_startup_warning(
    anvil: Anvil,
    caplog: pytest.LogCaptureFixture,
) -> None:
    evicting = RedisServer("--maxmemory", "30mb", "--maxmemory-policy", "allkeys-lru")
    try:
        # Inline, not make_proxy: started and closed while the evicting Redis runs.
        proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, API_KEYS="k1", REDIS_URL=evicting.url))
        await proxy.close()
    finally:
        evicting.stop()
    warnings = [r.getMessage() for r in caplog.records if r.name == "proxy.credits"]
    assert any("allkeys-lru" in w and "CREDITS_REDIS_URL" in w for w in warnings)


def test_an_evicting_ledger_redis_is_refused_when_noeviction_is_required(anvil: Anvil, tmp_path: Path) -> None:
    evicting = RedisServer("--maxmemory", "30mb", "--maxmemory-policy", "allkeys-lru")
    try:
        env = {
            "PATH": "/usr/bin:/bin",
            "EVM_UPSTREAM": anvil.url,
            "API_KEYS": "k1",
            "REDIS_URL": evicting.url,
            "CREDITS_REQUIRE_NOEVICTION": "true",
            "PROXY_PORT": "1",
        }
        result = subprocess.run(
            [sys.executable, "-m", "proxy"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 2
        assert "maxmemory-policy allkeys-lru" in result.stderr and "CREDITS_REDIS_URL" in result.stderr
    finally:
        evicting.stop()


def _run(anvil: Anvil, redis_url: str, *command: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "EVM_UPSTREAM": anvil.url,
        "API_KEYS": "k1",
        "REDIS_URL": redis_url,
        "CREDITS_REQUIRE_NOEVICTION": "true",
        "PROXY_PORT": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "proxy", *command], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_check_fails_an_evicting_ledger_redis_that_serve_would_refuse(anvil: Anvil) -> None:
    """Rule: `check` says what `serve` does of the ledger's policy: with CREDITS_REQUIRE_NOEVICTION,
    `check` said ok and `serve` exited 2 (an outside attack)."""
    evicting = RedisServer("--maxmemory", "30mb", "--maxmemory-policy", "allkeys-lru")
    try:
        result = _run(anvil, evicting.url, "check")
        assert result.returncode == 1, result.stdout
        assert "FAIL credits: the credit ledger's Redis has maxmemory-policy allkeys-lru" in result.stdout
    finally:
        evicting.stop()


async def test_a_noeviction_ledger_whose_config_command_is_blocked_is_read_from_info(anvil: Anvil) -> None:
    """Rule: the policy is read with INFO memory, which a managed Redis answers where it renames or
    blocks CONFIG: CONFIG GET failed, and with CREDITS_REQUIRE_NOEVICTION `serve` exited 2 on a
    noeviction Redis. One that cannot be asked at all (down at start) is warned of, never refused:
    `serve` starts, as it does on a Redis that is down."""
    blocked = RedisServer("--maxmemory-policy", "noeviction", "--rename-command", "CONFIG", "")
    try:
        assert "ok   redis REDIS_URL" in _run(anvil, blocked.url, "check").stdout
        assert "FAIL credits" not in _run(anvil, blocked.url, "check").stdout
        proxy = await start_proxy(
            settings_for(
                EVM_UPSTREAM=anvil.url, API_KEYS="k1", REDIS_URL=blocked.url, CREDITS_REQUIRE_NOEVICTION="true"
            )
        )
        await proxy.close()
    finally:
        blocked.stop()
    down = RedisServer()
    down.stop()
    proxy = await start_proxy(
        settings_for(EVM_UPSTREAM=anvil.url, API_KEYS="k1", REDIS_URL=down.url, CREDITS_REQUIRE_NOEVICTION="true")
    )
    await proxy.close()


# --- operator view --------------------------------------------------------------------------


async def test_keys_usage_lists_every_key_with_journaled_usage_not_yet_written_back(
    anvil: Anvil,
    redis_server: RedisServer,
    redis_url: str,
    tmp_path: Path,
) -> None:
    journal = tmp_path / "journal"
    journal.mkdir()
    path = keys_file(tmp_path, alice={"daily_credits": 10_000}, bob={"daily_credits": 5_000})
    settings = settings_for(
        EVM_UPSTREAM=anvil.url,
        API_KEYS_FILE=path,
        REDIS_URL=redis_url,
        CREDITS_REDIS_TIMEOUT="0.2",
        CREDITS_REDIS_FAILURES="1",
        CREDITS_LEASE_MAX="80",
        CREDITS_JOURNAL_DIR=str(journal),
    )
    assert redis_server.proc is not None
    # Inline, not make_proxy: closed mid-test while Redis is stopped, so the usage stays in the journal.
    proxy = await start_proxy(settings)
    try:
        await proxy.head_at(0)
        assert (await proxy.post(storage(1), key="alice"))[0] == 200  # leases 80 + 80
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        for i in range(6):  # one from the lease, five journaled
            assert (await proxy.post(storage(i), key="alice"))[0] == 200
        await proxy.close()  # cannot write back: Redis is stopped
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    env = {"PATH": "/usr/bin:/bin", "REDIS_URL": redis_url, "API_KEYS_FILE": path, "CREDITS_JOURNAL_DIR": str(journal)}
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "keys", "usage"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert f"key {ALICE}: 560 credits used, 9440 left of 10000" in result.stdout
    assert "0 leased to replicas and not spent; 400 journaled and not yet in the ledger" in result.stdout, result.stdout
    assert f"key {derived_name('bob')}: 0 credits used, 5000 left of 5000" in result.stdout


def test_a_ledger_policy_info_memory_does_not_give_is_unknown_not_blank() -> None:
    """Rule: a Redis-compatible server whose INFO memory has no maxmemory_policy is named as unknown
    (it said "has maxmemory-policy :"), and, unknown, it is not taken for noeviction."""
    from proxy.credits.ledger_storage import eviction_problem

    assert eviction_problem(["noeviction", "noeviction"]) is None
    problem = eviction_problem(["noeviction", ""])
    assert problem is not None and "maxmemory-policy unknown (INFO memory does not say)" in problem
    assert "allkeys-lru" in (eviction_problem(["allkeys-lru"]) or "")
