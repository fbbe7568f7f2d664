"""Head polls shared by the workers of one host (WORKERS > 1).

Every worker keeps its own head tracker, so everything that hangs off a tracker (the unfinalized
window and its reorg detection, orphans, finality epochs, staleness and /readyz, read-your-writes
catch-up, newHeads/logs feeds) works in each worker exactly as in a single process. What the workers
share is the upstream's answers to the tracker's calls: the first worker to poll in a round asks the
upstream and writes the answers to a small file under the run directory; a worker polling in the same
round reads them instead of asking again. The trackers poll on wall-clock ticks when shared, so all
workers poll in the same instant and the upstream sees one poll per interval, not one per worker.

A worker never takes an answer older than half a poll interval, and a poll woken by read-your-writes
takes only answers fetched after it was woken: no worker's view trails what a single process would
have by more than half an interval, well inside the staleness bound (three intervals).

The file is read and written under an flock, held across the upstream call, so a worker arriving while
another is asking waits for that answer rather than sending its own. A worker that dies holding it
releases it with its descriptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson

from proxy.values import Answer

Call = tuple[str, Any]
LOCK_RETRY = 0.002  # seconds between tries of a held lock: a poll takes milliseconds
LOCK_WAIT_MAX = 5.0  # past this, the worker asks the upstream itself rather than wait on a stuck peer


def _encode(answer: Answer, fetched: float) -> list[Any]:
    return [fetched, answer.payload.decode(), answer.result, answer.error, answer.seconds, answer.upstream]


def _decode(entry: list[Any]) -> Answer:
    _, payload, result, error, seconds, upstream = entry
    return Answer(payload.encode(), result, error, seconds, upstream)


def fresh_answers(memo: dict[str, list[Any]], keys: Sequence[str], since: float) -> dict[str, Answer]:
    """The memo's answers for `keys` fetched at or after `since` (pure)."""
    return {k: _decode(memo[k]) for k in keys if k in memo and memo[k][0] >= since}


def pruned(memo: dict[str, list[Any]], oldest: float) -> dict[str, list[Any]]:
    return {k: v for k, v in memo.items() if v[0] >= oldest}


def aligned_delay(interval: float, now: float) -> float:
    """Seconds to the next wall-clock multiple of `interval`: every worker's tracker wakes then."""
    return interval - (now % interval)


class SharedPolls:
    """One network's memo of tracker answers, shared through `directory`."""

    def __init__(self, directory: str, network: str, interval: float) -> None:
        self.interval = interval
        self._path = os.path.join(directory, f"polls-{network}.json")
        self._lock_fd = os.open(os.path.join(directory, f"polls-{network}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        # flock is per open file: a second task of this process would pass it at once (and write back
        # a memo read before the first one's answers). Tasks of one process queue here first.
        self._in_process = asyncio.Lock()

    async def ask(
        self,
        scope: str,
        calls: Sequence[Call],
        fetch: Callable[[list[Call]], Awaitable[list[Answer]]],
        *,
        since: float,
    ) -> list[Answer]:
        """Answers to `calls` no older than `since`: from the memo when a sibling fetched them,
        else from `fetch` (and written to the memo for the siblings)."""
        keys = [scope + orjson.dumps(call).decode() for call in calls]
        async with self._in_process:
            return await self._ask_locked(keys, calls, fetch, since)

    async def _ask_locked(
        self,
        keys: list[str],
        calls: Sequence[Call],
        fetch: Callable[[list[Call]], Awaitable[list[Answer]]],
        since: float,
    ) -> list[Answer]:
        locked = await self._lock()
        try:
            memo = self._read() if locked else {}
            found = fresh_answers(memo, keys, since)
            missing = [(k, c) for k, c in zip(keys, calls, strict=True) if k not in found]
            if missing:
                # An answer is as fresh as its asking: one asked before a read-your-writes wake-up
                # (`since`) and come after it may not show the write (its node answered before it).
                asked = time.time()
                answers = await fetch([c for _, c in missing])
                for (key, _), answer in zip(missing, answers, strict=True):
                    found[key] = answer
                    memo[key] = _encode(answer, asked)
                if locked:
                    self._write(pruned(memo, asked - 2 * self.interval))
            return [found[k] for k in keys]
        finally:
            if locked:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    async def _lock(self) -> bool:
        deadline = time.monotonic() + LOCK_WAIT_MAX
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                await asyncio.sleep(LOCK_RETRY)

    def _read(self) -> dict[str, list[Any]]:
        try:
            with open(self._path, "rb") as handle:
                memo = orjson.loads(handle.read())
        except (OSError, orjson.JSONDecodeError):
            return {}
        return memo if isinstance(memo, dict) else {}

    def _write(self, memo: dict[str, list[Any]]) -> None:
        temporary = self._path + ".tmp"
        with open(temporary, "wb") as handle:
            handle.write(orjson.dumps(memo))
        os.replace(temporary, self._path)

    def close(self) -> None:
        os.close(self._lock_fd)


class ShownRelay:
    """Read-your-writes across workers: a worker that shows a client block N tells its siblings, whose
    trackers then treat N as shown too (`latest` never resolves below it; they poll at once). One
    datagram per newly shown block, to each sibling's socket in the run directory."""

    def __init__(self, directory: str, index: int, on_shown: Callable[[str, int], None], name: str = "shown") -> None:
        self._directory = directory
        self._name = name  # one relay per kind of news: blocks shown, keys refused for credits
        self._own = os.path.join(directory, f"{name}-{index}.sock")
        self._on_shown = on_shown
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._out.setblocking(False)
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> None:
        relay = self

        class Receiver(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                network, _, number = data.decode(errors="replace").rpartition(" ")
                with contextlib.suppress(ValueError):
                    relay._on_shown(network, int(number))

        with contextlib.suppress(OSError):
            os.unlink(self._own)  # left by this worker's predecessor, if it was killed
        inbound = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        inbound.bind(self._own)  # bound here: uvloop takes no unix path as local_addr
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(Receiver, sock=inbound)

    def tell(self, network: str, number: int) -> None:
        message = f"{network} {number}".encode()
        for path in glob.glob(os.path.join(self._directory, f"{self._name}-*.sock")):
            if path != self._own:
                with contextlib.suppress(OSError):  # a sibling restarting, or its queue full
                    self._out.sendto(message, path)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._out.close()
        with contextlib.suppress(OSError):
            os.unlink(self._own)
