"""What an operator meets running the real command: every stderr line in LOG_FORMAT (the proxy's,
aiohttp's, asyncio's and the CLI's own), a logged shutdown, settings from ./.env under the
environment, and subcommand help that lists the subcommand's own options."""

from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import KEYS_USAGE_OPTIONS, parse_dotenv
from proxy.config import OPTIONS, ConfigError
from proxy.file_trust import trust_problem
from tests.support import ROOT, Anvil, free_port, healthy, wait_until

# logfmt: key=value pairs, a value bare or double-quoted with backslash escapes, nothing else.
LOGFMT = re.compile(r'^[a-z_]+=(?:[^\s="\\]+|"(?:[^"\\]|\\.)*")(?: [a-z_]+=(?:[^\s="\\]+|"(?:[^"\\]|\\.)*"))*$')
CALL = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId"}


def clean_env(**settings: str) -> dict[str, str]:
    """The process environment without any of the proxy's settings, plus `settings`."""
    names = {o.env for o in OPTIONS}
    return {**{k: v for k, v in os.environ.items() if k not in names}, **settings}


def parsed(line: str, fmt: str) -> dict[str, Any]:
    """A stderr line read back as its format says; fails on a line in any other shape."""
    if fmt == "json":
        return dict(json.loads(line))
    assert LOGFMT.match(line), f"not a key=value line: {line!r}"
    return {
        m.group(1): json.loads(m.group(2)) if m.group(2).startswith('"') else m.group(2)
        for m in re.finditer(r'([a-z_]+)=("(?:[^"\\]|\\.)*"|\S+)', line)
    }


def run_then_sigterm(env: Mapping[str, str], cwd: Path, port: int) -> tuple[int, list[str]]:
    """`python -m proxy` serving a call and a malformed request, then SIGTERM: exit code, stderr lines."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy"],
        env=dict(env),
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: healthy(port) or proc.poll() is not None, 20, "the proxy to listen")
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v3/k", json.dumps(CALL).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read())["result"] == "0x7a69"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # the fast server logs this one
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            sock.recv(1024)
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    return proc.returncode, err.splitlines()


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_every_stderr_line_follows_log_format_whoever_writes_it(
    fmt: str, event_loop: str, anvil: Anvil, tmp_path: Path
) -> None:
    port = free_port()
    env = clean_env(
        EVM_UPSTREAM=anvil.url,
        PROXY_PORT=str(port),
        LOG_FORMAT=fmt,
        LOG_LEVEL="DEBUG",
        ACCESS_LOG="true",
        HEAD_POLL_INTERVAL="0.5",
        EVENT_LOOP=event_loop,
    )
    code, lines = run_then_sigterm(env, tmp_path, port)
    assert code == 0
    records = [parsed(line, fmt) for line in lines]  # every line, none skipped
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    loggers = {r["logger"] for r in records}
    # The proxy's startup warning, the fast server's lines, the access log, the shutdown; and asyncio's
    # own lines where its loop writes some (its selector, at DEBUG): uvloop writes none of its own.
    assert any(r["logger"] == "proxy" and "running open" in r["msg"] for r in records)
    expected = {"proxy.front", "proxy.access", "proxy.listeners"} | ({"asyncio"} if event_loop == "asyncio" else set())
    assert expected <= loggers, loggers


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_configuration_error_is_one_line_in_log_format(fmt: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "proxy"],
        env=clean_env(LOG_FORMAT=fmt),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    record = parsed(line, fmt)
    assert record["level"] == "error" and record["msg"].startswith("configuration error: no upstream configured")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_taken_port_is_one_line_in_log_format_with_or_without_workers(workers: str, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = clean_env(
            LOG_FORMAT="json",
            WORKERS=workers,
            EVM_UPSTREAM="http://127.0.0.1:1",
            PROXY_PORT=str(taken.getsockname()[1]),
        )
        result = subprocess.run(
            [sys.executable, "-m", "proxy"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 1
    records = [parsed(line, "json") for line in result.stderr.splitlines()]
    assert any(r["level"] == "error" and r["msg"].startswith("cannot listen on 127.0.0.1:") for r in records)


def test_a_proxy_host_that_does_not_resolve_is_named_with_why_not_an_unknown_error(tmp_path: Path) -> None:
    """Rule: a failed bind names the listener and the reason in words: getaddrinfo's negative codes
    are no errno (os.strerror(-2) is "Unknown error -2")."""
    env = clean_env(
        LOG_FORMAT="json", EVM_UPSTREAM="http://127.0.0.1:1", PROXY_HOST="no-such-host.invalid", PROXY_PORT="8545"
    )
    result = subprocess.run(
        [sys.executable, "-m", "proxy"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    errors = [r["msg"] for r in (parsed(line, "json") for line in result.stderr.splitlines()) if r["level"] == "error"]
    assert any(
        m.startswith("cannot listen on no-such-host.invalid:8545") and "does not resolve" in m for m in errors
    ), errors
    assert not any("Unknown error" in m for m in errors), errors


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_keys_usage_with_an_unusable_ledger_redis_speaks_in_log_format(
    fmt: str,
    tmp_path: Path,
    redis_url: str,
) -> None:
    # A cluster URL that names a plain server: redis-py's cluster error is an outage, not a traceback.
    cluster_url = "redis+cluster://" + redis_url.split("://", 1)[1].rsplit("/", 1)[0]
    env = clean_env(LOG_FORMAT=fmt, API_KEYS="k1", REDIS_URL=cluster_url)
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "keys", "usage"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    records = [parsed(line, fmt) for line in result.stderr.splitlines()]
    assert records and records[-1]["msg"].startswith("the credit ledger's redis is unreachable")


def test_sigterm_logs_the_shutdown_and_when_the_drain_is_over(anvil: Anvil, tmp_path: Path) -> None:
    port = free_port()
    env = clean_env(EVM_UPSTREAM=anvil.url, PROXY_PORT=str(port), LOG_FORMAT="json", SHUTDOWN_TIMEOUT="7")
    code, lines = run_then_sigterm(env, tmp_path, port)
    assert code == 0
    messages = [json.loads(line)["msg"] for line in lines]
    (received,) = [m for m in messages if m.startswith("SIGTERM received")]
    assert "up to 7s (SHUTDOWN_TIMEOUT)" in received
    assert messages[-1].startswith("shut down in ") and "drained" in messages[-1]  # the last line written
    assert messages.index(received) < len(messages) - 1


def test_settings_come_from_dotenv_under_the_environment(tmp_path: Path) -> None:
    # The shipped .env.example, copied to .env as docs/configuration/index.md says; the environment overrides two of it.
    shutil.copy(ROOT / ".env.example", tmp_path / ".env")
    port = free_port()
    env = clean_env(PROXY_PORT=str(port), LOG_FORMAT="json", WORKER="2")  # .env says 8545 and text; WORKER: a typo
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # It starts: EVM_UPSTREAM (required) came from .env; it listens on the environment's port.
        wait_until(lambda: healthy(port) or proc.poll() is not None, 20, "the proxy to listen")
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    records = [json.loads(line) for line in err.splitlines()]  # LOG_FORMAT from the environment
    (note,) = [r["msg"] for r in records if r["msg"].startswith("settings from .env")]
    named = set(note.split(": ", 1)[1].split(" (")[0].split(", "))
    assert "EVM_UPSTREAM" in named and "PROXY_PORT" not in named and "LOG_FORMAT" not in named
    assert not any(r["msg"].startswith("ignored in .env") for r in records)  # every name in it is a setting
    # A setting's near twin in the environment is named (never its value) and ignored.
    assert "in the environment, not settings (misspelt?), ignored: WORKER (WORKERS?)" in [r["msg"] for r in records]


def test_an_empty_value_is_a_setting_left_unset_in_the_environment_and_in_a_flag(tmp_path: Path) -> None:
    """Rule (docs/configuration/index.md): a setting given an empty value, in the environment or a
    flag, is the same as one left unset: the source below it gives the setting (.env, the environment)."""
    (tmp_path / ".env").write_text("PROXY_PORT=59512\nEVM_UPSTREAM=http://127.0.0.1:1\n")

    def port(*flags: str, **environment: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "proxy", *flags, "check", "--offline"],
            env=clean_env(**environment),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        (line,) = [line.strip() for line in result.stdout.splitlines() if line.strip().startswith("port = ")]
        return line

    assert port(PROXY_PORT="") == "port = 59512"  # .env's, not the default 8545
    assert port(PROXY_PORT=" ") == "port = 59512"
    assert port("--proxy-port=", PROXY_PORT="59513") == "port = 59513"  # the environment's
    assert port("--proxy-port=59514", PROXY_PORT="59513") == "port = 59514"  # a flag still wins


def test_no_dotenv_reads_nothing(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "proxy"], env=clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2 and "no upstream configured" in result.stderr


def refused(cwd: Path, **settings: str) -> str:
    """Run the command expecting a configuration error: its one stderr line."""
    result = subprocess.run(
        [sys.executable, "-m", "proxy"], env=clean_env(**settings), cwd=cwd, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    return line


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file to another user")
def test_a_dotenv_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    # Issue 19, item 9: a .env planted in the start directory opened anvil_ and added a rich key.
    dotenv = tmp_path / ".env"
    dotenv.write_text("EVM_UPSTREAM=http://127.0.0.1:1\nALLOW_NAMESPACES=anvil\nAPI_KEYS=planted\n")
    os.chown(dotenv, 12345, 12345)
    line = refused(tmp_path)
    assert "configuration error: .env:" in line and "owned by uid 12345" in line and "refused" in line


def test_a_keys_file_writable_by_others_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.a]\nkey = "secret-a"\n')
    keys.chmod(0o666)
    line = refused(tmp_path, EVM_UPSTREAM="http://127.0.0.1:1", API_KEYS_FILE=str(keys))
    assert "API_KEYS_FILE:" in line and "writable by other users" in line and "secret-a" not in line
    keys.chmod(0o600)  # the same file, owned and writable by the proxy's user alone, is read
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "keys", "usage"],
        timeout=30,
        capture_output=True,
        text=True,
        env=clean_env(API_KEYS_FILE=str(keys), REDIS_URL="redis://127.0.0.1:1"),
    )
    assert "writable" not in result.stderr


class TestTrustedFiles:
    def test_owner_and_mode_decide(self) -> None:
        decide = functools.partial(trust_problem, euid=1000, egid=1000, read_only=False)
        assert decide(0o100600, 1000, 1000) is None and decide(0o100644, 0, 0) is None
        assert decide(0o100664, 1000, 1000) is None  # a private group's own file
        assert "owned by uid 1001" in str(decide(0o100600, 1001, 1000))
        assert "other users" in str(decide(0o100602, 1000, 1000))
        assert "group 50" in str(decide(0o100620, 1000, 50))

    def test_a_read_only_mount_is_trusted_whoever_owns_it(self) -> None:
        assert trust_problem(0o100644, 1001, 1001, euid=10001, egid=10001, read_only=True) is None


class TestDotenvParsing:
    def test_names_values_quotes_export_and_comments(self) -> None:
        text = "# a comment\n\nEVM_UPSTREAM=http://a:1,http://b:2\nexport LOG_FORMAT=\"json\"\nX='a b'\nY=v # kept\n"
        assert parse_dotenv(text) == {
            "EVM_UPSTREAM": "http://a:1,http://b:2",
            "LOG_FORMAT": "json",
            "X": "a b",
            "Y": "v # kept",
        }

    def test_a_malformed_line_is_named_by_number_never_echoed(self) -> None:
        with pytest.raises(ConfigError, match=r"^\.env line 2 is not NAME=value$"):
            parse_dotenv("A=1\nsecret-sk-123 oops\n")
        with pytest.raises(ConfigError, match=r"^\.env line 1 is not NAME=value \(no spaces around =: "):
            parse_dotenv("BODY_TIMEOUT = 30\n")

    def test_a_setting_given_twice_is_refused_naming_both_lines_never_the_values(self) -> None:
        """Rule: each name once: the last silently won, so an `API_KEYS=` appended ran the proxy open."""
        with pytest.raises(ConfigError, match=r"^\.env lines 1 and 3 both set API_KEYS: give each setting once$"):
            parse_dotenv("API_KEYS=sk-secret-1\n# later\nexport API_KEYS=\n")

    def test_lines_end_at_newlines_alone_as_docker_splits_them(self) -> None:
        """Rule: one physical line is one setting, as `docker run --env-file` reads it: splitlines()
        also split at a form feed, so `API_KEYS=k1<FF>WORKERS=3` set WORKERS here alone."""
        for odd in ("\x0c", "\x0b", "\x1c", "\x85", "\u2028"):
            parsed = parse_dotenv(f"API_KEYS=k1{odd}WORKERS=3\r\nLOG_FORMAT=json\n")
            assert parsed == {"API_KEYS": f"k1{odd}WORKERS=3", "LOG_FORMAT": "json"}

    def test_a_leading_byte_order_mark_is_dropped_as_docker_drops_it(self) -> None:
        """Rule: a file saved as UTF-8 "with BOM" reads as without it (it was 'line 1 is not NAME=value')."""
        assert parse_dotenv("\ufeffEVM_UPSTREAM=http://a:1\nLOG_FORMAT=json\n") == {
            "EVM_UPSTREAM": "http://a:1",
            "LOG_FORMAT": "json",
        }


def test_keys_usage_help_lists_its_own_options_only() -> None:
    script = Path(sys.executable).parent / "rpc-proxy"
    usage = subprocess.run([script, "keys", "usage", "--help"], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 0
    flags = set(re.findall(r"--[a-z][a-z0-9-]+", usage.stdout)) - {"--help"}
    assert flags == {o.flag for o in OPTIONS if o.env in KEYS_USAGE_OPTIONS} | {"--metrics-url"}
    serve = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, timeout=30)
    assert {o.flag for o in OPTIONS} <= set(re.findall(r"--[a-z][a-z0-9-]+", serve.stdout))


def bound_in(sock: socket.socket, ports: range) -> int:
    """Bind `sock` on 127.0.0.1 to a free port of `ports`, from a random start; the port."""
    start = random.randrange(len(ports))
    for offset in range(len(ports)):
        port = ports[(start + offset) % len(ports)]
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return port
    raise OSError("no free port in range")


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("setting", ["METRICS_PORT", "ADMIN_PORT"])
def test_a_taken_internal_port_is_named_not_the_public_one(setting: str, workers: str, tmp_path: Path) -> None:
    """Rule: a bind error names the listener and address that failed (METRICS_PORT, ADMIN_PORT)."""
    with socket.socket() as taken, socket.socket() as public:
        port, proxy_port = (bound_in(sock, range(52000, 53000)) for sock in (taken, public))
        taken.listen()
        public.close()  # free again for the proxy: only the internal port is taken
        env = clean_env(
            LOG_FORMAT="json",
            WORKERS=workers,
            EVM_UPSTREAM="http://127.0.0.1:1",
            PROXY_PORT=str(proxy_port),
            ADMIN_TOKEN="Adm1n-T0ken-For-Tests",
            **{setting: str(port)},
        )
        result = subprocess.run(
            [sys.executable, "-m", "proxy"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 1, result.stderr
    errors = [
        r["msg"] for r in map(lambda line: parsed(line, "json"), result.stderr.splitlines()) if r["level"] == "error"
    ]
    assert f"cannot listen on 127.0.0.1:{port} ({setting}): Address already in use" in errors, errors


def test_serve_logs_a_trusted_proxy_header_near_a_known_one_as_a_warning_and_starts(
    anvil: Anvil, tmp_path: Path
) -> None:
    """Rule: what `rpc-proxy check` says as `warn` (config.doubts) serve logs at WARNING, then serves."""
    port = free_port()
    env = clean_env(EVM_UPSTREAM=anvil.url, PROXY_PORT=str(port), LOG_FORMAT="json", TRUSTED_PROXY_HEADER="X-Real-Ip2")
    code, lines = run_then_sigterm(env, tmp_path, port)
    assert code == 0
    records = [json.loads(line) for line in lines]
    assert any(r["level"] == "warning" and "is not X-Real-IP, which it resembles" in r["msg"] for r in records)
