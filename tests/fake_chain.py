"""An in-process fake EVM upstream for head-tracker unit tests: a list of block hashes you edit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.values import Answer


def _hash(height: int, fork: int) -> str:
    return "0x" + format(fork, "02x") + format(height, "062x")


class FakeChain:
    """Blocks 0..latest; `reorg(depth)` replaces the last `depth` blocks with a new fork."""

    def __init__(self, latest: int, *, finalized_tag: bool = True, depth: int = 64) -> None:
        self.forks = [0] * (latest + 1)
        self.finalized_tag = finalized_tag
        self.depth = depth
        self.gas_limit = 30_000_000

    @property
    def latest(self) -> int:
        return len(self.forks) - 1

    def block_hash(self, height: int) -> str:
        return _hash(height, self.forks[height])

    def mine(self, count: int = 1) -> None:
        self.forks.extend([0] * count)

    def reorg(self, depth: int) -> None:
        fork = max(self.forks) + 1
        for height in range(self.latest - depth + 1, self.latest + 1):
            self.forks[height] = fork

    def _block(self, height: int) -> dict[str, Any] | None:
        if height < 0 or height > self.latest:
            return None
        return {
            "number": hex(height),
            "hash": self.block_hash(height),
            "parentHash": self.block_hash(height - 1) if height else "0x" + "00" * 32,
            "gasLimit": hex(self.gas_limit),
            "timestamp": hex(1_700_000_000 + 12 * height),
        }

    def answer(self, method: str, params: Any) -> Answer:
        if method != "eth_getBlockByNumber":
            return Answer.from_response({"error": {"code": -32601, "message": "not in the fake"}})
        tag = params[0]
        heights = {"latest": self.latest, "safe": self.latest - self.depth // 2, "finalized": self.latest - self.depth}
        if tag in ("safe", "finalized") and not self.finalized_tag:
            return Answer.from_response({"error": {"code": -32602, "message": "unknown block tag"}})
        height = heights[tag] if tag in heights else int(tag, 16)
        return Answer.from_response({"result": self._block(max(height, 0))})

    async def request(self, method: str, params: Any, *, timeout: float | None = None) -> Answer:
        return self.answer(method, params)

    async def batch(self, calls: Sequence[tuple[str, Any]]) -> list[Answer]:
        return [self.answer(m, p) for m, p in calls]

    async def together(self, calls: Sequence[tuple[str, Any]]) -> list[Answer] | None:
        return await self.batch(calls)

    async def close(self) -> None:
        pass
