"""Secrets out of files: ${VAR} in NETWORKS_FILE and API_KEYS_FILE, and per-upstream header fields
sent on every request and WebSocket handshake, never shown."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import WSMsgType, web

from proxy.config import ConfigError, build_settings
from proxy.config_expand import expand
from proxy.upstream.scrubbing import REDACTED, scrub_reply, scrub_text, secrets_of
from tests.fault_relay import FaultRelay
from tests.support import Anvil, eventually, fake_server, settings_for, start_proxy

TOKEN = "s3cret-token-9f8e7d"


class TestExpansion:
    def test_variables_and_defaults_expand_from_the_environment(self) -> None:
        env = {"KEY": "abc", "EMPTY": ""}
        data = {"a": "https://x/v2/${KEY}", "b": ["${MISSING:-dflt}", "${EMPTY:-used}"], "c": 3, "d": "$${KEY} $5"}
        assert expand(data, "NETWORKS_FILE", env) == {
            "a": "https://x/v2/abc",
            "b": ["dflt", "used"],
            "c": 3,
            "d": "${KEY} $5",
        }

    def test_an_unset_variable_without_default_names_the_variable_and_where(self) -> None:
        with pytest.raises(ConfigError) as error:
            expand({"networks": {"main": {"upstreams": ["https://x/${PROVIDER_KEY}"]}}}, "NETWORKS_FILE", {})
        assert str(error.value) == (
            "NETWORKS_FILE networks.main.upstreams[0]: environment variable PROVIDER_KEY is "
            "not set (or write ${PROVIDER_KEY:-default})"
        )

    def test_a_keys_file_error_never_names_a_table_which_may_be_a_secret(self) -> None:
        with pytest.raises(ConfigError) as error:
            expand({"keys": {"sk-live-secret": {"daily_credits": "${NOPE}"}}}, "API_KEYS_FILE", {}, trace=False)
        assert "sk-live-secret" not in str(error.value) and "NOPE" in str(error.value)

    def test_a_reference_inside_a_default_is_refused_naming_the_variable_set_or_not(self) -> None:
        # spec: nested defaults are not expanded; `Bearer abc}` or a literal `${DEFAULT_TOKEN}` never goes out.
        for env in ({"TOKEN": "abc", "DEFAULT_TOKEN": "d"}, {"DEFAULT_TOKEN": "d"}):
            with pytest.raises(ConfigError) as error:
                expand({"h": "Bearer ${TOKEN:-${DEFAULT_TOKEN}}"}, "NETWORKS_FILE", env)
            assert str(error.value) == (
                "NETWORKS_FILE h: the default of ${TOKEN:-...} holds '${': a default is plain text "
                "(nested references are not expanded)"
            )

    def test_a_malformed_reference_is_refused(self) -> None:
        with pytest.raises(ConfigError, match="must start"):
            expand({"a": "${1BAD}"}, "NETWORKS_FILE", {})


def networks_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "networks.toml"
    path.write_text(text)
    return str(path)


def test_header_values_and_misuse_are_checked_by_name_never_echoing_a_value(tmp_path: Path) -> None:
    for headers, problem in (
        ('{"Bad Name" = "x"}', "is not an HTTP field name"),
        ('{Host = "evil"}', "is the proxy's own to send"),
        ('{Authorization = "Bearer\\nX: y"}', "must be one line of ASCII"),
    ):
        path = networks_file(
            tmp_path,
            f'[networks.evm]\nfamily = "evm"\nupstreams = [{{url = "http://127.0.0.1:1", headers = {headers}}}]\n',
        )
        with pytest.raises(ConfigError, match=problem) as error:
            build_settings({"NETWORKS_FILE": path})
        assert "Bearer" not in str(error.value) and "evil" not in str(error.value)


def test_credentials_in_the_url_beside_an_authorization_header_are_refused(tmp_path: Path) -> None:
    """Rule: an upstream's credentials come one way: a URL's user:password@ was sent as Basic in
    place of a configured Authorization header, silently (an outside attack). Neither is echoed."""
    path = networks_file(
        tmp_path,
        '[networks.evm]\nfamily = "evm"\nupstreams = [{url = "https://user:pw-secret@rpc.example/v1", '
        'headers = {authorization = "Bearer tok-secret"}}]\n',
    )
    with pytest.raises(ConfigError, match="both user:password@ in its URL") as error:
        build_settings({"NETWORKS_FILE": path})
    assert "secret" not in str(error.value)
    alone = networks_file(
        tmp_path,
        '[networks.evm]\nfamily = "evm"\nupstreams = [{url = "https://rpc.example/a@b", '
        'headers = {Authorization = "Bearer tok"}}]\n',
    )
    assert build_settings({"NETWORKS_FILE": alone}).networks[0].upstreams  # an "@" in the path is no user
    for tail in ("?key=a@b", "#a@b"):
        query = networks_file(
            tmp_path,
            f'[networks.evm]\nfamily = "evm"\nupstreams = [{{url = "https://rpc.example{tail}", '
            'headers = {Authorization = "Bearer tok"}}]\n',
        )
        assert build_settings({"NETWORKS_FILE": query}).networks[0].upstreams  # nor one in the query


def test_an_unset_variable_is_a_configuration_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RPC_TOKEN_UNSET", raising=False)
    path = networks_file(tmp_path, '[networks.evm]\nfamily = "evm"\nupstreams = ["https://x/${RPC_TOKEN_UNSET}"]\n')
    with pytest.raises(ConfigError, match="RPC_TOKEN_UNSET is not set"):
        build_settings({"NETWORKS_FILE": path})


def test_a_keys_file_takes_its_secret_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALICE_KEY", "alice-secret-from-env")
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.alice]\nkey = "${ALICE_KEY}"\ndaily_credits = 1000\n')
    settings = build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", "API_KEYS_FILE": str(keys)})
    from proxy.credits.accounts import digest

    assert settings.api_keys is not None and settings.api_keys["alice"].sha256 == digest("alice-secret-from-env")


@pytest.fixture
async def ws_upstream() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """A node's WebSocket that records each handshake's headers and accepts eth_subscribe."""
    handshakes: list[dict[str, str]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        handshakes.append(dict(request.headers))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                call: Any = json.loads(message.data)
                await ws.send_str(json.dumps({"jsonrpc": "2.0", "id": call["id"], "result": "0x1"}))
        return ws

    app = web.Application()
    app.router.add_get("/", handle)
    server = await fake_server(app)
    try:
        yield f"ws://127.0.0.1:{server.port}/", handshakes
    finally:
        await server.close()


async def test_upstream_headers_are_sent_on_every_request_and_handshake_and_never_shown(
    anvil: Anvil,
    relays: list[FaultRelay],
    ws_upstream: tuple[str, list[dict[str, str]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ws_url, handshakes = ws_upstream
    monkeypatch.setenv("RELAY_URL", relays[0].url)
    monkeypatch.setenv("UPSTREAM_TOKEN", TOKEN)
    monkeypatch.delenv("T", raising=False)
    path = networks_file(
        tmp_path,
        f"""
[networks.evm]
family = "evm"
upstreams = [
  {{url = "${{RELAY_URL}}", headers = {{Authorization = "Bearer ${{UPSTREAM_TOKEN}}", X-Tenant = "${{T:-acme}}"}}}},
  {{url = "{ws_url}", headers = {{Authorization = "Bearer ${{UPSTREAM_TOKEN}}"}}}},
]
""",
    )
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(settings_for(NETWORKS_FILE=path, LOG_LEVEL="DEBUG"))
    try:
        assert await proxy.result("eth_getBalance", ["0x" + "11" * 20, "latest"]) == "0x0"
        assert relays[0].request_headers, "no request reached the upstream"
        assert all(
            h.get("Authorization") == f"Bearer {TOKEN}" and h.get("X-Tenant") == "acme"
            for h in relays[0].request_headers
        )
        async with proxy.session.ws_connect(proxy.ws_url()) as ws:  # a relayed subscription opens the node's
            await ws.send_str(
                json.dumps({"jsonrpc": "2.0", "id": 1, "method": "eth_subscribe", "params": ["newPendingTransactions"]})
            )
            await ws.receive(timeout=5)

        async def handshaken() -> bool:
            return bool(handshakes)

        await eventually(handshaken, 10, "the upstream WebSocket's handshake")
        assert handshakes[0].get("Authorization") == f"Bearer {TOKEN}"
        async with proxy.session.get(proxy.base + "/metrics") as resp:
            assert TOKEN not in await resp.text()
        assert TOKEN not in caplog.text and TOKEN not in repr(proxy.app)
    finally:
        await proxy.close()


PROV_TOKEN = "TOKENzzz999"
PROV_KEY = "SECRETKEY4f1a2b"
ECHOED = "invalid token <redacted> for /v2/<redacted>?<redacted>"  # the header whole, each URL part


@pytest.fixture
async def echoing_upstream() -> AsyncIterator[str]:
    """A node that answers every call with an error echoing its Authorization header and path, as a
    provider refusing a revoked token may (HTTP 200, code -32000)."""

    async def handle(request: web.Request) -> web.Response:
        calls: Any = await request.json()
        text = f"invalid token {request.headers.get('Authorization')} for {request.path_qs}"

        def error(call: dict[str, Any]) -> dict[str, Any]:
            data = {"echo": text, text: [{request.path_qs: 1}]}  # in values and in object keys, nested
            return {"jsonrpc": "2.0", "id": call.get("id"), "error": {"code": -32000, "message": text, "data": data}}

        return web.json_response([error(c) for c in calls] if isinstance(calls, list) else error(calls))

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    server = await fake_server(app)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


def echoing_networks(tmp_path: Path, url: str) -> str:
    return networks_file(
        tmp_path,
        f'[networks.evm]\nfamily = "evm"\nupstreams = [{{url = "{url}/v2/${{PROV_KEY}}?apikey=${{PROV_KEY}}", '
        'headers = {Authorization = "Bearer ${PROV_TOKEN}"}}]\n',
    )


async def test_an_upstream_error_echoing_its_secrets_reaches_no_client_or_log_line(
    echoing_upstream: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PROV_TOKEN", PROV_TOKEN)
    monkeypatch.setenv("PROV_KEY", PROV_KEY)
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(
        settings_for(NETWORKS_FILE=echoing_networks(tmp_path, echoing_upstream), LOG_LEVEL="DEBUG")
    )
    try:
        _, body, _ = await proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": ["0x" + "11" * 20, "0x1"]}
        )
        error = body["error"]
        echoed_path = ECHOED.rpartition(" ")[2]
        assert error == {"code": -32000, "message": ECHOED, "data": {"echo": ECHOED, ECHOED: [{echoed_path: 1}]}}
        shown = json.dumps(body) + "".join(r.getMessage() for r in caplog.records if r.name.startswith("proxy"))
        assert PROV_TOKEN not in shown and PROV_KEY not in shown
    finally:
        await proxy.close()


async def test_an_echoed_basic_authorization_from_a_urls_user_and_password_reaches_no_client_or_log_line(
    echoing_upstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    # spec: upstream URLs may carry a provider key; `user:password@` travels as Basic credentials.
    caplog.set_level(logging.DEBUG)
    sent = base64.b64encode(f"provuser:{PROV_KEY}".encode()).decode()
    url = echoing_upstream.replace("http://", f"http://provuser:{PROV_KEY}@")
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=url, LOG_LEVEL="DEBUG"))
    try:
        _, body, _ = await proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_getBalance", "params": ["0x" + "11" * 20, "0x1"]}
        )
        assert body["error"]["message"] == f"invalid token Basic {REDACTED} for /", body
        shown = json.dumps(body) + "".join(r.getMessage() for r in caplog.records if r.name.startswith("proxy"))
        assert sent not in shown and PROV_KEY not in shown
    finally:
        await proxy.close()


async def test_check_prints_an_upstream_error_without_the_secrets_it_echoes(
    echoing_upstream: str, tmp_path: Path
) -> None:
    from tests.test_check_command import check

    result = await asyncio.to_thread(  # the upstream answers on this test's loop
        check,
        tmp_path,
        NETWORKS_FILE=echoing_networks(tmp_path, echoing_upstream),
        PROV_TOKEN=PROV_TOKEN,
        PROV_KEY=PROV_KEY,
    )
    assert result.returncode == 1 and ECHOED[:40] in result.stdout, result.stdout
    assert PROV_TOKEN not in result.stdout + result.stderr and PROV_KEY not in result.stdout + result.stderr


class TestScrubbing:
    def test_every_configured_secret_is_scrubbed_and_short_url_words_are_kept(self) -> None:
        secrets = secrets_of(
            "https://user:pa55word@host/v2/abcdef123456?apikey=qwerty7890&LONEKEY99",
            (("Authorization", "Bearer tok-123456"), ("X-Api-Version", "2")),
        )
        text = "pa55word abcdef123456 qwerty7890 LONEKEY99 tok-123456 Bearer tok-123456 v2 eth_call 2"
        assert scrub_text(text, secrets) == " ".join([REDACTED] * 6 + ["v2 eth_call 2"])

    def test_the_basic_credentials_a_urls_user_and_password_are_sent_as_are_scrubbed(self) -> None:
        # An echoed Authorization header shows them only as base64 ("user:pa55word").
        sent = base64.b64encode(b"user:pa55word").decode()
        secrets = secrets_of("http://user:pa55word@host/", ())
        assert scrub_text(f"auth=Basic {sent}", secrets) == f"auth=Basic {REDACTED}"

    def test_a_secret_in_another_letter_case_or_percent_encoded_is_scrubbed(self) -> None:
        secrets = ("SuperSecretKey123",)
        assert (
            scrub_text("bad key SUPERSECRETKEY123 and supersecretkey123", secrets)
            == f"bad key {REDACTED} and {REDACTED}"
        )
        assert scrub_text("for /v2/%53uperSecretKey123", secrets) == REDACTED  # an unreserved letter escaped
        assert scrub_text("for /v2/%2553%2575perSecretKey123", secrets) == REDACTED  # and escaped again
        assert scrub_text("100% fine", secrets) == "100% fine"

    def test_object_keys_in_an_error_are_scrubbed_too(self) -> None:
        reply = {"id": 1, "error": {"message": "m", "data": {"abcdef123456": {"k abcdef123456": "v"}}}}
        scrub_reply(reply, ("abcdef123456",))
        assert reply == {"id": 1, "error": {"message": "m", "data": {REDACTED: {f"k {REDACTED}": "v"}}}}

    def test_an_error_nested_past_any_encodable_depth_is_scrubbed_without_recursing_past_the_limit(self) -> None:
        nested: Any = "abcdef123456"
        for _ in range(5000):  # a node's crafted nesting, deeper than Python's recursion limit
            nested = [nested]
        reply = {"id": 1, "error": {"message": "m abcdef123456", "data": nested}}
        scrub_reply(reply, ("abcdef123456",))
        assert reply["error"]["message"] == f"m {REDACTED}" and "abcdef123456" not in repr(reply)[:10_000]

    def test_only_errors_are_scrubbed_in_a_batch(self) -> None:
        reply = [{"id": 1, "result": "key abcdef123456"}, {"id": 2, "error": {"message": "bad abcdef123456"}}]
        scrub_reply(reply, ("abcdef123456",))
        assert reply == [{"id": 1, "result": "key abcdef123456"}, {"id": 2, "error": {"message": f"bad {REDACTED}"}}]


def test_headers_that_would_change_how_a_body_is_sent_or_read_are_refused_by_name(tmp_path: Path) -> None:
    # spec: the upstream client sends identity bodies and reads only identity answers, without 100-continue.
    for name in ("Accept-Encoding", "content-encoding", "Expect"):
        path = networks_file(
            tmp_path,
            '[networks.evm]\nfamily = "evm"\n'
            f'upstreams = [{{url = "http://127.0.0.1:1", headers = {{{name} = "gzip"}}}}]\n',
        )
        with pytest.raises(ConfigError, match=f"header {name} is the proxy's own to send"):
            build_settings({"NETWORKS_FILE": path})
