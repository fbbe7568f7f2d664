"""One scrape for all workers (WORKERS > 1): each worker's registry, and the supervisor's, is served
on a unix socket in the run directory; whichever worker a scrape reaches reads them all and answers
with their merge.

The per-request metrics stay plain numbers in each worker (metrics.py): nothing is shared or locked
per request, and merging costs only the scrape. prometheus_client's multiprocess mode would instead
write every update to a memory-mapped file, and it cannot carry the proxy's own collectors.

Counters and histograms are summed. Gauges follow `GAUGE_MERGE`: a quantity every worker holds a part
of (cache bytes, connections, requests in flight) is summed; a view of the chain every worker holds
whole (head block, last poll) takes the highest; a health bit (Redis up) takes the lowest, so one
worker that cannot reach Redis shows.

What a worker counted outlives it, so the host's counters never step back when one dies: each scrape
records every worker's counts as it read them (by socket and pid, `metrics-seen.json` in the run
directory, under a lock), and a worker found gone (its pid dead, or its socket answered by a new one)
has its last counts added to the retired ones, which every later scrape adds in. As every scrape
serves what it records, a dead worker's retired counts are at least what any scrape served of it
(its increments after the last scrape are lost, never counted twice). A worker alive but not
answering in time is counted at its last recorded counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

SOCKET_PATTERN = "metrics-*.sock"
SCRAPE_TIMEOUT = 5.0
PROCESS_HEADER = "X-Process-Id"  # a process's own registry says its pid: what it counted outlives it
SEEN_FILE = "metrics-seen.json"
COUNTED = ("counter", "histogram", "summary")  # the families whose totals must never step back

Merge = Callable[[float, float], float]
GAUGE_MERGE: dict[str, Merge] = {
    "rpc_proxy_head_block": max,
    "rpc_proxy_head_block_timestamp_seconds": max,
    "rpc_proxy_head_last_poll_timestamp_seconds": max,
    "rpc_proxy_upstream_identity_mismatch": max,
    "rpc_proxy_upstream_head_lag_blocks": min,  # workers poll at different moments: the freshest view
    "rpc_proxy_upstream_catching_up": min,  # as the lag: the freshest view
    "rpc_proxy_redis_up": min,
    "rpc_proxy_upstream_up": max,  # each worker has its own pools: down when no worker can use it
    "rpc_proxy_memory_limit_bytes": max,  # the container's, which every worker shares
    "process_start_time_seconds": min,  # the oldest worker's
    "process_max_fds": max,
    "python_info": max,
}


def _sum(a: float, b: float) -> float:
    return a + b


def merge_rule(family: Metric, sample_name: str) -> Merge:
    if sample_name.endswith("_created"):
        return min  # the first worker's start
    if family.type == "gauge":
        return GAUGE_MERGE.get(family.name, _sum)
    return _sum


def merged(expositions: Iterable[str], rule: Callable[[Metric, str], Merge] = merge_rule) -> list[Metric]:
    """The families of several text expositions, samples of the same name and labels combined (pure)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in expositions:
        for family in text_string_to_metric_families(text):
            kept = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            samples = values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = samples.get(key)
                samples[key] = sample.value if old is None else rule(kept, sample.name)(old, sample.value)
    for name, family in families.items():
        family.samples = [Sample(n, dict(labels), value) for (n, labels), value in values[name].items()]
    return list(families.values())


class _Merged:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def render(families: list[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(families))
    return generate_latest(registry)


def metrics_socket(directory: str, name: str) -> str:
    return os.path.join(directory, f"metrics-{name}.sock")


def counts_of(text: str) -> str:
    """An exposition's counted families alone (counters, histograms), without their `_created` (pure)."""
    families = [f for f in text_string_to_metric_families(text) if f.type in COUNTED]
    for family in families:
        family.samples = [s for s in family.samples if not s.name.endswith("_created")]
    return render(families).decode()


def _highest(_family: Metric, _name: str) -> Merge:
    return max


Read = tuple[str, int | None, str | None]  # a socket's name, the pid that answered, its exposition


def with_retired(seen: dict[str, Any], reads: list[Read], alive: Callable[[int], bool]) -> list[str]:
    """The expositions a scrape merges: those read, the last counts of a worker that did not answer
    but lives, and the retired counts of every worker gone; `seen` (the record) updated (pure)."""
    workers: dict[str, dict[str, Any]] = seen.setdefault("workers", {})
    retired: list[str] = [seen["retired"]] if seen.get("retired") else []
    texts, answered = [], set()
    for name, pid, text in reads:
        if text is None:
            continue
        texts.append(text)
        if pid is None:
            continue
        answered.add(name)
        last, counts = workers.get(name), counts_of(text)
        if last is not None and last["pid"] != pid:  # restarted: what its predecessor counted is kept
            retired.append(last["counts"])
        elif last is not None:  # a scrape beside this one may have recorded a later read
            counts = render(merged([last["counts"], counts], _highest)).decode()
        workers[name] = {"pid": pid, "counts": counts}
    for name, last in list(workers.items()):
        if name in answered:
            continue
        if alive(last["pid"]):
            texts.append(last["counts"])  # no answer in time: its last counts stand, never a step back
        else:
            retired.append(last["counts"])
            del workers[name]
    if retired:
        seen["retired"] = render(merged(retired)).decode()
        texts.append(seen["retired"])
    return texts


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _recorded(directory: str, reads: list[Read]) -> list[str]:
    """with_retired on the run directory's record, under its lock (one scrape at a time per host)."""
    path = os.path.join(directory, SEEN_FILE)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        seen: dict[str, Any] = {}
        with contextlib.suppress(OSError, orjson.JSONDecodeError), open(path, "rb") as handle:
            seen = orjson.loads(handle.read())
        texts = with_retired(seen, reads, _alive)
        with open(path + ".new", "wb") as handle:
            handle.write(orjson.dumps(seen))
        os.replace(path + ".new", path)
    return texts


async def _read(path: str) -> Read:
    name = os.path.basename(path)
    try:
        async with (
            aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=path),
                timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT),
            ) as session,
            session.get("http://worker/metrics") as response,
        ):
            if response.status != 200:
                return name, None, None
            pid = response.headers.get(PROCESS_HEADER)
            return name, int(pid) if pid and pid.isdigit() else None, await response.text()
    except (OSError, aiohttp.ClientError, TimeoutError):
        return name, None, None  # a worker that just died (and is being restarted): its last counts stand


async def scrape_all(directory: str) -> bytes:
    """The merged exposition of every worker and the supervisor serving in `directory`, with what
    workers gone had counted."""
    paths = sorted(glob.glob(os.path.join(directory, SOCKET_PATTERN)))
    reads = list(await asyncio.gather(*(_read(p) for p in paths)))
    texts = await asyncio.to_thread(_recorded, directory, reads)
    return render(merged(texts))
