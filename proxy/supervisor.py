"""WORKERS=N: a supervisor and N worker processes sharing the listening port.

Each worker is a whole proxy (its own event loop, in-process cache tier and trackers) bound to the
same address with SO_REUSEPORT, so the kernel spreads connections across them; they share Redis when
REDIS_URL is set, their head polls (shared_polls.py) and one /metrics scrape (metrics_merge.py)
through a private run directory. The supervisor only starts, watches and stops them: it restarts a
worker that dies (backing off when one keeps dying at once), forwards SIGTERM so each drains its
in-flight requests within SHUTDOWN_TIMEOUT, and exits 0 once all are done. WORKERS=1 runs no
supervisor at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy import hangup, via
from proxy.workers.context import NoRunDirectory, WorkerContext, run_directory

if TYPE_CHECKING:
    from proxy.config import Settings

log = logging.getLogger("proxy.workers")

RESTART_DELAY_MIN = 0.1  # seconds before restarting a worker that died young the first time
RESTART_DELAY_MAX = 30.0
STABLE_AFTER = 10.0  # a worker that ran this long is restarted at once, its record wiped
EXIT_GRACE = 5.0  # seconds past SHUTDOWN_TIMEOUT before a worker that is still draining is killed
FATAL_CODES = frozenset({1, 2})  # cannot listen / configuration error: what a worker exits with at start


# --- pure decisions ----------------------------------------------------------------------


def restart_delay(uptime: float, quick_exits: int) -> tuple[float, int]:
    """(seconds to wait before restarting a worker that exited after `uptime` seconds, its count of
    quick exits so far). One that ran long is restarted at once; one that keeps dying young waits
    twice as long each time, up to RESTART_DELAY_MAX, so a crash loop does not spin a core."""
    if uptime >= STABLE_AFTER:
        return 0.0, 0
    quick = quick_exits + 1
    return min(RESTART_DELAY_MAX, RESTART_DELAY_MIN * 2 ** (quick - 1)), quick


def is_fatal(exit_code: int | None, listened: bool) -> bool:
    """A worker that never listened and exited with a start-up error (cannot bind, bad configuration)
    would fail the same way again: the supervisor stops rather than restart it forever."""
    return not listened and exit_code in FATAL_CODES


def exit_status(fatal_code: int | None) -> int:
    """The supervisor's own exit code: 0 after a drain, the workers' start-up error otherwise."""
    return 0 if fatal_code is None else fatal_code


# --- the worker process ------------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: a worker gets SIGTERM if its supervisor is killed outright, rather than hold the port."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def worker_main(settings: Settings, context: WorkerContext, ready: Connection) -> None:
    from proxy import hangup, logs
    from proxy.reload import as_files_are
    from proxy.server import run_server

    hangup.hold()  # started with SIGHUP blocked (Supervisor._start): one sent meanwhile is remembered
    _die_with_parent()
    if context.via:
        via.adopt(context.via)
    logs.setup(settings.log_format, settings.log_level, settings.access_log)
    settings = as_files_are(settings)
    code = run_server(settings, worker=context, on_listening=lambda: ready.send(os.getpid()))
    sys.exit(code)


# --- the supervisor ----------------------------------------------------------------------


@dataclass
class _Slot:
    index: int
    process: BaseProcess | None = None
    ready: Connection | None = None
    started: float = 0.0
    listened: bool = False
    quick_exits: int = 0


class Supervisor:
    def __init__(self, settings: Settings, run_dir: str) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self.registry = CollectorRegistry()
        self.restarts = Counter(
            "rpc_proxy_worker_restarts", "Worker processes restarted after they exited.", registry=self.registry
        )
        self.listening = Gauge(
            "rpc_proxy_workers", "Worker processes up and listening (of WORKERS).", registry=self.registry
        )
        self._context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited loop state
        self._slots = [_Slot(i) for i in range(settings.workers)]
        self._stopping = False
        self._fatal: int | None = None
        self._stop = asyncio.Event()
        self._all_listening = asyncio.Event()

    def _reload(self) -> None:
        """SIGHUP: each worker reloads the keys itself (reload.py)."""
        for slot in self._slots:
            if slot.process is not None and slot.process.pid:
                os.kill(slot.process.pid, signal.SIGHUP)

    async def run(self) -> int:
        from proxy.http.listeners import registry_exposition, start_unix_metrics
        from proxy.workers.metrics_merge import metrics_socket

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        held = hangup.received()  # before now: forwarded once the workers run (each reloads once it serves)
        own = await start_unix_metrics(registry_exposition(self.registry), metrics_socket(self.run_dir, "supervisor"))
        try:
            for slot in self._slots:
                self._start(slot)
            if held:
                log.info("SIGHUP received while starting: the workers read the keys again once they serve")
                self._reload()
            waiting = asyncio.create_task(self._all_listening.wait())
            stopped = asyncio.create_task(self._stop.wait())
            await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if self._all_listening.is_set() and not self._stop.is_set():
                log.info(
                    "listening on http://%s:%d with %d workers (pids %s)",
                    self.settings.host,
                    self.settings.port,
                    len(self._slots),
                    " ".join(str(s.process.pid) for s in self._slots if s.process is not None),
                )
            await stopped
            await self._drain()
        finally:
            await own.cleanup()
        return exit_status(self._fatal)

    def _start(self, slot: _Slot) -> None:
        if self._stopping:
            return
        loop = asyncio.get_running_loop()
        reader, writer = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=worker_main,
            args=(self.settings, WorkerContext(slot.index, self.run_dir, via.pseudonym()), writer),
            name=f"rpc-proxy-worker-{slot.index}",
        )
        with hangup.Blocked():  # until the worker runs hangup.hold, a SIGHUP waits instead of killing it
            process.start()
        writer.close()
        slot.process, slot.ready, slot.started, slot.listened = process, reader, time.monotonic(), False
        loop.add_reader(reader.fileno(), self._on_ready, slot)
        loop.add_reader(process.sentinel, self._on_exit, slot)

    def _on_ready(self, slot: _Slot) -> None:
        loop = asyncio.get_running_loop()
        assert slot.ready is not None
        loop.remove_reader(slot.ready.fileno())
        with contextlib.suppress(EOFError, OSError):
            slot.ready.recv()
            slot.listened = True
        self.listening.set(sum(1 for s in self._slots if s.listened))
        if all(s.listened for s in self._slots):
            self._all_listening.set()

    def _on_exit(self, slot: _Slot) -> None:
        loop = asyncio.get_running_loop()
        process = slot.process
        assert process is not None
        loop.remove_reader(process.sentinel)
        if slot.ready is not None:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(slot.ready.fileno())
            slot.ready.close()
        process.join()
        code, listened = process.exitcode, slot.listened
        slot.process, slot.listened = None, False
        self.listening.set(sum(1 for s in self._slots if s.listened))
        if self._stopping:
            log.info("worker %d (pid %d) stopped with code %s", slot.index, process.pid, code)
            return
        if is_fatal(code, listened):
            log.error("worker %d (pid %d) could not start (exit code %s): stopping", slot.index, process.pid, code)
            self._fatal = code
            self._stop.set()
            return
        delay, slot.quick_exits = restart_delay(time.monotonic() - slot.started, slot.quick_exits)
        log.warning(
            "worker %d (pid %d) exited with code %s; restarting it in %.1fs", slot.index, process.pid, code, delay
        )
        self.restarts.inc()
        loop.call_later(delay, self._start, slot)

    async def _drain(self) -> None:
        self._stopping = True
        alive = [s.process for s in self._slots if s.process is not None]
        log.info(
            "shutting down: SIGTERM sent to %d worker(s), draining in-flight requests (SHUTDOWN_TIMEOUT %gs)",
            len(alive),
            self.settings.shutdown_timeout,
        )
        for process in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid or 0, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown_timeout + EXIT_GRACE
        while any(s.process is not None for s in self._slots) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for slot in self._slots:
            if slot.process is not None:
                log.warning(
                    "worker %d (pid %d) still running past SHUTDOWN_TIMEOUT: killed", slot.index, slot.process.pid
                )
                slot.process.kill()
                slot.process.join()
                slot.process = None
        log.info("shutdown complete: all workers stopped")


def port_free(host: str, port: int) -> OSError | None:
    """Whether the workers will be able to bind: tried once here, so a taken port fails at start."""
    probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        return None
    except OSError as exc:
        return exc
    finally:
        probe.close()


def supervise(settings: Settings) -> int:
    for listener in settings.listeners:  # each worker binds them all: a taken one fails here, named
        problem = port_free(listener.host, listener.port)
        if problem is not None:
            log.error("cannot listen on %s: %s", listener, problem.strerror)
            return 1
    try:
        run_dir = run_directory()
    except NoRunDirectory as exc:
        log.error("cannot start WORKERS=%d: %s", settings.workers, exc)
        return 1
    try:
        return asyncio.run(Supervisor(settings, run_dir).run())
    finally:
        hangup.hold()  # the loop's handlers are gone: a SIGHUP now is not an exit code of -1
        shutil.rmtree(run_dir, ignore_errors=True)
