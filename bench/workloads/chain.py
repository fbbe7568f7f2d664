"""A realistic token chain on Anvil, built in seconds: thousands of blocks, Transfer events to many holders.

Automine is switched off; each block with events gets its transactions in one JSON-RPC batch (explicit
nonces and gas, so Anvil neither estimates nor orders them) and `anvil_mine` then mines it together with
the empty blocks that follow it, in one call. Automine stays off: the dapp workload's `Miner` mines.
"""

from __future__ import annotations

import http.client
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from eth_utils.crypto import keccak

CONTRACTS = Path(__file__).resolve().parents[2] / "tests" / "contracts"
DEV = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266"  # anvil's first funded, unlocked account
HOLDER_BASE = 0x7E57 << 144  # holder i is the address HOLDER_BASE + i (what `scatter` pays)
TRANSFER_TOPIC = "0x" + keccak(text="Transfer(address,address,uint256)").hex()


def selector(signature: str) -> str:
    return keccak(text=signature)[:4].hex()


def word(value: int | str) -> str:
    return format(int(value, 16) if isinstance(value, str) else value, "064x")


def holder(i: int) -> str:
    return "0x" + format(HOLDER_BASE + i, "040x")


def balance_of(address: str) -> str:
    return "0x" + selector("balanceOf(address)") + word(address)


TOTAL_SUPPLY = "0x" + selector("totalSupply()")
SYMBOL = "0x" + selector("symbol()")


@dataclass(frozen=True)
class ChainSpec:
    """The chain's size: `blocks` in all, every `event_every`-th one holding `txs_per_block` scatter
    transactions of `transfers_per_tx` Transfer events each, paid round-robin to `holders` addresses."""

    blocks: int = 5000
    event_every: int = 4
    txs_per_block: int = 2
    transfers_per_tx: int = 8
    holders: int = 1000


@dataclass
class Chain:
    url: str
    token: str
    holders: list[str]
    event_blocks: list[int]
    head: int
    recent_txs: list[str] = field(default_factory=list)  # the last mined block's transactions


class NodeRpc:
    """Blocking JSON-RPC over one keep-alive connection: building a chain is thousands of small requests."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=60)
        self.path = parts.path or "/"
        self.ids = itertools.count(1)

    def _post(self, body: Any) -> Any:
        self.conn.request("POST", self.path, json.dumps(body), {"Content-Type": "application/json"})
        return json.loads(self.conn.getresponse().read())

    def call(self, method: str, *params: Any) -> Any:
        reply = self._post({"jsonrpc": "2.0", "id": next(self.ids), "method": method, "params": list(params)})
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def batch(self, calls: list[tuple[str, list[Any]]]) -> list[Any]:
        body = [{"jsonrpc": "2.0", "id": next(self.ids), "method": m, "params": p} for m, p in calls]
        by_id = {item["id"]: item for item in self._post(body)}
        answers = [by_id[call["id"]] for call in body]
        failed = [a["error"] for a in answers if "error" in a]
        if failed:
            raise RuntimeError(f"batch: {failed[0]}")
        return [a["result"] for a in answers]

    def close(self) -> None:
        self.conn.close()


def scatter_tx(token: str, nonce: int, first: int, count: int, amount: int) -> dict[str, str]:
    data = "0x" + selector("scatter(uint160,uint256,uint256)") + word(first) + word(count) + word(amount)
    return {"from": DEV, "to": token, "data": data, "nonce": hex(nonce), "gas": hex(80_000 + 40_000 * count)}


def deploy_token(rpc: NodeRpc, supply: int = 10**30) -> str:
    code = (CONTRACTS / "Token.bin").read_text().strip() + word(supply)
    tx_hash = rpc.call("eth_sendTransaction", {"from": DEV, "data": "0x" + code, "gas": hex(2_000_000)})
    rpc.call("anvil_mine", "0x1")
    receipt = rpc.call("eth_getTransactionReceipt", tx_hash)
    return str(receipt["contractAddress"])


def build_chain(url: str, spec: ChainSpec) -> Chain:
    """Deploys the token, funds the holders with ether and mines `spec.blocks` blocks of Transfers."""
    rpc = NodeRpc(url)
    try:
        rpc.call("evm_setAutomine", False)
        token = deploy_token(rpc)
        holders = [holder(i) for i in range(spec.holders)]
        rpc.batch([("anvil_setBalance", [h, hex((i + 1) * 10**15)]) for i, h in enumerate(holders)])
        nonce = int(rpc.call("eth_getTransactionCount", DEV, "pending"), 16)
        head = int(rpc.call("eth_blockNumber"), 16)
        event_blocks: list[int] = []
        paid = 0  # holders paid so far, round-robin
        last: list[str] = []
        while head < spec.blocks:
            txs = []
            for _ in range(spec.txs_per_block):
                first = paid % spec.holders
                count = min(spec.transfers_per_tx, spec.holders - first)
                txs.append(
                    ("eth_sendTransaction", [scatter_tx(token, nonce, HOLDER_BASE + first, count, 10**15 + head)])
                )
                nonce += 1
                paid += count
            last = [str(h) for h in rpc.batch(txs)]
            step = min(spec.event_every, spec.blocks - head)
            rpc.call("anvil_mine", hex(step))
            event_blocks.append(head + 1)
            head += step
        return Chain(url, token, holders, event_blocks, head, last)
    finally:
        rpc.close()


class Miner:
    """Mines a block of a few token transfers on demand (the dapp workload's chain keeps moving)."""

    def __init__(self, session: aiohttp.ClientSession, chain: Chain, transfers: int = 3) -> None:
        self.session = session
        self.chain = chain
        self.transfers = transfers
        self.ids = itertools.count(1)
        self.mined = 0

    async def _rpc(self, body: Any) -> Any:
        async with self.session.post(self.chain.url, json=body) as resp:
            return await resp.json(content_type=None)

    async def step(self) -> int:
        """Sends the transfers, mines them in one block; returns the new head."""
        sends = []
        for k in range(self.transfers):
            to = self.chain.holders[(self.mined * self.transfers + k) % len(self.chain.holders)]
            data = "0x" + selector("transfer(address,uint256)") + word(to) + word(10**12 + self.mined)
            sends.append(
                {
                    "jsonrpc": "2.0",
                    "id": next(self.ids),
                    "method": "eth_sendTransaction",
                    "params": [{"from": DEV, "to": self.chain.token, "data": data, "gas": hex(100_000)}],
                }
            )
        # Sent one by one: Anvil numbers a sender's nonces in arrival order.
        hashes = [str((await self._rpc(body))["result"]) for body in sends]
        await self._rpc({"jsonrpc": "2.0", "id": next(self.ids), "method": "anvil_mine", "params": ["0x1"]})
        self.mined += 1
        self.chain.head += 1
        self.chain.recent_txs = hashes
        return self.chain.head
