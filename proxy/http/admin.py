"""The admin listener (ADMIN_PORT, off by default): what an operator asks of the upstreams.

- `GET /upstreams`: per network, each upstream by index with its host (never its path or query,
  where providers put keys), whether it is in rotation, cordoned, verified, its head and head lag,
  its `fastest` score and its budget.
- `POST /upstreams/{network}/{index}/cordon` and `.../uncordon`: out of rotation (and back) from the
  next call on. Logged at WARNING with the network and index.
- `POST /reload`: NETWORKS_FILE read again and applied without a restart (network_set.py): new
  routing fields from the next call on, a network added, removed, or given new upstreams swapped in
  once its new pool has checked its chain. A file that does not check is 400, and nothing applied.

Every request needs `Authorization: Bearer <ADMIN_TOKEN>` (compared in constant time); anything else
is 401 and logged. With WORKERS=N the listener is in every worker (SO_REUSEPORT): the worker a
command reaches writes it into the host's one record of cordons in the run directory, under its
lock, takes that record as its own, and tells its siblings to take it too (through their own unix
sockets there): commands crossing on two workers are ordered by the lock, and every worker ends
with the last (each applying the other's command last had left two workers disagreeing for good).
A restarted worker reads the record, and NETWORKS_FILE as it is. A reload answers 200 once every
worker has applied it, else 502 naming how many did not.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import hmac
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from proxy.config import Listener, Settings
from proxy.http.listeners import bind
from proxy.logs import Throttled
from proxy.network import NetworkRuntime
from proxy.network_parts import STARTUP_WAIT
from proxy.upstream.pool import HttpUpstream, http_pool

log = logging.getLogger("proxy.admin")
# Seconds a worker waits for a sibling to take a command: a reload starts new pools (STARTUP_WAIT)
# and waits for each new network's first identity check (RELOAD_CHECK_WAIT each, one after another).
SIBLING_TIMEOUT = STARTUP_WAIT + 3.0
RELOAD_SIBLING_TIMEOUT = 120.0


def _pool(runtime: NetworkRuntime) -> HttpUpstream | None:
    return http_pool(runtime.upstream)


def upstream_view(runtimes: Mapping[str, NetworkRuntime]) -> dict[str, list[dict[str, object]]]:
    """What GET /upstreams answers: no URL beyond its scheme and host."""
    now = time.monotonic()
    view: dict[str, list[dict[str, object]]] = {}
    for name, runtime in runtimes.items():
        pool = _pool(runtime)
        if pool is None:
            continue
        states, rows = pool.states, []
        best = max(states.latest, default=-1)
        for index, url in enumerate(pool.urls):
            parts, budget = urlsplit(url), pool.budgets[index]
            rows.append(
                {
                    "index": index,
                    "host": f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else ""),
                    "in_rotation": states.in_rotation(index),
                    "cordoned": states.cordoned[index],
                    "verified": states.verified[index],
                    "head": states.latest[index],
                    "head_lag": best - states.latest[index] if states.latest[index] >= 0 else None,
                    "score_seconds": round(pool.selector.scores.score(index, 0, now), 6),
                    "max_rps": budget.max_rps,
                    "max_concurrency": budget.max_concurrency,
                    "in_flight": budget.in_flight,
                    "max_units_per_second": budget.units.per_second if budget.units is not None else None,
                }
            )
        view[name] = rows
    return view


Reload = Callable[[], Awaitable[tuple[int, dict[str, object]]]]  # network_set.NetworkSet.reload


class Cordons:
    """Cordoned upstreams, applied to the pools; with workers, kept in the run directory and told to siblings."""

    def __init__(self, runtimes: Mapping[str, NetworkRuntime], run_dir: str | None, index: int | None) -> None:
        self._runtimes = runtimes
        self._file = os.path.join(run_dir, "cordons.json") if run_dir else None
        self._own = os.path.join(run_dir, f"admin-{index}.sock") if run_dir is not None else None
        self._run_dir = run_dir

    def apply(self, network: str, index: int, cordoned: bool) -> bool:
        """One cordon or uncordon: in the host's record (under its lock), then this worker's pools made
        to match the record; False if there is no such upstream."""
        runtime = self._runtimes.get(network)
        pool = _pool(runtime) if runtime is not None else None
        if pool is None or not 0 <= index < len(pool.urls):
            return False
        if self._file is None:
            pool.states.cordoned[index] = cordoned
            return True
        with self._locked():
            held = self._read()
            marks = set(held.get(network, ())) - {index} | ({index} if cordoned else set())
            held[network] = sorted(marks)
            self._write(held)
            self._take(held)
        return True

    def load(self) -> None:
        """This worker's pools made to match the host's record (a restarted worker, a sibling told)."""
        if self._file is not None:
            with self._locked():
                self._take(self._read())

    def forget(self, networks: Iterable[str]) -> None:
        """After a reload: the record drops what it held of the networks the reload replaced or removed
        (a new pool starts with none), keeps every other cordon (a command crossing the reload on a
        sibling included: this worker's own view, written over the record, had erased it), and this
        worker takes it."""
        if self._file is None:
            return
        gone = set(networks)
        with self._locked():
            held = {name: marks for name, marks in self._read().items() if name not in gone}
            self._write(held)
            self._take(held)

    def _take(self, held: dict[str, list[int]]) -> None:
        for name, runtime in self._runtimes.items():
            pool = _pool(runtime)
            if pool is not None:
                marks = set(held.get(name, ()))
                for index in range(len(pool.states.cordoned)):
                    pool.states.cordoned[index] = index in marks

    def _read(self) -> dict[str, list[int]]:
        assert self._file is not None
        with contextlib.suppress(OSError, ValueError), open(self._file) as handle:
            raw = json.load(handle)
            return {str(k): [int(i) for i in v] for k, v in raw.items()} if isinstance(raw, dict) else {}
        return {}

    def _write(self, held: dict[str, list[int]]) -> None:
        assert self._file is not None
        temporary = f"{self._file}.{os.getpid()}"
        with open(temporary, "w") as handle:
            json.dump(held, handle)
        os.replace(temporary, self._file)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The host's record, one worker at a time (never held across an await)."""
        assert self._file is not None
        fd = os.open(f"{self._file}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    async def tell_siblings(self, path: str, timeout: float = SIBLING_TIMEOUT) -> int:
        """`path` posted to every sibling; how many did not answer 200 within `timeout`."""
        if self._run_dir is None:
            return 0
        siblings = [p for p in glob.glob(os.path.join(self._run_dir, "admin-*.sock")) if p != self._own]

        async def tell(socket: str) -> bool:
            with contextlib.suppress(OSError, aiohttp.ClientError, TimeoutError):
                async with (
                    aiohttp.ClientSession(
                        connector=aiohttp.UnixConnector(path=socket),
                        timeout=aiohttp.ClientTimeout(total=timeout),
                    ) as session,
                    session.post(f"http://worker{path}") as response,
                ):
                    await response.read()
                    return response.status == 200
            return False

        return sum(not told for told in await asyncio.gather(*(tell(s) for s in siblings)))


def admin_app(
    runtimes: Mapping[str, NetworkRuntime],
    reload_networks: Reload,
    cordons: Cordons,
    token: str | None,
    app: web.Application,
) -> web.Application:
    """The admin routes, on `app`; `token` None: a worker's own unix socket, which only its siblings reach."""
    # A flood of bad tokens (a scanner, a guesser) costs a line a minute, not one per request.
    refusals = Throttled(log)

    def refused(request: web.Request) -> web.Response | None:
        if token is None:
            return None
        given = request.headers.get("Authorization", "")
        # Header bytes that are no UTF-8 arrive as surrogates: compared as they came, never an error.
        if hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {token}".encode()):
            return None
        refusals.warning(
            "refused",
            "admin: refused %s %s from %s (no valid bearer token)",
            request.method[:16],
            request.path[:100],
            request.remote,
        )
        return web.json_response({"error": "unauthorized: send Authorization: Bearer <ADMIN_TOKEN>"}, status=401)

    async def listing(request: web.Request) -> web.Response:
        return refused(request) or web.json_response(upstream_view(runtimes))

    async def cordon(request: web.Request) -> web.Response:
        refusal = refused(request)
        if refusal is not None:
            return refusal
        network, action = request.match_info["network"], request.match_info["action"]
        written = request.match_info["index"]  # ASCII digits only: int() also took "+1" and "١"
        index = int(written) if written.isascii() and written.isdigit() and len(written) < 10 else -1
        if token is None:  # a sibling's word: the host's record holds the command, in its order
            cordons.load()
        elif not cordons.apply(network, index, action == "cordon"):
            return web.json_response(
                {"error": f"no upstream #{request.match_info['index']} on network '{network[:64]}'"}, status=404
            )
        else:  # the public listener: the command is this worker's to spread
            log.warning("admin: %sed upstream %s#%d", action, network, index)
            await cordons.tell_siblings(request.path)
        return web.json_response({"network": network, "index": index, "cordoned": action == "cordon"})

    async def reload(request: web.Request) -> web.Response:
        refusal = refused(request)
        if refusal is not None:
            return refusal
        status, answer = await reload_networks()
        if token is None and status == 200:
            cordons.load()  # the record, as the worker that took the command left it
        if token is not None:
            log.warning("admin: reload of NETWORKS_FILE: %s", answer.get("reloaded") or answer.get("error"))
            if status == 200:
                changed = (answer.get("replaced"), answer.get("removed"))
                cordons.forget(str(name) for names in changed if isinstance(names, list) for name in names)
                missed = await cordons.tell_siblings(request.path, RELOAD_SIBLING_TIMEOUT)
                if missed:  # the 200 says every worker serves the new file
                    answer = {**answer, "error": f"applied here, but {missed} other worker(s) did not confirm it"}
                    status = 502
        return web.json_response(answer, status=status)

    app.router.add_post("/reload", reload)
    app.router.add_get("/upstreams", listing)
    app.router.add_post("/upstreams/{network}/{index}/{action:cordon|uncordon}", cordon)
    return app


async def start_admin(
    runtimes: Mapping[str, NetworkRuntime],
    reload_networks: Reload,
    settings: Settings,
    app: web.Application,
    *,
    run_dir: str | None = None,
    index: int | None = None,
) -> list[web.AppRunner]:
    """The public admin listener (ADMIN_PORT), served by `app` (one that answers as the public port
    does: aiohttp_routes.answering_app), and, with workers, this worker's own socket for its siblings."""
    assert settings.admin_port is not None and settings.admin_token is not None
    cordons = Cordons(runtimes, run_dir, index)
    cordons.load()
    runners = []
    public = web.AppRunner(
        admin_app(runtimes, reload_networks, cordons, settings.admin_token, app), access_log=None, auto_decompress=False
    )
    await public.setup()
    site = web.TCPSite(public, settings.admin_host, settings.admin_port, reuse_port=run_dir is not None)
    await bind(site, Listener("ADMIN_PORT", settings.admin_host, settings.admin_port))
    runners.append(public)
    if run_dir is not None:
        own = web.AppRunner(
            admin_app(runtimes, reload_networks, cordons, None, web.Application()),
            access_log=None,
            auto_decompress=False,
        )
        await own.setup()
        await web.UnixSite(own, os.path.join(run_dir, f"admin-{index}.sock")).start()
        runners.append(own)
    return runners
