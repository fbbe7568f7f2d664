"""A reload of keys reaches open WebSockets: a key removed or whose secret changed is refused on its
open sockets at once (its subscriptions end with an error notification, the socket closes 1008 with
a reason), a removed account never falls back to the default terms, and new balances and allow-lists
apply to open sockets as they do to the next HTTP request."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.config_files import KeyConfig
from proxy.http.ws import REVOKED, refusal
from tests.support import Anvil, ProxyFactory, free_port, settings_for
from tests.test_keyed_hits import ALICE, STORAGE, keyed, reload
from tests.test_operator_signals import _start, _stop
from tests.ws_client import Client, connect

BOB = '[keys.bob]\nkey = "bob-secret"\n'
COST = 80  # eth_getStorageAt's credits


async def closed_with(client: Client) -> tuple[list[dict[str, Any]], aiohttp.WSMessage]:
    """Every message up to the close frame (notifications and replies), and the close frame."""
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(10):
        while True:
            message = await client.ws.receive()
            if message.type is not aiohttp.WSMsgType.TEXT:
                return seen, message
            seen.append(json.loads(message.data))


async def storage_call(client: Client) -> dict[str, Any]:
    return await client.call(STORAGE["method"], *STORAGE["params"])


async def test_a_key_a_reload_removes_is_closed_on_its_open_socket_with_its_subscriptions_ended(
    anvil: Anvil,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    path = tmp_path / "keys.toml"
    proxy = await keyed(make_proxy, anvil, "", path, ALICE + "daily_credits = 200\n" + BOB)
    client = await connect(proxy, "alice-secret")
    sub = await client.subscribe("newHeads")
    for _ in range(3):  # 80 + 80 + a refusal: the key's 200 are spent
        await storage_call(client)
    assert "error" in await storage_call(client)
    reload(proxy, path, BOB)
    seen, close = await closed_with(client)
    ended = [m for m in seen if m.get("params", {}).get("subscription") == sub and "error" in m["params"]]
    assert ended and ended[0]["params"]["error"]["code"] == -32001, seen
    assert close.type is aiohttp.WSMsgType.CLOSE and close.data == 1008, close
    assert "revoked" in close.extra
    assert not [m for m in seen if "result" in m and m.get("id") is not None]  # nothing served after it
    status, _, _ = await proxy.post(STORAGE, key="alice-secret")
    assert status == 401
    assert (await proxy.post(STORAGE, key="bob-secret"))[0] == 200


async def test_a_secret_a_reload_changes_closes_the_sockets_opened_with_the_old_one(
    anvil: Anvil,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    path = tmp_path / "keys.toml"
    proxy = await keyed(make_proxy, anvil, "", path, ALICE + BOB)
    alice, bob = await connect(proxy, "alice-secret"), await connect(proxy, "bob-secret")
    await alice.call("eth_chainId")
    reload(proxy, path, '[keys.alice]\nkey = "alice-new-secret"\n' + BOB)
    _, close = await closed_with(alice)
    assert close.data == 1008
    assert "result" in await bob.call("eth_chainId")  # an unchanged key's socket is served on
    fresh = await connect(proxy, "alice-new-secret")
    assert "result" in await fresh.call("eth_chainId")


async def test_calls_racing_a_revocation_are_refused_not_served_under_default_terms(
    anvil: Anvil,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    path = tmp_path / "keys.toml"
    proxy = await keyed(make_proxy, anvil, "", path, ALICE + "daily_credits = 200\n" + BOB)
    client = await connect(proxy, "alice-secret")
    await storage_call(client)
    await storage_call(client)
    reload(proxy, path, BOB)
    for rid in range(20):  # sent before the close frame can arrive: none is answered with a result
        await client.ws.send_str(json.dumps({**STORAGE, "id": 100 + rid}))
    await client.ws.send_str(json.dumps([{**STORAGE, "id": 200}, {"jsonrpc": "2.0", "method": "eth_chainId"}]))
    seen, close = await closed_with(client)
    assert close.data == 1008
    assert not [m for m in seen if "result" in m], seen
    # A refusal answers each call under its own id (JSON-RPC 2.0 section 5), a batch's in an array:
    # a client pairs its refused calls by id (they were all answered "id": null).
    replies = [r for m in seen for r in (m if isinstance(m, list) else [m]) if "params" not in r]
    assert all(r["id"] in range(100, 120) or r["id"] == 200 for r in replies), replies
    assert all(r["error"]["code"] == -32001 for r in replies), replies


@pytest.mark.parametrize(
    ("message", "answer"),
    [
        ('{"jsonrpc":"2.0","id":7,"method":"eth_chainId"}', {"id": 7, "code": -32001}),
        ('{"jsonrpc":"2.0","id":"a","method":"eth_chainId"}', {"id": "a", "code": -32001}),
        (
            '[{"jsonrpc":"2.0","id":1,"method":"m"},{"jsonrpc":"2.0","method":"n"},{"id":2}]',
            [
                {"id": 1, "code": -32001},
                {"id": 2, "code": -32600},
            ],
        ),
        ('{"jsonrpc":"2.0","method":"eth_chainId"}', None),
        ('[{"jsonrpc":"2.0","method":"eth_chainId"}]', None),
        ("{not json", {"id": None, "code": -32700}),
    ],
)
def test_a_refused_message_is_answered_under_each_calls_own_id(message: str, answer: object) -> None:
    refused = refusal(message, REVOKED, max_batch=100)
    seen = None if refused is None else json.loads(refused)
    shown = [{"id": r["id"], "code": r["error"]["code"]} for r in seen] if isinstance(seen, list) else seen
    if isinstance(seen, dict):
        shown = {"id": seen["id"], "code": seen["error"]["code"]}
    assert shown == answer


def test_an_account_no_key_names_has_no_balance_not_the_default_one() -> None:
    settings = dataclasses.replace(
        settings_for(EVM_UPSTREAM="http://127.0.0.1:1"),
        daily_credits=3_000_000,
        api_keys={"bob": KeyConfig(sha256="0" * 64)},
    )
    assert settings.daily_credits_for("alice") == 0  # removed by a reload, still named by a call in flight
    assert settings.daily_credits_for("bob") == 3_000_000


async def test_a_balance_a_reload_lowers_stops_an_open_socket_there(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    path = tmp_path / "keys.toml"
    proxy = await keyed(make_proxy, anvil, "", path, ALICE + "daily_credits = 100000\n")
    client = await connect(proxy, "alice-secret")
    for _ in range(3):
        assert "result" in await storage_call(client)
    reload(proxy, path, ALICE + f"daily_credits = {4 * COST}\n")
    assert "result" in await storage_call(client)
    refused = await storage_call(client)
    assert refused["error"]["code"] == -32005 and "daily credit limit" in refused["error"]["message"]


async def test_allowed_addresses_a_reload_adds_end_the_subscriptions_they_refuse(
    anvil: Anvil,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    path = tmp_path / "keys.toml"
    allowed, other = "0x" + "aa" * 20, "0x" + "bb" * 20
    proxy = await keyed(make_proxy, anvil, "", path, ALICE)
    client = await connect(proxy, "alice-secret")
    kept = await client.subscribe("logs", {"address": allowed})
    dropped = await client.subscribe("logs", {"address": other})
    reload(proxy, path, ALICE + f'allowed_addresses = ["{allowed}"]\n')
    await client.notes_until(1)
    assert [n["params"]["subscription"] for n in client.notes] == [dropped]
    assert "allowed_addresses" in client.notes[0]["params"]["error"]["message"]
    assert await client.call("eth_unsubscribe", kept) == {"jsonrpc": "2.0", "id": 3, "result": True}
    assert not client.ws.closed


async def test_allowed_origins_a_reload_adds_close_a_socket_from_another_origin(
    anvil: Anvil,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    path = tmp_path / "keys.toml"
    proxy = await keyed(make_proxy, anvil, "", path, ALICE)
    ws = await proxy.session.ws_connect(proxy.ws_url("alice-secret"), headers={"Origin": "https://evil.example"})
    client = Client(ws)
    await client.call("eth_chainId")
    reload(proxy, path, ALICE + 'allowed_origins = ["https://app.example"]\n')
    _, close = await closed_with(client)
    assert close.data == 1008 and "origin" in close.extra


async def test_a_reload_that_fails_leaves_open_sockets_alone(
    anvil: Anvil, tmp_path: Path, make_proxy: ProxyFactory
) -> None:
    path = tmp_path / "keys.toml"
    proxy = await keyed(make_proxy, anvil, "", path, ALICE)
    client = await connect(proxy, "alice-secret")
    reload(proxy, path, "[keys.alice\n")  # no longer parses: the keys in force stay
    assert "result" in await client.call("eth_chainId")
    assert not client.ws.closed


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_sighup_closes_every_open_socket_of_a_removed_key_in_every_worker(
    anvil: Anvil,
    tmp_path: Path,
    redis_url: str,
    workers: str,
) -> None:
    """The real command: a key exhausted, removed from API_KEYS_FILE, SIGHUP; each of its sockets
    (spread over the workers) ends its subscription with an error and is closed 1008."""
    keys = tmp_path / "keys.toml"
    keys.write_text(ALICE + "daily_credits = 200\n" + BOB)
    port = free_port()
    proc = _start(
        {
            "EVM_UPSTREAM": anvil.url,
            "API_KEYS_FILE": str(keys),
            "LOG_FORMAT": "json",
            "REDIS_URL": redis_url,
            "WORKERS": workers,
        },
        port,
    )
    try:
        async with aiohttp.ClientSession() as session:
            clients = [Client(await session.ws_connect(f"ws://127.0.0.1:{port}/ws/v3/alice-secret")) for _ in range(6)]
            subs = [await client.subscribe("newHeads") for client in clients]
            for _ in range(3):  # 80 + 80, then refused: the key's 200 are spent
                await storage_call(clients[0])
            keys.write_text(BOB)
            proc.send_signal(signal.SIGHUP)
            for client, sub in zip(clients, subs, strict=True):
                seen, close = await closed_with(client)
                assert close.type is aiohttp.WSMsgType.CLOSE and close.data == 1008, close
                assert any(m.get("params", {}).get("subscription") == sub and "error" in m["params"] for m in seen)
            async with session.post(f"http://127.0.0.1:{port}/v3/alice-secret", json=STORAGE) as resp:
                assert resp.status == 401
    finally:
        _stop(proc)
