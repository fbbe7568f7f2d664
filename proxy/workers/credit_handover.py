"""A worker's leases outlive it (WORKERS > 1): each worker records, in the supervisor's run directory,
the keys it leased and under which replica name; the worker started in its place gives those leases
back (shrunk to what the dead one spent, as its last report or its journal says), so a worker that
dies leaves no key under-served for the rest of the day (README "Limits and credits").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proxy.credits.journal import read_journals
from proxy.credits.key_lease import KeyLease
from proxy.credits.leases import LeasedLedger
from proxy.rpc import jsonrpc
from proxy.workers.shared_polls import ShownRelay

log = logging.getLogger("proxy.credits")


class Handover:
    """Worker `index`'s record of its leases, and the release of its predecessors'."""

    def __init__(self, run_dir: str, index: int, ledger: LeasedLedger, journal_dir: str | None) -> None:
        self._directory = Path(run_dir)
        self._prefix = f"leases-{index}-"
        self._own = self._directory / f"{self._prefix}{ledger.replica}.jsonl"
        self._ledger = ledger
        self._journal_dir = journal_dir
        ledger.on_new_lease.append(self._record)
        ledger.exchanges.on_known.append(self._record_known)
        ledger.host_saw = self.sibling_leased

    def _record(self, lease: KeyLease, known: bool = False) -> None:
        entry: dict[str, Any] = {"k": lease.key, "a": lease.api_key}
        if known:
            entry["known"] = True
        line = jsonrpc.dumps(entry)
        try:
            with self._own.open("ab") as handle:
                handle.write(line + b"\n")
        except OSError as exc:
            log.warning("credits: cannot record a lease in %s: %s", self._own, exc.strerror)

    def _record_known(self, lease: KeyLease) -> None:
        self._record(lease, known=True)

    def sibling_leased(self, key: str) -> bool:
        """Whether another worker of this host (or a dead one's record) had the ledger's word on the
        ledger key `key` (a lease granted, its view of the others): not one that only tried, as every
        worker does on its first call during an outage."""
        return any(
            key in _known(path)
            for path in self._directory.glob("leases-*.jsonl")
            if not path.name.startswith(self._prefix)
        )

    def predecessors(self) -> list[Path]:
        return [p for p in self._directory.glob(self._prefix + "*.jsonl") if p != self._own]

    async def release_predecessors(self, now: float) -> bool:
        """Give back every lease a dead predecessor held; True once none is left to give back."""
        journals = read_journals(self._journal_dir)
        done = True
        for path in self.predecessors():
            replica = path.name[len(self._prefix) : -len(".jsonl")]
            released = True
            for key, api_key in sorted(_leased(path)):
                counters = journals.get(key, {}).get(replica, (0, 0))
                released = await self._ledger.exchanges.release(replica, key, api_key, counters, now) and released
            if released:
                log.warning(
                    "credits: gave back the leases of worker replica %s, which exited without doing so", replica
                )
                path.unlink(missing_ok=True)
                if self._journal_dir:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self._journal_dir, f"{replica}.journal"))
            done = done and released
        return done

    def close(self, settled: bool) -> None:
        """On a clean stop: every lease went back, so nothing is left for a successor."""
        if settled:
            self._own.unlink(missing_ok=True)


def _entries(path: Path) -> list[dict[str, Any]]:
    """A worker's record, line by line (a line cut short by a crash is skipped)."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return []
    entries = []
    for line in lines:
        try:
            entry = jsonrpc.loads(line)
        except jsonrpc.JSONDecodeError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("k"), str) and isinstance(entry.get("a"), str):
            entries.append(entry)
    return entries


def _known(path: Path) -> set[str]:
    """The ledger keys a worker's record says the ledger answered it about."""
    return {entry["k"] for entry in _entries(path) if entry.get("known") is True}


def _leased(path: Path) -> set[tuple[str, str]]:
    return {(entry["k"], entry["a"]) for entry in _entries(path)}


class WorkerLedger:
    """What one worker's ledger shares with its siblings: keys refused for exhaustion (one datagram to
    each, as blocks shown are: the outage rule is per key, not per process), and its leases' handover."""

    def __init__(self, run_dir: str, index: int, ledger: LeasedLedger, journal_dir: str | None) -> None:
        self._ledger = ledger
        self.handover = Handover(run_dir, index, ledger, journal_dir)
        self._relay = ShownRelay(run_dir, index, ledger.exhausted.heard, name="exhausted")
        ledger.exhausted.on_exhausted.append(self._relay.tell)

    async def start(self) -> None:
        await self._relay.start()

    async def run(self, clock: Callable[[], float], interval: float = 1.0) -> None:
        """Give back dead predecessors' leases, retried until Redis answers."""
        task = asyncio.current_task()
        while self.handover.predecessors() and not await self.handover.release_predecessors(clock()):
            if task is not None and task.cancelling():
                raise asyncio.CancelledError  # taken for a command's timeout (leases.LeasedLedger.run)
            await asyncio.sleep(interval)

    def close(self) -> None:
        self._relay.close()
        self.handover.close(self._ledger.given_back)
