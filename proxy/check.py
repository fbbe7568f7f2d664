"""`rpc-proxy check`: every setting and file read as `serve` reads them, each upstream tried, and the
effective configuration printed with its secrets redacted. Exit 0: all is well; 1: a problem, each
named (a name in ./.env that is no setting, which serve ignores, among them); 2: a configuration
error (as `serve` exits). `--offline` checks the settings and files only.

Per upstream (HTTP), asked with serve's own client (no redirect followed, no compressed answer read):
it answers, its chain id (EVM) and genesis hash, both equal to the other upstreams' of its network,
a chain id equal to a declared `chain_id`, and a batch of two calls accepted (the proxy batches calls
to upstreams). A WebSocket upstream: its handshake, and an EVM one's chain identity, equal to the
network's upstreams'. Redis (REDIS_URL, CREDITS_REDIS_URL): a PING answered, its password taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError, ResponseError

from proxy.config import Network, Settings, doubts
from proxy.credits.ledger_storage import eviction_problem
from proxy.credits.prices import METHOD_CREDITS
from proxy.redis_link import connect, memory_policies
from proxy.rpc import jsonrpc
from proxy.upstream.http_client import ClientFault, HostPool, TooLarge, Unreadable
from proxy.upstream.scrubbing import scrub_text, secrets_of
from proxy.upstream.standing import parse_identity
from proxy.upstream.ws_identity import EVM_IDENTITY_CALLS, IDENTITY_WAIT, told
from proxy.workers.context import NoRunDirectory, run_directory

REDACTED = "<redacted>"
CHECK_WAIT = 10.0  # seconds check waits for one upstream or Redis at most (UPSTREAM_TIMEOUT when less)


def redact_url(url: str) -> str:
    """A URL fit to print: scheme, host and port; its credentials, every path segment and the whole
    query replaced (providers put the key in any of them, and a short one, `/v2/abc123` or a bare
    `?KEY`, is a key all the same)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return REDACTED
    host = parts.hostname or ""
    netloc = (
        ("<credentials>@" if "@" in parts.netloc else "")
        + (f"[{host}]" if ":" in host else host)
        + (f":{port}" if port else "")
    )
    path = "/".join(REDACTED if s else s for s in parts.path.split("/"))
    return f"{parts.scheme}://{netloc}{path}" + (f"?{REDACTED}" if parts.query else "")


def _shown(name: str, value: Any) -> Any:
    """One setting's value as printed: URLs redacted, tokens hidden, networks and keys summarised."""
    if value is None:
        return None
    if name == "admin_token":
        return REDACTED
    if name.endswith("_url") and isinstance(value, str):
        return redact_url(value)
    if name == "networks":
        return [_network(n) for n in value]
    if name == "api_keys":
        return {
            account: {
                "daily_credits": k.daily_credits,
                "credits_per_second": k.credits_per_second,
                "allow_lists": k.lists.any,
            }
            for account, k in value.items()
        }
    if name == "method_credits":  # the built-in table is long: only what CREDITS_FILE changed
        return {m: c for m, c in value.items() if METHOD_CREDITS.get(m) != c}
    if name == "keys_source":  # API_KEYS holds the secrets themselves: only whether it is set
        return {k: REDACTED if k == "API_KEYS" else v for k, v in value.items()}
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value


def _network(network: Network) -> dict[str, Any]:
    def headers(pairs: tuple[tuple[str, str], ...]) -> dict[str, str]:
        return {name: REDACTED for name, _ in pairs}

    return {
        "name": network.name,
        "family": network.family,
        "chain_id": network.chain_id,
        "upstreams": [
            {"url": redact_url(u), **({"headers": headers(network.headers_of(i))} if network.headers_of(i) else {})}
            for i, u in enumerate(network.upstreams)
        ],
        "ws_upstreams": [
            {
                "url": redact_url(u),
                **({"headers": headers(network.ws_headers_of(i))} if network.ws_headers_of(i) else {}),
            }
            for i, u in enumerate(network.ws_upstreams)
        ],
        "hosts": list(network.hosts),
        "selection": network.selection,
        **({"verify": network.verify} if network.family == "evm" else {}),  # VERIFY_ANSWERS, or the file's
    }


def effective(settings: Settings) -> list[str]:
    """`name = value` per setting, secrets redacted."""
    lines = []
    for field in dataclasses.fields(settings):
        value = _shown(field.name, getattr(settings, field.name))
        lines.append(f"{field.name} = {value!r}")
    return lines


@dataclass(frozen=True, slots=True)
class Probe:
    """What one upstream answered: its chain id (EVM), genesis hash, and the problems found."""

    network: str
    label: str  # "upstream #0 https://host/<redacted>"
    chain_id: int | None = None
    genesis: str | None = None
    problems: tuple[str, ...] = ()


def _calls(family: str) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """(chain id call, genesis call, a batch of two) for a family."""
    if family == "evm":
        return (
            {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []},
            {"jsonrpc": "2.0", "id": 2, "method": "eth_getBlockByNumber", "params": ["0x0", False]},
            [
                {"jsonrpc": "2.0", "id": 3, "method": "eth_chainId", "params": []},
                {"jsonrpc": "2.0", "id": 4, "method": "eth_blockNumber", "params": []},
            ],
        )
    return (
        {},
        {"jsonrpc": "2.0", "id": 2, "method": "getGenesisHash", "params": []},
        [
            {"jsonrpc": "2.0", "id": 3, "method": "getGenesisHash", "params": []},
            {"jsonrpc": "2.0", "id": 4, "method": "getSlot", "params": []},
        ],
    )


async def _post(pool: HostPool, body: Any, timeout: float, limit: int) -> Any:
    """One call as serve posts it (proxy/upstream/http_client.py): no redirect followed, only an
    identity body read, under the reply bound. What serve could not use is a ValueError saying why."""
    try:
        response = await pool.post(jsonrpc.dumps(body), timeout, limit)
    except (Unreadable, TooLarge) as exc:
        raise ValueError(str(exc) if isinstance(exc, Unreadable) else f"a reply over {limit} bytes") from None
    if response.status != 200:
        where = " (a redirect: the proxy follows none; configure its target)" if 300 <= response.status < 400 else ""
        raise ValueError(f"HTTP {response.status}{where}")
    try:
        return jsonrpc.loads(response.body)
    except jsonrpc.JSONDecodeError:
        raise ValueError("reply is not JSON") from None


def _result(answer: Any, what: str) -> Any:
    if not isinstance(answer, dict) or "result" not in answer:
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else "no result"
        raise ValueError(f"{what}: {str(message)[:120]}")
    return answer["result"]


async def probe_http(network: Network, index: int, timeout: float, limit: int) -> Probe:
    """One HTTP upstream tried with serve's own client; its problems with the secrets it was configured
    with scrubbed (a provider's error may echo its key or token)."""
    url = network.upstreams[index]
    headers = network.headers_of(index)
    pool = HostPool(url, limit=1, idle_timeout=timeout, on_connect=lambda alone: None, headers=headers)
    try:
        probe = await _probe_http(pool, network, index, timeout, limit)
    finally:
        pool.close()
    secrets = secrets_of(url, headers)
    return dataclasses.replace(probe, problems=tuple(scrub_text(p, secrets) for p in probe.problems))


async def _probe_http(pool: HostPool, network: Network, index: int, timeout: float, limit: int) -> Probe:
    label = f"upstream #{index} {redact_url(network.upstreams[index])}"
    chain_call, genesis_call, batch = _calls(network.family)
    problems: list[str] = []
    chain_id = genesis = None
    try:
        if chain_call:
            chain_id = int(_result(await _post(pool, chain_call, timeout, limit), "eth_chainId"), 16)
        found = _result(await _post(pool, genesis_call, timeout, limit), "genesis")
        genesis = found.get("hash") if isinstance(found, dict) else found
    except (ClientFault, TimeoutError, ValueError) as exc:
        return Probe(network.name, label, problems=(_failure(exc, timeout),))
    if network.chain_id is not None and chain_id is not None and chain_id != network.chain_id:
        problems.append(f"chain id {chain_id}, but the network declares chain_id = {network.chain_id}")
    try:
        answers = await _post(pool, batch, timeout, limit)
        if not isinstance(answers, list) or len(answers) != 2 or any("result" not in a for a in answers):
            problems.append(f"a batch of two calls was not answered with two results: {UNBATCHED}")
    except (ClientFault, TimeoutError, ValueError) as exc:
        problems.append(f"a batch of two calls failed ({_failure(exc, timeout)}): {UNBATCHED}")
    return Probe(network.name, label, chain_id, genesis, tuple(problems))


# What a node that refuses batches costs: UPSTREAM_BATCH_MAX=1 does not help, since an answer's proof
# of its chain (the block's header) rides in its batch (pool.py _with_proofs).
UNBATCHED = "its answers would be served but never cached; point it at a node (or a provider plan) that takes batches"


def _failure(exc: Exception, timeout: float) -> str:
    """Why a post failed, in words: a silent upstream's timeout says so (its message is empty)."""
    if isinstance(exc, TimeoutError):
        return f"timed out after {timeout:g}s (UPSTREAM_TIMEOUT, at most {CHECK_WAIT:g}s in check)"
    if isinstance(exc, ValueError):
        return str(exc)
    return f"unreachable ({str(exc) or type(exc).__name__})"


async def probe_ws(session: aiohttp.ClientSession, network: Network, index: int, timeout: float) -> Probe:
    url = network.ws_upstreams[index]
    label = f"WebSocket upstream #{index} {redact_url(url)}"
    try:
        async with session.ws_connect(
            url, headers=dict(network.ws_headers_of(index)), timeout=aiohttp.ClientWSTimeout(ws_close=timeout)
        ) as ws:
            if network.family != "evm":  # Solana's pubsub socket serves subscriptions alone
                return Probe(network.name, label)
            # Its chain, as serve asks it on each connection (ws_identity.py): held to the others' (agreement).
            results = await told(ws, EVM_IDENTITY_CALLS, 1, min(timeout, IDENTITY_WAIT))  # as serve waits
            chain_id, genesis = results if results is not None else (None, None)
            seen = parse_identity(chain_id, genesis)
            if seen is None or not isinstance(genesis, dict):
                return Probe(network.name, label, problems=("handshake accepted; it did not tell its chain identity",))
            return Probe(network.name, label, seen.chain_id, genesis["hash"])  # as the HTTP probe has it
    except TimeoutError:  # a silent upstream: how long, and the setting that bounds it (as _failure)
        return Probe(
            network.name,
            label,
            problems=(f"handshake timed out after {timeout:g}s (UPSTREAM_TIMEOUT, at most {CHECK_WAIT:g}s in check)",),
        )
    except (aiohttp.ClientError, OSError) as exc:
        return Probe(network.name, label, problems=(f"handshake failed ({type(exc).__name__})",))


async def probe_all(settings: Settings) -> list[Probe]:
    seconds = min(settings.upstream_timeout, CHECK_WAIT)  # a silent host: not 30 s
    timeout = aiohttp.ClientTimeout(total=seconds)
    limit = settings.max_response_bytes
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        tasks = []
        for network in settings.networks:
            tasks += [probe_http(network, i, seconds, limit) for i in range(len(network.upstreams))]
            tasks += [probe_ws(session, network, i, timeout.total or 5.0) for i in range(len(network.ws_upstreams))]
        probes = list(await asyncio.gather(*tasks))
    return agreement(probes)


def agreement(probes: list[Probe]) -> list[Probe]:
    """Each network's upstreams must serve one chain: a chain id or genesis hash unlike those of the
    network's first upstream that answered is a problem of that upstream (pure)."""
    first: dict[str, Probe] = {}
    checked = []
    for probe in probes:
        if probe.genesis is None:
            checked.append(probe)
            continue
        expected = first.setdefault(probe.network, probe)
        differs = [
            f"{what} {mine} differs from the network's other upstreams' ({theirs}): another chain"
            for what, mine, theirs in (
                ("chain id", probe.chain_id, expected.chain_id),
                ("genesis hash", probe.genesis, expected.genesis),
            )
            if mine != theirs
        ]
        checked.append(dataclasses.replace(probe, problems=(*probe.problems, *differs)) if differs else probe)
    return checked


async def probe_redis(url: str, timeout: float) -> str | None:
    """What keeps the proxy from the Redis a URL names (None: it answered PING, its password taken):
    a wrong password only shows once a command is sent, so `serve` starts and then bypasses it."""
    client = connect(url, timeout)
    try:
        async with asyncio.timeout(timeout):  # the whole probe: a Sentinel's lookups are steps of their own
            await client.ping()
    except TimeoutError:
        return f"unreachable (no answer in {timeout:g}s: UPSTREAM_TIMEOUT, at most {CHECK_WAIT:g}s in check)"
    except RedisClusterException as exc:  # redis+cluster://: no node reached; why is its cause
        if "cluster mode is not enabled" in str(exc).lower():
            return "refused: cluster mode is not enabled on this server (redis+cluster:// needs a Redis Cluster)"
        return _redis_problem(exc.__cause__ or exc)
    except (RedisError, OSError) as exc:
        return _redis_problem(exc)
    finally:
        with contextlib.suppress(RedisError, RedisClusterException, OSError):
            await client.aclose()
    return None


def _redis_problem(exc: BaseException) -> str:
    if isinstance(exc, AuthenticationError):
        return "authentication refused (the URL's user or password)"
    if isinstance(exc, ResponseError):  # NOAUTH, WRONGPASS...: the server's words, never the URL's
        return f"refused: {str(exc)[:80]}"
    return f"unreachable ({type(exc).__name__})"


async def probe_redises(settings: Settings) -> list[tuple[str, str, str | None]]:
    """(setting, URL, problem or None) for REDIS_URL and a CREDITS_REDIS_URL of its own."""
    seconds = min(settings.upstream_timeout, CHECK_WAIT)
    named = [("REDIS_URL", settings.redis_url), ("CREDITS_REDIS_URL", settings.credits_redis_url)]
    urls = [(name, url) for name, url in named if url and (name == "REDIS_URL" or url != settings.redis_url)]
    problems = await asyncio.gather(*(probe_redis(url, seconds) for _, url in urls))
    return [(name, url, problem) for (name, url), problem in zip(urls, problems, strict=True)]


async def ledger_eviction(settings: Settings) -> str | None:
    """What `serve` says of the credit ledger's Redis policy (ledger_storage.py), when keys are
    charged and it answers: CREDITS_REQUIRE_NOEVICTION refuses to start on it. Asked only of a Redis
    its probe reached (probe_redises)."""
    url = settings.ledger_redis_url
    if url is None or settings.open_mode:
        return None
    seconds = min(settings.upstream_timeout, CHECK_WAIT)
    client = connect(url, seconds)
    try:
        async with asyncio.timeout(seconds):
            return eviction_problem(await memory_policies(client))
    except (RedisError, RedisClusterException, OSError, TimeoutError):
        return None  # unreachable or refused: its own FAIL line above
    finally:
        with contextlib.suppress(RedisError, RedisClusterException, OSError):
            await client.aclose()


def print_redises(settings: Settings) -> int:
    """A line for each Redis and, when the ledger's answered, one for its policy; the problems found."""
    problems, unreached = 0, set()
    for name, url, problem in asyncio.run(probe_redises(settings)):
        problems += problem is not None
        unreached.update([url] if problem else [])
        shown = redact_url(url)
        print(f"FAIL redis {name} {shown}: {problem}" if problem else f"ok   redis {name} {shown}: PONG")
    if settings.ledger_redis_url not in unreached and (evicts := asyncio.run(ledger_eviction(settings))) is not None:
        problems += settings.credits_require_noeviction  # serve refuses it, or warns
        print(
            f"FAIL credits: {evicts} (CREDITS_REQUIRE_NOEVICTION is set)"
            if settings.credits_require_noeviction
            else f"warn credits: {evicts}"
        )
    return problems


_LOOPBACK = ("localhost", "127.0.0.1", "::1")


def unbindable(settings: Settings) -> list[tuple[str, str, str]]:
    """The listen hosts serve could not bind, each as its setting, the host and why: no name this
    machine resolves (`not a host`, `999.1.1.1`), or no address of this machine (`8.8.8.8`). Each is
    bound on port 0 (any free port), so a proxy already listening there does not fail its own check."""
    found = []
    for listener in settings.listeners:
        setting = listener.setting.replace("_PORT", "_HOST")
        try:
            for family, kind, proto, _, address in socket.getaddrinfo(
                listener.host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            ):
                with socket.socket(family, kind, proto) as sock:
                    sock.bind(address)
        except (OSError, UnicodeError) as exc:  # UnicodeError: a name IDNA cannot encode (`a..b`)
            found.append((setting, listener.host, getattr(exc, "strerror", None) or "not a host name"))
    return found


def own_address(settings: Settings) -> list[tuple[Network, str, str]]:
    """The upstreams, http(s) and ws(s), at this proxy's own HOST and PROXY_PORT (pure), each as its
    network, its label and its URL: serve would send every call (or handshake) to itself, and refuse
    it (via.py)."""
    hosts = {settings.host, *(_LOOPBACK if settings.host in (*_LOOPBACK, "0.0.0.0", "::") else ())}
    found = []
    for network in settings.networks:
        for kind, urls in (("upstream", network.upstreams), ("WebSocket upstream", network.ws_upstreams)):
            for index, url in enumerate(urls):
                parts = urlsplit(url)
                port = parts.port or (443 if parts.scheme in ("https", "wss") else 80)
                if port == settings.port and parts.hostname in hosts:
                    found.append((network, f"{kind} #{index}", url))
    return found


def run_check(
    settings: Settings,
    *,
    offline: bool,
    ignored: Sequence[str] = (),
    misspelt: Sequence[str] = (),
    quoted: Sequence[str] = (),
) -> int:
    """Print the effective configuration and, online, each upstream's result; the exit status.
    `ignored`: names in ./.env that are no setting (serve logs and ignores them: most are typos);
    `misspelt`: names in the environment that are a setting's near twin (`API_KEY (API_KEYS?)`);
    `quoted`: settings in the environment whose value is wrapped in quotes (`docker run --env-file`)."""
    print("effective configuration (secrets redacted):")
    for line in effective(settings):
        print(f"  {line}")
    if settings.api_keys is None:
        print("note open mode: neither API_KEYS nor API_KEYS_FILE is set: any key is accepted, nothing is charged")
    for line in doubts(settings):  # serve logs each as a WARNING, and starts
        print(f"warn {line}")
    problems = 0
    if ignored:
        problems += 1
        print(f"FAIL .env: not settings, serve ignores them: {', '.join(ignored)}")
    if misspelt:
        problems += 1
        print(f"FAIL environment: not settings (misspelt?), serve ignores them: {', '.join(misspelt)}")
    if quoted:
        problems += 1
        print(
            f"FAIL environment: values wrapped in quotes, which serve takes as part of them: {', '.join(quoted)}"
            " (`docker run --env-file` keeps a .env line's quotes: write the values unquoted there)"
        )
    looping = own_address(settings)
    for network, label, url in looping:
        problems += 1
        print(
            f"FAIL network {network.name} {label} {redact_url(url)}: this proxy's own address (a loop, via.py;"
            " a node already on PROXY_PORT fails serve first, `Address already in use`: move the node or PROXY_PORT)"
        )
    for setting, host, why in unbindable(settings):
        problems += 1
        print(f"FAIL listen {setting} {host[:100]!r}: serve cannot listen there ({why})")
    if settings.workers > 1:
        try:
            os.rmdir(run_directory())  # serve makes one for its workers' sockets
        except NoRunDirectory as exc:
            problems += 1
            print(f"FAIL workers WORKERS={settings.workers}: {exc}")
    if offline:
        print(
            "offline: settings and files are valid; upstreams not tried" if not problems else f"{problems} problem(s)"
        )
        return 1 if problems else 0
    probes = asyncio.run(probe_all(settings))
    problems += print_redises(settings)
    looped = {(network.name, f"{label} {redact_url(url)}") for network, label, url in looping}
    for probe in probes:
        if (probe.network, probe.label) in looped:
            continue  # its FAIL is above: an ok from itself would contradict it
        if probe.problems:
            problems += len(probe.problems)
            for problem in probe.problems:
                print(f"FAIL network {probe.network} {probe.label}: {problem}")
        else:
            chain = f"chain id {probe.chain_id}, " if probe.chain_id is not None else ""
            accepted = "handshake accepted" if probe.label.startswith("WebSocket") else "batch accepted"
            found = f"{chain}genesis {probe.genesis}, {accepted}" if probe.genesis else accepted
            print(f"ok   network {probe.network} {probe.label}: {found}")
    print(f"{problems} problem(s)" if problems else "all upstreams ok")
    return 1 if problems else 0
