"""Prices calls with the proxy's own credits table and prints the figures against the issue's targets."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from proxy.config import build_settings
from proxy.credits.prices import METHOD_CREDITS, credits_of

from .rpc import Phase


def pricer(settings: Mapping[str, str] | None = None) -> Callable[[str], int]:
    """What the upstream charges per call: the proxy's credits table (proxy/credits/prices.py), with
    DEFAULT_CREDITS (from `settings`, else its default) for the methods it does not list."""
    default = build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", **(settings or {})}).default_credits
    return lambda method: credits_of(method, METHOD_CREDITS, default)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclass
class Row:
    name: str
    client: Counter[str]  # calls the clients sent, per method
    upstream: Counter[str]  # calls that reached the node through the proxy, per method
    proxy_ms: tuple[float, float]  # p50, p99 of an HTTP request through the proxy
    node_ms: tuple[float, float]  # the same workload against the node directly
    errors: int = 0

    def credits(self, price: Callable[[str], int]) -> tuple[int, int]:
        return (sum(price(m) * n for m, n in self.client.items()), sum(price(m) * n for m, n in self.upstream.items()))

    def saved(self, price: Callable[[str], int]) -> tuple[float, float]:
        """(credits saved %, calls saved %) against sending every client call to the node."""
        client_credits, upstream_credits = self.credits(price)
        calls, upstream = sum(self.client.values()), sum(self.upstream.values())
        return (
            100 * (1 - upstream_credits / client_credits) if client_credits else 0.0,
            100 * (1 - upstream / calls) if calls else 0.0,
        )


def latency(phase: Phase) -> tuple[float, float]:
    return percentile(phase.latencies, 50) * 1000, percentile(phase.latencies, 99) * 1000


# issue 13: what each workload should save, and on which measure.
TARGETS: dict[str, tuple[str, float]] = {
    "indexer pass 1": ("credits", 40.0),
    "indexer pass 2": ("credits", 99.0),
    "dapp": ("calls", 90.0),
    "wallet repeated views": ("credits", 80.0),
}


def table(rows: list[Row], price: Callable[[str], int]) -> str:
    head = (
        f"| {'phase':<22} | client calls | upstream calls /1k | upstream credits /1k | credits saved | "
        f"calls saved | proxy p50 / p99 ms | node p50 / p99 ms | target |"
    )
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        calls = sum(row.client.values())
        _, upstream_credits = row.credits(price)
        credits_saved, calls_saved = row.saved(price)
        target = TARGETS.get(row.name)
        verdict = ""
        if target is not None:
            measure, threshold = target
            value = credits_saved if measure == "credits" else calls_saved
            verdict = f"{measure} >= {threshold:g}%: {'reached' if value >= threshold else 'NOT reached'}"
        lines.append(
            f"| {row.name:<22} | {calls:>12,} | {1000 * sum(row.upstream.values()) / max(calls, 1):>18.1f} | "
            f"{1000 * upstream_credits / max(calls, 1):>20,.0f} | {credits_saved:>12.1f}% | {calls_saved:>10.1f}% | "
            f"{row.proxy_ms[0]:>7.1f} / {row.proxy_ms[1]:>7.1f} | {row.node_ms[0]:>6.1f} / {row.node_ms[1]:>7.1f} | "
            f"{verdict} |"
        )
    return "\n".join(lines)


def by_method(rows: list[Row]) -> str:
    """Where the upstream calls went: client calls -> upstream calls, per method and phase."""
    out = []
    for row in rows:
        methods = sorted(set(row.client) | set(row.upstream))
        parts = [f"{m} {row.client[m]}->{row.upstream[m]}" for m in methods]
        out.append(f"{row.name}: " + ", ".join(parts) + (f" ({row.errors} error answers)" if row.errors else ""))
    return "\n".join(out)
