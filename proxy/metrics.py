"""One Metrics object on an injected prometheus registry.

Label sets stay bounded: methods outside the known tables are labelled "other", upstreams are
named by index (never by URL), and API keys appear only when they are configured keys.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class _Cell:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0  # an int until a fraction is added: int arithmetic is cheaper

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


class _Buckets:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        bounds = self.bounds
        # le semantics: value <= bound. Most observations (memory hits) fall in the first bucket.
        self.counts[0 if value <= bounds[0] else bisect_left(bounds, value)] += 1
        self.sum += value


class _Local:
    """A labelled metric kept in plain numbers and exported when scraped.

    The proxy serves from one asyncio thread, so the per-call metrics need no lock; prometheus
    client's own metrics take one on every update, which the cache-hit path feels.
    """

    def __init__(
        self,
        kind: str,
        name: str,
        doc: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float] = (),
    ) -> None:
        self.kind, self.name, self.doc, self.labelnames = kind, name, doc, list(labelnames)
        self.buckets = tuple(buckets)
        self.cells: dict[tuple[str, ...], Any] = {}
        registry.register(self)

    def labels(self, *values: str) -> Any:
        cell = self.cells.get(values)
        if cell is None:
            cell = self.cells[values] = _Buckets(self.buckets) if self.kind == "histogram" else _Cell()
        return cell

    def describe(self) -> list[Metric]:
        return list(self._families(with_samples=False))

    def collect(self) -> Iterator[Metric]:
        return self._families(with_samples=True)

    def _families(self, with_samples: bool) -> Iterator[Metric]:
        family: Any
        if self.kind == "counter":
            family = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        elif self.kind == "gauge":
            family = GaugeMetricFamily(self.name, self.doc, labels=self.labelnames)
        else:
            family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        if with_samples:
            for values, cell in list(self.cells.items()):
                if self.kind == "histogram":
                    running, cumulative = 0, []
                    for bound, count in zip([*map(str, self.buckets), "+Inf"], cell.counts, strict=True):
                        running += count
                        cumulative.append((bound, running))
                    family.add_metric(list(values), cumulative, cell.sum)
                else:
                    family.add_metric(list(values), cell.value)
        yield family


@dataclass(slots=True)
class HitCells:
    """The cells one memory hit updates, updated in one call: a hit takes microseconds."""

    requests: _Cell
    seconds: _Buckets
    memory_hit: _Cell
    saved: _Cell
    charged: _Cell  # rpc_proxy_credits_charged for the method: a keyed hit adds its credits

    @classmethod
    def of(cls, metrics: Metrics, network: str, method: str, is_error: bool) -> HitCells:
        return cls(
            requests=metrics.requests.labels(network, method, "error" if is_error else "ok"),
            seconds=metrics.request_seconds.labels(network, method, "HIT"),
            memory_hit=metrics.cache_lookups.labels("memory", "hit"),
            saved=metrics.credits_saved.labels(network, method),
            charged=metrics.credits_charged.labels(method),  # cached methods are their own label
        )

    def record(self, credits: int, seconds: float) -> None:
        self.requests.value += 1
        self.memory_hit.value += 1
        self.saved.value += credits
        buckets = self.seconds  # _Buckets.observe, inlined: a hit falls in the first bucket
        bounds = buckets.bounds
        buckets.counts[0 if seconds <= bounds[0] else bisect_left(bounds, seconds)] += 1
        buckets.sum += seconds


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # Registration order is exposition order: calls and cache, upstreams, credits and limits,
        # chain heads, then connections and Redis.
        self._add_call_metrics(registry)
        self.upstreams = UpstreamMetrics(registry)
        self._add_credit_metrics(registry)
        self._add_chain_metrics(registry)
        self._add_connection_metrics(registry)
        # The process (CPU, memory, file descriptors) and the interpreter (version, GC), as every
        # Prometheus client exports them by default.
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        self._children: dict[tuple[Any, ...], Any] = {}
        self._hit_cells: dict[tuple[str, str], tuple[HitCells, HitCells]] = {}

    def _add_call_metrics(self, r: CollectorRegistry) -> None:
        """Calls answered and their latency; cache lookups and the memory tier's size."""
        self.requests = _Local(
            "counter",
            "rpc_proxy_requests",
            "JSON-RPC calls answered, by network, method and outcome (ok, error, invalid, refused, upstream_error).",
            ["network", "method", "outcome"],
            r,
        )
        self.request_seconds = _Local(
            "histogram",
            "rpc_proxy_request_duration_seconds",
            "Time to answer one JSON-RPC call, by cache result.",
            ["network", "method", "cache"],
            r,
            LATENCY_BUCKETS,
        )
        self.cache_lookups = _Local(
            "counter",
            "rpc_proxy_cache_lookups",
            "Cache lookups by tier (memory, redis, tracker, none) and result (hit, miss, bypass).",
            ["tier", "result"],
            r,
        )
        self.cache_memory_bytes = Gauge(
            "rpc_proxy_cache_memory_bytes",
            "Bytes the in-process cache tier holds: its entries and their tables, "
            "as the allocator sizes them (bounded by CACHE_MEMORY_BYTES).",
            registry=r,
        )
        self.cache_entries = Gauge("rpc_proxy_cache_entries", "Entries in the in-process cache tier.", registry=r)
        self.answer_bytes_pending = Gauge(
            "rpc_proxy_answer_bytes_pending",
            "Bytes of answers made and not yet taken by their clients (those being made at their "
            "connection's estimate), all connections together (bounded by MAX_PENDING_ANSWER_BYTES_PER_PROCESS).",
            registry=r,
        )
        self.requests_waiting_for_room = Gauge(
            "rpc_proxy_requests_waiting_for_room",
            "Requests read and not yet made because their connection, key or process holds its bound "
            "of answer bytes not yet taken.",
            registry=r,
        )

    def _add_credit_metrics(self, r: CollectorRegistry) -> None:
        """Credits charged and saved; calls refused for credits or by an eth_getLogs limit."""
        self.credits_charged = _Local(
            "counter",
            "rpc_proxy_credits_charged",
            "Credits charged to callers, by method.",
            ["method"],
            r,
        )
        self.key_credits_charged = _Local(
            "counter",
            "rpc_proxy_key_credits_charged",
            "Credits charged, by configured API key.",
            ["key"],
            r,
        )
        self.credits_saved = _Local(
            "counter",
            "rpc_proxy_upstream_credits_saved",
            "Upstream credits not spent because the cache answered.",
            ["network", "method"],
            r,
        )
        self.credit_rejections = Counter(
            "rpc_proxy_credit_rejections",
            "Requests refused for credits (exhausted, rate).",
            ["reason"],
            registry=r,
        )
        self.getlogs_rejections = Counter(
            "rpc_proxy_getlogs_limit_rejections",
            "eth_getLogs refused by a limit (results, timeout, params, range).",
            ["reason"],
            registry=r,
        )

    def _add_chain_metrics(self, r: CollectorRegistry) -> None:
        """Head trackers, reorgs, chain identity, finality and answers served uncached."""
        self.head_block = Gauge(
            "rpc_proxy_head_block",
            "Head tracker: block number (EVM) or slot (Solana) by tag or commitment.",
            ["network", "tag"],
            registry=r,
        )
        self.head_timestamp = Gauge(
            "rpc_proxy_head_block_timestamp_seconds",
            "Unix time of the latest block the tracker saw: its timestamp (EVM), when a poll first saw the "
            "processed slot advance (Solana).",
            ["network"],
            registry=r,
        )
        self.head_updated = Gauge(
            "rpc_proxy_head_last_poll_timestamp_seconds",
            "Unix time of the tracker's last successful poll (of its start until one succeeds).",
            ["network"],
            registry=r,
        )
        self.reorgs = Counter("rpc_proxy_reorgs", "Reorgs the head tracker detected.", ["network"], registry=r)
        self.identity_mismatch = Gauge(
            "rpc_proxy_upstream_identity_mismatch",
            "1 while an upstream serves another chain (chain id or genesis hash) and is out of rotation.",
            ["network", "upstream"],
            registry=r,
        )
        self.identity_adoptions = Counter(
            "rpc_proxy_identity_adoptions",
            "Networks with no declared identity that adopted a new chain every "
            "upstream agreed on (a restarted devnet); its old cache entries are never served.",
            ["network"],
            registry=r,
        )
        self.finality_violations = Counter(
            "rpc_proxy_finality_violations",
            "Finalized blocks whose hash changed (the network's entries were invalidated).",
            ["network"],
            registry=r,
        )
        self.finality_contradictions = Counter(
            "rpc_proxy_finality_contradictions",
            "Times an upstream showed the finalized block with another hash, then with the known one again "
            "(no violation believed; it is out of head tracking for a while).",
            ["network", "upstream"],
            registry=r,
        )
        self.fork_disagreements = Counter(
            "rpc_proxy_fork_disagreements",
            "Times this replica's chain disagreed with the chain of the shared cache's key space (another "
            "fork behind the same Redis): it uses a key space of its own from then on.",
            ["network"],
            registry=r,
        )
        self.uncached_answers = Counter(
            "rpc_proxy_uncached_answers",
            "Answers the proxy could not tie to their block: served uncached "
            "(unverified, unknown_hash, late_head, beyond_head, state_gone: no upstream keeps that old state) or "
            "refused with -32002 (lagging, fork).",
            ["network", "reason"],
            registry=r,
        )
        self.verifications = Counter(
            "rpc_proxy_verifications",
            "Answers about a final block checked against its header before being kept forever (verify): "
            "proven, refuted (the proofs show otherwise: its upstream cools down) or unproven (no proof to be had).",
            ["network", "method", "outcome"],
            registry=r,
        )
        self.unverifiable = Gauge(
            "rpc_proxy_network_unverifiable",
            "1 while no header of the network can be believed (a field the proxy does not know): "
            "nothing of it is proven, so nothing is kept forever under verify = auto or required.",
            ["network"],
            registry=r,
        )

    def _add_connection_metrics(self, r: CollectorRegistry) -> None:
        """Requests in flight, WebSocket connections and subscriptions, Redis health."""
        self.inflight = _Local(
            "gauge", "rpc_proxy_inflight_requests", "HTTP and WebSocket requests being served.", [], r
        ).labels()
        self.ws_connections = Gauge("rpc_proxy_websocket_connections", "Open WebSocket connections.", registry=r)
        self.redis_errors = Counter(
            "rpc_proxy_redis_errors",
            "Redis commands that failed or timed out.",
            ["operation"],
            registry=r,
        )
        self.redis_up = Gauge("rpc_proxy_redis_up", "1 while Redis answers, 0 while it is skipped.", registry=r)
        self.redis_invalid_values = Counter(
            "rpc_proxy_redis_invalid_values",
            "Values read from the Redis cache that are not as the proxy writes them: taken as misses.",
            ["operation"],
            registry=r,
        )
        self.memory_limit = Gauge(
            "rpc_proxy_memory_limit_bytes",
            "The memory limit of the proxy's cgroup (its container); 0: none. "
            "process_resident_memory_bytes must stay under it.",
            registry=r,
        )
        self.subscriptions = _Local(
            "gauge",
            "rpc_proxy_subscriptions",
            "Open WebSocket subscriptions, by kind (its credits-table row).",
            ["kind"],
            r,
        )
        self.slow_consumers = Counter(
            "rpc_proxy_slow_consumer_disconnects",
            "WebSocket connections closed because their consumer fell behind.",
            registry=r,
        )
        self.ws_protocol_closes = Counter(
            "rpc_proxy_websocket_protocol_closes",
            "WebSocket connections the proxy closed for what the client sent, by reason (unmasked: a client "
            "frame without a mask, RFC 6455 section 5.1, 1002; unfinished: a message not whole within "
            "BODY_TIMEOUT, 1008; no_room: a message the host had no room to receive, 1013).",
            ["reason"],
            registry=r,
        )

    def hit_cells(self, network: str, method: str) -> tuple[HitCells, HitCells]:
        """The cells one memory hit updates, for a result and for an error (a plan holds both), found
        once per label set for the hot path."""
        pair = self._hit_cells.get((network, method))
        if pair is None:
            pair = self._hit_cells[network, method] = (
                HitCells.of(self, network, method, False),
                HitCells.of(self, network, method, True),
            )
        return pair

    def child(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), looked up once per label set: the hot path calls this per request."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found


class UpstreamMetrics:
    """The upstreams' metrics, held by Metrics as `metrics.upstreams`: every call sent upstream and
    what is known of each upstream (selection, hedging, budgets, rate limits, lag)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._add_call_metrics(registry)
        self._add_selection_metrics(registry)

    def _add_call_metrics(self, r: CollectorRegistry) -> None:
        """Upstream latency, failures, failovers and coalesced calls."""
        # Per upstream call (every miss): plain numbers, as Metrics' per-call metrics.
        self.seconds = _Local(
            "histogram",
            "rpc_proxy_upstream_request_duration_seconds",
            "Upstream request latency.",
            ["network", "method", "upstream"],
            r,
            LATENCY_BUCKETS,
        )
        self.errors = Counter(
            "rpc_proxy_upstream_errors",
            "Upstream failures by kind (connect, timeout, http, refused, rate_limited, unhealthy, invalid, "
            "mismatch, loop).",
            ["network", "upstream", "kind"],
            registry=r,
        )
        self.failovers = Counter(
            "rpc_proxy_upstream_failovers",
            "Requests passed on to the next upstream after a failure.",
            ["network"],
            registry=r,
        )
        self.coalesced = Counter(
            "rpc_proxy_coalesced_requests",
            "Calls answered by joining an identical in-flight upstream call.",
            ["network", "method"],
            registry=r,
        )

    def _add_selection_metrics(self, r: CollectorRegistry) -> None:
        """Which upstream was asked, hedged reads, provider budgets and rate limits, head lag."""
        self.selected = _Local(
            "counter",
            "rpc_proxy_upstream_selected",
            "Attempts sent to each upstream (the selection policy's choices, failovers and hedges included).",
            ["network", "upstream"],
            r,
        )
        self.hedged = Counter(
            "rpc_proxy_upstream_hedged",
            "Reads also sent to a second upstream after hedge_after_ms without an answer.",
            ["network"],
            registry=r,
        )
        self.hedge_wins = Counter(
            "rpc_proxy_upstream_hedge_wins",
            "Hedged reads, by the upstream whose answer won.",
            ["network", "upstream"],
            registry=r,
        )
        self.budget_waits = Counter(
            "rpc_proxy_upstream_budget_waits",
            "Attempts that waited for an upstream's max_rps/max_concurrency "
            "budget (no upstream in the order had budget at once).",
            ["network", "upstream"],
            registry=r,
        )
        self.rate_limited = Counter(
            "rpc_proxy_upstream_rate_limited",
            "Upstream rate-limit answers (HTTP 429 or a provider's rate-limit "
            "error): that upstream alone cools down, for Retry-After when given.",
            ["network", "upstream"],
            registry=r,
        )
        self.disagreements = Counter(
            "rpc_proxy_upstream_disagreements",
            "Answers about to be kept forever that an upstream got wrong: "
            "outside the majority (confirm_immutable) or failing the logsBloom check (confirm_logs_bloom).",
            ["network", "upstream"],
            registry=r,
        )
        self.catching_up = Gauge(
            "rpc_proxy_upstream_catching_up",
            "1 while an upstream is still syncing (its eth_syncing says so) or its "
            "head is far behind the others: out of head tracking and asked last.",
            ["network", "upstream"],
            registry=r,
        )
        self.up = Gauge(
            "rpc_proxy_upstream_up",
            "1 while an upstream is in rotation and not cooling down after a failure; "
            "0 while calls skip it. Every upstream of a network at 0: the network is down.",
            ["network", "upstream"],
            registry=r,
        )
        self.head_lag = Gauge(
            "rpc_proxy_upstream_head_lag_blocks",
            "Blocks an upstream's own head is behind the furthest upstream's.",
            ["network", "upstream"],
            registry=r,
        )
