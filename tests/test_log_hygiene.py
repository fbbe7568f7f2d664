"""What a client or a guesser can put in the logs, and a weak admin token: every log line is printable
ASCII whatever a client sends (control and non-ASCII characters escaped, in both formats), a flood
of bad admin tokens costs a few lines, and an ADMIN_TOKEN with whitespace or too little variety is
refused at start (exit 2, naming ADMIN_TOKEN, never its value)."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from proxy.config import admin_token_problem
from proxy.logs import line, logfmt_value
from tests.support import Anvil, free_port, healthy, settings_for, start_proxy, wait_until
from tests.test_cli_and_logs import clean_env, parsed

GOOD_TOKEN = "s3cret-admin-token-0123456789"
FORGED = "203.0.113.9\x9b31m\x1b[2J\x7f\u202e\U0001f600"  # a C1 CSI, an ESC sequence, DEL, a bidi override


def printable_ascii(text: str) -> bool:
    return all(0x20 <= ord(c) <= 0x7E for c in text)


class TestEscaping:
    @pytest.mark.parametrize("fmt", ["text", "json"])
    def test_every_character_outside_printable_ascii_is_escaped_and_decodes_back(self, fmt: str) -> None:
        written = line(fmt, logging.WARNING, FORGED)
        assert printable_ascii(written), written
        assert parsed(written, fmt)["msg"] == FORGED

    @pytest.mark.parametrize("fmt", ["text", "json"])
    def test_a_key_that_holds_quotes_is_cut_whole_and_the_line_still_parses(self, fmt: str) -> None:
        # A key may be any visible ASCII but / % ? # \: cut on the written line, the part after an
        # escaped quote was left in it (an outside attack).
        secret = """ab"cd'ef<x>"""
        written = line(fmt, logging.WARNING, f"POST /v3/{secret} and /V3//{secret}")
        assert "cd" not in written and "ef" not in written, written
        assert parsed(written, fmt)["msg"] == "POST /v3/<key> and /V3//<key>"

    def test_a_value_with_a_last_newline_is_quoted_not_bare(self) -> None:
        assert logfmt_value("abc\n") == '"abc\\n"'
        assert logfmt_value("plain-1.2") == "plain-1.2"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_forged_client_address_reaches_the_access_log_escaped(fmt: str, anvil: Anvil, tmp_path: Path) -> None:
    port = free_port()
    env = clean_env(
        EVM_UPSTREAM=anvil.url,
        PROXY_PORT=str(port),
        LOG_FORMAT=fmt,
        ACCESS_LOG="true",
        TRUSTED_PROXY_HEADER="X-Real-IP",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy"], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_until(lambda: healthy(port) or proc.poll() is not None, 20, "the proxy to listen")
        body = b'{"jsonrpc":"2.0","id":1,"method":"eth_chainId"}'
        forged = b"203.0.113.9\x9b31m\xe2\x80\xae"  # a C1 CSI and a bidi override, as bytes the parser passes
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(
                b"POST /v3/k HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Real-IP: "
                + forged
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            assert b" 200 " in sock.recv(4096)
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    text = err.decode("utf-8", "replace")
    assert all(printable_ascii(row) for row in text.splitlines()), [
        r for r in text.splitlines() if not printable_ascii(r)
    ]
    clients = [parsed(row, fmt).get("client") for row in text.splitlines()]
    assert any(c is not None and c.startswith("203.0.113.9") and not c.isascii() for c in clients), clients


async def test_a_flood_of_bad_admin_tokens_costs_a_line_not_one_per_request(
    anvil: Anvil,
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, ADMIN_PORT=str(port), ADMIN_TOKEN=GOOD_TOKEN))
    try:
        with caplog.at_level(logging.WARNING, logger="proxy.admin"):
            async with aiohttp.ClientSession() as session:
                for n in range(300):
                    headers = {"Authorization": f"Bearer guess-{n}"}
                    async with session.get(f"http://127.0.0.1:{port}/upstreams", headers=headers) as resp:
                        assert resp.status == 401
                async with session.get(
                    f"http://127.0.0.1:{port}/upstreams", headers={"Authorization": f"Bearer {GOOD_TOKEN}"}
                ) as resp:
                    assert resp.status == 200
        refused = [r for r in caplog.records if "refused" in r.getMessage()]
        assert 1 <= len(refused) <= 2, len(refused)
    finally:
        await proxy.close()


class TestAdminToken:
    @pytest.mark.parametrize(
        ("token", "why"),
        [
            (None, "not set"),
            ("short-Token1", "fewer than 16"),
            (" " * 20, "whitespace"),
            ("abcdefgh ijklmnopq", "whitespace"),
            ("a" * 32, "distinct"),
            ("abab" * 8, "distinct"),
            ("tokén-with-accent-1234", "printable ASCII"),
        ],
    )
    def test_a_weak_token_is_refused_with_why(self, token: str | None, why: str) -> None:
        problem = admin_token_problem(token)
        assert problem is not None and why in problem
        assert token is None or token.strip() == "" or token not in problem

    def test_a_long_varied_token_is_accepted(self) -> None:
        assert admin_token_problem(GOOD_TOKEN) is None

    @pytest.mark.parametrize("token", [" " * 20, "0123012301230123" * 2, "good-token-with\ttab-0123"])
    def test_the_command_refuses_a_weak_token_at_start_with_exit_2_never_echoing_it(
        self,
        token: str,
        tmp_path: Path,
    ) -> None:
        env = clean_env(
            EVM_UPSTREAM="http://127.0.0.1:1", ADMIN_PORT=str(free_port()), ADMIN_TOKEN=token, LOG_FORMAT="json"
        )
        result = subprocess.run(
            [sys.executable, "-m", "proxy"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 2, result.stderr
        (row,) = result.stderr.splitlines()
        message = json.loads(row)["msg"]
        assert message.startswith("configuration error:") and "ADMIN_TOKEN" in message
        assert token.strip() not in message or not token.strip()


def test_a_websocket_clients_subprotocols_never_reach_the_log(anvil: Anvil, tmp_path: Path) -> None:
    # A browser client may put its token in Sec-WebSocket-Protocol (it can set no header): aiohttp
    # logged it word for word, twice per upgrade, at WARNING.
    port = free_port()
    env = clean_env(EVM_UPSTREAM=anvil.url, PROXY_PORT=str(port), API_KEYS="sekritKEY123456", LOG_LEVEL="DEBUG")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy"], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_until(lambda: healthy(port) or proc.poll() is not None, 20, "the proxy to listen")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(
                b"GET /ws/v3/sekritKEY123456 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                b"Sec-WebSocket-Protocol: sekritKEY123456, tokenTWO\r\n\r\n"
            )
            assert b" 101 " in sock.recv(4096)
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    text = err.decode("utf-8", "replace")
    assert "sekritKEY123456" not in text and "tokenTWO" not in text, text
    assert "subprotocols were not taken" in text  # at DEBUG, without them
