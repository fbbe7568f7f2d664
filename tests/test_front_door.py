"""The front door: the root URL where apps already point, request ids, and what the proxy answers itself."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import MultiDict
from web3 import AsyncHTTPProvider, AsyncWeb3

from proxy import via
from proxy.http.access_log import shown_path
from proxy.logs import redacted
from proxy.request_ids import IDS, RequestIds
from tests.fault_relay import FaultRelay
from tests.support import Anvil, Proxy, ProxyFactory, eventually, free_port, settings_for, start_proxy
from tests.test_front import exchange

CHAIN_ID = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}
ACCOUNTS = {"jsonrpc": "2.0", "id": 7, "method": "eth_accounts", "params": []}
GENESIS = {"jsonrpc": "2.0", "id": 2, "method": "eth_getBlockByNumber", "params": ["0x0", False]}  # final: cached
NEW_ID = re.compile(r"[0-9a-f]{12}-[0-9a-f]+")


async def test_open_mode_root_post_answers_as_v3(evm_proxy: Proxy) -> None:
    async with evm_proxy.session.post(evm_proxy.base + "/", data=json.dumps(CHAIN_ID)) as resp:
        assert resp.status == 200
        assert (await resp.json())["result"] == "0x7a69"
    async with evm_proxy.session.post(evm_proxy.base + "/", data=json.dumps([CHAIN_ID, ACCOUNTS])) as resp:
        assert [r["result"] for r in await resp.json()] == ["0x7a69", []]


async def test_open_mode_root_websocket_answers_as_ws_v3(evm_proxy: Proxy) -> None:
    async with evm_proxy.session.ws_connect(f"ws://127.0.0.1:{evm_proxy.server.port}/") as ws:
        await ws.send_str(json.dumps(CHAIN_ID))
        assert json.loads((await ws.receive(timeout=5)).data)["result"] == "0x7a69"


async def test_open_mode_root_get_without_upgrade_is_refused_as_a_websocket_path(evm_proxy: Proxy) -> None:
    async with evm_proxy.session.get(evm_proxy.base + "/") as resp:
        assert resp.status == 400
        assert "WebSocket" in (await resp.json())["error"]["message"]


async def test_root_post_with_keys_is_an_error_saying_where_the_key_goes(anvil: Anvil) -> None:
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, API_KEYS="alice"))
    try:
        async with proxy.session.post(proxy.base + "/", data=json.dumps(CHAIN_ID)) as resp:
            assert resp.status == 404
            assert "/v3/<API_KEY>" in (await resp.json())["error"]["message"]
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await proxy.session.ws_connect(f"ws://127.0.0.1:{proxy.server.port}/")
    finally:
        await proxy.close()


async def test_eth_accounts_is_empty_since_the_proxy_holds_no_accounts(evm_proxy: Proxy) -> None:
    w3 = AsyncWeb3(AsyncHTTPProvider(evm_proxy.base + "/"))
    assert await w3.eth.accounts == []  # Anvil has ten unlocked accounts: none is shown
    assert evm_proxy.upstreams["evm"].calls["eth_accounts"] == 0


async def test_eth_accounts_named_in_allow_methods_is_the_nodes(anvil: Anvil) -> None:
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, ALLOW_METHODS="eth_accounts"))
    try:
        assert len(await proxy.result("eth_accounts", [])) == 10  # Anvil's unlocked dev accounts
    finally:
        await proxy.close()


class TestRequestIdRules:
    def test_a_sane_id_is_kept_and_any_other_replaced(self) -> None:
        ids = RequestIds()
        assert ids.of("abc-123.x:y_Z") == "abc-123.x:y_Z" and ids.of("a" * 128) == "a" * 128
        for hostile in ("a" * 129, "", "a b", "x\r\nSet-Cookie: a=b", "caf\u00e9", "a;b", None):
            assert NEW_ID.fullmatch(ids.of(hostile)), hostile

    def test_new_ids_are_unique_per_process(self) -> None:
        ids = RequestIds()
        made = {ids.new() for _ in range(1000)} | {f"{ids.prefix}{ids.count():x}" for _ in range(1000)}
        assert len(made) == 2000 and all(NEW_ID.fullmatch(i) for i in made)
        assert RequestIds().prefix != ids.prefix  # another process's (or worker's) ids never collide


async def test_every_answer_carries_a_request_id_hit_miss_error_and_batch(evm_proxy: Proxy) -> None:
    seen = []
    for body in (GENESIS, GENESIS, [GENESIS, CHAIN_ID], "{not json"):
        status, _, headers = await evm_proxy.post(body)
        seen.append((status, headers.get("X-Cache"), headers["X-Request-Id"]))
    assert [(s, c) for s, c, _ in seen] == [(200, "MISS"), (200, "HIT"), (200, None), (400, None)]
    assert all(NEW_ID.fullmatch(rid) for _, _, rid in seen) and len({rid for _, _, rid in seen}) == 4
    async with evm_proxy.session.get(evm_proxy.base + "/nowhere") as resp:
        assert resp.status == 404 and NEW_ID.fullmatch(resp.headers["X-Request-Id"])
    async with evm_proxy.session.get(evm_proxy.base + "/healthz") as resp:
        assert NEW_ID.fullmatch(resp.headers["X-Request-Id"])


async def test_a_sane_client_id_is_echoed_on_hits_and_misses(evm_proxy: Proxy) -> None:
    for expected in ("MISS", "HIT", "HIT"):
        status, _, headers = await evm_proxy.post(GENESIS, headers={"X-Request-Id": "trace-42.a:b_c"})
        assert (status, headers["X-Cache"], headers["X-Request-Id"]) == (200, expected, "trace-42.a:b_c")


@pytest.mark.parametrize("sent", [b"a" * 129, b"caf\xc3\xa9", b"a b", b"<script>"])
async def test_a_hostile_client_id_is_replaced(evm_proxy: Proxy, sent: bytes) -> None:
    body = json.dumps(GENESIS).encode()
    request = b"POST /v3/k HTTP/1.1\r\nHost: x\r\nX-Request-Id: %b\r\nContent-Length: %d\r\n\r\n%b" % (
        sent,
        len(body),
        body,
    )
    for _ in range(2):  # a miss, then a memory hit
        ((status, headers, _),) = await exchange(evm_proxy.server.port, request)
        assert status == 200 and NEW_ID.fullmatch(headers["x-request-id"]), headers


async def test_a_header_split_attempt_is_a_bad_request_with_a_new_id(evm_proxy: Proxy) -> None:
    request = b"POST /v3/k HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\rSet-Cookie: b\r\nContent-Length: 2\r\n\r\n{}"
    ((status, headers, _),) = await exchange(evm_proxy.server.port, request)
    assert status == 400 and NEW_ID.fullmatch(headers["x-request-id"]) and "set-cookie" not in headers


async def test_cors_exposes_the_request_id(evm_proxy: Proxy) -> None:
    _, _, headers = await evm_proxy.post(GENESIS, headers={"Origin": "https://app.example"})
    assert "X-Request-Id" in headers["Access-Control-Expose-Headers"] and headers["X-Request-Id"]


async def test_the_access_log_names_the_request_id(anvil: Anvil, caplog: pytest.LogCaptureFixture) -> None:
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, ACCESS_LOG="true", LOG_LEVEL="INFO"))
    try:
        with caplog.at_level(logging.INFO, logger="proxy.access"):
            for _ in range(2):  # a miss and a hit
                _, _, headers = await proxy.post(GENESIS, headers={"X-Request-Id": "from-client-1"})
                assert headers["X-Request-Id"] == "from-client-1"
            _, _, headers = await proxy.post(GENESIS)
        lines = [(r.getMessage(), getattr(r, "request_id", None)) for r in caplog.records if r.name == "proxy.access"]
        assert lines.count(("request", "from-client-1")) == 2 and lines.count(("call", "from-client-1")) == 2
        assert ("request", headers["X-Request-Id"]) in lines and ("call", headers["X-Request-Id"]) in lines
    finally:
        await proxy.close()


async def test_a_websocket_handshake_carries_a_request_id(evm_proxy: Proxy) -> None:
    async with evm_proxy.session.ws_connect(evm_proxy.ws_url(), headers={"X-Request-Id": "ws-1"}) as ws:
        assert ws._response.headers["X-Request-Id"] == "ws-1"


def test_the_process_has_one_id_source() -> None:
    assert NEW_ID.fullmatch(IDS.new())


async def test_paid_hits_carry_a_request_id_new_or_the_clients(anvil: Anvil) -> None:
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, API_KEYS="alice"))
    try:
        answers = [await proxy.post(GENESIS, key="alice", headers=h) for h in ({}, {}, {"X-Request-Id": "paid-7"})]
        assert [(s, h["X-Cache"]) for s, _, h in answers] == [(200, "MISS"), (200, "HIT"), (200, "HIT")]
        assert NEW_ID.fullmatch(answers[1][2]["X-Request-Id"]) and answers[2][2]["X-Request-Id"] == "paid-7"
        assert int(answers[1][2]["X-Credits-Charged"]) > 0
    finally:
        await proxy.close()


async def test_the_access_log_has_a_request_line_for_every_http_answer(
    anvil: Anvil, caplog: pytest.LogCaptureFixture
) -> None:
    # spec (operations.md): ACCESS_LOG writes the request line of each HTTP request: method, path
    # without the key, status and request id, whatever answered it.
    secret = "sk-live-0123456789abcdef"
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, API_KEYS=secret, ACCESS_LOG="true"))
    answered: list[tuple[str, str, int, str]] = []
    try:
        with caplog.at_level(logging.INFO, logger="proxy.access"):
            sent = (("POST", "/", "/"), ("GET", "/healthz", "/healthz"), ("GET", "/readyz", "/readyz"))
            for method, path, logged in (*sent, ("GET", "/nope", "/<redacted>")):  # a path no route names: the client's
                async with proxy.session.request(method, proxy.base + path, json=CHAIN_ID) as resp:
                    answered.append((method, logged, resp.status, resp.headers["X-Request-Id"]))
            async with proxy.session.options(proxy.base + f"/v3/{secret}") as resp:
                answered.append(("OPTIONS", "/v3/<key>", resp.status, resp.headers["X-Request-Id"]))
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await proxy.session.ws_connect(f"ws://127.0.0.1:{proxy.server.port}/ws/v3/wrong-{secret}")
            assert refused.value.headers is not None
            answered.append(("GET", "/ws/v3/<key>", refused.value.status, refused.value.headers["X-Request-Id"]))
            ((status, headers, _),) = await exchange(proxy.server.port, b"NOT HTTP\r\n\r\n")
            answered.append(("", "", status, headers["x-request-id"]))
        lines = [
            (
                getattr(r, "method", ""),
                getattr(r, "path", ""),
                getattr(r, "status", None),
                getattr(r, "request_id", None),
            )
            for r in caplog.records
            if r.name == "proxy.access" and r.getMessage() == "request"
        ]
        assert {a[2] for a in answered} >= {404, 200, 401, 400}
        for line in answered:
            assert (line[0] or None, line[1] or None, line[2], line[3]) in [
                (m or None, p or None, s, i) for m, p, s, i in lines
            ], (line, lines)
        assert secret not in caplog.text
    finally:
        await proxy.close()


async def test_the_metrics_and_admin_ports_answer_with_a_request_id_a_request_line_and_no_version(
    anvil: Anvil, caplog: pytest.LogCaptureFixture
) -> None:
    # spec (operations.md): every HTTP answer carries X-Request-Id and, with ACCESS_LOG, logs one
    # request line, /metrics included; security.md: no answer names a library or interpreter version.
    metrics, admin, token = free_port(), free_port(), "s3cret-admin-token-0123456789"
    settings = settings_for(
        EVM_UPSTREAM=anvil.url, ACCESS_LOG="true", METRICS_PORT=str(metrics), ADMIN_PORT=str(admin), ADMIN_TOKEN=token
    )
    proxy = await start_proxy(settings)
    bearer = {"Authorization": f"Bearer {token}"}
    asked = [
        ("GET", metrics, "/metrics", {}, 200),
        ("GET", metrics, "/nope", {}, 404),
        ("POST", metrics, "/metrics", {}, 405),
        ("GET", admin, "/upstreams", bearer, 200),
        ("GET", admin, "/upstreams", {}, 401),  # the auth refusal
        ("GET", admin, "/nope", bearer, 404),
        ("GET", admin, "/reload", bearer, 405),
    ]
    answered: list[tuple[str, str, int, str]] = []
    try:
        with caplog.at_level(logging.INFO, logger="proxy.access"):
            for n, (method, port, path, headers, status) in enumerate(asked):
                sent = {**headers, "X-Request-Id": f"ops-{n}"} if n % 2 else headers  # the client's own, or a new one
                async with proxy.session.request(method, f"http://127.0.0.1:{port}{path}", headers=sent) as resp:
                    assert resp.status == status, (method, port, path, resp.status)
                    rid, server = resp.headers.get("X-Request-Id", ""), resp.headers.get("Server", "")
                    assert (rid == sent.get("X-Request-Id")) if n % 2 else NEW_ID.fullmatch(rid), (path, rid)
                    assert "aiohttp" not in server and "Python" not in server, (path, server)
                    answered.append((method, path.replace("/nope", "/<redacted>"), status, rid))
        lines = [
            (r.method, r.path, r.status, r.request_id)  # type: ignore[attr-defined]
            for r in caplog.records
            if r.name == "proxy.access" and r.getMessage() == "request"
        ]
        assert sorted(lines) == sorted(answered), lines
        assert token not in caplog.text
    finally:
        await proxy.close()


async def test_a_broken_gzip_body_to_the_metrics_or_admin_port_is_answered_without_a_traceback(
    anvil: Anvil, caplog: pytest.LogCaptureFixture
) -> None:
    # Rule: bad input gets an answer and no traceback. Neither port reads a body, so none is decoded:
    # aiohttp decoded one anyway and logged "Unhandled exception" with its traceback (an outside attack).
    metrics, admin, token = free_port(), free_port(), "s3cret-admin-token-0123456789"
    settings = settings_for(EVM_UPSTREAM=anvil.url, METRICS_PORT=str(metrics), ADMIN_PORT=str(admin), ADMIN_TOKEN=token)
    proxy = await start_proxy(settings)
    broken = b"Content-Encoding: gzip\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"
    try:
        with caplog.at_level(logging.ERROR):
            for port, path, auth, status in (
                (metrics, b"/metrics", b"", 405),
                (admin, b"/reload", b"Authorization: Bearer %s\r\n" % token.encode(), 409),  # no NETWORKS_FILE
            ):
                head = b"POST %s HTTP/1.1\r\nHost: proxy\r\n%s" % (path, auth)
                ((answered, _, _),) = await exchange(port, head + broken)
                assert answered == status, (path, answered)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        await proxy.close()


def test_a_logged_path_shows_no_key_nor_any_segment_no_route_names() -> None:
    assert shown_path("/evm/ws/v3/sk-live-secret", {"evm"}) == "/evm/ws/v3/<key>"
    assert shown_path("/sk-live-0123456789abcdef/x") == "/<redacted>/<redacted>"
    assert shown_path("/healthz") == "/healthz" and shown_path("") is None
    # A short key on a path next to a served one (an outside attack found each logged whole).
    assert shown_path("/v3//key123") == "/v3//<key>" and shown_path("/ws/v3//key123") == "/ws/v3//<key>"
    assert shown_path("/V3/key123") == "/V3/<key>" and shown_path("/v3/./key123") == "/v3/<key>/<redacted>"
    assert shown_path("/key123/v3/x", {"evm"}) == "/<redacted>/v3/<key>"
    # A key may hold quotes: it is cut whole, as every /v3/ segment of every line is.
    assert shown_path("/v3/" + "A" * 20 + "'x9Q") == "/v3/<key>"
    assert redacted("""Bad request line 'GET /v3/ab"c'd HTTP/1.1'""") == "Bad request line 'GET /v3/<key> HTTP/1.1'"
    assert redacted("/V3//key123?x") == "/V3//<key>?x"


async def test_eth_accounts_answered_by_the_proxy_costs_an_identity_reads_price(anvil: Anvil) -> None:
    # spec (keys-and-credits.md): answered locally as eth_chainId is, it is priced as one (5), not the default.
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, API_KEYS="test-key"))
    try:
        for call in (ACCOUNTS, CHAIN_ID):
            status, body, headers = await proxy.post(call)
            assert status == 200 and "result" in body and headers["X-Credits-Charged"] == "5", (call, headers)
    finally:
        await proxy.close()


def _serving(port: int, upstream: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    """`python -m proxy` on `port` with `upstream` as EVM_UPSTREAM, its log in `log`."""
    environ = {**os.environ, "PROXY_PORT": str(port), "EVM_UPSTREAM": upstream, "UPSTREAM_TIMEOUT": "20", **env}
    with log.open("wb") as handle:  # a file, not a pipe nobody reads
        return subprocess.Popen([sys.executable, "-m", "proxy"], env=environ, stdout=subprocess.DEVNULL, stderr=handle)


async def _first_answer(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    """The first answer of a proxy still starting (its port refuses connections until it listens)."""
    answered: list[tuple[int, Any]] = []

    async def answers() -> bool:
        try:
            async with session.post(url, json=body) as response:
                answered.append((response.status, await response.json()))
        except aiohttp.ClientConnectionError:
            return False
        return True

    await eventually(answers, 30, "the proxy to answer")
    return answered[0]


async def test_an_upstream_that_is_the_proxy_itself_is_refused_at_once_as_a_loop(tmp_path: Path) -> None:
    """Rule (RFC 9110 7.6.3 Via): a request this proxy sent that comes back to it is refused, not forwarded."""
    port = free_port()
    log = tmp_path / "proxy.log"
    proc = _serving(port, f"http://127.0.0.1:{port}", log)
    try:
        async with aiohttp.ClientSession() as session:
            started = time.monotonic()
            status, answer = await _first_answer(session, f"http://127.0.0.1:{port}/v3/k", CHAIN_ID)
            assert time.monotonic() - started < 15  # not an upstream timeout after a fan-out to itself
            assert status == 502 and answer["error"]["code"] == -32002, answer
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 30)
    text = log.read_text()
    assert "level=error" in text and "an upstream of this proxy is this proxy itself" in text, text


async def test_a_chain_of_two_proxies_is_no_loop(anvil: Anvil, tmp_path: Path) -> None:
    """Rule: another proxy's Via is not this one's: proxy -> proxy -> node answers."""
    port = free_port()
    inner = _serving(port, anvil.url, tmp_path / "inner.log")
    try:
        async with aiohttp.ClientSession() as session:
            status, answer = await _first_answer(session, f"http://127.0.0.1:{port}/v3/k", CHAIN_ID)
        assert status == 200 and answer["result"] == "0x7a69", answer
        outer = await start_proxy(settings_for(EVM_UPSTREAM=f"http://127.0.0.1:{port}"))
        try:
            status, answer, _ = await outer.post(GENESIS)
            assert status == 200 and answer["result"]["number"] == "0x0", answer
        finally:
            await outer.close()
    finally:
        inner.send_signal(signal.SIGTERM)
        await asyncio.to_thread(inner.wait, 30)


class _Hop:
    """A hop in front of `target` that counts the calls it passes and keeps their Via, as a plain TCP
    forwarder would: what one proxy sends the other, seen on the wire."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.methods: list[str] = []
        self.port = free_port()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._relay)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return f"http://127.0.0.1:{self.port}/"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _relay(self, request: web.Request) -> web.Response:
        assert self._session is not None
        body = await request.read()
        payload = json.loads(body)
        self.methods += [str(c.get("method")) for c in (payload if isinstance(payload, list) else [payload])]
        headers = {"Content-Type": "application/json"}
        if "Via" in request.headers:
            headers["Via"] = ", ".join(request.headers.getall("Via"))
        try:
            async with self._session.post(self.target, data=body, headers=headers) as answer:
                return web.Response(body=await answer.read(), status=answer.status, content_type="application/json")
        except aiohttp.ClientError:
            return web.Response(status=502)


async def test_two_proxies_that_are_each_others_upstream_refuse_a_call_at_once_and_stop_calling(
    tmp_path: Path,
) -> None:
    """Rule (RFC 9110 7.6.3): a proxy appends its Via to the one it received, so two proxies that are
    each other's upstream see their own mark on the second hop: the call fails fast and the two
    stop calling each other (the calls between them, counted on the wire, stop growing)."""
    ports = free_port(), free_port()
    hops = [_Hop(f"http://127.0.0.1:{port}/") for port in ports]
    urls = [await hop.start() for hop in hops]
    procs = [_serving(ports[0], urls[1], tmp_path / "a.log"), _serving(ports[1], urls[0], tmp_path / "b.log")]
    try:
        async with aiohttp.ClientSession() as session:
            for port in ports:
                await _first_answer(session, f"http://127.0.0.1:{port}/", CHAIN_ID)  # both listening
            started = time.monotonic()
            call = {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": ["0x" + "ab" * 20, "latest"]}
            status, answer = await _first_answer(session, f"http://127.0.0.1:{ports[0]}/", call)
            assert time.monotonic() - started < 15 and status >= 500 and "error" in answer, (status, answer)
        seen: list[int] = []

        async def stopped() -> bool:
            seen.append(sum(m == "eth_getBalance" for hop in hops for m in hop.methods))
            return len(seen) > 100 and seen[-1] == seen[-101]  # unchanged over 100 polls (2 s and more)

        await eventually(stopped, 60, "the proxies to stop calling each other")
        assert seen[-1] <= 8, seen[-1]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            await asyncio.to_thread(proc.wait, 30)
        for hop in hops:
            await hop.close()
    assert "an upstream of this proxy is this proxy itself" in (tmp_path / "a.log").read_text()


async def test_a_call_that_came_through_other_proxies_goes_upstream_with_their_via_and_this_ones(
    relays: list[FaultRelay], make_proxy: ProxyFactory
) -> None:
    """Rule (RFC 9110 7.6.3): the rpc-proxy marks a request arrived with travel on, this proxy's
    appended, alone or in a batch (a call with other proxies' marks is auto-batched only with calls
    carrying the same marks); another kind of proxy's entry (a load balancer's) is not carried."""
    proxy = await make_proxy(EVM_UPSTREAM=relays[0].url)
    status, answers, _ = await proxy.post(
        _balances(1), headers={"Via": "1.1 google, 1.1 rpc-proxy-0123456789abcdef, 1.0 edge-b"}
    )
    assert status == 200 and [a["result"] for a in answers] == ["0x0"] * 3, answers
    marked = _balance_vias(relays[0])
    assert marked, marked
    assert all(re.fullmatch(r"1\.1 rpc-proxy-0123456789abcdef, 1\.1 rpc-proxy-\w+", v) for v in marked), marked


async def test_a_call_through_a_load_balancers_via_is_sent_as_any_other(
    relays: list[FaultRelay], make_proxy: ProxyFactory
) -> None:
    """Rule: only rpc-proxy marks are carried on (via.py): a call that came through a load balancer
    that writes Via (`1.1 google`) goes upstream as a call that came straight, batched the same."""
    proxy = await make_proxy(EVM_UPSTREAM=relays[0].url)
    assert (await proxy.post(_balances(1)))[0] == 200
    straight = len(_balance_vias(relays[0]))
    assert (await proxy.post(_balances(10), headers={"Via": "1.1 google"}))[0] == 200
    vias = _balance_vias(relays[0])
    assert len(vias) == 2 * straight and set(vias) == {via.field()}, vias


def _balances(first: int) -> list[dict[str, Any]]:
    """Three balance reads of accounts no call asked before (from `first`): three misses."""
    return [
        {"jsonrpc": "2.0", "id": n, "method": "eth_getBalance", "params": [f"0x{first + n:040x}", "latest"]}
        for n in range(3)
    ]


def _balance_vias(relay: FaultRelay) -> list[str]:
    """The Via of each request the relay was sent with a balance read in it."""
    return [
        h.get("Via", "")
        for h, (_, methods) in zip(relay.request_headers, relay.timeline, strict=True)
        if "eth_getBalance" in methods
    ]


async def test_a_request_whose_via_names_more_than_eight_proxies_is_refused_as_a_loop(evm_proxy: Proxy) -> None:
    """Rule: a request that already passed more than 8 proxies is a loop of proxies (508), not forwarded."""
    eight = ", ".join(f"1.1 p{n}" for n in range(8))
    status, answer, _ = await evm_proxy.post(CHAIN_ID, headers={"Via": eight})
    assert status == 200 and answer["result"] == "0x7a69", answer
    status, answer, _ = await evm_proxy.post(CHAIN_ID, headers={"Via": eight + ", 1.1 p8"})
    assert status == 508 and "Via names over 8 proxies" in answer["error"]["message"], answer


@pytest.mark.parametrize("upgrade", [False, True])
async def test_this_proxys_mark_in_any_via_line_is_a_loop(evm_proxy: Proxy, upgrade: bool) -> None:
    """Rule (RFC 9110 5.3, 7.6.3): repeated Via lines are one list: the own mark in a second line is a
    loop as in the first, for a POST and for a WebSocket handshake alike."""
    body = json.dumps(CHAIN_ID).encode()
    head = (
        "GET /ws/v3/k HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        if upgrade
        else f"POST /v3/k HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    )
    request = f"{head}Host: rpc.example\r\nVia: 1.1 edge\r\nVia: {via.field()}\r\n\r\n".encode()
    ((status, _, answer),) = await exchange(evm_proxy.server.port, request + (b"" if upgrade else body))
    assert status == 508 and b"loop detected" in answer, answer


ERRORS = "rpc_proxy_upstream_errors_total"


def _marks(count: int) -> str:
    """A Via of `count` rpc-proxy marks of other deployments, in the form a proxy writes them."""
    return ", ".join(f"1.1 rpc-proxy-{n:016x}" for n in range(count))


async def test_a_request_carrying_max_proxies_marks_is_refused_at_this_front_never_sent_upstream(
    relays: list[FaultRelay], make_proxy: ProxyFactory
) -> None:
    """Rule (via.py): with its own mark appended, a request that arrived with MAX_PROXIES rpc-proxy
    marks would be refused by its upstream for its count (and that upstream's 508 taken as the node's
    fault): this proxy refuses it itself, and sends nothing."""
    proxy = await make_proxy(EVM_UPSTREAM=relays[0].url)
    status, answer, _ = await proxy.post(_balances(1)[0], headers={"Via": _marks(via.MAX_PROXIES)})
    assert status == 508 and "loop detected" in answer["error"]["message"], answer
    assert _balance_vias(relays[0]) == []
    status, answer, _ = await proxy.post(_balances(1)[0], headers={"Via": _marks(via.MAX_PROXIES - 1)})
    assert status == 200 and answer["result"] == "0x0", answer


async def test_an_upstreams_loop_refusal_fails_the_call_but_never_cools_the_upstream(
    relays: list[FaultRelay], make_proxy: ProxyFactory
) -> None:
    """Rule: an upstream's HTTP 508 (Loop Detected) is the request's fault, not the node's: the call
    fails, the upstream stays up, and the refusal is counted as kind="loop", not as the node's error."""
    proxy = await make_proxy(EVM_UPSTREAM=relays[0].url)
    relays[0].inject("http508", method="eth_getBalance", times=None)
    status, answer, _ = await proxy.post(_balances(1)[0])
    assert status >= 500 and "HTTP 508" in answer["error"]["message"], answer
    assert proxy.metric("rpc_proxy_upstream_up", network="evm", upstream="0") == 1
    errors = [proxy.metric(ERRORS, network="evm", upstream="0", kind=kind) for kind in ("loop", "http")]
    assert errors[0] >= 1 and errors[1] == 0, errors


async def test_a_batch_refused_upstream_as_a_loop_is_not_asked_again_call_by_call(
    relays: list[FaultRelay], make_proxy: ProxyFactory
) -> None:
    """Rule (via.py): a loop refusal is the request's Via's fault, and each call alone carries the same
    marks: a client batch whose upstream request is refused with 508 fails once, never resent call by
    call (a forged Via turned one batch of 500 into 510 requests to the next proxy)."""
    proxy = await make_proxy(EVM_UPSTREAM=relays[0].url)
    relays[0].inject("http508", method="eth_getBalance", times=None)
    status, answers, _ = await proxy.post(_balances(1), headers={"Via": _marks(1)})
    assert status == 200 and all("HTTP 508" in a["error"]["message"] for a in answers), answers
    sent = [methods for _, methods in relays[0].timeline if "eth_getBalance" in methods]
    assert len(sent) == 1 and sent[0].count("eth_getBalance") == 3, sent  # one request for the three, not 1 + 3


async def test_a_marked_call_never_leads_a_coalesced_call_of_unmarked_callers(
    relays: list[FaultRelay], make_proxy: ProxyFactory
) -> None:
    """Rule (via.py): coalesced calls share one request, marks and all, so only identically marked
    calls share one: unmarked callers of a call a marked one is asking send their own request (a
    forged Via that gets its request refused upstream fails no other client's call)."""
    proxy = await make_proxy(EVM_UPSTREAM=relays[0].url)
    relays[0].inject("slow", method="eth_getBalance", delay=2)
    call = _balances(1)[0]
    marked = asyncio.create_task(proxy.post(call, headers={"Via": _marks(1)}))

    async def sent() -> bool:
        return relays[0].in_flight == 1

    await eventually(sent, 10, "the marked call to reach the upstream")
    answers = await asyncio.gather(*(proxy.post(call) for _ in range(5)))
    assert all(status == 200 and answer["result"] == "0x0" for status, answer, _ in answers), answers
    assert (await marked)[0] == 200
    vias = _balance_vias(relays[0])
    assert len(vias) == 2 and vias[0].startswith(_marks(1) + ", ") and vias[1] == via.field(), vias


async def test_a_marked_client_batch_is_auto_batched_as_an_unmarked_one(
    relays: list[FaultRelay], make_proxy: ProxyFactory
) -> None:
    """Rule (via.py, batching.py): calls carrying the same rpc-proxy marks go upstream together, as
    unmarked calls do: a forged mark costs no more upstream requests, and a marked call never
    travels in a request of unmarked calls (a request has one Via)."""
    proxy = await make_proxy(EVM_UPSTREAM=relays[0].url)
    batch = [
        {"jsonrpc": "2.0", "id": n, "method": "eth_getBalance", "params": [f"0x{n + 1000:040x}", "latest"]}
        for n in range(100)
    ]
    assert (await proxy.post(batch))[0] == 200
    straight = len(_balance_vias(relays[0]))
    assert (
        await proxy.post(
            [{**c, "params": [f"0x{n + 2000:040x}", "latest"]} for n, c in enumerate(batch)], headers={"Via": _marks(1)}
        )
    )[0] == 200
    marked = _balance_vias(relays[0])[straight:]
    assert len(marked) == straight and set(marked) == {f"{_marks(1)}, {via.field()}"}, marked


async def test_only_marks_in_the_form_this_proxy_writes_are_carried_upstream(
    relays: list[FaultRelay], make_proxy: ProxyFactory
) -> None:
    """Rule (via.py): a received entry is carried on only if it is `<protocol> rpc-proxy-<16 lowercase
    hex>`, the form a proxy writes: an oversized, malformed or non-ASCII one is dropped, never forwarded."""
    proxy = await make_proxy(EVM_UPSTREAM=relays[0].url)
    junk = [
        "1.1 rpc-proxy-" + "a" * 8000,
        "1.1 rpc-proxy-0123456789ABCDEF",
        "1.1 rpc-proxy-0123456789abcdef (a comment)",
        "1.1 rpc-proxy-\u00e90123456789abcde",
        "1.1 rpc-proxy-0123456789abcdef0",
    ]
    headers = MultiDict([("Via", entry) for entry in [*junk, "HTTP/1.1 rpc-proxy-0000000000000007"]])
    status, answer, _ = await proxy.post(_balances(1)[0], headers=headers)
    assert status == 200 and answer["result"] == "0x0", answer
    assert _balance_vias(relays[0]) == [f"HTTP/1.1 rpc-proxy-0000000000000007, {via.field()}"]


def test_at_most_max_proxies_marks_are_carried() -> None:
    """Rule (via.py): the marks carried on are bounded, whatever a client sends."""
    carried = via.marks(_marks(3 * via.MAX_PROXIES))
    assert carried == _marks(via.MAX_PROXIES), carried
