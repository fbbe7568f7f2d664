"""`rpc-proxy check`: the settings and files read as `serve` reads them, each upstream tried, the
effective configuration printed with its secrets redacted."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from proxy.check import redact_url
from proxy.cli import misspelt
from tests.support import Anvil, RedisServer, fake_server, free_port
from tests.test_cli_and_logs import clean_env

SECRET = "k3yABCDEFGHIJKLMNOPQRSTUVWXYZ0123"


def check(tmp_path: Path, *args: str, **settings: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "check", *args],
        env=clean_env(**settings),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


class TestRedaction:
    def test_every_path_segment_the_whole_query_and_credentials_are_redacted(self) -> None:
        # spec: keys are short (`/v2/abc123`), bare (`?SECRETKEY`) or anywhere: only scheme, host and port show.
        assert redact_url(f"https://eth.example.io/v2/{SECRET}") == "https://eth.example.io/<redacted>/<redacted>"
        assert redact_url(f"https://rpc.example/?apikey={SECRET}&x=1") == "https://rpc.example/?<redacted>"
        assert redact_url("https://rpc.example/rpc?SECRETKEY") == "https://rpc.example/<redacted>?<redacted>"
        assert redact_url("https://rpc.example/abcdefgh/123456/") == "https://rpc.example/<redacted>/<redacted>/"
        assert redact_url(f"https://user:{SECRET}@host:8443/rpc") == "https://<credentials>@host:8443/<redacted>"
        assert redact_url("http://127.0.0.1:8545") == "http://127.0.0.1:8545"
        assert redact_url("http://[::1]:8545/") == "http://[::1]:8545/"


@pytest.fixture
def locked_redis() -> Iterator[RedisServer]:
    """A private redis-server that asks for the password SECRET."""
    redis = RedisServer()
    with socket.create_connection(("127.0.0.1", redis.port), timeout=5) as sock:
        sock.sendall(f"CONFIG SET requirepass {SECRET}\r\n".encode())
        assert sock.recv(16).startswith(b"+OK")
    yield redis
    redis.stop()


def test_a_reachable_anvil_checks_ok_and_secrets_are_never_printed(
    anvil: Anvil, tmp_path: Path, locked_redis: RedisServer
) -> None:
    networks = tmp_path / "networks.toml"
    networks.write_text(
        '[networks.main]\nfamily = "evm"\nchain_id = 31337\n'
        f'upstreams = [{{url = "{anvil.url}/?key=${{KEY}}", headers = {{X-Token = "${{KEY}}"}}}},'
        f' "{anvil.url}"]\n'
    )
    result = check(
        tmp_path,
        NETWORKS_FILE=str(networks),
        KEY=SECRET,
        ADMIN_PORT="9100",
        ADMIN_TOKEN=SECRET,
        API_KEYS=f"{SECRET}-api",
        REDIS_URL=f"redis://:{SECRET}@127.0.0.1:{locked_redis.port}/0",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok   network main upstream #0" in result.stdout and "ok   network main upstream #1" in result.stdout
    assert "chain id 31337" in result.stdout and "all upstreams ok" in result.stdout
    assert "X-Token" in result.stdout and SECRET not in result.stdout + result.stderr


def test_a_dead_upstream_exits_1_naming_it_by_its_redacted_url(anvil: Anvil, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v3/{SECRET}"
    result = check(tmp_path, EVM_UPSTREAM=f"{anvil.url},{dead}")
    assert result.returncode == 1
    assert f"FAIL network evm upstream #1 {redact_url(dead)}: unreachable" in result.stdout
    assert SECRET not in result.stdout + result.stderr


def test_another_chain_among_a_networks_upstreams_is_a_problem(anvil: Anvil, tmp_path: Path) -> None:
    other = Anvil("--chain-id", "5")
    try:
        result = check(tmp_path, EVM_UPSTREAM=f"{anvil.url},{other.url}")
    finally:
        other.stop()
    assert result.returncode == 1 and "differs from the network's other upstreams'" in result.stdout


def test_a_misspelt_field_exits_2_naming_it_as_serve_does(tmp_path: Path) -> None:
    networks = tmp_path / "networks.toml"
    networks.write_text('[networks.main]\nfamily = "evm"\nupstream = ["http://127.0.0.1:1"]\n')
    result = check(tmp_path, NETWORKS_FILE=str(networks))
    assert result.returncode == 2 and "unknown field 'upstream'" in result.stderr


@pytest.mark.parametrize(
    ("setting", "host", "why"),
    [
        ("PROXY_HOST", "8.8.8.8", "Cannot assign requested address"),
        ("PROXY_HOST", "not a host!!", ""),
        ("PROXY_HOST", "a..b", "not a host name"),  # IDNA cannot encode it: a traceback before
        ("METRICS_HOST", "192.0.2.1", "Cannot assign requested address"),
    ],
)
def test_a_listen_host_serve_cannot_bind_fails_the_check_offline_too(
    tmp_path: Path, setting: str, host: str, why: str
) -> None:
    """Rule: check fails what serve cannot start with: a host that is no address of this machine, or
    no name it resolves, passed `check` and then `serve` exited 1 (an outside attack)."""
    ports = {"METRICS_PORT": str(free_port())} if setting == "METRICS_HOST" else {}
    result = check(tmp_path, "--offline", EVM_UPSTREAM="http://127.0.0.1:1", **{setting: host}, **ports)
    assert result.returncode == 1
    assert f"FAIL listen {setting} {host!r}: serve cannot listen there ({why}" in result.stdout


def test_a_listen_host_of_this_machine_passes_the_check_while_the_proxy_holds_its_port(tmp_path: Path) -> None:
    with socket.socket() as taken:  # a proxy already listening there: bound on port 0, the check is not its
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = check(tmp_path, "--offline", EVM_UPSTREAM="http://127.0.0.1:1", PROXY_PORT=port)
    assert result.returncode == 0 and "FAIL" not in result.stdout, result.stdout


def test_offline_checks_the_files_alone(tmp_path: Path) -> None:
    result = check(tmp_path, "--offline", EVM_UPSTREAM=f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 0 and "upstreams not tried" in result.stdout and "FAIL" not in result.stdout


@pytest.fixture
async def bent_upstream(anvil: Anvil) -> AsyncIterator[str]:
    """In front of Anvil: `/moved` redirects every call to it (307), `/gzip` relays its answers
    gzip-compressed whatever Accept-Encoding asked. aiohttp follows and inflates both; serve does not."""

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(anvil.url)

    async def gzipped(request: web.Request) -> web.Response:
        async with (
            aiohttp.ClientSession() as session,
            session.post(anvil.url, data=await request.read(), headers={"Content-Type": "application/json"}) as node,
        ):
            body = await node.read()
        return web.Response(
            body=gzip.compress(body), headers={"Content-Encoding": "gzip"}, content_type="application/json"
        )

    app = web.Application()
    app.router.add_post("/moved", moved)
    app.router.add_post("/gzip", gzipped)
    server = await fake_server(app)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


async def test_check_refuses_what_serve_cannot_use_a_redirect_or_a_compressed_answer(
    bent_upstream: str, tmp_path: Path
) -> None:
    # spec: check's requests are serve's (no redirect followed, Accept-Encoding: identity, no Content-Encoding).
    upstreams = f"{bent_upstream}/moved,{bent_upstream}/gzip"
    result = await asyncio.to_thread(check, tmp_path, EVM_UPSTREAM=upstreams)
    assert result.returncode == 1, result.stdout
    assert "FAIL network evm upstream #0" in result.stdout and "HTTP 307" in result.stdout
    assert "FAIL network evm upstream #1" in result.stdout and "Content-Encoding 'gzip'" in result.stdout


def test_redis_is_tried_a_wrong_password_is_a_problem_and_no_password_is_printed(
    anvil: Anvil, tmp_path: Path, locked_redis: RedisServer
) -> None:
    """Rule: check tries REDIS_URL as serve will use it (a wrong password only shows once a command
    is sent: serve starts and bypasses Redis), and prints neither the password nor the URL's path."""
    base = f"127.0.0.1:{locked_redis.port}"
    good = check(tmp_path, EVM_UPSTREAM=anvil.url, REDIS_URL=f"redis://:{SECRET}@{base}/0")
    assert good.returncode == 0, good.stdout + good.stderr
    assert f"ok   redis REDIS_URL redis://<credentials>@{base}/<redacted>: PONG" in good.stdout
    wrong = check(tmp_path, EVM_UPSTREAM=anvil.url, REDIS_URL=f"redis://:wrong-{SECRET}@{base}/0")
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert f"FAIL redis REDIS_URL redis://<credentials>@{base}/<redacted>: " in wrong.stdout
    assert "authentication" in wrong.stdout or "WRONGPASS" in wrong.stdout, wrong.stdout
    dead = check(tmp_path, EVM_UPSTREAM=anvil.url, REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    assert dead.returncode == 1 and "unreachable" in dead.stdout, dead.stdout
    for result in (good, wrong, dead):
        assert SECRET not in result.stdout + result.stderr


def test_a_cluster_url_check_cannot_use_is_a_problem_line_not_a_traceback(
    anvil: Anvil, tmp_path: Path, locked_redis: RedisServer
) -> None:
    """Rule: check reports a `redis+cluster://` URL it cannot use (a wrong password, a server without
    cluster mode, nothing listening) as a FAIL line, then the upstreams, exit 1: never a traceback."""
    base = f"127.0.0.1:{locked_redis.port}"
    for url, why in (
        (f"redis+cluster://:wrong-{SECRET}@{base}", "authentication refused"),
        (f"redis+cluster://:{SECRET}@{base}", "cluster mode is not enabled"),
        (f"redis+cluster://127.0.0.1:{free_port()}", "unreachable"),
    ):
        result = check(tmp_path, EVM_UPSTREAM=anvil.url, REDIS_URL=url)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
        assert "FAIL redis REDIS_URL redis+cluster://" in result.stdout and why in result.stdout, result.stdout
        assert "ok   network evm upstream #0" in result.stdout and SECRET not in result.stdout + result.stderr


def test_a_misspelt_setting_in_the_environment_is_a_problem_and_open_mode_is_said(tmp_path: Path) -> None:
    """Rule: a name in the environment that is a setting's near twin (API_KEY for API_KEYS, as
    Compose's env_file or Kubernetes' envFrom deliver it) is a problem: serve would ignore it and, here,
    run open. check names it (never its value) and says the proxy runs open; other names pass."""
    upstream = f"http://127.0.0.1:{free_port()}"
    result = check(tmp_path, "--offline", EVM_UPSTREAM=upstream, API_KEY=SECRET, HOSTNAME="box", REDIS_HOST="r")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL environment: not settings (misspelt?), serve ignores them: API_KEY (API_KEYS?)" in result.stdout
    assert "note open mode:" in result.stdout and SECRET not in result.stdout + result.stderr
    assert misspelt(["api_keys", "Redis_Url", "HOSTNAME", "PATH"]) == ["Redis_Url (REDIS_URL?)", "api_keys (API_KEYS?)"]
    keyed = check(tmp_path, "--offline", EVM_UPSTREAM=upstream, API_KEYS=SECRET, HOSTNAME="box")
    assert keyed.returncode == 0 and "open mode" not in keyed.stdout and "FAIL" not in keyed.stdout, keyed.stdout


def test_a_setting_in_the_environment_wrapped_in_quotes_is_a_problem_named_never_shown(tmp_path: Path) -> None:
    """Rule (docs/configuration/index.md, `docker run --env-file`): docker keeps a .env line's quotes
    as part of the value, so `API_KEYS="k"` served the key `"k"`, quotes included, and `check` passed
    (outside attack). A setting wrapped in quotes is a problem for `check`, by name only; `.env`'s own
    quotes, which the proxy drops, are not."""
    upstream = f"http://127.0.0.1:{free_port()}"
    result = check(tmp_path, "--offline", EVM_UPSTREAM=upstream, API_KEYS=f'"{SECRET}"', HOSTNAME="'box'")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL environment: values wrapped in quotes, which serve takes as part of them: API_KEYS (" in result.stdout
    assert SECRET not in result.stdout + result.stderr and "HOSTNAME" not in result.stdout
    (tmp_path / ".env").write_text(f'API_KEYS="{SECRET}"\n')
    (tmp_path / ".env").chmod(0o600)
    unquoted = check(tmp_path, "--offline", EVM_UPSTREAM=upstream)
    assert unquoted.returncode == 0 and "FAIL" not in unquoted.stdout, unquoted.stdout
    refused = check(tmp_path, "--offline", EVM_UPSTREAM=f'"{upstream}"')  # refused first: said why
    assert refused.returncode == 2 and "(wrapped in quotes, taken as part of the value: EVM_UPSTREAM)" in refused.stderr


@pytest.mark.parametrize("offline", [True, False])
def test_names_in_dotenv_that_are_no_setting_are_a_problem(offline: bool, tmp_path: Path) -> None:
    """Rule: check reports the .env names serve ignores (a misspelt setting would keep its default)."""
    (tmp_path / ".env").write_text(
        "PROXY_PROT=9000\nREDIS_URLL=redis://127.0.0.1:1\nLOG_FORMAT=text\nbody_timeout=5\nMY_OWN=1\n"
    )
    args = ("--offline",) if offline else ()
    result = check(tmp_path, *args, EVM_UPSTREAM=f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 1, result.stderr
    # Each near twin named, as the environment's are (a .env typo got no hint).
    assert (
        "FAIL .env: not settings, serve ignores them: MY_OWN, PROXY_PROT (PROXY_PORT?), REDIS_URLL (REDIS_URL?), "
        "body_timeout (BODY_TIMEOUT?)"
    ) in result.stdout, result.stdout


def test_check_prints_each_evm_networks_verify_mode(tmp_path: Path) -> None:
    """Rule: the effective configuration shows what VERIFY_ANSWERS (or a networks file's `verify`)
    made of each EVM network, so `off` and the default `auto` do not print alike."""
    upstream = f"http://127.0.0.1:{free_port()}"
    off = check(tmp_path, "--offline", EVM_UPSTREAM=upstream, VERIFY_ANSWERS="off")
    default = check(tmp_path, "--offline", EVM_UPSTREAM=upstream)
    assert "'verify': 'off'" in off.stdout and "'verify': 'auto'" in default.stdout, off.stdout + default.stdout


def test_a_silent_upstream_is_said_to_have_timed_out_naming_the_setting(tmp_path: Path) -> None:
    """Rule: a timeout is no empty `unreachable ()`: it says how long and which setting bounds it."""
    with socket.socket() as silent:  # accepts (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        result = check(tmp_path, EVM_UPSTREAM=url, UPSTREAM_TIMEOUT="1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        f"FAIL network evm upstream #0 {url}: timed out after 1s (UPSTREAM_TIMEOUT, at most 10s in check)"
        in result.stdout
    )


@pytest.mark.parametrize("scheme", ["redis+sentinel", "redis"])
def test_a_silent_redis_is_one_fail_line_within_the_timeout_not_minutes(
    scheme: str, anvil: Anvil, tmp_path: Path
) -> None:
    """Rule (docs/commands.md: at most 10 s for each upstream or Redis): a Sentinel or server that takes
    connections and never answers is one FAIL line, tried once. A silent Sentinel took about 12
    timeouts (redis-py's retries, then its master lookup), nearly 2 minutes at the default; with keys
    the ledger's policy was asked of it again after."""
    with socket.socket() as silent:  # accepts (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        url = f"{scheme}://127.0.0.1:{port}" + ("/mymaster" if scheme == "redis+sentinel" else "")
        started = time.monotonic()
        result = check(tmp_path, EVM_UPSTREAM=anvil.url, REDIS_URL=url, UPSTREAM_TIMEOUT="2", API_KEYS=SECRET)
        took = time.monotonic() - started
        silent.setblocking(False)
        tried = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                silent.accept()[0].close()
                tried += 1
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL redis REDIS_URL" in result.stdout and "no answer in 2s" in result.stdout, result.stdout
    assert tried == 1, f"{tried} connections to the silent Redis"
    assert took < 15, f"{took:.1f}s"  # one 2 s wait and the start; it was 25 s at UPSTREAM_TIMEOUT=2


def test_a_websocket_upstream_at_the_proxys_own_address_is_a_loop(tmp_path: Path) -> None:
    """Rule: a ws(s) upstream at this proxy's own HOST and PROXY_PORT is named a loop, as an http(s) one."""
    port = free_port()
    result = check(
        tmp_path,
        "--offline",
        PROXY_PORT=str(port),
        EVM_UPSTREAM="http://127.0.0.1:1",
        EVM_UPSTREAM_WS=f"ws://localhost:{port}",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"WebSocket upstream #0 ws://localhost:{port}: this proxy's own address" in result.stdout


def test_a_websocket_upstream_of_another_chain_fails_the_check(anvil: Anvil, tmp_path: Path) -> None:
    """Rule (README, one chain per network): a WebSocket upstream's chain id and genesis are asked, as
    serve asks them on each connection, and held to the network's HTTP upstreams'."""
    ws = anvil.url.replace("http://", "ws://")
    same = check(tmp_path, EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=ws)
    assert same.returncode == 0, same.stdout + same.stderr
    assert f"WebSocket upstream #0 {ws}: chain id 31337, genesis 0x" in same.stdout, same.stdout
    other = Anvil("--chain-id", "5")
    try:
        result = check(tmp_path, EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=other.url.replace("http://", "ws://"))
    finally:
        other.stop()
    assert result.returncode == 1, result.stdout + result.stderr
    assert "WebSocket upstream #0" in result.stdout and "chain id 5 differs" in result.stdout, result.stdout


async def test_a_websocket_upstream_that_never_tells_its_chain_fails_the_check_as_serve_refuses_it(
    anvil: Anvil, tmp_path: Path
) -> None:
    """Rule: a WebSocket upstream that takes the handshake and answers nothing is no upstream of the
    network's chain: check says so, as serve, which waits IDENTITY_WAIT for it, does not use it."""

    async def silent(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for _ in ws:  # reads, answers nothing
            pass
        return ws

    app = web.Application()
    app.router.add_get("/", silent)
    server = await fake_server(app)
    try:
        ws_url = str(server.make_url("/")).replace("http://", "ws://")
        result = await asyncio.to_thread(check, tmp_path, EVM_UPSTREAM=anvil.url, EVM_UPSTREAM_WS=ws_url)
    finally:
        await server.close()
    assert result.returncode == 1, result.stdout + result.stderr
    assert "handshake accepted; it did not tell its chain identity" in result.stdout, result.stdout


def test_a_silent_websocket_upstream_is_said_to_have_timed_out_naming_the_setting(tmp_path: Path) -> None:
    """Rule: a WebSocket handshake that times out says how long and which setting bounds it."""
    with socket.socket() as silent:  # accepts (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"ws://127.0.0.1:{silent.getsockname()[1]}"
        result = check(tmp_path, EVM_UPSTREAM="http://127.0.0.1:1", EVM_UPSTREAM_WS=url, UPSTREAM_TIMEOUT="1")
    assert (
        f"WebSocket upstream #0 {url}: handshake timed out after 1s (UPSTREAM_TIMEOUT, at most 10s in check)"
        in result.stdout
    ), result.stdout


@pytest.mark.parametrize("offline", [True, False])
def test_an_upstream_at_the_proxys_own_address_is_a_loop(offline: bool, tmp_path: Path) -> None:
    port = free_port()
    args = ("--offline",) if offline else ()
    result = check(tmp_path, *args, PROXY_PORT=str(port), EVM_UPSTREAM=f"http://localhost:{port}", UPSTREAM_TIMEOUT="1")
    assert result.returncode == 1 and f"upstream #0 http://localhost:{port}: this proxy's own address" in result.stdout


def test_a_node_on_the_proxys_own_port_is_one_fail_line_not_also_an_ok(anvil: Anvil, tmp_path: Path) -> None:
    # The quickstart's clash (node and proxy on 8545): its FAIL line was followed by "ok ... batch accepted".
    port = urlsplit(anvil.url).port
    result = check(tmp_path, PROXY_PORT=str(port), EVM_UPSTREAM=anvil.url, UPSTREAM_TIMEOUT="2")
    assert result.returncode == 1 and "this proxy's own address" in result.stdout, result.stdout
    assert "ok   network evm upstream #0" not in result.stdout and "1 problem(s)" in result.stdout, result.stdout


def test_a_near_miss_of_a_known_method_or_client_ip_header_is_a_warning_not_an_error(tmp_path: Path) -> None:
    """Rule: allowed_methods `eth_cal` and TRUSTED_PROXY_HEADER `X-Forwarded-Fro` look like typos:
    said, naming the near twin; an unknown method unlike any stays silent (it may be the node's own)."""
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[keys.alice]\nkey = "alice-secret-1"\nallowed_methods = ["eth_cal", "eth_chainId", "acme_quote"]\n'
    )
    keys.chmod(0o600)
    settings = {"API_KEYS_FILE": str(keys), "TRUSTED_PROXY_HEADER": "X-Forwarded-Fro"}
    result = check(tmp_path, "--offline", EVM_UPSTREAM="http://127.0.0.1:1", **settings)
    assert result.returncode == 0, result.stdout + result.stderr
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warn ")]
    assert warnings == [
        "warn API_KEYS_FILE: key 'alice': allowed_methods 'eth_cal' is no known method (eth_call?)",
        "warn TRUSTED_PROXY_HEADER 'X-Forwarded-Fro' is not X-Forwarded-For, which it resembles (a typo?)",
    ]


def test_a_near_miss_is_suggested_only_within_the_names_family_and_namespace(tmp_path: Path) -> None:
    """Rule: real names of clients' and providers' namespaces (Otterscan ots_, Arbitrum arbtrace_,
    Alchemy's eth_getAccountInfo) are no typo; a name is compared only with its own kind: an `ns_`
    name with its namespace's names (any EVM name when the namespace is unknown), a camelCase name
    with Solana's. `eth_cal` and `eht_call` still warn."""
    real = ["ots_getTransactionBySenderAndNonce", "arbtrace_block", "arbtrace_transaction", "eth_getAccountInfo"]
    real += ["ots_getBlockDetails", "erigon_getHeaderByNumber", "bor_getAuthor", "alchemy_getAssetTransfers"]
    other_kind = ["getBlockByNumber", "eth_getSignaturesForAddress"]  # near eth_getBlockByNumber, a Solana name
    keys = tmp_path / "keys.toml"
    listed = ", ".join(f'"{m}"' for m in [*real, *other_kind, "eth_cal", "eht_call"])
    keys.write_text(f'[keys.alice]\nkey = "alice-secret-1"\nallowed_methods = [{listed}]\n')
    keys.chmod(0o600)
    result = check(tmp_path, "--offline", EVM_UPSTREAM="http://127.0.0.1:1", API_KEYS_FILE=str(keys))
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warn ")]
    assert warnings == [
        "warn API_KEYS_FILE: key 'alice': allowed_methods 'eht_call' is no known method (eth_call?)",
        "warn API_KEYS_FILE: key 'alice': allowed_methods 'eth_cal' is no known method (eth_call?)",
    ], result.stdout


def test_a_real_method_the_proxy_has_no_policy_for_is_never_a_near_miss(tmp_path: Path) -> None:
    """Rule: allowed_methods names that nodes serve (Solana's getBlocks, getTransactionCount, the
    execution API's eth_getRawTransactionByHash, debug_ and trace_ names) are no typo of another; a
    near miss of such a name is."""
    real = ["getBlocks", "getTokenLargestAccounts", "getTransactionCount", "eth_getRawTransactionByHash"]
    real += ["debug_traceTransaction", "trace_block", "txpool_status", "engine_newPayloadV3", "slotSubscribe"]
    keys = tmp_path / "keys.toml"
    listed = ", ".join(f'"{m}"' for m in [*real, "getTokenLargestAcounts"])
    keys.write_text(f'[keys.alice]\nkey = "alice-secret-1"\nallowed_methods = [{listed}]\n')
    keys.chmod(0o600)
    result = check(tmp_path, "--offline", EVM_UPSTREAM="http://127.0.0.1:1", API_KEYS_FILE=str(keys))
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warn ")]
    assert warnings == [
        "warn API_KEYS_FILE: key 'alice': allowed_methods 'getTokenLargestAcounts' is no known method "
        "(getTokenLargestAccounts?)"
    ], result.stdout
