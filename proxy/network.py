"""A network at run time: its settings, its upstream pool and the tracker of its head."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.chain.heads import EvmHeadTracker
from proxy.chain.slots import SolanaSlotTracker
from proxy.config import Network
from proxy.upstream.pool import PerUpstream, Upstream, http_pool
from proxy.upstream.sending import NONE_IN_ROTATION


@dataclass(slots=True)
class NetworkRuntime:
    config: Network
    upstream: Upstream
    tracker: EvmHeadTracker | SolanaSlotTracker
    per_upstream: PerUpstream | None = None  # each upstream on its own: its head, identity, a retry
    name: str = field(init=False)  # config.name, as a plain attribute: the hot path reads it per call
    # The name its memoized plans are held under: the network's, and a Solana cluster's key space once
    # known (rescope): a plan names its cluster's keys, and no head changes with the cluster to retire it.
    scope: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.scope = self.config.name

    def rescope(self, space: str) -> None:
        self.scope = space

    def health(self, now: float) -> str | None:
        """Why this network cannot be trusted to answer right now (for /readyz), or None."""
        if self.per_upstream is not None:
            states = self.per_upstream.states
            if all(states.mismatch):
                return "degraded: no upstream serves the network's chain (see rpc_proxy_upstream_identity_mismatch)"
            rotating = [i for i in range(states.size) if states.in_rotation(i)]
            if not rotating:  # (all() of none is true: it said syncing of a node down or cordoned)
                return f"degraded: {NONE_IN_ROTATION} (see rpc_proxy_upstream_up)"
            if all(states.syncing[i] for i in rotating):
                return "degraded: every upstream is still syncing (see rpc_proxy_upstream_catching_up)"
        return self.tracker.health(now)

    def fork_note(self) -> str | None:
        """Why this replica uses a key space of its own (its chain is not the shared cache's), or None."""
        return self.tracker.forks.note if isinstance(self.tracker, EvmHeadTracker) else None

    def catching_up(self) -> dict[str, str]:
        """Upstreams (by index, never URL) still syncing or far behind, and how far: for /readyz."""
        # A Solana pool's states too: its upstreams' slots are polled one by one (network_parts.py).
        pool = self.per_upstream or http_pool(self.upstream)
        states = pool.states if pool is not None else None
        if states is None:
            return {}
        return {
            str(i): ("syncing" if states.syncing[i] else "behind") + f", {states.behind_by(i)} blocks behind"
            for i in range(states.size)
            if states.catching_up(i)
        }
