"""Chain identity guard: every upstream of an EVM network must serve the same chain.

At start-up, every IDENTITY_CHECK_INTERVAL seconds, and as soon as an upstream's connection was
lost (it may come back as another chain: a restarted devnet), each upstream is asked for
eth_chainId and the genesis block's hash. The network's identity is the `chain_id` declared in
NETWORKS_FILE (with the genesis of the first upstream that matches it) or the first one seen. An
upstream with another identity is taken out of rotation (an ERROR line, and
`rpc_proxy_upstream_identity_mismatch` set to 1) until it matches again. The identity is part of
every cache key of the network (`Head.space`), so entries of another chain are never served.

The adoption rule (a restarted devnet: a fresh Anvil or Hardhat on the same URL has a new genesis):
with no identity declared, once every upstream of the network answers with the same new identity
in ADOPT_AFTER consecutive rounds of checks, the network adopts it: an ERROR line,
`rpc_proxy_identity_adoptions_total`, a new cache namespace (entries of the old chain are never
served again) and a head tracker that starts over. A declared `chain_id` is never replaced this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from proxy.metrics import Metrics
from proxy.rpc.jsonrpc import JsonRpcError
from proxy.upstream.pool import PerUpstream
from proxy.upstream.standing import ChainIdentity, parse_identity

log = logging.getLogger("proxy.identity")
PROBE_TIMEOUT = 5.0
ROUND_GAP = 1.0  # seconds between the starts of two rounds of checks, at least
ADOPT_AFTER = 3  # rounds of checks in which every upstream agrees on the new identity


def judge(
    network: ChainIdentity | None, declared: int | None, seen: ChainIdentity
) -> tuple[ChainIdentity | None, bool]:
    """(the network's identity after this sighting, whether `seen` matches it)."""
    if network is None:
        if declared is not None and seen.chain_id != declared:
            return None, False
        return seen, True
    return network, seen == network


def agreed(seen: list[ChainIdentity | None], network: ChainIdentity | None) -> ChainIdentity | None:
    """The identity other than the network's that every upstream answered with this round, if any."""
    if not seen or seen[0] is None or seen[0] == network:
        return None
    return seen[0] if all(s == seen[0] for s in seen) else None


def adoption(
    streak: tuple[ChainIdentity | None, int],
    candidate: ChainIdentity | None,
    declared: int | None,
) -> tuple[tuple[ChainIdentity | None, int], bool]:
    """(the streak after this round, whether to adopt `candidate` now). Never with a declared identity."""
    if candidate is None or declared is not None:
        return (None, 0), False
    count = streak[1] + 1 if streak[0] == candidate else 1
    return ((None, 0), True) if count >= ADOPT_AFTER else ((candidate, count), False)


class IdentityGuard:
    def __init__(
        self,
        network: str,
        pool: PerUpstream,
        *,
        declared_chain_id: int | None,
        interval: float,
        retry: float,
        metrics: Metrics,
        on_identity: Callable[[ChainIdentity], None],
        on_adopt: Callable[[ChainIdentity], None] | None = None,
        checkpoint: Callable[[], tuple[int, str] | None] = lambda: None,
    ) -> None:
        self.network = network
        self.identity: ChainIdentity | None = None
        self.checked = asyncio.Event()  # the first round of checks has finished
        self._pool = pool
        self._declared = declared_chain_id
        self._interval = interval
        self._retry = retry  # while an upstream waits for its check after a lost connection
        self._metrics = metrics
        self._on_identity = on_identity
        self._on_adopt = on_adopt
        self._streak: tuple[ChainIdentity | None, int] = (None, 0)
        self._checkpoint = checkpoint  # the network's finalized block (number, hash), once known

    async def run(self) -> None:
        states = self._pool.states
        while True:
            states.suspect.clear()
            began = time.monotonic()
            await self.check_all()
            self.checked.set()
            # Checked again soon while an upstream is lost or a new identity is gaining agreement.
            waiting = any(states.lost_since_verified) or self._streak[1] > 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._retry if waiting else self._interval):
                    await states.suspect.wait()
            # Rounds ROUND_GAP apart at least: a burst of suspicions (each dev call that changes state is
            # one) is a round a second, not a round per call back to back; a lost connection's still soon.
            if (rest := began + min(self._retry, ROUND_GAP) - time.monotonic()) > 0:
                await asyncio.sleep(rest)

    async def check_all(self) -> None:
        # In index order: with no declared chain id, the primary's identity is the network's.
        checkpoint = self._checkpoint()
        checks = [await self.check(index, checkpoint) for index in range(self._pool.states.size)]
        seen = [identity for identity, _ in checks]
        self._streak, adopt = adoption(self._streak, agreed(seen, self.identity), self._declared)
        if adopt and seen[0] is not None:
            self.adopt(seen[0])
            return
        verdicts = [on_chain for _, on_chain in checks]
        if checkpoint is not None and True in verdicts:
            # Some upstream has the network's finalized block: one with another block there is on
            # another fork. (If none has it, the network's chain itself moved on: the tracker sees it.)
            for index, on_chain in enumerate(verdicts):
                if on_chain is False and not self._pool.states.mismatch[index]:
                    log.error(
                        "network %s: upstream #%d has another block %d than the network's "
                        "finalized one: taken out of rotation",
                        self.network,
                        index,
                        checkpoint[0],
                    )
                    self._pool.states.judged(index, False)
                    self._metrics.identity_mismatch.labels(self.network, str(index)).set(1)

    def adopt(self, identity: ChainIdentity) -> None:
        states = self._pool.states
        log.error(
            "network %s: every upstream now serves %s, not %s, and no identity is declared (a restarted "
            "devnet?): adopted as the network's chain; cache entries of the old chain are never served",
            self.network,
            identity.describe(),
            self.identity.describe() if self.identity else "none",
        )
        self.identity = identity
        self._metrics.identity_adoptions.labels(self.network).inc()
        (self._on_adopt or self._on_identity)(identity)
        for index in range(states.size):
            states.judged(index, True)
            self._metrics.identity_mismatch.labels(self.network, str(index)).set(0)

    async def check(
        self,
        index: int,
        checkpoint: tuple[int, str] | None = None,
    ) -> tuple[ChainIdentity | None, bool | None]:
        """Check upstream `index`'s identity: what it answered (None: nothing), and whether its block at
        `checkpoint` has the checkpoint's hash (None: not asked, or it has no such block yet)."""
        probes: list[Any] = [
            self._pool.ask(index, "eth_chainId", [], timeout=PROBE_TIMEOUT),
            self._pool.ask(index, "eth_getBlockByNumber", ["0x0", False], timeout=PROBE_TIMEOUT),
        ]
        if checkpoint is not None:
            probes.append(
                self._pool.ask(index, "eth_getBlockByNumber", [hex(checkpoint[0]), False], timeout=PROBE_TIMEOUT)
            )
        try:
            chain_id, genesis, *at = await asyncio.gather(*probes)
        except JsonRpcError:
            return None, None  # unreachable: it stays unverified (answers uncached) and is checked again later
        seen = parse_identity(chain_id.result, genesis.result)
        if seen is None:
            return None, None
        on_chain = None
        if checkpoint is not None and isinstance(at[0].result, dict):
            on_chain = str(at[0].result.get("hash", "")).lower() == checkpoint[1]
        self._judge(index, seen)
        return seen, on_chain

    def _judge(self, index: int, seen: ChainIdentity) -> None:
        states = self._pool.states
        first = self.identity is None
        self.identity, matches = judge(self.identity, self._declared, seen)
        if first and self.identity is not None:
            log.info("network %s: chain identity is %s", self.network, self.identity.describe())
            self._on_identity(self.identity)
        if not matches and not states.mismatch[index]:
            expected = self.identity.describe() if self.identity else f"declared chain id {self._declared}"
            log.error(
                "network %s: upstream #%d serves %s, not the network's %s: taken out of rotation",
                self.network,
                index,
                seen.describe(),
                expected,
            )
        elif matches and states.mismatch[index]:
            log.warning(
                "network %s: upstream #%d serves the network's chain again: back in rotation", self.network, index
            )
        states.judged(index, matches)
        self._metrics.identity_mismatch.labels(self.network, str(index)).set(0 if matches else 1)
