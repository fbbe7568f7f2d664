"""The dapp frontend: ethers-v6-style clients while a block is mined every second.

What ethers v6 sends (JsonRpcProvider defaults, read from its source): block polling is a lone
`eth_blockNumber` every `pollingInterval` (4 s); on a new block the page refreshes its reads at once, so
they leave in one batch (10 ms batch stall) with one `eth_chainId` (every `getNetwork()` re-detects the
chain; concurrent detections share one call). A page shows the connected user's ether and token balance,
a few shared contract views, and the receipts of the latest transactions (an activity feed).
"""

from __future__ import annotations

import asyncio
import random
import time

from .chain import DEV, SYMBOL, TOTAL_SUPPLY, Chain, Miner, balance_of
from .rpc import CallSpec, Client, Target


class Page:
    """One browser tab: its user, the last block it saw, what it asks on a new block."""

    def __init__(self, client: Client, chain: Chain, user: str) -> None:
        self.client = client
        self.chain = chain
        self.user = user
        self.seen: str | None = None

    def refresh(self) -> list[CallSpec]:
        token = self.chain.token
        calls: list[CallSpec] = [
            ("eth_chainId", []),
            ("eth_getBalance", [self.user, "latest"]),
            ("eth_call", [{"to": token, "data": balance_of(self.user)}, "latest"]),
            ("eth_call", [{"to": token, "data": TOTAL_SUPPLY}, "latest"]),
            ("eth_call", [{"to": token, "data": SYMBOL}, "latest"]),
            ("eth_call", [{"to": token, "data": balance_of(DEV)}, "latest"]),
        ]
        calls += [("eth_getTransactionReceipt", [tx]) for tx in self.chain.recent_txs[:2]]
        return calls

    async def connect(self) -> None:
        await self.client.call("eth_chainId", [])  # the provider's network detection

    async def poll(self) -> None:
        number = (await self.client.call("eth_blockNumber", [])).get("result")
        if number != self.seen:
            self.seen = number
            await self.client.batch(self.refresh())


async def run(
    target: Target,
    chain: Chain,
    miner: Miner,
    *,
    clients: int = 50,
    seconds: float = 30.0,
    poll: float = 4.0,
    block_time: float = 1.0,
    seed: int = 1,
) -> None:
    """Free-running: a block every `block_time`, each page polling every `poll` from a random phase."""
    rng = random.Random(seed)
    phase = await target.begin("dapp")
    pages = [Page(target.client(phase), chain, chain.holders[i % len(chain.holders)]) for i in range(clients)]
    deadline = time.monotonic() + seconds

    async def mine() -> None:
        while time.monotonic() < deadline:
            started = time.monotonic()
            await miner.step()
            await asyncio.sleep(max(0.0, block_time - (time.monotonic() - started)))

    async def browse(page: Page, offset: float) -> None:
        await page.connect()
        await asyncio.sleep(offset)
        next_poll = time.monotonic()
        while next_poll < deadline:
            await page.poll()
            next_poll += poll
            await asyncio.sleep(max(0.0, next_poll - time.monotonic()))

    await asyncio.gather(mine(), *(browse(page, rng.uniform(0, poll)) for page in pages))
    await target.finish()


async def run_lockstep(target: Target, chain: Chain, miner: Miner, *, clients: int = 10, blocks: int = 3) -> None:
    """For tests: mine a block, wait until the server answers for it, then every page polls at once.
    The chain holds still while the pages read, so each answer can be compared with the node's."""
    phase = await target.begin("dapp")
    pages = [Page(target.client(phase), chain, chain.holders[i % len(chain.holders)]) for i in range(clients)]
    await asyncio.gather(*(page.connect() for page in pages))
    for _ in range(blocks):
        head = await miner.step()
        if target.settle is not None:
            await target.settle(head)
        await asyncio.gather(*(page.poll() for page in pages))
    await target.finish()
