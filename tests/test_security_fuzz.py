"""Property-based fuzzing (hypothesis) of what a hostile client can send: HTTP and WebSocket bodies,
and the seven methods' params. Whatever arrives, the answer is JSON with no 5xx, and the proxy keeps
serving. Example counts are bounded for CI (FUZZ_EXAMPLES raises them for a longer run).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fake_solana import TOKEN_ACCOUNT, FakeSolana
from tests.support import DEV_ACCOUNT, Anvil, Proxy, settings_for, start_proxy

T = TypeVar("T")
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
SEVEN = (
    "eth_getStorageAt",
    "eth_getLogs",
    "eth_getUncleByBlockHashAndIndex",
    "eth_call",
    "eth_getBlockReceipts",
    "getTokenAccountBalance",
    "getLargestAccounts",
)


class Harness:
    """A proxy (Anvil and a fake Solana node behind it) on its own event loop in a thread, so that
    hypothesis drives plain functions and the server keeps running across examples."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.anvil = Anvil()
        self.solana = self.run(FakeSolana().start())
        self.proxy: Proxy = self.run(
            # Inline, not make_proxy: this proxy runs on the fuzzer's own event loop, in another thread.
            start_proxy(
                settings_for(
                    EVM_UPSTREAM=self.anvil.url,
                    SOLANA_UPSTREAM=self.solana.url,
                    MAX_BODY_BYTES="65536",
                    WS_MAX_MESSAGE_BYTES="65536",
                )
            )
        )
        self.run(self.proxy.head_at(0))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def _post(self, body: bytes) -> tuple[int, bytes]:
        async with self.proxy.session.post(
            self.proxy.url(), data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            return resp.status, await resp.read()

    def post(self, body: bytes) -> tuple[int, bytes]:
        return self.run(self._post(body))

    async def _ws(self, frames: list[str | bytes]) -> list[Any]:
        replies = []
        async with self.proxy.session.ws_connect(self.proxy.ws_url()) as ws:
            for frame in frames:
                await (ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_str(frame))
            # A closing marker: every frame before it has been answered (or was a notification).
            await ws.send_str('{"jsonrpc":"2.0","id":"end","method":"eth_chainId","params":[]}')
            while True:
                message = await ws.receive(timeout=30)
                assert message.type is aiohttp.WSMsgType.TEXT, message
                reply = json.loads(message.data)
                replies.append(reply)
                if isinstance(reply, dict) and reply.get("id") == "end":
                    return replies

    def ws(self, frames: list[str | bytes]) -> list[Any]:
        return self.run(self._ws(frames))

    def close(self) -> None:
        self.run(self.proxy.close())
        self.run(self.solana.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.anvil.stop()


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def answered_cleanly(status: int, body: bytes) -> None:
    assert status < 500, (status, body[:500])
    if status == 204:
        assert body == b""
        return
    decoded = json.loads(body)  # never a traceback, an HTML page or text
    for reply in decoded if isinstance(decoded, list) else [decoded]:
        assert reply["jsonrpc"] == "2.0" and ("result" in reply) != ("error" in reply), reply


# --- strategies ---------------------------------------------------------------------------

hex_strings = st.builds(
    lambda b, upper: "0x" + (b.hex().upper() if upper else b.hex()), st.binary(max_size=40), st.booleans()
)
near_valid = st.one_of(
    hex_strings,
    st.sampled_from(
        [
            "latest",
            "earliest",
            "pending",
            "safe",
            "finalized",
            "0x",
            "0X1",
            "0x1\n",
            " 0x1",
            "9" * 30,
            "1e3",
            "-1",
            DEV_ACCOUNT,
            DEV_ACCOUNT.upper(),
            "0x" + "ab" * 32,
            TOKEN_ACCOUNT,
            "finalized\u0000",
            "ﬁnalized",
        ]
    ),
    st.integers(min_value=-(2**70), max_value=2**70),
)
leaves = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30), near_valid
)
json_values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(
            st.one_of(
                st.sampled_from(
                    [
                        "from",
                        "to",
                        "gas",
                        "data",
                        "input",
                        "blockHash",
                        "fromBlock",
                        "toBlock",
                        "address",
                        "topics",
                        "commitment",
                        "filter",
                        "blockNumber",
                        "value",
                        "gasLimit",
                    ]
                ),
                st.text(max_size=8),
            ),
            inner,
            max_size=6,
        ),
    ),
    max_leaves=20,
)
methods = st.one_of(
    st.sampled_from(SEVEN),
    st.sampled_from(["eth_chainId", "eth_estimateGas", "net_version", "admin_nodeInfo", "eth_sendTransaction"]),
    st.text(max_size=20),
)
ids = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63),
    st.text(max_size=10),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.integers(), max_size=2),
)
envelopes = st.fixed_dictionaries(
    {"jsonrpc": st.sampled_from(["2.0", "2.0", "1.0", 2]), "method": methods},
    optional={"id": ids, "params": st.one_of(st.lists(json_values, max_size=4), json_values)},
)
bodies = st.one_of(
    envelopes.map(lambda e: json.dumps(e).encode()),
    st.lists(envelopes, min_size=0, max_size=6).map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
)


@FUZZ
@given(body=bodies)
def test_any_http_body_gets_a_json_answer_and_never_a_5xx(harness: Harness, body: bytes) -> None:
    answered_cleanly(*harness.post(body))


@FUZZ
@given(method=st.sampled_from(SEVEN), params=st.lists(json_values, max_size=4), rid=st.integers(0, 2**31))
def test_the_seven_methods_answer_any_params_with_a_result_or_an_error(
    harness: Harness, method: str, params: list[Any], rid: int
) -> None:
    status, body = harness.post(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}).encode())
    answered_cleanly(status, body)
    reply = json.loads(body)
    assert reply["id"] == rid
    if "error" in reply:
        assert reply["error"]["code"] not in (-32603,), reply  # never an internal error


@settings(FUZZ, max_examples=max(EXAMPLES // 4, 10))
@given(
    frames=st.lists(
        st.one_of(bodies.map(lambda b: b.decode("utf-8", "replace")), st.binary(max_size=100)), min_size=1, max_size=5
    )
)
def test_any_websocket_frames_get_json_frames_and_the_connection_keeps_serving(
    harness: Harness, frames: list[str | bytes]
) -> None:
    replies = harness.ws(frames)
    assert replies[-1] == {"jsonrpc": "2.0", "id": "end", "result": "0x7a69"}


def test_the_proxy_still_serves_after_the_fuzzing(harness: Harness) -> None:
    status, body = harness.post(b'{"jsonrpc":"2.0","id":1,"method":"eth_chainId","params":[]}')
    assert status == 200 and json.loads(body)["result"] == "0x7a69"
