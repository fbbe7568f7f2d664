"""Benchmark: how many times one cache miss crosses from one package of the proxy into another, followed
call by call from the request's bytes reaching the front to the answer's bytes leaving it.

    .venv/bin/python -m bench.crossings [--misses 5] [--verify off|auto] [--rooms package|module]
                                        [--tree DIR] [--show]

The proxy runs in a child process under `sys.setprofile` (EVENT_LOOP=asyncio, whose transports'
writes are Python calls). A marked request (an eth_getStorageAt of a position never read, so the
node is asked) arms the profiler when its bytes reach the front's `data_received`; the first write
to the client's transport disarms it. In between, every real call from a function of one package
into a function of another is a crossing, and so is its return; calls within a package, and the
event loop's suspensions and resumptions of a coroutine (an `await` that waits, then goes on), are
not, so the figure is the code's structure, not how often the loop switched tasks. A package is a
folder of `proxy/` (`http`, `gateway`, `cache`, `chain`, `upstream`, ...); the modules at the top of
`proxy/` (`service.py`, `fetching.py`, `values.py`, `metrics.py`, ...) are one more.

Two figures: the request's walk counts the crossings that go on (a call into another package whose
code crosses again before it returns: the request handed further), with their returns; "with
detours" counts every crossing, the detours included (a call that comes back without crossing
again: a validator, a price, a metric). `--rooms module` counts a crossing between any two modules
instead. `--tree DIR` counts another checkout's proxy (this script and its Anvil stay this
checkout's), so two trees compare in one session. `--show` lists the last miss's crossings.
"""

from __future__ import annotations

import argparse
import dis
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MARK = 777_000  # ids from here on are the counted misses
_MARKED = f'"id": {MARK // 1000}'.encode()
_SUSPENDING = {dis.opmap["YIELD_VALUE"]}
_LOOP_CALLBACKS = ("asyncio/events.py", "asyncio/base_events.py")  # Handle._run, the loop's own
_COROUTINE_FLAGS = 0x20 | 0x80 | 0x100 | 0x200  # generator, coroutine, iterable coroutine, async generator


class Tracer:
    """The child's profile function: crossings of the one armed request, written to `out` per request."""

    def __init__(self, package: str, out: str, by_module: bool = False) -> None:
        self.package = package.rstrip("/") + "/"
        self.out = out
        self.armed = False
        self.client: object = None
        self.rooms: dict[str, tuple[str, str] | None] = {}
        self.started: set[int] = set()
        self.calls: list[list[Any]] = []
        self.open: dict[int, int] = {}
        self.module_moves = 0
        self.side = 1 if by_module else 0  # what a room is: a module, or a package

    def room(self, frame: FrameType) -> tuple[str, str] | None:
        """(package, module) of a frame's code, or None outside the proxy."""
        name = frame.f_code.co_filename
        found = self.rooms.get(name, False)
        if found is not False:
            return found  # type: ignore[return-value]
        if not name.startswith(self.package):
            self.rooms[name] = None
            return None
        module = name[len(self.package) :]
        package = module.split("/", 1)[0] if "/" in module else "proxy"
        self.rooms[name] = (package, module)
        return self.rooms[name]

    def caller(self, frame: FrameType | None) -> tuple[FrameType, tuple[str, str]] | None:
        """The nearest proxy frame below, unless the event loop ran this one (then it has no caller)."""
        while frame is not None:
            room = self.room(frame)
            if room is not None:
                return frame, room
            if frame.f_code.co_filename.endswith(_LOOP_CALLBACKS):
                return None
            frame = frame.f_back
        return None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.armed:
            if event == "call" and frame.f_code.co_name == "data_received" and self.room(frame) is not None:
                data = frame.f_locals.get("data")
                if isinstance(data, (bytes, bytearray)) and _MARKED in data:
                    self.arm(frame)
            return
        if event == "c_call":
            if (
                getattr(arg, "__name__", "") in ("write", "writelines")
                and getattr(arg, "__self__", None) is self.client
            ):
                self.disarm()
            return
        if (
            event == "call"
            and frame.f_code.co_name in ("write", "writelines")
            and frame.f_locals.get("self") is self.client
        ):
            self.disarm()
            return
        if event not in ("call", "return"):
            return
        room = self.room(frame)
        if room is None:
            return
        coroutine = frame.f_code.co_flags & _COROUTINE_FLAGS
        if event == "call":
            if coroutine:
                if id(frame) in self.started:
                    return  # a resumption: the loop's, not a call
                self.started.add(id(frame))
            found = self.caller(frame.f_back)
            if found is not None:
                self.crossed(found[0], found[1], frame, room, True)
        else:
            if coroutine and frame.f_lasti >= 0 and frame.f_code.co_code[frame.f_lasti] in _SUSPENDING:
                return  # a suspension
            self.started.discard(id(frame))
            found = self.caller(frame.f_back)
            if found is not None:
                self.crossed(frame, room, found[0], found[1], False)

    def crossed(
        self,
        source: FrameType,
        source_room: tuple[str, str],
        target: FrameType,
        target_room: tuple[str, str],
        call: bool,
    ) -> None:
        """One call (or return) from one frame to another; counted when it changes package."""
        if source_room[1] != target_room[1]:
            self.module_moves += 1
        if source_room[self.side] == target_room[self.side]:
            return
        if not call:
            at = self.open.pop(id(source), None)
            if at is not None:
                self.calls[at][4] = True
            return
        outer: FrameType | None = source
        while outer is not None:  # every open crossing this one runs inside goes on past a detour
            at = self.open.get(id(outer))
            if at is not None:
                self.calls[at][3] = False
            outer = outer.f_back
        self.open[id(target)] = len(self.calls)
        # [caller, callee, packages, a detour (it crossed no further), returned]
        self.calls.append(
            [
                f"{source_room[1]}:{source.f_code.co_qualname}",
                f"{target_room[1]}:{target.f_code.co_qualname}",
                f"{source_room[self.side]}->{target_room[self.side]}",
                True,
                False,
            ]
        )

    def arm(self, frame: FrameType) -> None:
        protocol = frame.f_locals.get("self")
        self.client = getattr(protocol, "transport", None) or getattr(protocol, "_transport", None)
        self.armed = True
        self.started.clear()
        self.open.clear()
        self.calls = []
        self.module_moves = 0

    def disarm(self) -> None:
        self.armed = False
        with open(self.out, "a") as out:
            out.write(json.dumps({"calls": self.calls, "module_moves": self.module_moves}) + "\n")


def child() -> None:
    """The proxy (the one in the working directory: `--tree`), profiled from its first line."""
    sys.path.insert(0, os.getcwd())
    import proxy
    from proxy.cli import main as cli_main

    tracer = Tracer(
        os.path.dirname(proxy.__file__), os.environ["CROSSINGS_OUT"], os.environ["CROSSINGS_BY"] == "module"
    )
    sys.setprofile(tracer)
    cli_main([])


def post(conn: http.client.HTTPConnection, body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    conn.request("POST", "/v3/bench", json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.getheader("X-Cache"), json.loads(response.read())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--misses", type=int, default=5, help="marked misses counted")
    parser.add_argument("--verify", choices=["off", "auto"], default="auto", help="VERIFY_ANSWERS")
    parser.add_argument("--rooms", choices=["package", "module"], default="package", help="what a crossing leaves")
    parser.add_argument("--tree", default=str(ROOT), help="the checkout whose proxy is counted (default: this one)")
    parser.add_argument("--show", action="store_true", help="print the crossings of the last miss")
    args = parser.parse_args()
    if args.misses < 1:
        raise SystemExit("--misses must be at least 1")

    from bench.cache_hit import final_storage_request, listening, proxy_env
    from tests.support import Anvil, free_port, wait_until

    anvil = Anvil()
    port = free_port()
    try:
        request = final_storage_request(anvil)
        store, _slot, block = request["params"]
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/crossings.jsonl"
            env = {
                **proxy_env(anvil.url),
                "PROXY_PORT": str(port),
                "HEAD_POLL_INTERVAL": "30",  # no poll among the counted calls
                "VERIFY_ANSWERS": args.verify,
                "EVENT_LOOP": "asyncio",  # its transports' writes are Python calls the profiler sees
                "CROSSINGS_OUT": out,
                "CROSSINGS_BY": args.rooms,
                "PYTHONPATH": args.tree,
            }
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child"],
                env=env,
                cwd=args.tree,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                wait_until(lambda: listening(port), 120, "the proxy to answer")
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                for warm in range(20):  # every lazy path taken once before the counted ones
                    post(
                        conn,
                        {
                            "jsonrpc": "2.0",
                            "id": warm,
                            "method": "eth_getStorageAt",
                            "params": [store, hex(1000 + warm), block],
                        },
                    )
                for n in range(args.misses):
                    cache, answer = post(
                        conn,
                        {
                            "jsonrpc": "2.0",
                            "id": MARK + n,
                            "method": "eth_getStorageAt",
                            "params": [store, hex(5000 + n), block],
                        },
                    )
                    if cache != "MISS" or "result" not in answer:
                        raise SystemExit(f"the counted request was not a miss answered by the node: {cache} {answer}")
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    if os.path.exists(out) and len(Path(out).read_text().splitlines()) >= args.misses:
                        break
                    time.sleep(0.05)
                rows = [json.loads(line) for line in Path(out).read_text().splitlines()]
            finally:
                proc.terminate()
                proc.wait(30)
    finally:
        anvil.stop()
    if len(rows) < args.misses:
        raise SystemExit(f"only {len(rows)} of {args.misses} misses were counted")
    report(rows, args.verify, args.rooms, args.show)
    return 0


def walk(calls: list[list[Any]]) -> int:
    """Crossings of the request's own walk: each call into another package that goes on further, and
    its return (a detour, a call that comes back without crossing again, is not part of the walk)."""
    return sum(1 + returned for _source, _target, _kind, detour, returned in calls if not detour)


def median(values: list[int]) -> int:
    return sorted(values)[len(values) // 2]


def report(rows: list[dict[str, Any]], verify: str, rooms: str, show: bool) -> None:
    every = [sum(1 + row_call[4] for row_call in row["calls"]) for row in rows]
    walks = [walk(row["calls"]) for row in rows]
    last = rows[-1]["calls"]
    print(f"one miss (VERIFY_ANSWERS={verify}), median of {len(rows)}:")
    print(f"  the request's walk: {median(walks)} crossings between {rooms}s (range {min(walks)}-{max(walks)})")
    print(
        f"  with detours: {median(every)} crossings (range {min(every)}-{max(every)}), "
        f"{median([row['module_moves'] for row in rows])} moves between modules"
    )
    pairs = Counter(kind for _source, _target, kind, detour, _returned in last if not detour)
    print("  the walk by packages (last miss): " + ", ".join(f"{kind} {n}" for kind, n in pairs.most_common()))
    if show:
        for source, target, kind, detour, returned in last:
            what = "detour" if detour else ("walk, back" if returned else "walk")
            print(f"    {what:10} {kind:18} {source} -> {target}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        child()
    else:
        raise SystemExit(main())
