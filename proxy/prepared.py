"""A validated call bound to the network it goes to, and priced: what the read-through flow carries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.network import NetworkRuntime
from proxy.rpc.jsonrpc import Call
from proxy.rpc.methods import MethodPolicy
from proxy.rpc.params import BlockRef


@dataclass(slots=True)  # not frozen: built per call, and frozen init costs 3x
class Prepared:
    """A validated call, ready to run and priced."""

    call: Call
    network: NetworkRuntime
    policy: MethodPolicy | None
    params: Any
    credits: int
    refs: list[BlockRef]  # the block parameters inside params, found once
    fingerprint: tuple[str, str, bytes] | None = None  # the raw request, for the plan memo
    piece: bool = False  # a piece of a chunked eth_getLogs: the result limit holds over the merged answer
