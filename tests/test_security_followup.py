"""Holes an outside attack found after the first hardening pass, each closed and tried again."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy.config import ConfigError, build_settings
from proxy.logs import redacted
from proxy.rpc.jsonrpc import MAX_CONTAINERS, JsonRpcError, parse_body
from proxy.service import MEMO_MAX_CONTAINERS, _fingerprint
from tests.support import ROOT, Anvil, Proxy, ProxyFactory, free_port, wait_until

ADDRESS = "0x" + "11" * 20
SECRET = "sk-live-SECRET123"


class TestRedaction:
    def test_every_v3_key_segment_is_cut_from_log_text(self) -> None:
        line = f"b'POST /v3/{SECRET} HTTP/1.x' and /evm/ws/v3/{SECRET}?x and '/v3/{SECRET}'"
        assert SECRET not in redacted(line) and redacted(line).count("/v3/<key>") == 3


def test_a_malformed_request_line_logs_no_key_and_no_traceback(anvil: Anvil) -> None:
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "EVM_UPSTREAM": anvil.url,
        "PROXY_PORT": str(port),
        "API_KEYS": SECRET,
    }
    proc = subprocess.Popen([sys.executable, "-m", "proxy"], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return True
            except OSError:
                return False

        wait_until(listening, 20, "the proxy to listen")
        for request_line in (f"POST /v3/{SECRET} HTTP/1.x", f"junk /v3/{SECRET} HTTP/1.1", f"POST\t/v3/{SECRET}"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(f"{request_line}\r\nHost: a\r\nContent-Length: 2\r\n\r\n{{}}".encode())
                assert sock.recv(4096).split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert SECRET not in err
    assert "Traceback" not in err and "Error handling request" not in err


@pytest.mark.parametrize("tx", [{"gas": "1000000000000"}, {"gas": 10**15}, {"gasLimit": "0xffffffffffff"}])
async def test_eth_create_access_list_validates_its_call_object_like_eth_call(
    evm_proxy: Proxy, tx: dict[str, Any]
) -> None:
    reply = await evm_proxy.call("eth_createAccessList", [{"from": ADDRESS, "to": ADDRESS, **tx}])
    assert reply["error"]["code"] == -32602, reply
    assert evm_proxy.upstreams["evm"].calls["eth_createAccessList"] == 0


async def test_eth_create_access_list_is_capped_like_eth_call(evm_proxy: Proxy) -> None:
    # It executes the call as eth_estimateGas does: the same cap, or it is a way round it.
    tx = {"from": ADDRESS, "to": ADDRESS, "gas": "0x" + "f" * 20}
    assert "result" in await evm_proxy.call("eth_createAccessList", [tx, "latest"])
    sent = [p for m, p in evm_proxy.upstreams["evm"].params if m == "eth_createAccessList"]
    assert [p[0]["gas"] for p in sent] == [hex(10 * 30_000_000)]


class TestBodiesOfManyValues:
    def test_one_call_with_a_flood_of_objects_in_its_params_is_refused_before_parsing(self) -> None:
        params = ",".join(["{}"] * (MAX_CONTAINERS + 1))
        body = f'{{"jsonrpc":"2.0","id":1,"method":"eth_getBalance","params":[{params}]}}'
        for form in (body, body.encode()):  # WebSocket text and HTTP bytes
            with pytest.raises(JsonRpcError) as caught:
                parse_body(form, max_batch=100)
            assert caught.value.code == -32600 and caught.value.http_status == 400

    async def test_over_http_it_is_a_json_rpc_error_and_nothing_is_forwarded(self, evm_proxy: Proxy) -> None:
        params = ",".join(["[]"] * (MAX_CONTAINERS + 1))
        status, reply, _ = await evm_proxy.post(
            f'{{"jsonrpc":"2.0","id":1,"method":"eth_getBalance","params":[{params}]}}'
        )
        assert status == 400 and reply["error"]["code"] == -32600
        assert evm_proxy.upstreams["evm"].calls["eth_getBalance"] == 0


def test_memos_hold_only_params_of_few_objects_and_arrays(evm_proxy: Proxy) -> None:
    from proxy.http.app_keys import SERVICE

    net = evm_proxy.app[SERVICE].networks["evm"]
    plain = [{"from": ADDRESS, "to": ADDRESS, "data": "0x"}, "0x88"]
    many = [{"from": ADDRESS, "to": ADDRESS, "accessList": [{}] * MEMO_MAX_CONTAINERS}, "0x88"]
    assert _fingerprint(net, "eth_call", plain) is not None
    assert len(json.dumps(many)) < 512 and _fingerprint(net, "eth_call", many) is None


async def test_a_method_of_the_other_family_on_a_named_network_is_refused_not_forwarded(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url)
    status, reply, headers = await proxy.post(
        {"jsonrpc": "2.0", "id": 1, "method": "getSlot", "params": []}, network="evm"
    )
    assert status == 200 and reply["error"]["code"] == -32601, reply
    assert proxy.upstreams["evm"].calls["getSlot"] == 0 and headers["X-Credits-Charged"] == "0"


@pytest.mark.parametrize(
    "raw",
    [
        {"REDIS_URL": "redis://:hunter2@127.0.0.1:6379/0?db=x"},
        {"REDIS_URL": "redis://:hunter2@127.0.0.1:6379/0?socket_timeout=abc"},
        {"CREDITS_REDIS_URL": "redis://:hunter2@[bad"},
        {"EVM_UPSTREAM": "http://user:hunter2@[bad"},
    ],
)
def test_bad_urls_are_one_line_configuration_errors_naming_no_secret(raw: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as caught:
        build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", **raw})
    assert "hunter2" not in str(caught.value) and "\n" not in str(caught.value)


def test_a_keys_file_that_is_not_utf8_is_a_configuration_error(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_bytes(b'[keys.alice]\nkey = "\xff\xfe"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        build_settings({"EVM_UPSTREAM": "http://127.0.0.1:1", "API_KEYS_FILE": str(path)})
