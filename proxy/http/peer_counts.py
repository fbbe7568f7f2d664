"""Open connections per client address (MAX_CONNECTIONS_PER_IP), so one client cannot fill
MAX_CONNECTIONS.

A connection counts until its handler's transport is gone: closed ones are swept from an address
when it reaches the cap, and from all of them whenever the table has doubled since the last sweep.
With workers (WORKERS > 1) the cap is the host's: a new connection takes a place in the address's
count in the run directory (workers/shared_table.py), which holds each worker's connections. A
worker tells it of the connections it closed every SETTLE_SECONDS (and at once when its own closed
ones are all that stand in the way): an address's connections never pass the cap, and one that
closed a connection through one worker may, for that long, be refused a new one by another.
"""

from __future__ import annotations

from typing import Any

from proxy.workers.shared_table import SharedCounts

SETTLE_SECONDS = 1.0


class PeerCounts:
    """Open connections per client address; `cap` 0: no cap. `shared`: counted across the workers."""

    def __init__(self, cap: int, shared: SharedCounts | None = None) -> None:
        self.cap = cap
        self.shared = shared
        self._open: dict[str, list[Any]] = {}
        self._held = 0
        self._sweep_at = 1024
        self._swept: dict[str, int] = {}  # addresses whose count fell since the shared count was told

    def admits(self, peer: str) -> bool:
        """Whether one more connection from `peer` fits (with workers: its place is taken when it does)."""
        held = self._open.get(peer)
        if self.shared is not None:
            if self.shared.take(peer, self.cap):
                return True
            if held is None or not self._sweep(peer, held):
                return False
            self.settle()
            return self.shared.take(peer, self.cap)
        if not self.cap or held is None or len(held) < self.cap:
            return True
        self._sweep(peer, held)
        return len(held) < self.cap

    def add(self, peer: str, handler: Any) -> None:
        if not self.cap:
            return
        self._open.setdefault(peer, []).append(handler)
        self._held += 1
        if self._held > self._sweep_at:
            for address, held in list(self._open.items()):
                self._sweep(address, held)
            self._held = sum(len(held) for held in self._open.values())
            self._sweep_at = max(1024, 2 * self._held)

    def settle(self) -> None:
        """Closed connections swept from every address, and the shared count told of what changed."""
        for address, held in list(self._open.items()):
            self._sweep(address, held)
        if self.shared is not None and self._swept:
            swept, self._swept = self._swept, {}
            self.shared.settle(swept)

    def _sweep(self, address: str, held: list[Any]) -> bool:
        """Drops `address`'s closed connections; True if there were any."""
        live = [h for h in held if h.transport is not None]
        if len(live) == len(held):
            return False
        held[:] = live
        if self.shared is not None:
            self._swept[address] = len(live)
        if not live:
            del self._open[address]
        return True
