"""One Metrics object on an injected prometheus registry.

Label sets stay bounded: methods outside the known tables are labelled "other", upstreams are
named by index (never by URL), and API keys appear only when they are configured keys.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        self.requests = Counter(
            "rpc_proxy_requests", "JSON-RPC calls answered, by network, method and outcome "
            "(ok, error, invalid, refused, upstream_error).",
            ["network", "method", "outcome"], registry=r,
        )
        self.request_seconds = Histogram(
            "rpc_proxy_request_duration_seconds", "Time to answer one JSON-RPC call, by cache result.",
            ["network", "method", "cache"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.cache_lookups = Counter(
            "rpc_proxy_cache_lookups", "Cache lookups by tier (memory, redis, none) and result (hit, miss, bypass).",
            ["tier", "result"], registry=r,
        )
        self.cache_memory_bytes = Gauge(
            "rpc_proxy_cache_memory_bytes", "Bytes held by the in-process cache tier.", registry=r,
        )
        self.upstream_seconds = Histogram(
            "rpc_proxy_upstream_request_duration_seconds", "Upstream request latency.",
            ["network", "method", "upstream"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.upstream_errors = Counter(
            "rpc_proxy_upstream_errors", "Upstream failures by kind (connect, timeout, http, invalid).",
            ["network", "upstream", "kind"], registry=r,
        )
        self.upstream_failovers = Counter(
            "rpc_proxy_upstream_failovers", "Requests passed on to the next upstream after a failure.",
            ["network"], registry=r,
        )
        self.coalesced = Counter(
            "rpc_proxy_coalesced_requests", "Calls answered by joining an identical in-flight upstream call.",
            ["network", "method"], registry=r,
        )
        self.credits_charged = Counter(
            "rpc_proxy_credits_charged", "Credits charged to callers, by method.", ["method"], registry=r,
        )
        self.key_credits_charged = Counter(
            "rpc_proxy_key_credits_charged", "Credits charged, by configured API key.", ["key"], registry=r,
        )
        self.credits_saved = Counter(
            "rpc_proxy_upstream_credits_saved", "Upstream credits not spent because the cache answered.",
            ["network", "method"], registry=r,
        )
        self.credit_rejections = Counter(
            "rpc_proxy_credit_rejections", "Requests refused for credits (exhausted, rate).", ["reason"], registry=r,
        )
        self.getlogs_rejections = Counter(
            "rpc_proxy_getlogs_limit_rejections", "eth_getLogs refused by a limit (results, timeout, params, range).",
            ["reason"], registry=r,
        )
        self.head_block = Gauge(
            "rpc_proxy_head_block", "Head tracker: block number (EVM) or slot (Solana) by tag or commitment.",
            ["network", "tag"], registry=r,
        )
        self.head_timestamp = Gauge(
            "rpc_proxy_head_block_timestamp_seconds", "Unix time of the latest block the tracker saw.",
            ["network"], registry=r,
        )
        self.head_updated = Gauge(
            "rpc_proxy_head_last_poll_timestamp_seconds", "Unix time of the tracker's last successful poll.",
            ["network"], registry=r,
        )
        self.reorgs = Counter("rpc_proxy_reorgs", "Reorgs the head tracker detected.", ["network"], registry=r)
        self.inflight = Gauge("rpc_proxy_inflight_requests", "HTTP and WebSocket requests being served.", registry=r)
        self.ws_connections = Gauge("rpc_proxy_websocket_connections", "Open WebSocket connections.", registry=r)
        self.redis_errors = Counter(
            "rpc_proxy_redis_errors", "Redis commands that failed or timed out.", ["operation"], registry=r,
        )
        self.redis_up = Gauge("rpc_proxy_redis_up", "1 while Redis answers, 0 while it is skipped.", registry=r)
