"""Every answered call counted and logged: the requests metric, the credits charged, and with
ACCESS_LOG a `call` line per call under its request's id (never a key's secret: its name only)."""

from __future__ import annotations

import itertools
import logging
import uuid

from proxy.config import Settings
from proxy.credits.charging import free
from proxy.metrics import Metrics
from proxy.prepared import Prepared
from proxy.request_ids import REQUEST_ID
from proxy.rpc.jsonrpc import UPSTREAM_UNAVAILABLE, Call, Invalid
from proxy.rpc.methods import metric_label
from proxy.values import Outcome

log = logging.getLogger("proxy.access")
REFUSED_STATUSES = (402, 429, 503)  # refused for credits: exhausted, per-second limit, ledger unreachable


class CallAccounting:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self._access_log = settings.access_log
        self._metrics = metrics
        self._id_prefix = uuid.uuid4().hex[:8] + "-"  # unique per process; a counter within it
        self._ids = itertools.count(1)

    def request_id(self) -> int:
        """An id for this request's log lines; 0 when there are none (ACCESS_LOG off, the default),
        decided without asking the logging module, which a cache hit would feel."""
        return next(self._ids) if self._access_log and log.isEnabledFor(logging.INFO) else 0

    def count(
        self,
        entries: list[Call | Invalid],
        slots: list[Prepared | Outcome],
        results: list[Outcome],
        keyed: bool,
        request_id: int,
    ) -> None:
        """Count and log a body's calls; `keyed`: their credits were charged."""
        for entry, slot, outcome in zip(entries, slots, results, strict=True):
            if isinstance(slot, Prepared):
                self.call(slot.network.name, slot.call.method, outcome, slot.credits if keyed else 0, request_id)
            else:
                method = entry.method if isinstance(entry, Call) else "invalid"
                self.call("none", method, outcome, 0, request_id)

    def call(self, network: str, method: str, outcome: Outcome, credits: int, request_id: int) -> None:
        """Count and log one call; `network` "none" marks a call refused before routing."""
        metrics = self._metrics
        label = metric_label(method) if method != "invalid" else method
        if network == "none":
            result = "invalid"
        elif outcome.error is None:
            result = "error" if outcome.is_error else "ok"
        elif outcome.error.http_status in REFUSED_STATUSES:
            result = "refused"
        elif outcome.error.code == UPSTREAM_UNAVAILABLE:
            result = "upstream_error"
        else:
            result = "error"
        if credits and result != "refused" and not free(outcome):
            metrics.child(metrics.credits_charged, label).inc(credits)
        metrics.child(metrics.requests, network, label, result).inc()
        if request_id:
            cache = outcome.cache if network != "none" else None
            self.log_call(request_id, network, label, result, cache, outcome.upstream_seconds)

    def log_call(
        self, request_id: int, network: str, label: str, result: str, cache: str | None, upstream: float | None
    ) -> None:
        log.info(
            "call",
            extra={
                "request_id": REQUEST_ID.get() or f"{self._id_prefix}{request_id:x}",
                "network": network,
                "method": label,
                "outcome": result,
                "cache": cache,
                "upstream_ms": None if upstream is None else round(upstream * 1000, 2),
            },
        )
