"""Which responses carry which credit headers (docs/keys-and-credits.md): every answer to a call
carries X-Credits-Charged and X-Credits-Remaining; a request refused before any balance is looked at
(wrong path, wrong HTTP method, a body refused unread, a server too busy) carries
X-Credits-Charged: 0 alone, since it was charged nothing and named no balance to show."""

from __future__ import annotations

import pytest

from proxy.http.listeners import BUSY_RESPONSE
from tests.support import Anvil, Proxy, ProxyFactory

KEY = "sk-headers"
CALL = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId"}


@pytest.fixture
async def keyed_proxy(anvil: Anvil, make_proxy: ProxyFactory) -> Proxy:
    return await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS=KEY, DAILY_CREDITS="1000", MAX_BODY_BYTES="1000")


async def test_every_answer_to_a_call_carries_both_credit_headers(keyed_proxy: Proxy) -> None:
    for key, body in (
        (KEY, CALL),
        (KEY, {"jsonrpc": "2.0", "id": 2, "method": "no_such_method"}),
        (KEY, b"not json"),
        ("unknown-key", CALL),
    ):
        _status, _body, headers = await keyed_proxy.post(body, key=key)
        assert "X-Credits-Charged" in headers and "X-Credits-Remaining" in headers, (key, body)


@pytest.mark.parametrize(
    ("verb", "path", "status"),
    [
        ("GET", "/no/such/path", 404),
        ("GET", f"/v3/{KEY}", 405),
        ("PUT", f"/v3/{KEY}", 405),
        ("POST", f"/v3/{KEY}", 413),
    ],
)
async def test_a_request_refused_before_any_balance_is_read_carries_only_a_zero_charge(
    keyed_proxy: Proxy,
    verb: str,
    path: str,
    status: int,
) -> None:
    body = b"[" + b"1," * 600 + b"1]" if status == 413 else None  # over MAX_BODY_BYTES
    async with keyed_proxy.session.request(verb, keyed_proxy.base + path, data=body) as resp:
        assert resp.status == status
        assert resp.headers["X-Credits-Charged"] == "0" and "X-Credits-Remaining" not in resp.headers
        assert (await resp.json())["error"]["code"] == -32600


def test_a_connection_over_the_cap_is_refused_with_a_zero_charge() -> None:
    # The raw answer the listener writes when MAX_CONNECTIONS is reached, before reading a request
    # (tests/test_security_connections.py sends it for real).
    head = BUSY_RESPONSE.split(b"\r\n\r\n")[0].split(b"\r\n")
    assert head[0] == b"HTTP/1.1 503 Service Unavailable" and b"X-Credits-Charged: 0" in head
    assert not any(line.startswith(b"X-Credits-Remaining") for line in head)
