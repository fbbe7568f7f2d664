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
"""

from __future__ import annotations

import asyncio
import glob
import os
from collections.abc import Callable, Iterable, Iterator

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

SOCKET_PATTERN = "metrics-*.sock"
SCRAPE_TIMEOUT = 5.0

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


def merged(expositions: Iterable[str]) -> list[Metric]:
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


async def _read(path: str) -> str | None:
    try:
        async with (
            aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=path),
                timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT),
            ) as session,
            session.get("http://worker/metrics") as response,
        ):
            return await response.text() if response.status == 200 else None
    except (OSError, aiohttp.ClientError, TimeoutError):
        return None  # a worker that just died (and is being restarted): its counts are left out


async def scrape_all(directory: str) -> bytes:
    """The merged exposition of every worker and the supervisor serving in `directory`."""
    paths = sorted(glob.glob(os.path.join(directory, SOCKET_PATTERN)))
    texts = await asyncio.gather(*(_read(p) for p in paths))
    return render(merged(t for t in texts if t is not None))
