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

from proxy.workers.shared_table import alive

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


def merged(expositions: Iterable[str | list[Metric]]) -> list[Metric]:
    """The families of several expositions (text, or parsed), samples of the same name and labels
    combined (pure)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for exposition in expositions:
        parsed = text_string_to_metric_families(exposition) if isinstance(exposition, str) else exposition
        for family in parsed:
            kept = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            samples = values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = samples.get(key)
                samples[key] = sample.value if old is None else merge_rule(kept, sample.name)(old, sample.value)
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


# A process's counts as recorded: {"types": {family: [type, help]}, "values": {sample: value}}, each
# sample named by the JSON of [family, sample name, its labels sorted].
Counts = dict[str, Any]
GONE_KEPT = 16  # pids of a socket's processes found gone that are remembered (a late read of one is dropped)


def counts_of(families: list[Metric]) -> Counts:
    """A parsed exposition's counted families alone (counters, histograms), without `_created` (pure)."""
    types, values = {}, {}
    for family in families:
        if family.type not in COUNTED:
            continue
        types[family.name] = [family.type, family.documentation]
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                key = orjson.dumps([family.name, sample.name, sorted(sample.labels.items())]).decode()
                values[key] = sample.value
    return {"types": types, "values": values}


def combined(counts: Iterable[Counts], merge: Merge) -> Counts:
    types: dict[str, Any] = {}
    values: dict[str, float] = {}
    for one in counts:
        types.update(one["types"])
        for key, value in one["values"].items():
            old = values.get(key)
            values[key] = value if old is None else merge(old, value)
    return {"types": types, "values": values}


def families_of(counts: Counts) -> list[Metric]:
    families = {name: Metric(name, help_, kind) for name, (kind, help_) in counts["types"].items()}
    for key, value in counts["values"].items():
        family, name, labels = orjson.loads(key)
        if family in families:
            families[family].samples.append(Sample(name, dict(labels), value))
    return list(families.values())


Read = tuple[str, int | None, list[Metric] | None]  # a socket's name, the pid that answered, its families


def with_retired(seen: dict[str, Any], reads: list[Read], alive: Callable[[int], bool]) -> list[list[Metric]]:
    """The expositions a scrape merges: those read, the last counts of a worker that did not answer
    but lives, and the retired counts of every worker gone; `seen` (the record) updated (pure).

    A worker is gone when its pid is dead or another pid answers on its socket; its last counts join
    the retired ones once, and a read of it that reaches the record later (a slower scrape beside this
    one) is dropped, as the retired counts hold it."""
    workers: dict[str, dict[str, Any]] = seen.setdefault("workers", {})
    gone: dict[str, list[int]] = seen.setdefault("gone", {})
    retired: list[Counts] = [seen["retired"]] if seen.get("retired") else []
    texts: list[list[Metric]] = []
    answered = set()

    def retire(name: str, last: dict[str, Any]) -> None:
        retired.append(last["counts"])
        gone[name] = [*gone.get(name, []), last["pid"]][-GONE_KEPT:]

    for name, pid, families in reads:
        if families is None or pid in gone.get(name, ()):
            continue
        texts.append(families)
        if pid is None:
            continue
        answered.add(name)
        last, counts = workers.get(name), counts_of(families)
        if last is not None and last["pid"] != pid:  # restarted: what its predecessor counted is kept
            retire(name, last)
        elif last is not None:  # a scrape beside this one may have recorded a later read
            counts = combined([last["counts"], counts], max)
        workers[name] = {"pid": pid, "counts": counts}
    for name, last in list(workers.items()):
        if name in answered:
            continue
        if alive(last["pid"]):
            texts.append(families_of(last["counts"]))  # no answer in time: its last counts stand
        else:
            retire(name, last)
            del workers[name]
    if retired:
        seen["retired"] = combined(retired, _sum)
        texts.append(families_of(seen["retired"]))
    return texts


async def _locked(path: str, deadline: float) -> int | None:
    """The record's lock, taken by `deadline` (loop time); None past it (its holder stopped or slow)."""
    handle = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    loop = asyncio.get_running_loop()
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if loop.time() >= deadline:
                os.close(handle)
                return None
            await asyncio.sleep(0.01)


def _load(path: str) -> dict[str, Any]:
    with contextlib.suppress(OSError, orjson.JSONDecodeError), open(path, "rb") as handle:
        loaded = orjson.loads(handle.read())
        if isinstance(loaded, dict):
            return loaded
    return {}


async def _recorded(directory: str, reads: list[Read], deadline: float) -> list[list[Metric]]:
    """with_retired on the run directory's record, under its lock (one scrape at a time per host;
    nothing awaited while it is held). A lock not had by `deadline` (its holder stopped): this scrape
    merges by the record as it stands and writes nothing."""
    path = os.path.join(directory, SEEN_FILE)
    lock = await _locked(path + ".lock", deadline)
    try:
        seen = _load(path)
        texts = with_retired(seen, reads, alive)
        if lock is not None:
            fresh = os.open(path + ".new", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            with open(fresh, "wb") as handle:
                handle.write(orjson.dumps(seen))
            os.replace(path + ".new", path)
    finally:
        if lock is not None:
            os.close(lock)
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
            families = list(text_string_to_metric_families(await response.text()))
            return name, int(pid) if pid and pid.isdigit() else None, families
    except (OSError, aiohttp.ClientError, TimeoutError, ValueError):
        return name, None, None  # a worker that just died (and is being restarted): its last counts stand


async def scrape_all(directory: str) -> bytes:
    """The merged exposition of every worker and the supervisor serving in `directory`, with what
    workers gone had counted."""
    deadline = asyncio.get_running_loop().time() + SCRAPE_TIMEOUT + 1.0
    paths = sorted(glob.glob(os.path.join(directory, SOCKET_PATTERN)))
    reads = list(await asyncio.gather(*(_read(p) for p in paths)))
    return render(merged(await _recorded(directory, reads, deadline)))
