"""WORKERS=N: N processes share the port, a supervisor restarts and drains them, one /metrics scrape
totals them all, and the upstream sees one set of head polls, not N. The process tests run the real
CLI (`python -m proxy`) in front of a real Anvil, through a relay that records every upstream call."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import rlp
from eth_utils import keccak
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from proxy.chain.heads import EvmHeadTracker
from proxy.check import run_check
from proxy.config import ConfigError, build_settings
from proxy.cpus import cgroup_quota, usable_cpus
from proxy.metrics import Metrics
from proxy.supervisor import RESTART_DELAY_MAX, STABLE_AFTER, exit_status, is_fatal, restart_delay, supervise
from proxy.values import Answer
from proxy.workers.metrics_merge import merged, render, with_retired
from proxy.workers.shared_polls import SharedPolls, aligned_delay, fresh_answers
from tests.fake_chain import FakeChain
from tests.fault_relay import FaultRelay
from tests.support import CONTRACTS, DEV_ACCOUNT, Anvil, eventually, free_port, word
from tests.test_cli_and_logs import clean_env
from tests.test_observability import promtool

# --- pure decisions ----------------------------------------------------------------------


def test_a_worker_that_ran_long_is_restarted_at_once() -> None:
    assert restart_delay(STABLE_AFTER + 1, quick_exits=5) == (0.0, 0)


def test_a_worker_that_keeps_dying_young_backs_off_up_to_a_bound() -> None:
    delays, quick = [], 0
    for _ in range(12):
        delay, quick = restart_delay(0.5, quick)
        delays.append(delay)
    assert delays[:3] == [0.1, 0.2, 0.4]
    assert delays == sorted(delays) and delays[-1] == RESTART_DELAY_MAX


def test_a_start_up_error_stops_the_supervisor_instead_of_a_restart_loop() -> None:
    assert is_fatal(2, listened=False) and is_fatal(1, listened=False)
    assert not is_fatal(1, listened=True)  # a crash after serving: restarted
    assert not is_fatal(-9, listened=False)  # killed by a signal: restarted
    assert exit_status(None) == 0 and exit_status(2) == 2


def test_workers_auto_is_one_per_usable_cpu_and_keyed_workers_need_a_shared_ledger() -> None:
    base = {"EVM_UPSTREAM": "http://127.0.0.1:1"}
    assert build_settings({**base, "WORKERS": "auto"}).workers == usable_cpus()
    assert build_settings(base).workers == 1
    with pytest.raises(ConfigError, match="shared credit ledger"):
        build_settings({**base, "WORKERS": "2", "API_KEYS": "secret"})
    assert build_settings({**base, "WORKERS": "2", "API_KEYS": "secret", "REDIS_URL": "redis://h:1/0"}).workers == 2
    with pytest.raises(ConfigError):
        build_settings({**base, "WORKERS": "0"})


def test_workers_without_a_writable_temporary_directory_are_a_clear_error_and_a_check_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule (docs/deployment.md, more cores per pod): WORKERS > 1 needs a directory for its workers'
    sockets. Under the Kubernetes files' read-only root file system, with no /tmp mounted, `serve`
    died with a traceback and `check` passed (outside attack): now `serve` says what to mount and
    exits 1, and `check` fails the same way."""

    def no_directory(*_: Any, **__: Any) -> str:
        raise FileNotFoundError(2, "No usable temporary directory found in ['/tmp', '/var/tmp']")

    settings = build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", "PROXY_PORT": str(free_port()), "WORKERS": "2"})
    monkeypatch.setattr(tempfile, "mkdtemp", no_directory)
    assert run_check(settings, offline=True) == 1
    out = capsys.readouterr().out
    assert "FAIL workers WORKERS=2: no writable temporary directory" in out and "mount one at /tmp" in out
    assert supervise(settings) == 1
    monkeypatch.undo()
    assert run_check(settings, offline=True) == 0 and "FAIL" not in capsys.readouterr().out


def test_workers_under_a_temporary_directory_too_long_for_a_socket_path_are_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Rule (docs/deployment.md): a Unix socket's path is at most 107 bytes; under a TMPDIR too long
    for the workers' sockets `serve` died with a traceback (`AF_UNIX path too long`) and `check`
    passed (outside attack): both say so now, and leave no directory behind."""
    long = tmp_path / ("d" * 110)
    long.mkdir()
    settings = build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", "PROXY_PORT": str(free_port()), "WORKERS": "2"})
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    assert run_check(settings, offline=True) == 1
    assert "leaves no room for a socket's name" in capsys.readouterr().out
    assert supervise(settings) == 1 and list(long.iterdir()) == []
    fits = Path(tempfile.mkdtemp(dir="/tmp"))  # short: tmp_path under xdist is past the bound itself
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(fits))
        assert run_check(settings, offline=True) == 0 and list(fits.iterdir()) == []
    finally:
        shutil.rmtree(fits)


def _worker_exposition(requests: float, head: float, redis_up: float, memory: float, seconds: float) -> str:
    registry = CollectorRegistry()
    Counter("rpc_proxy_requests", "calls", ["method"], registry=registry).labels("eth_call").inc(requests)
    Gauge("rpc_proxy_head_block", "head", ["tag"], registry=registry).labels("latest").set(head)
    Gauge("rpc_proxy_redis_up", "redis", registry=registry).set(redis_up)
    Gauge("rpc_proxy_cache_memory_bytes", "bytes", registry=registry).set(memory)
    Histogram("rpc_proxy_request_duration_seconds", "t", buckets=(0.1, 1.0), registry=registry).observe(seconds)
    return generate_latest(registry).decode()


def test_one_scrape_sums_counters_and_histograms_and_merges_gauges_by_their_meaning() -> None:
    families = {
        f.name: f for f in merged([_worker_exposition(3, 100, 1, 10, 0.05), _worker_exposition(4, 101, 0, 20, 0.5)])
    }

    def value(family: str, sample: str, **labels: str) -> float:
        return next(s.value for s in families[family].samples if s.name == sample and s.labels == labels)

    assert value("rpc_proxy_requests", "rpc_proxy_requests_total", method="eth_call") == 7
    assert value("rpc_proxy_head_block", "rpc_proxy_head_block", tag="latest") == 101  # the furthest view
    assert value("rpc_proxy_redis_up", "rpc_proxy_redis_up") == 0  # one worker without Redis shows
    assert value("rpc_proxy_cache_memory_bytes", "rpc_proxy_cache_memory_bytes") == 30  # each holds a part
    histogram = "rpc_proxy_request_duration_seconds"
    assert value(histogram, histogram + "_bucket", le="0.1") == 1
    assert value(histogram, histogram + "_bucket", le="1.0") == 2
    assert value(histogram, histogram + "_count") == 2


def test_the_merged_scrape_is_promtool_clean() -> None:
    text = render(merged([_worker_exposition(1, 5, 1, 1, 0.2), _worker_exposition(2, 5, 1, 1, 2.0)]))
    result = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()


def _parsed(text: str) -> list[Any]:
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))


def test_what_a_worker_counted_outlives_it_and_its_gauges_do_not() -> None:
    # A dead worker's counts went with it: the host's totals stepped back, which rate() read as a reset
    # (a spike of every surviving worker's total on the dashboards).
    seen: dict[str, Any] = {}
    dead: set[int] = set()

    def scrape(*reads: tuple[str, int | None, float | None, float]) -> dict[str, float]:
        parsed = [
            (n, p, None if r is None else _parsed(_worker_exposition(r, 100, 1, m, 0.05))) for n, p, r, m in reads
        ]
        families = merged(with_retired(seen, parsed, lambda pid: pid not in dead))
        return {f"{s.name}{sorted(s.labels.items())}": s.value for f in families for s in f.samples}

    calls, memory, count = (
        "rpc_proxy_requests_total[('method', 'eth_call')]",
        "rpc_proxy_cache_memory_bytes[]",
        ("rpc_proxy_request_duration_seconds_count[]"),
    )
    assert scrape(("w0", 10, 3, 10), ("w1", 11, 4, 20))[calls] == 7
    # Worker 0 does not answer in time but lives: its last counts stand, its gauges are left out.
    late = scrape(("w0", None, None, 0), ("w1", 11, 5, 20))
    assert late[calls] == 8 and late[memory] == 20
    # It died (no answer, its pid gone), then its successor answers on its socket: counted from 0 on top.
    dead.add(10)
    assert scrape(("w0", None, None, 0), ("w1", 11, 5, 20))[calls] == 8
    reborn = scrape(("w0", 12, 1, 5), ("w1", 11, 6, 20))
    assert reborn[calls] == 3 + 1 + 6 and reborn[count] == 3 and reborn[memory] == 25  # gauges: the living's
    # A successor found on the socket at once (no scrape saw its predecessor gone) retires it too.
    assert scrape(("w0", 13, 0, 5), ("w1", 11, 6, 20))[calls] == 3 + 1 + 6
    # A slower scrape's read of a worker found gone since reaches the record late: dropped, never its
    # successor retired for it (the retired counts hold it; outside attack: counted twice, for good).
    assert scrape(("w0", 12, 1, 5), ("w1", 11, 6, 20))[calls] == 3 + 1 + 6
    assert scrape(("w0", 13, 0, 5), ("w1", 11, 6, 20))[calls] == 3 + 1 + 6
    text = render(merged(with_retired(seen, [], lambda _pid: True)))
    check = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True)
    assert check.returncode == 0, check.stderr.decode()


async def test_a_scrape_whose_record_is_locked_by_a_stopped_worker_ends_by_its_deadline(tmp_path: Path) -> None:
    # A worker stopped while it held the record's lock stalled every scrape of the host without end,
    # each holding a thread of the default executor, which the gzip of large answers then waited for
    # (an outside attack, SIGSTOP).
    import fcntl

    from proxy.workers import metrics_merge

    read = ("metrics-0.sock", os.getpid(), _parsed(_worker_exposition(3, 100, 1, 10, 0.05)))
    with open(tmp_path / (metrics_merge.SEEN_FILE + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held as by a stopped process
        deadline = asyncio.get_running_loop().time() + 0.2
        texts = await asyncio.wait_for(metrics_merge._recorded(str(tmp_path), [read], deadline), 10)
        assert [s.value for f in merged(texts) for s in f.samples if s.name == "rpc_proxy_requests_total"] == [3]
        assert not (tmp_path / metrics_merge.SEEN_FILE).exists()  # written by the lock's holder alone
    await metrics_merge._recorded(str(tmp_path), [read], asyncio.get_running_loop().time() + 5)
    assert (tmp_path / metrics_merge.SEEN_FILE).stat().st_mode & 0o777 == 0o600


def test_polls_wake_on_the_same_wall_clock_tick_in_every_worker() -> None:
    assert aligned_delay(2.0, 1000.5) == pytest.approx(1.5)
    assert aligned_delay(2.0, 1001.999) == pytest.approx(0.001)


def test_a_shared_answer_older_than_asked_for_is_not_taken() -> None:
    memo = {"a": [10.0, "1", 1, None, 0.0, 0], "b": [5.0, "2", 2, None, 0.0, 0]}
    assert set(fresh_answers(memo, ["a", "b", "c"], since=8.0)) == {"a"}


async def test_a_sibling_polling_in_the_same_round_takes_the_answer_instead_of_asking(tmp_path: Path) -> None:
    first, second = SharedPolls(str(tmp_path), "evm", 1.0), SharedPolls(str(tmp_path), "evm", 1.0)
    asked: list[list[tuple[str, Any]]] = []

    async def fetch(calls: list[tuple[str, Any]]) -> list[Answer]:
        asked.append(calls)
        return [Answer(b'"0x10"', "0x10", upstream=0) for _ in calls]

    calls = [("eth_getBlockByNumber", ["latest", False])]
    since = time.time() - 0.5
    both = await asyncio.gather(
        first.ask("tracker", calls, fetch, since=since), second.ask("tracker", calls, fetch, since=since)
    )
    assert len(asked) == 1  # the second waited on the lock and read the first one's answer
    assert both[0][0].result == both[1][0].result == "0x10" and both[1][0].upstream == 0
    # A poll woken by read-your-writes asks for answers newer than the wake-up: fetched again.
    await second.ask("tracker", calls, fetch, since=time.time())
    assert len(asked) == 2
    first.close()
    second.close()


# --- the real CLI with WORKERS=2 ---------------------------------------------------------


class Running:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log
        self.metrics_port = port
        self.url = f"http://127.0.0.1:{port}/v3/any-key"

    def workers(self) -> set[int]:
        """The supervisor's worker processes (its spawned children), from /proc."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        found = set()
        for pid in map(int, children):
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.add(pid)
            except OSError:
                continue
        return found


def _start(relay_url: str, workers: int, **env: str) -> Running:
    port = free_port()
    environ = {
        **os.environ,
        "EVM_UPSTREAM": relay_url,
        "PROXY_PORT": str(port),
        "WORKERS": str(workers),
        "HEAD_POLL_INTERVAL": "0.2",
        "SHUTDOWN_TIMEOUT": "10",
        **env,
    }
    log = Path(tempfile.mkstemp(prefix="rpc-proxy-test-", suffix=".log")[1])
    with log.open("wb") as handle:  # a file, not a pipe: a pipe nobody reads could fill and block the proxy
        proc = subprocess.Popen([sys.executable, "-m", "proxy"], env=environ, stdout=subprocess.DEVNULL, stderr=handle)
    running = Running(proc, port, log)
    if "METRICS_PORT" in env:
        running.metrics_port = int(env["METRICS_PORT"])
    return running


async def _answers(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any] | None:
    try:
        async with session.post(url, json=body) as response:
            return dict(await response.json()) if response.status == 200 else None
    except aiohttp.ClientError:
        return None


async def _scrape(session: aiohttp.ClientSession, running: Running) -> str:
    async with session.get(f"http://127.0.0.1:{running.metrics_port}/metrics") as response:
        assert response.status == 200
        return await response.text()


def _sample(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


CHAIN_ID = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}


@pytest.fixture
async def relay(anvil: Anvil) -> AsyncIterator[FaultRelay]:
    relay = await FaultRelay(anvil.url).start()
    yield relay
    await relay.close()


async def _ready(session: aiohttp.ClientSession, running: Running, workers: int) -> None:
    """Every worker listening (the supervisor's gauge), or the single process answering."""

    seen: list[str] = ["no answer yet"]

    async def up() -> bool:
        if running.proc.poll() is not None:
            raise TimeoutError("the proxy exited")  # it will never answer
        answer = await _answers(session, running.url, CHAIN_ID)
        if answer is None:
            return False
        if workers == 0:
            return True
        listening = _sample(await _scrape(session, running), "rpc_proxy_workers")
        seen[0] = f"eth_chainId answered {answer}, rpc_proxy_workers {listening}"
        return listening == workers

    try:
        await eventually(up, 30, "the workers to answer")
    except TimeoutError:
        # What the proxy said, for a failure seen once on a busy machine: _stop removes its log.
        state = f"exit code {running.proc.poll()}" if running.proc.poll() is not None else "running"
        raise TimeoutError(
            f"the workers did not answer ({state}; {seen[0]}):\n{running.log.read_text()[-4000:]}"
        ) from None


async def _stop(running: Running) -> tuple[int, str]:
    running.proc.send_signal(signal.SIGTERM)
    returncode = await asyncio.to_thread(running.proc.wait, 30)
    text = running.log.read_text()
    running.log.unlink()
    return returncode, text


def _connections_by_process(port: int, pids: set[int]) -> dict[int, int]:
    """Established connections on the proxy's port held by each process (from /proc/net/tcp)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":
            inodes.add(fields[9])
    held: dict[int, int] = {}
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        links = []
        for fd in os.listdir(fds):
            with contextlib.suppress(FileNotFoundError):  # closed since the listing (a busy worker)
                links.append(os.readlink(fds / fd))
        held[pid] = sum(1 for link in links if link.startswith("socket:[") and link[8:-1] in inodes)
    return held


async def test_both_workers_answer_and_one_scrape_totals_their_calls(relay: FaultRelay) -> None:
    running = _start(relay.url, 2)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=24)) as session:
            await _ready(session, running, 2)
            before = _sample(
                await _scrape(session, running),
                "rpc_proxy_requests_total",
                network="evm",
                method="eth_chainId",
                outcome="ok",
            )
            # 24 calls at once: 24 connections, which the kernel spreads over the workers (SO_REUSEPORT).
            replies = await asyncio.gather(*(_answers(session, running.url, CHAIN_ID) for _ in range(24)))
            assert all(r is not None and r["result"] == "0x7a69" for r in replies)
            held = _connections_by_process(running.port, running.workers())
            assert len(held) == 2 and all(count > 0 for count in held.values()), held
            text = await _scrape(session, running)
        after = _sample(text, "rpc_proxy_requests_total", network="evm", method="eth_chainId", outcome="ok")
        assert after - before == 24  # both workers' calls, in one scrape
        assert _sample(text, "rpc_proxy_workers") == 2
        check = subprocess.run([promtool(), "check", "metrics"], input=text.encode(), capture_output=True)
        assert check.returncode == 0, check.stderr.decode()
    finally:
        returncode, _log = await _stop(running)
    assert returncode == 0


async def _kill_one(running: Running) -> int:
    """One of two workers killed (SIGKILL), once the supervisor has started another: its pid."""
    victim = min(running.workers())
    os.kill(victim, signal.SIGKILL)

    async def replaced() -> bool:
        pids = running.workers()
        return len(pids) == 2 and victim not in pids

    await eventually(replaced, 30, "the killed worker to be replaced")
    return victim


async def test_a_killed_worker_is_restarted_logged_and_counted(relay: FaultRelay) -> None:
    # What the killed worker counted stays in the host's totals: they never step back (a reset to rate()).
    running = _start(relay.url, 2)
    version = {"jsonrpc": "2.0", "id": 1, "method": "net_version", "params": []}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=24)) as session:
            await _ready(session, running, 2)
            replies = await asyncio.gather(*(_answers(session, running.url, version) for _ in range(24)))
            assert all(r is not None for r in replies)
            held = _connections_by_process(running.port, running.workers())
            assert len(held) == 2 and all(count > 0 for count in held.values()), held  # both served some
            counted = {"network": "evm", "method": "net_version", "outcome": "ok"}
            assert _sample(await _scrape(session, running), "rpc_proxy_requests_total", **counted) == 24
        async with aiohttp.ClientSession() as session:
            victim = await _kill_one(running)
            await _ready(session, running, 2)
            for _ in range(3):  # whichever worker the scrape reaches
                text = await _scrape(session, running)
                assert _sample(text, "rpc_proxy_requests_total", **counted) == 24
            assert _sample(text, "rpc_proxy_worker_restarts_total") == 1
    finally:
        returncode, log = await _stop(running)
    assert returncode == 0
    assert f"pid {victim}) exited with code -9; restarting it" in log


async def test_sigterm_drains_in_flight_requests_and_exits_0(relay: FaultRelay, anvil: Anvil) -> None:
    running = _start(relay.url, 2)
    try:
        async with aiohttp.ClientSession() as session:
            await _ready(session, running, 2)
            relay.inject("slow", method="eth_getBalance", delay=1.5)
            balance = {"jsonrpc": "2.0", "id": 7, "method": "eth_getBalance", "params": [DEV_ACCOUNT, "latest"]}
            in_flight = asyncio.create_task(_answers(session, running.url, balance))

            async def reached_upstream() -> bool:
                return "slow" in relay.applied

            await eventually(reached_upstream, 10, "the call to reach the upstream")
            running.proc.send_signal(signal.SIGTERM)
            reply = await in_flight
        assert reply is not None and reply["result"] == hex(int(anvil.rpc("eth_getBalance", DEV_ACCOUNT, "latest"), 16))
    finally:
        returncode, log = await _stop(running)
    assert returncode == 0
    assert "shutting down" in log and "shutdown complete" in log


def _head_polls(relay: FaultRelay, since: int) -> int:
    """Upstream calls the trackers make each interval: the latest block, and each upstream's number."""
    return sum(
        1
        for c in relay.calls[since:]
        if (c.get("method") == "eth_getBlockByNumber" and (c.get("params") or [None])[0] == "latest")
        or c.get("method") == "eth_blockNumber"
    )


async def _polls_over(relay: FaultRelay, workers: int, seconds: float) -> int:
    running = _start(relay.url, workers)
    try:
        async with aiohttp.ClientSession() as session:
            await _ready(session, running, workers if workers > 1 else 0)
            mark = len(relay.calls)
            # The count over a stretch of time is the figure (no assertion on time itself).
            await asyncio.sleep(seconds)
            return _head_polls(relay, mark)
    finally:
        returncode, _log = await _stop(running)
        assert returncode == 0


async def test_two_workers_poll_the_head_about_as_often_as_one(relay: FaultRelay) -> None:
    one = await _polls_over(relay, 1, 3.0)
    two = await _polls_over(relay, 2, 3.0)
    assert one >= 10  # about 2 calls per 0.2 s interval
    assert two <= one * 1.3 + 2, (one, two)  # not doubled


async def test_two_tasks_of_one_worker_never_write_back_an_older_memo(tmp_path: Path) -> None:
    polls = SharedPolls(str(tmp_path), "evm", 1.0)
    asked: list[str] = []

    def fetcher(scope: str) -> Any:
        async def fetch(calls: list[tuple[str, Any]]) -> list[Answer]:
            asked.append(scope)
            await asyncio.sleep(0)  # the other task runs meanwhile
            return [Answer(b"1", 1) for _ in calls]

        return fetch

    since = time.time() - 0.5
    await asyncio.gather(
        polls.ask("tracker", [("eth_blockNumber", [])], fetcher("tracker"), since=since),
        polls.ask("upstream0", [("eth_blockNumber", [])], fetcher("upstream0"), since=since),
    )
    sibling = SharedPolls(str(tmp_path), "evm", 1.0)
    for scope in ("tracker", "upstream0"):  # both answers are in the memo: the sibling asks nothing
        await sibling.ask(scope, [("eth_blockNumber", [])], fetcher("sibling"), since=since)
    assert sorted(asked) == ["tracker", "upstream0"]
    polls.close()
    sibling.close()


async def test_an_answer_asked_before_a_wake_up_is_not_taken_by_it(tmp_path: Path) -> None:
    """Rule (docs/scaling.md: a poll woken by read-your-writes takes only answers fetched after it was
    woken): an answer is dated by its asking. Dated by its arrival, a sibling's poll asked before a
    write and answered after the wake-up was taken, the write not in it: `latest` reads on the other
    workers were HITs of the block before (6 of 90 under load, WORKERS=3)."""
    first, sibling = SharedPolls(str(tmp_path), "evm", 1.0), SharedPolls(str(tmp_path), "evm", 1.0)
    out, answered = asyncio.Event(), asyncio.Event()
    asked: list[str] = []

    async def slow(calls: list[tuple[str, Any]]) -> list[Answer]:
        asked.append("first")
        out.set()
        await answered.wait()  # the node answers once the write is made and the sibling woken
        return [Answer(b"1", 1) for _ in calls]

    async def fresh(calls: list[tuple[str, Any]]) -> list[Answer]:
        asked.append("sibling")
        return [Answer(b"2", 1) for _ in calls]

    polling = asyncio.create_task(first.ask("tracker", [("eth_blockNumber", [])], slow, since=time.time() - 0.5))
    await out.wait()
    woken = time.time()
    answered.set()
    assert [a.payload for a in await polling] == [b"1"]
    [answer] = await sibling.ask("tracker", [("eth_blockNumber", [])], fresh, since=woken)
    assert answer.payload == b"2" and asked == ["first", "sibling"]
    first.close()
    sibling.close()


async def test_a_write_is_covered_only_by_an_answer_asked_write_settle_after_it(tmp_path: Path) -> None:
    """Rule (docs/caching.md: a node answers a write before its miner has sealed the block, so a poll
    covers the writes made WRITE_SETTLE before it): with workers, a sibling's poll asked just after
    the write (the block not sealed yet) was taken from the shared memo by the poll that was to cover
    it, and `latest` stayed at the block before (HITs; 6 to 42 of 180 reads under load, WORKERS=3)."""
    chain = FakeChain(100)
    trackers = [
        EvmHeadTracker(
            "evm",
            chain,
            interval=10,
            finality_depth=64,
            metrics=Metrics(CollectorRegistry()),
            shared=SharedPolls(str(tmp_path), "evm", 10),
        )
        for _ in range(2)
    ]
    writer, sibling = trackers
    for tracker in trackers:
        await tracker.poll()
    writer.wrote()  # forwarded by one worker, told to the other
    sibling.wrote(relayed=True)
    await writer.poll()  # asked at once: the node has answered the write, not sealed its block yet
    chain.mine()  # sealed now

    async def covered() -> bool:
        await sibling.poll()
        return not sibling.behind()

    await eventually(covered, 10, "a poll that covers the write")
    assert sibling.head is not None and sibling.head.latest == 101


def _next_contract_address(anvil: Anvil) -> str:
    nonce = int(anvil.rpc("eth_getTransactionCount", DEV_ACCOUNT, "latest"), 16)
    return "0x" + keccak(rlp.encode([bytes.fromhex(DEV_ACCOUNT[2:]), nonce]))[12:].hex()


@pytest.mark.parametrize("told", ["a block shown", "a write forwarded"])
async def test_what_one_worker_showed_or_wrote_is_never_trailed_by_another(
    relay: FaultRelay, anvil: Anvil, told: str
) -> None:
    """Read-your-writes across workers: once any worker has shown block N, `latest` is at least N on
    every connection, whichever worker it reaches (a long poll interval keeps the trackers behind);
    and after a write one worker forwarded, every worker's `latest` waits for a fresh poll (docs/caching.md:
    only the forwarding worker waited, and a read reaching its sibling was answered at the sibling's
    old head: an outside attack, 13 of 90 stale)."""
    anvil.mine(5)
    store = _next_contract_address(anvil)
    slot = {"jsonrpc": "2.0", "id": 1, "method": "eth_getStorageAt", "params": [store, "0x0", "latest"]}
    running = _start(relay.url, 2, HEAD_POLL_INTERVAL="5", ALLOW_METHODS="eth_sendTransaction")
    code = "0x" + (CONTRACTS / "Store.bin").read_text().strip()  # slot 0 := 7
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            await _ready(session, running, 2)
            for _ in range(10):  # both workers cache the empty slot at their tracked head
                reply = await _answers(session, running.url, slot)
                assert reply is not None and reply["result"] == "0x" + word(0)
            if told == "a block shown":
                receipt = anvil.send(None, code)
                assert receipt["contractAddress"].lower() == store
                shown = [receipt["transactionHash"]]
                call = {"jsonrpc": "2.0", "id": 2, "method": "eth_getTransactionReceipt", "params": shown}
                reply = await _answers(session, running.url, call)  # one worker shows the deployment's block
                assert reply is not None and reply["result"]["blockNumber"] == receipt["blockNumber"]
            else:
                deploy = [{"from": DEV_ACCOUNT, "data": code}]
                call = {"jsonrpc": "2.0", "id": 2, "method": "eth_sendTransaction", "params": deploy}
                reply = await _answers(session, running.url, call)  # one worker forwards it (Anvil mines it)
                assert reply is not None and "result" in reply, reply
            for _ in range(20):  # fresh connections, spread over both workers
                reply = await _answers(session, running.url, slot)
                assert reply is not None and reply["result"] == "0x" + word(7)
    finally:
        returncode, _log = await _stop(running)
    assert returncode == 0


async def test_the_metrics_port_listener_also_answers_for_all_workers(relay: FaultRelay) -> None:
    running = _start(relay.url, 2, METRICS_PORT=str(free_port()))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            await _ready(session, running, 2)
            before = _sample(
                await _scrape(session, running),
                "rpc_proxy_requests_total",
                network="evm",
                method="eth_chainId",
                outcome="ok",
            )
            for _ in range(10):  # fresh connections: both workers answer some
                assert await _answers(session, running.url, CHAIN_ID) is not None
            for _ in range(5):  # whichever worker the scrape reaches, the same total
                text = await _scrape(session, running)
                assert (
                    _sample(text, "rpc_proxy_requests_total", network="evm", method="eth_chainId", outcome="ok")
                    - before
                    == 10
                )
            async with session.get(f"http://127.0.0.1:{running.port}/metrics") as response:
                assert response.status == 404  # internal only, as with one process
    finally:
        returncode, _log = await _stop(running)
    assert returncode == 0


@pytest.mark.parametrize("workers", [1, 2])
async def test_event_loop_uvloop_serves_and_drains_through_the_real_cli(relay: FaultRelay, workers: int) -> None:
    # EVENT_LOOP=uvloop (the default where uvloop is installed, as the test command does) runs each process.
    running = _start(relay.url, workers, EVENT_LOOP="uvloop")
    try:
        async with aiohttp.ClientSession() as session:
            await _ready(session, running, workers if workers > 1 else 0)
            reply = await _answers(session, running.url, CHAIN_ID)
            assert reply is not None and reply["result"] == "0x7a69"
    finally:
        returncode, log = await _stop(running)
    assert returncode == 0, log


class TestUsableCpus:
    """WORKERS=auto counts the CPUs the process may use, not the host's: a container allowed 2 CPUs on
    a 64-core node starts 2 workers, not 64 (each with its own memory tier, past the pod's memory)."""

    def test_a_cgroup_quota_is_cpus_and_none_is_no_quota(self) -> None:
        assert cgroup_quota({"cpu.max": "200000 100000\n"}) == 2.0
        assert cgroup_quota({"cpu.max": "150000 100000"}) == 1.5
        assert cgroup_quota({"cpu.max": "max 100000\n"}) is None
        assert cgroup_quota({"cpu.cfs_quota_us": "50000\n", "cpu.cfs_period_us": "100000\n"}) == 0.5
        assert cgroup_quota({"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"}) is None
        assert cgroup_quota({"cpu.max": "garbage"}) is None and cgroup_quota({"cpu.max": "5 0"}) is None
        assert cgroup_quota({}) is None

    def test_the_quota_of_its_own_cgroup_bounds_the_affinity_rounded_down_and_at_least_one(
        self, tmp_path: Path
    ) -> None:
        affinity = len(os.sched_getaffinity(0))
        own = tmp_path / "cgroup"
        (tmp_path / "fs" / "kubepods" / "pod1").mkdir(parents=True)
        own.write_text("0::/kubepods/pod1\n")
        (tmp_path / "fs" / "kubepods" / "pod1" / "cpu.max").write_text("100000 100000\n")
        assert usable_cpus(str(tmp_path / "fs"), str(own)) == 1
        (tmp_path / "fs" / "kubepods" / "pod1" / "cpu.max").write_text("20000 100000\n")  # 0.2 CPU: still one
        assert usable_cpus(str(tmp_path / "fs"), str(own)) == 1
        (tmp_path / "fs" / "kubepods" / "pod1" / "cpu.max").write_text("max 100000\n")
        assert usable_cpus(str(tmp_path / "fs"), str(own)) == affinity
        # cgroup v1, seen from inside the container's namespace ("/"): the hierarchy's root files.
        (tmp_path / "v1" / "cpu").mkdir(parents=True)
        own.write_text("4:memory:/x\n1:cpu,cpuacct:/\n")
        (tmp_path / "v1" / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
        (tmp_path / "v1" / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
        assert usable_cpus(str(tmp_path / "v1"), str(own)) == 1
        assert usable_cpus(str(tmp_path / "none"), str(tmp_path / "missing")) == affinity

    @pytest.mark.skipif(not shutil.which("taskset"), reason="taskset (util-linux) not installed")
    def test_check_plans_one_worker_for_a_process_allowed_one_cpu(self, tmp_path: Path) -> None:
        cpu = min(os.sched_getaffinity(0))
        result = subprocess.run(
            ["taskset", "-c", str(cpu), sys.executable, "-m", "proxy", "check", "--offline"],
            env=clean_env(WORKERS="auto", EVM_UPSTREAM="http://127.0.0.1:1"),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert re.search(r"^\s*workers\s*=\s*1$", result.stdout, re.M), result.stdout


async def test_a_restarted_worker_takes_the_keys_file_as_it_is_not_as_it_started(
    relay: FaultRelay, redis_url: str, tmp_path: Path
) -> None:
    """Rule: a restarted worker reads the keys file (and NETWORKS_FILE) as it is: it took the
    supervisor's start-up settings, so a key revoked by a SIGHUP worked again on it (an outside
    attack: 6 of 12 calls of the revoked key answered)."""
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.alice]\nkey = "alice-secret"\n')
    running = _start(relay.url, 2, API_KEYS_FILE=str(keys), REDIS_URL=redis_url)
    base = f"http://127.0.0.1:{running.port}/v3/"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:

            async def statuses(key: str) -> set[int]:
                found = set()
                for _ in range(40):  # new connections: the kernel spreads them over both workers
                    try:
                        async with session.post(base + key, json=CHAIN_ID) as response:
                            found.add(response.status)
                    except aiohttp.ClientError:
                        found.add(0)  # not listening yet
                return found

            async def answered(key: str, status: int) -> bool:
                return await statuses(key) == {status}

            await eventually(lambda: answered("alice-secret", 200), 30, "both workers to serve alice")
            keys.write_text('[keys.bob]\nkey = "bob-secret"\n')
            running.proc.send_signal(signal.SIGHUP)
            await eventually(lambda: answered("alice-secret", 401), 30, "alice revoked on both workers")
            await _kill_one(running)

            async def listening() -> bool:
                try:
                    return _sample(await _scrape(session, running), "rpc_proxy_workers") == 2
                except aiohttp.ClientError:  # a connection met the killed worker's closing socket: not yet
                    return False

            await eventually(listening, 30, "the restarted worker to listen")
            assert await statuses("bob-secret") == {200}
            assert await statuses("alice-secret") == {401}
    finally:
        returncode, _log = await _stop(running)
    assert returncode == 0
