"""Which upstream of a network is asked first: the network's selection policy (NETWORKS_FILE
`selection`). Pure decisions over what is known of each upstream; the pool does the I/O.

- `priority` (the default): the order the upstreams are declared in, primary first.
- `weighted`: a random order drawn by weight (`weight` per upstream, default 1): an upstream of
  weight 3 is asked first three times as often as one of weight 1.
- `fastest`: the lowest score first, where the score is the upstream's recent latency, raised by
  its recent error rate and its head lag. Recent means time-decayed: an observation's weight halves
  every SCORE_HALF_LIFE seconds, and once an upstream's samples have decayed below STALE_WEIGHT (about
  two minutes after its last one) its latency is unknown again, which ranks first: an upstream that
  was slow is tried again rather than shunned forever. Every answer counts, the per-upstream head
  polls' too, so every upstream in rotation is measured every poll interval.

Every policy orders only the upstreams in rotation (identity verified or not yet judged, not
cordoned); upstreams cooling down after a failure come last, and the per-upstream head checks
(asking.py) still skip an upstream that lacks a block an answer needs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from proxy.config_files import SELECTION_POLICIES

POLICIES = SELECTION_POLICIES
SCORE_HALF_LIFE = 30.0  # seconds for an observation's weight in a score to halve
STALE_WEIGHT = 0.05  # a score whose samples have decayed below this weight is no longer known...
UNMEASURED_SECONDS = 0.0  # ...and an unknown latency counts as the best: that upstream is tried again
ERROR_PENALTY = 4.0  # a score is latency * (1 + ERROR_PENALTY * error rate)...
LAG_PENALTY_SECONDS = 0.25  # ...plus this much per block the upstream's head is behind the best


@dataclass(slots=True)
class _Decayed:
    """A time-decayed mean: each sample's weight halves every SCORE_HALF_LIFE seconds."""

    total: float = 0.0
    weight: float = 0.0
    at: float = 0.0

    def add(self, value: float, now: float) -> None:
        self._decay(now)
        self.total += value
        self.weight += 1.0

    def mean(self, now: float) -> float | None:
        """None when no sample is left with weight enough to say anything (never measured, or long ago)."""
        self._decay(now)
        return self.total / self.weight if self.weight > STALE_WEIGHT else None

    def _decay(self, now: float) -> None:
        if now > self.at:
            factor = math.pow(0.5, (now - self.at) / SCORE_HALF_LIFE)
            self.total *= factor
            self.weight *= factor
            self.at = now


@dataclass(slots=True)
class Scores:
    """Each upstream's recent latency and error rate, for the `fastest` policy."""

    size: int
    latency: list[_Decayed] = field(init=False)
    errors: list[_Decayed] = field(init=False)

    def __post_init__(self) -> None:
        self.latency = [_Decayed() for _ in range(self.size)]
        self.errors = [_Decayed() for _ in range(self.size)]

    def observe(self, index: int, seconds: float | None, now: float) -> None:
        """One answer (`seconds`) or one failure (None) of upstream `index`."""
        if not 0 <= index < self.size:
            return
        self.errors[index].add(0.0 if seconds is not None else 1.0, now)
        if seconds is not None:
            self.latency[index].add(seconds, now)

    def score(self, index: int, lag_blocks: int, now: float) -> float:
        latency = self.latency[index].mean(now)
        error_rate = self.errors[index].mean(now) or 0.0
        base = UNMEASURED_SECONDS if latency is None else latency
        return base * (1.0 + ERROR_PENALTY * error_rate) + LAG_PENALTY_SECONDS * max(lag_blocks, 0)


def weighted_order(candidates: Sequence[int], weights: Sequence[float], draw: Callable[[], float]) -> list[int]:
    """A random order in which each upstream comes first with probability proportional to its weight
    (Efraimidis-Spirakis: sort by u ** (1 / w), largest first)."""
    keyed = []
    for index in candidates:
        weight = weights[index] if index < len(weights) else 1.0
        u = draw()
        keyed.append((u ** (1.0 / weight) if weight > 0 else -1.0, index))
    keyed.sort(reverse=True)
    return [index for _, index in keyed]


class Selector:
    """Orders a network's upstreams for one call under its policy."""

    def __init__(
        self,
        policy: str,
        weights: Sequence[float],
        *,
        draw: Callable[[], float] = random.random,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown selection policy {policy!r}")
        self.policy = policy
        self.weights = tuple(weights)
        self.scores = Scores(len(weights))
        self._draw = draw

    def order(self, candidates: Sequence[int], heads: Sequence[int], now: float) -> list[int]:
        """`candidates` (in declared order) as this policy would ask them; `heads` is each upstream's
        own latest block (-1 when unknown)."""
        if self.policy == "priority" or len(candidates) < 2:
            return list(candidates)
        if self.policy == "weighted":
            return weighted_order(candidates, self.weights, self._draw)
        best = max((heads[i] for i in candidates), default=-1)
        return sorted(
            candidates,
            key=lambda i: (self.scores.score(i, best - heads[i] if heads[i] >= 0 and best >= 0 else 0, now), i),
        )
