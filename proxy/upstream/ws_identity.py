"""What an EVM network's WebSocket upstream is asked on each connection before it carries a
subscription: its chain identity (eth_chainId and the genesis block's hash), held to the network's as
its HTTP upstreams' is (chain/identity.py). One that serves another chain is not used: its
notifications would be another chain's heads, logs and transactions. (Solana's pubsub socket serves
subscriptions only: no getGenesisHash is asked there.)"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from proxy.rpc import jsonrpc
from proxy.upstream.standing import ChainIdentity, parse_identity

# Seconds a new connection has to tell its chain (as the HTTP upstreams' identity probes: chain/identity.py):
# subscriptions wait for the connection meanwhile, so a silent node is not waited on for UPSTREAM_TIMEOUT.
IDENTITY_WAIT = 5.0
EVM_IDENTITY_CALLS: tuple[tuple[str, list[Any]], ...] = (("eth_chainId", []), ("eth_getBlockByNumber", ["0x0", False]))


async def identity_problem(
    ws: aiohttp.ClientWebSocketResponse, expected: ChainIdentity | None, first_id: int, timeout: float
) -> str | None:
    """Why the freshly opened `ws` is not the network's chain (`expected`; None: not known yet, the
    connection taken), or None; told within `timeout` (UPSTREAM_TIMEOUT), IDENTITY_WAIT at most."""
    if expected is None:
        return None
    results = await told(ws, EVM_IDENTITY_CALLS, first_id, min(timeout, IDENTITY_WAIT))
    seen = parse_identity(*results) if results is not None else None
    if seen is None:
        return "did not tell its chain identity"
    if seen != expected:
        return f"serves {seen.describe()}, not the network's {expected.describe()}"
    return None


async def told(
    ws: aiohttp.ClientWebSocketResponse, calls: tuple[tuple[str, list[Any]], ...], first_id: int, timeout: float
) -> list[Any] | None:
    """The results of `calls` asked on `ws` (ids from `first_id` on), or None if not all came within
    `timeout`. Asked before any subscription: nothing else is sent back meanwhile but noise, skipped."""
    ids = list(range(first_id, first_id + len(calls)))
    results: dict[int, Any] = {}
    try:
        async with asyncio.timeout(timeout):
            for rid, (method, params) in zip(ids, calls, strict=True):
                call = {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}
                await ws.send_str(jsonrpc.dumps(call).decode())
            while len(results) < len(ids):
                message = await ws.receive()
                if message.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                    return None
                try:
                    data = jsonrpc.loads(message.data)
                except jsonrpc.JSONDecodeError:
                    continue
                if isinstance(data, dict) and data.get("id") in ids:
                    results[data["id"]] = data.get("result")
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None
    return [results[rid] for rid in ids]
