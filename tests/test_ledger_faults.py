"""Credits exact through every fault (docs/keys-and-credits.md): a stalled, emptied or lost ledger
Redis, workers and replicas that have or have not seen a key, a journal directory that cannot be used,
calls that cross midnight, and the balance every replica and the operator CLI show."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis as sync_redis

from proxy.credits.accounts import derived_name
from proxy.credits.lease_exchange import exhausted_key, ledger_key
from proxy.credits.leases import spent_of
from proxy.rpc.jsonrpc import UPSTREAM_UNAVAILABLE, JsonRpcError
from proxy.values import Answer
from tests.support import (
    ROOT,
    Anvil,
    CountingUpstream,
    FakeClock,
    Proxy,
    ProxyFactory,
    RedisServer,
    eventually,
    free_port,
    settings_for,
    start_proxy,
)
from tests.test_credits import keys_file, storage

ALICE, BOB = derived_name("alice"), derived_name("bob")
STORAGE_PRICE = 80


@pytest.fixture
def ledger_redis() -> Iterator[RedisServer]:
    """A ledger Redis of the test's own: stopped, emptied and restarted freely."""
    server = RedisServer()
    yield server
    if server.proc is not None:
        os.kill(server.proc.pid, signal.SIGCONT)
    server.stop()


@asynccontextmanager
async def stalled(server: RedisServer) -> AsyncIterator[None]:
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def entry(url: str, key: str, day: int | None = None) -> dict[bytes, bytes]:
    client = sync_redis.Redis.from_url(url)
    try:
        return dict(client.hgetall(ledger_key(key, int(time.time()) // 86400 if day is None else day)))
    finally:
        client.close()


def spent(url: str, key: str, day: int | None = None) -> int:
    return spent_of(entry(url, key, day))


def keyed(anvil: Anvil, ledger: RedisServer, tmp_path: Path, **keys: dict[str, int]) -> tuple[str, dict[str, str]]:
    """The keys file and the environment of a proxy whose only Redis is the ledger's."""
    path = keys_file(tmp_path, warm={"daily_credits": 10**9}, **keys)
    return path, {"EVM_UPSTREAM": anvil.url, "API_KEYS_FILE": path, "CREDITS_REDIS_URL": ledger.url}


@dataclass
class Workers:
    """`python -m proxy` with WORKERS=2: a supervisor and two worker processes on one port."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.port}/v3/{key}"

    def pids(self) -> set[int]:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return {int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()}


@asynccontextmanager
async def two_workers(env: dict[str, str]) -> AsyncIterator[Workers]:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="rpc-proxy-ledger-", suffix=".log")[1])
    environ = {
        **os.environ,
        "PROXY_PORT": str(port),
        "WORKERS": "2",
        "HEAD_POLL_INTERVAL": "0.2",
        "LOG_LEVEL": "WARNING",
        **env,
    }
    with log.open("wb") as handle:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy"], env=environ, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=handle
        )
    workers = Workers(proc, port, log)
    try:
        async with aiohttp.ClientSession() as session:

            async def up() -> bool:
                try:
                    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                        return "rpc_proxy_workers 2.0" in await response.text()
                except aiohttp.ClientError:
                    return False

            await eventually(up, 30, "both workers to listen")
        yield workers
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 30)
        log.unlink()


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, int]:
    """(status, credits charged) of one call on a new connection (so the kernel picks a worker); a
    connection a killed worker had queued is reset, unanswered: (0, 0)."""
    try:
        async with session.post(url, json=body) as response:
            await response.read()
            return response.status, int(response.headers.get("X-Credits-Charged", "0"))
    except aiohttp.ClientError:
        return 0, 0


def fresh_connections() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def warm(replica: Proxy) -> None:
    for position in ("0x0", "0x1"):
        assert (await replica.post(storage(1, position), key="warm"))[0] == 200


# --- 1. a stalled ledger delays no call beyond CREDITS_REDIS_TIMEOUT ------------------------------


async def test_a_call_during_a_ledger_stall_is_answered_within_the_ledger_timeout(
    anvil: Anvil,
    ledger_redis: RedisServer,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    path = keys_file(
        tmp_path, alice={"daily_credits": 2 * STORAGE_PRICE}, bob={"daily_credits": 10**6, "credits_per_second": 10**5}
    )
    # Five failures before the breaker opens: a call that retried until then would take 5 s.
    proxy = await make_proxy(
        EVM_UPSTREAM=anvil.url,
        API_KEYS_FILE=path,
        CREDITS_REDIS_URL=ledger_redis.url,
        CREDITS_REDIS_TIMEOUT="1",
        CREDITS_REDIS_FAILURES="5",
    )
    await proxy.head_at(0)
    assert [(await proxy.post(storage(i), key="alice"))[0] for i in range(3)] == [200, 200, 402]
    assert (await proxy.post(storage(), key="bob"))[0] == 200  # a per-second key: Redis on every call

    async def timed(key: str) -> tuple[int, float]:
        started = time.monotonic()
        status, _, _ = await proxy.post(storage(9), key=key)
        return status, time.monotonic() - started

    async with stalled(ledger_redis):
        # One call alone first: with others beside it, their failures would open the breaker sooner.
        answers = [await timed("alice")]
        answers += await asyncio.gather(*(timed(key) for key in ["alice"] * 3 + ["bob"] * 2))
    for (status, seconds), key in zip(answers, ["alice"] * 4 + ["bob"] * 2, strict=True):
        assert seconds < 4.0, (key, status, seconds)  # the bound is 1 s; the stall would be 5 s
        assert status in ((402,) if key == "alice" else (200, 503)), (key, status)


# --- 2. a lost ledger entry is rebuilt, never counted twice ---------------------------------------


async def test_a_lost_ledger_entry_is_rebuilt_from_what_was_spent_and_never_counted_twice(
    anvil: Anvil,
    ledger_redis: RedisServer,
    tmp_path: Path,
) -> None:
    daily = 20_000
    _path, env = keyed(anvil, ledger_redis, tmp_path, alice={"daily_credits": daily})
    env["CREDITS_LEASE_SECONDS"] = "1"  # idle leases go back quickly, so the last credits can be served
    # Inline, not make_proxy: closed before the spent usage is read (closing gives its lease back).
    replica = await start_proxy(settings_for(**env))
    served = 0
    try:
        await replica.head_at(0)
        await warm(replica)
        async with two_workers(env) as workers, fresh_connections() as session:

            async def calls(count: int) -> None:
                nonlocal served
                for i in range(count):
                    if i % 3 == 2:
                        status, _, headers = await replica.post(storage(i, ("0x0", "0x1")[i % 2]), key="alice")
                        charged = int(headers["X-Credits-Charged"])
                    else:
                        status, charged = await post(session, workers.url("alice"), storage(i, ("0x0", "0x1")[i % 2]))
                    served += charged if status == 200 else 0

            await calls(30)  # every process holds a lease now
            client = sync_redis.Redis.from_url(ledger_redis.url)
            client.delete(ledger_key(ALICE, int(time.time()) // 86400))
            await calls(30)
            client.flushall()
            client.close()

            async def all_served() -> bool:
                await calls(6)
                assert spent(ledger_redis.url, ALICE) <= served  # never above what was served
                return served >= daily

            await eventually(all_served, 60, "the key's whole balance to be served")
        assert served == daily  # not a credit refused that was paid for, none served beyond
    finally:
        await replica.close()
    assert spent(ledger_redis.url, ALICE) == served  # recorded usage is what was served


async def test_a_key_spent_whose_entry_was_lost_is_refused_as_spent_not_as_unavailable(
    anvil: Anvil, ledger_redis: RedisServer, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    """Rule (docs/keys-and-credits.md, A lost ledger entry): while a rebuilt entry is unconfirmed no
    credit is granted ("retry shortly"), but a balance that cannot pay a call even so is spent: 402,
    as before the loss. It was 503 "the credit ledger cannot be reached" with Redis up."""
    _path, env = keyed(anvil, ledger_redis, tmp_path, alice={"daily_credits": 5 * STORAGE_PRICE})
    first, second = await make_proxy(settings_for(**env)), await make_proxy(settings_for(**env))
    for proxy in (first, second):
        await proxy.head_at(0)
    statuses = [(await (first, second)[i % 2].post(storage(i), key="alice"))[0] for i in range(7)]
    assert statuses.count(200) == 5 and statuses[-1] == 402, statuses
    client = sync_redis.Redis.from_url(ledger_redis.url)
    client.delete(ledger_key(ALICE, int(time.time()) // 86400))
    client.close()
    for i in range(4):
        status, body, _ = await (first, second)[i % 2].post(storage(10 + i), key="alice")
        assert status == 402 and "credits" in body["error"]["message"], (status, body)
    assert spent(ledger_redis.url, ALICE) == 5 * STORAGE_PRICE


# --- 3. the outage rule is per key: exhausted anywhere, refused everywhere -------------------------


async def test_a_key_exhausted_on_a_replica_stays_refused_on_every_worker_through_a_stall(
    anvil: Anvil,
    ledger_redis: RedisServer,
    tmp_path: Path,
) -> None:
    _path, env = keyed(
        anvil,
        ledger_redis,
        tmp_path,
        alice={"daily_credits": 10 * STORAGE_PRICE},
        bob={"daily_credits": 10**6},
        carol={"daily_credits": 4 * STORAGE_PRICE},
    )
    env.update(CREDITS_REDIS_TIMEOUT="0.5", CREDITS_REDIS_FAILURES="2", CREDITS_LEASE_MAX=str(10 * STORAGE_PRICE))
    # Inline, not make_proxy: closed before the spent usage is read (closing gives its lease back).
    replica = await start_proxy(settings_for(**env))
    try:
        await replica.head_at(0)
        async with two_workers(env) as workers, fresh_connections() as session:
            statuses = [(await replica.post(storage(i), key="alice"))[0] for i in range(11)]
            assert statuses == [200] * 10 + [402]
            client = sync_redis.Redis.from_url(ledger_redis.url)
            day = int(time.time()) // 86400

            async def told() -> bool:  # the replica adds it to the shared set in the background
                return bool(client.sismember(exhausted_key(day), ALICE))

            await eventually(told, 10, "the exhausted key in the shared set")
            reads = int(client.info("commandstats").get("cmdstat_smembers", {}).get("calls", 0))

            async def read_by_all() -> bool:  # three processes read the set every second
                stats = client.info("commandstats").get("cmdstat_smembers", {})
                return int(stats.get("calls", 0)) >= reads + 9

            await eventually(read_by_all, 20, "every process to read the exhausted keys")
            client.close()
            async with stalled(ledger_redis):
                alice = [await post(session, workers.url("alice"), storage(i)) for i in range(20)]
                bob = [await post(session, workers.url("bob"), storage(i)) for i in range(40)]
                bob_replica = [await replica.post(storage(i), key="bob") for i in range(20)]
                carol = [await post(session, workers.url("carol"), storage(i)) for i in range(20)]
        assert not [a for a in alice if a[0] == 200], alice  # the workers had never seen alice
        # A key no process had seen: one largest lease per host, whatever its number of workers.
        assert sum(charged for status, charged in bob if status == 200) <= 10 * STORAGE_PRICE
        assert sum(int(h["X-Credits-Charged"]) for s, _, h in bob_replica if s == 200) <= 10 * STORAGE_PRICE
        # ... or of its balance where that is less: each worker served all of it (twice the balance).
        assert 0 < sum(charged for status, charged in carol if status == 200) <= 4 * STORAGE_PRICE, carol
    finally:
        await replica.close()
    assert spent(ledger_redis.url, ALICE) == 10 * STORAGE_PRICE


async def test_a_key_one_worker_saw_is_served_no_more_than_its_balance_by_the_host_through_a_stall(
    anvil: Anvil, ledger_redis: RedisServer, tmp_path: Path
) -> None:
    """Rule (docs/keys-and-credits.md, "Overdraw bound"): a key one worker of a host saw, alone active
    at its last reply, is spent through a stall by that worker up to its lease and one worker's share
    of what nobody held, and by its sibling, which never saw it, not at all beyond its own lease.
    The first took all that nobody held and the second half the balance as a key never seen (an
    outside attack: 3,840 served of 2,000 by two such hosts)."""
    balance = {"daily_credits": 20 * STORAGE_PRICE}
    _path, env = keyed(anvil, ledger_redis, tmp_path, dave=balance, erin=balance)
    env.update(CREDITS_REDIS_TIMEOUT="0.5", CREDITS_REDIS_FAILURES="2")
    async with two_workers(env) as workers:
        async with aiohttp.ClientSession() as one:  # one keep-alive connection: one worker sees the key
            for i in range(2):
                assert (await post(one, workers.url("dave"), storage(i))) == (200, STORAGE_PRICE)
        async with stalled(ledger_redis), fresh_connections() as session:
            burst, unseen = await asyncio.gather(
                asyncio.gather(*(post(session, workers.url("dave"), storage(100 + i)) for i in range(60))),
                asyncio.gather(*(post(session, workers.url("erin"), storage(100 + i)) for i in range(60))),
            )
    served = 2 * STORAGE_PRICE + sum(charged for status, charged in burst if status == 200)
    assert served <= 20 * STORAGE_PRICE, burst
    # A key no worker had seen: each tried the ledger on its first call, and took the other's try for
    # the ledger's word: none was served, fail-open as fail-closed (a re-attack).
    assert 0 < sum(charged for status, charged in unseen if status == 200) <= 20 * STORAGE_PRICE, unseen


# --- 4. start-up refuses what cannot work; no ledger fault is a 500 -------------------------------


def test_a_journal_dir_that_cannot_be_used_stops_start_up_with_one_line(anvil: Anvil, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    for journal in (tmp_path / "missing", not_a_dir):
        env = {
            "PATH": "/usr/bin:/bin",
            "EVM_UPSTREAM": anvil.url,
            "API_KEYS": "k1",
            "REDIS_URL": "redis://127.0.0.1:1",
            "CREDITS_JOURNAL_DIR": str(journal),
            "PROXY_PORT": str(free_port()),
        }
        result = subprocess.run(
            [sys.executable, "-m", "proxy"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "configuration error: CREDITS_JOURNAL_DIR" in lines[0], result.stderr


async def test_a_journal_dir_gone_during_an_outage_is_never_an_http_500(
    anvil: Anvil,
    ledger_redis: RedisServer,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    journal = tmp_path / "journal"
    journal.mkdir()
    _path, env = keyed(anvil, ledger_redis, tmp_path, alice={"daily_credits": 10**6})
    proxy = await make_proxy(
        **env,
        CREDITS_JOURNAL_DIR=str(journal),
        CREDITS_LEASE_MAX="80",
        CREDITS_REDIS_TIMEOUT="0.3",
        CREDITS_REDIS_FAILURES="1",
    )
    await proxy.head_at(0)
    assert (await proxy.post(storage(), key="alice"))[0] == 200
    journal.rmdir()
    async with stalled(ledger_redis):
        answers = [await proxy.post(storage(i), key="alice") for i in range(10)]
    statuses = [status for status, _, _ in answers]
    assert 500 not in statuses and 200 in statuses, statuses
    for status, _, headers in answers:
        assert int(headers["X-Credits-Charged"]) == (STORAGE_PRICE if status == 200 else 0)


# --- 5. a charge and its refund belong to one day -------------------------------------------------


class FailsAcrossMidnight(CountingUpstream):
    """Asked for slot 0xdead, the clock passes midnight, a call of the new day is made, and then no
    node can be reached: the first call is refunded after midnight."""

    clock: FakeClock
    proxy: Proxy | None = None

    async def _cross_midnight(self, method: str, params: Any) -> None:
        if method == "eth_getStorageAt" and "dead" in str(params) and self.proxy is not None:
            self.clock.advance(10)
            assert (await self.proxy.post(storage(2, "0x1"), key="alice"))[0] == 200
            raise JsonRpcError(UPSTREAM_UNAVAILABLE, "upstream unavailable: connection refused", http_status=502)

    async def batch(self, calls: Any) -> list[Answer]:
        for method, params in calls:
            await self._cross_midnight(method, params)
        return await super().batch(calls)

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer:
        await self._cross_midnight(method, params)
        return await super().request(method, params, timeout=timeout)

    async def ask(
        self, index: int, method: str, params: Any, *, timeout: float, budget_wait: float | None = None
    ) -> Answer:
        await self._cross_midnight(method, params)
        return await super().ask(index, method, params, timeout=timeout, budget_wait=budget_wait)

    async def proven(
        self, method: str, params: Any, block: str, *, index: int | None = None, timeout: float | None = None
    ) -> Answer:
        await self._cross_midnight(method, params)
        return await super().proven(method, params, block, index=index, timeout=timeout)


async def test_a_refund_after_midnight_goes_back_to_the_day_of_its_charge(
    anvil: Anvil,
    redis_server: RedisServer,
    redis_url: str,
    tmp_path: Path,
) -> None:
    day = int(time.time()) // 86400 + 1
    clock = FakeClock(start=(day + 1) * 86400 - 5)  # five seconds before a midnight
    FailsAcrossMidnight.clock = clock
    path = keys_file(tmp_path, alice={"daily_credits": 2 * STORAGE_PRICE})
    # Inline, not make_proxy: closed before the spent usage is read (closing gives its lease back).
    proxy = await start_proxy(
        settings_for(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=path, REDIS_URL=redis_url, UPSTREAM_BATCH_MAX="1"),
        clock=clock,
        upstream_class=FailsAcrossMidnight,
    )
    FailsAcrossMidnight.proxy = proxy
    try:
        await proxy.head_at(0)
        status, _, headers = await proxy.post(storage(1, "0xdead"), key="alice")
        assert status == 502 and headers["X-Credits-Charged"] == "0"
        # The new day's balance pays for two calls, one of them already made: one more, not two.
        statuses = [(await proxy.post(storage(i, "0x1"), key="alice"))[0] for i in range(3, 6)]
        assert statuses == [200, 402, 402]
    finally:
        FailsAcrossMidnight.proxy = None
        await proxy.close()
    assert spent(redis_url, ALICE, day) == 0  # the refunded charge
    assert spent(redis_url, ALICE, day + 1) == 2 * STORAGE_PRICE


# --- 6. one balance, the same everywhere ------------------------------------------------------------


async def test_every_replica_shows_the_spent_balance_and_keys_usage_bills_from_it(
    anvil: Anvil,
    ledger_redis: RedisServer,
    tmp_path: Path,
) -> None:
    daily = 1_000_000
    tolerance = daily // 100  # docs/keys-and-credits.md: within 1% of the daily balance (or one call)
    path, env = keyed(anvil, ledger_redis, tmp_path, alice={"daily_credits": daily})
    env.update(CREDITS_REDIS_TIMEOUT="0.3", CREDITS_REDIS_FAILURES="1")
    # Inline, not make_proxy: both closed before the ledger Redis is stopped and `keys usage` is run.
    first, second = await start_proxy(settings_for(**env)), await start_proxy(settings_for(**env))
    charged = 0

    async def shown(replica: Proxy) -> int:
        nonlocal charged
        status, _, headers = await replica.post(storage(1), key="alice")
        assert status == 200
        charged += int(headers["X-Credits-Charged"])
        return int(headers["X-Credits-Remaining"])

    try:
        for replica in (first, second):
            await replica.head_at(0)
        for i in range(20):
            await shown((first, second)[i % 2])
        for replica in (first, second):
            assert abs(await shown(replica) - (daily - charged)) <= tolerance
        async with stalled(ledger_redis):
            for _ in range(150):
                await shown(first)  # more than the tolerance, spent while the ledger is stalled

        async def agree() -> bool:
            shown_now = [await shown(r) for r in (first, second)]
            return all(abs(balance - (daily - charged)) <= tolerance for balance in shown_now)

        await eventually(agree, 15, "both replicas to show the balance the ledger holds")
        usage_env = {"PATH": "/usr/bin:/bin", "CREDITS_REDIS_URL": ledger_redis.url, "API_KEYS_FILE": path}

        async def billed() -> bool:
            result = subprocess.run(
                [sys.executable, "-m", "proxy", "keys", "usage", "alice"],
                env=usage_env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=30,
            )
            return f"key {ALICE}: {charged} credits used, {daily - charged} left of {daily}" in result.stdout

        await eventually(billed, 15, "keys usage to bill what was spent")
    finally:
        await first.close()
        await second.close()
    ledger_redis.stop()
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "keys", "usage"],
        env=usage_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1 and "unreachable" in result.stderr


async def shown_through(session: aiohttp.ClientSession, url: str, rid: int) -> tuple[int, str, str]:
    """(status, X-Credits-Remaining, error message or "") of one call on a new connection."""
    async with session.post(url, json=storage(rid, hex(rid))) as response:
        reply = await response.json(content_type=None)
        return response.status, response.headers["X-Credits-Remaining"], reply.get("error", {}).get("message", "")


def at_most(shown: str, balance: int) -> bool:
    """The figure a replica shows is the balance it knew (never more) or, knowing none, `unknown`."""
    return shown == "unknown" or int(shown) <= balance


async def test_through_a_stall_no_replica_shows_more_than_the_balance_before_it(
    anvil: Anvil,
    ledger_redis: RedisServer,
    tmp_path: Path,
) -> None:
    """docs/keys-and-credits.md "Credits during a Redis outage": X-Credits-Remaining never shows more
    than before the outage, and a 402 never says more is left than the call needs; a replica that never
    saw the key (here two workers: exhausted on the other replica, and spent there) says `unknown`."""
    _path, env = keyed(
        anvil,
        ledger_redis,
        tmp_path,
        ex={"daily_credits": 100},
        sub={"daily_credits": 10 * STORAGE_PRICE},
    )
    env.update(CREDITS_REDIS_TIMEOUT="0.5", CREDITS_REDIS_FAILURES="2")
    replica = await start_proxy(settings_for(**env))
    try:
        await replica.head_at(0)
        async with two_workers(env) as workers, fresh_connections() as session:
            statuses = [(await replica.post(storage(i), key="ex"))[0] for i in range(2)]
            assert statuses == [200, 402]  # 80 spent, 20 left: the second call cannot be paid
            assert [(await replica.post(storage(i), key="sub"))[0] for i in range(8)] == [200] * 8
            client = sync_redis.Redis.from_url(ledger_redis.url)
            day = int(time.time()) // 86400

            async def told() -> bool:
                return bool(client.sismember(exhausted_key(day), derived_name("ex")))

            await eventually(told, 10, "the exhausted key in the shared set")
            reads = int(client.info("commandstats").get("cmdstat_smembers", {}).get("calls", 0))

            async def read_by_all() -> bool:
                stats = client.info("commandstats").get("cmdstat_smembers", {})
                return int(stats.get("calls", 0)) >= reads + 9

            await eventually(read_by_all, 20, "every process to read the exhausted keys")
            client.close()
            async with stalled(ledger_redis):
                refused = [await shown_through(session, workers.url("ex"), i) for i in range(6)]
                served = [await shown_through(session, workers.url("sub"), i) for i in range(4)]
    finally:
        await replica.close()
    assert all(status == 402 for status, _, _ in refused), refused
    for _, shown, message in refused:
        assert at_most(shown, 20), refused  # 20 was left when the ledger stalled
        left = re.search(r"(\d+) left", message)
        assert left is None or int(left[1]) <= 20, refused  # never more than the refusal implies
    served_ok = [s for s in served if s[0] == 200]
    assert served_ok, served  # a key no worker had seen is served its share (fail open)
    for _, shown, _ in served_ok:
        assert at_most(shown, 2 * STORAGE_PRICE), served  # 160 was left when the ledger stalled


# --- a worker that dies strands no lease (issue 19) --------------------------------------------------


async def test_a_killed_workers_leases_are_given_back_by_its_successor(
    anvil: Anvil,
    ledger_redis: RedisServer,
    tmp_path: Path,
) -> None:
    daily = 20_000
    _path, env = keyed(anvil, ledger_redis, tmp_path, alice={"daily_credits": daily})
    env["CREDITS_LEASE_SECONDS"] = "60"  # no lease goes back for idleness: the victim dies holding one
    served = 0
    async with two_workers(env) as workers, fresh_connections() as session:

        async def calls(count: int) -> None:
            nonlocal served
            for i in range(count):
                status, charged = await post(session, workers.url("alice"), storage(i, ("0x0", "0x1")[i % 2]))
                served += charged if status == 200 else 0

        async def both_hold_leases() -> bool:
            await calls(4)
            return sum(1 for field in entry(ledger_redis.url, ALICE) if field.startswith(b"a:")) == 2

        await eventually(both_hold_leases, 30, "both workers to lease")

        async def reported() -> bool:
            return spent(ledger_redis.url, ALICE) == served

        await eventually(reported, 10, "the workers to report what they spent")
        victim = min(workers.pids())
        os.kill(victim, signal.SIGKILL)

        async def all_served() -> bool:
            await calls(6)
            return served >= daily

        await eventually(all_served, 60, "the key's whole balance to be served")
        assert served == daily
